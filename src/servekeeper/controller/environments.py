"""A cluster's own environment (`rayVersion`, `pythonVersion`, `pip`) built beside the ticks
before its first node starts: `EnvironmentBuilding`, then `EnvironmentReady` with the time it
took, or `EnvironmentFailed` with uv's message, which fails the rollout (the active untouched).
The tick after a build starts the cluster, as it starts any cluster without a head. Once a
cluster is deleted, environments that no cluster, service or kept revision (what `undo` may
go back to) uses are deleted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, Event
from servekeeper.model.spec import ServiceSpec
from servekeeper.providers.environments import EnvironmentFailed, EnvironmentRequest, Environments
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)


def environments_in_use(store: Store) -> list[RayClusterConfigSpec]:
    """The cluster shapes whose environments must stay: every cluster's, every service's, and
    every kept revision's (`undo` may roll back to it: its environment then needs no build)."""
    used = [RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json) for cluster in store.list_clusters()]
    for service in store.list_services():
        specs = [service.spec_json, *(revision.spec_json for revision in store.list_revisions(service.name))]
        used += [ServiceSpec.model_validate_json(spec).spec.rayClusterConfig for spec in specs]
    return used


class EnvironmentBuilds:
    def __init__(
        self,
        store: Store,
        environments: Environments,
        clock: Callable[[], float],
        prune_elsewhere: Callable[[set[str], float], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.environments = environments
        self.clock = clock
        # The provider's copies of environments (a pool's hosts), told which keys stay.
        self.prune_elsewhere = prune_elsewhere

    def ready(self, config: RayClusterConfigSpec) -> bool:
        """True when the cluster runs the controller's own environment or its own is built."""
        request = EnvironmentRequest.of(config)
        return request is None or self.environments.built(request) is not None

    async def build(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        request = EnvironmentRequest.of(config)
        if request is None:
            return
        self._event(cluster, "Normal", "EnvironmentBuilding", f"{cluster.name}: {request.describe()}, built with uv")
        began = time.monotonic()
        try:
            environment, built_now = await self.environments.prepare(request)
        except (EnvironmentFailed, OSError) as exc:  # uv's answer, or the disk's: the rollout fails
            self._event(cluster, "Warning", "EnvironmentFailed", f"{cluster.name}: {exc}")
            with contextlib.suppress(KeyError):  # deleted meanwhile
                self.store.update_cluster(cluster.name, failure_reason=f"EnvironmentFailed: {exc}")
            return
        taken = time.monotonic() - began
        how = f"built in {taken:.1f}s" if built_now else "already built"
        message = f"{cluster.name}: {request.describe()} ({how}), environment {environment.key}"
        self._event(cluster, "Normal", "EnvironmentReady", message)

    def _event(self, cluster: ClusterRecord, kind: str, reason: str, message: str) -> None:
        self.store.add_events([Event(cluster.service, self.clock(), kind, reason, message)])

    async def prune(self) -> None:
        """Delete the environments nothing uses (hundreds of MB each): taken out of use at once,
        between two ticks, so no start finds one half gone; deleted in a thread. Not while one is
        being built (its cluster may be gone, its lock not yet written). Never fails a deletion."""
        if not self.environments.root.exists() or any(lock.locked() for lock in self.environments.building.values()):
            return  # (no environment was ever built here: the common case costs nothing)
        try:
            read_at, used = time.monotonic(), environments_in_use(self.store)
            retired = self.environments.retire_unused(used)
            if retired:
                await asyncio.to_thread(self.environments.empty_trash)
        except (OSError, ValueError) as exc:  # a stored spec that no longer reads; the disk
            logger.warning("environments not pruned: %s", exc)
            return
        if retired:
            logger.info("environments no cluster or kept revision uses deleted: %s", [d.name for d in retired])
            if self.prune_elsewhere is not None:  # only when one went out of use: SSH is not free
                try:
                    await self.prune_elsewhere(self.environments.keys_in_use(used), read_at)
                except Exception as exc:  # a pool deleted meanwhile, a host's answer: the next prune
                    logger.warning("environments on the hosts not pruned: %s", exc)
