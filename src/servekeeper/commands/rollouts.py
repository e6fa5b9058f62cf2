"""Rollout commands: promote, abort, undo, history.

Commands are intents stored for the controller (counters and flags on the pending cluster):
the next tick acts on them, and one given while a tick runs is never lost. `undo` is an apply
of an earlier revision's spec and code package, as a new generation.
"""

from __future__ import annotations

from typing import Any

from servekeeper.commands.apply import check_ports_free, store_spec
from servekeeper.commands.context import CommandContext
from servekeeper.commands.errors import Conflict, RevisionNotFound, ServiceNotFound
from servekeeper.model.records import Revision
from servekeeper.model.spec import ServiceSpec
from servekeeper.model.wire import HistoryView
from servekeeper.store.facts import import_fact_key
from servekeeper.views.history import revision_view

SUCCEEDED = "Succeeded"


def undo_target(revisions: list[Revision], current: int, wanted: int | None) -> Revision:
    """The revision `undo` rolls out: RevisionNotFound, or Conflict when there is none to roll to."""
    if wanted is not None:
        for revision in revisions:
            if revision.revision == wanted:
                if wanted == current:
                    raise Conflict(f"revision {wanted} is the current one")
                return revision
        raise RevisionNotFound(wanted, [r.revision for r in revisions])
    earlier = [r for r in revisions if r.revision < current and r.outcome == SUCCEEDED]
    if not earlier:
        raise Conflict("no earlier revision rolled out successfully; nothing to undo to")
    return earlier[-1]


class RolloutCommands:
    """promote, abort, undo and history, for the API's routes and the dashboard's buttons alike.
    A refusal is a CommandError (ServiceNotFound, RevisionNotFound; Conflict: not possible now)."""

    def __init__(self, context: CommandContext) -> None:
        self.context = context

    def _existing(self, name: str) -> None:
        service = self.context.store.get_service(name)
        if service is None or service.deleting:
            raise ServiceNotFound(name)

    async def promote(self, name: str, full: bool) -> dict[str, Any]:
        self._existing(name)
        pending = self.context.store.request_promote(name, full=full)
        if pending is None:
            raise Conflict(f"service {name!r} has no rollout in progress to promote")
        self.context.controller.wake(name)
        return {"name": name, "cluster": pending.name, "full": full, "promoteRequests": pending.promote_requests}

    async def abort(self, name: str) -> dict[str, Any]:
        self._existing(name)
        pending = self.context.store.request_abort(name)
        if pending is None:
            raise Conflict(f"service {name!r} has no rollout in progress to abort")
        self.context.controller.wake(name)
        return {"name": name, "cluster": pending.name, "aborting": True}

    def history(self, name: str) -> dict[str, Any]:
        service = self.context.store.get_service(name)
        if service is None:
            raise ServiceNotFound(name)
        revisions = self.context.store.list_revisions(name)
        history: HistoryView = {"name": name, "revisions": [revision_view(r, service.generation) for r in revisions]}
        return dict(history)  # plain for the routes: a TypedDict there would become FastAPI's response model

    async def undo(self, name: str, to_revision: int | None) -> dict[str, Any]:
        store, packages_dir = self.context.store, self.context.packages_dir
        async with self.context.packaging:  # no prune between choosing the package and storing the spec
            service = store.get_service(name)
            if service is None or service.deleting:
                raise ServiceNotFound(name)
            target = undo_target(store.list_revisions(name), service.generation, to_revision)
            if packages_dir is not None and target.package_hash is not None:
                if not (packages_dir / f"{target.package_hash}.zip").exists():
                    raise Conflict(f"the code package of revision {target.revision} is gone")
            target_spec = ServiceSpec.model_validate_json(target.spec_json)
            check_ports_free(store, target_spec)  # another service may have taken a port since
            stored, changed = store_spec(
                store,
                name,
                target.spec_json,
                target.package_hash,
                # The target's secret references come back with its spec (which holds their values).
                store.get_fact(import_fact_key(name, target.revision)),
                history_limit=target_spec.spec.revisionHistoryLimit,
                cause=f"undo to revision {target.revision}",
            )
        self.context.controller.wake(name)
        return {"name": name, "generation": stored.generation, "changed": changed, "toRevision": target.revision}
