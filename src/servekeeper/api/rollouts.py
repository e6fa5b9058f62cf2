"""Rollout commands of the daemon's API: promote, abort, undo, history.

Commands are intents stored for the controller (counters and flags on the pending cluster):
the next tick acts on them, and one given while a tick runs is never lost. `undo` is an apply
of an earlier revision's spec and code package, as a new generation.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict

from servekeeper.controller.loop import Controller
from servekeeper.controller.metrics import record_applied
from servekeeper.model.spec import ServiceSpec
from servekeeper.model.status import Revision
from servekeeper.store.store import Store

SUCCEEDED = "Succeeded"


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    full: bool = False  # skip every remaining step and analysis


class UndoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    toRevision: int | None = None  # None: the last revision that rolled out before the current one


def revision_view(revision: Revision, current: int) -> dict[str, Any]:
    return {
        "revision": revision.revision,
        "current": revision.revision == current,
        "createdAt": revision.created_at,
        "specHash": revision.spec_hash,
        "packageHash": revision.package_hash,
        "cause": revision.cause,
        "outcome": revision.outcome,
        "endedAt": revision.ended_at,
        "endedBy": revision.ended_by,
        "message": revision.message,
    }


def undo_target(revisions: list[Revision], current: int, wanted: int | None) -> Revision:
    """The revision `undo` rolls out; HTTPException when there is none to roll to."""
    if wanted is not None:
        for revision in revisions:
            if revision.revision == wanted:
                if wanted == current:
                    raise HTTPException(status_code=409, detail=f"revision {wanted} is the current one")
                return revision
        kept = [r.revision for r in revisions]
        raise HTTPException(status_code=404, detail=f"revision {wanted} is not in the history (kept: {kept})")
    earlier = [r for r in revisions if r.revision < current and r.outcome == SUCCEEDED]
    if not earlier:
        raise HTTPException(status_code=409, detail="no earlier revision rolled out successfully; nothing to undo to")
    return earlier[-1]


class RolloutCommands:
    """promote, abort, undo and history, for the API's routes and the dashboard's buttons alike.
    A refusal is an HTTPException (404 unknown service or revision, 409 not possible now)."""

    def __init__(
        self, store: Store, controller: Controller, packaging: asyncio.Lock, packages_dir: Path | None
    ) -> None:
        self.store = store
        self.controller = controller
        self.packaging = packaging  # the API's apply lock: no prune between choosing a package and storing it
        self.packages_dir = packages_dir

    def _existing(self, name: str) -> None:
        service = self.store.get_service(name)
        if service is None or service.deleting:
            raise HTTPException(status_code=404, detail=f"service {name!r} not found")

    async def promote(self, name: str, full: bool) -> dict[str, Any]:
        self._existing(name)
        pending = self.store.request_promote(name, full=full)
        if pending is None:
            raise HTTPException(status_code=409, detail=f"service {name!r} has no rollout in progress to promote")
        self.controller.wake(name)
        return {"name": name, "cluster": pending.name, "full": full, "promoteRequests": pending.promote_requests}

    async def abort(self, name: str) -> dict[str, Any]:
        self._existing(name)
        pending = self.store.request_abort(name)
        if pending is None:
            raise HTTPException(status_code=409, detail=f"service {name!r} has no rollout in progress to abort")
        self.controller.wake(name)
        return {"name": name, "cluster": pending.name, "aborting": True}

    def history(self, name: str) -> dict[str, Any]:
        service = self.store.get_service(name)
        if service is None:
            raise HTTPException(status_code=404, detail=f"service {name!r} not found")
        revisions = self.store.list_revisions(name)
        return {"name": name, "revisions": [revision_view(r, service.generation) for r in revisions]}

    async def undo(self, name: str, to_revision: int | None) -> dict[str, Any]:
        store = self.store
        async with self.packaging:
            service = store.get_service(name)
            if service is None or service.deleting:
                raise HTTPException(status_code=404, detail=f"service {name!r} not found")
            target = undo_target(store.list_revisions(name), service.generation, to_revision)
            if self.packages_dir is not None and target.package_hash is not None:
                if not (self.packages_dir / f"{target.package_hash}.zip").exists():
                    raise HTTPException(
                        status_code=409, detail=f"the code package of revision {target.revision} is gone"
                    )
            target_spec = ServiceSpec.model_validate_json(target.spec_json)
            check_ports_free(store, target_spec)  # another service may have taken a port since
            limit = target_spec.spec.revisionHistoryLimit
            now = time.time()
            with store.transaction():
                stored, changed = store.apply_spec(
                    name,
                    target.spec_json,
                    now,
                    package_hash=target.package_hash,
                    cause=f"undo to revision {target.revision}",
                    history_limit=limit,
                )
                if changed:
                    record_applied(store, name, stored.generation, now)
        self.controller.wake(name)
        return {"name": name, "generation": stored.generation, "changed": changed, "toRevision": target.revision}


def check_ports_free(store: Store, spec: ServiceSpec) -> None:
    """422 when another service's ingress holds one of the spec's ports (apply and undo)."""
    wanted = {spec.spec.ingress.port, spec.spec.ingress.grpcPort, spec.spec.ingress.previewPort} - {None}
    for other in store.list_services():
        if other.name == spec.name or other.deleting:
            continue
        ingress = ServiceSpec.model_validate_json(other.spec_json).spec.ingress
        taken = sorted(p for p in wanted & {ingress.port, ingress.grpcPort, ingress.previewPort} if p is not None)
        if taken:
            raise HTTPException(
                status_code=422,
                detail={"problems": [f"spec.ingress.port: port {taken[0]} is used by service {other.name!r}"]},
            )


def add_rollout_routes(app: FastAPI, commands: RolloutCommands) -> None:
    @app.post("/api/v1/services/{name}/promote")
    async def promote(name: str, body: PromoteRequest) -> dict[str, Any]:
        return await commands.promote(name, body.full)

    @app.post("/api/v1/services/{name}/abort")
    async def abort(name: str) -> dict[str, Any]:
        return await commands.abort(name)

    @app.get("/api/v1/services/{name}/history")
    async def history(name: str) -> dict[str, Any]:
        return commands.history(name)

    @app.post("/api/v1/services/{name}/undo")
    async def undo(name: str, body: UndoRequest) -> dict[str, Any]:
        return await commands.undo(name, body.toRevision)
