"""A cluster's own environment (`rayVersion`, `pythonVersion`, `pip`) built beside the ticks
before its first node starts: `EnvironmentBuilding`, then `EnvironmentReady` with the time it
took, or `EnvironmentFailed` with uv's message, which fails the rollout (the active untouched).
The tick after a build starts the cluster, as it starts any cluster without a head."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, Event
from servekeeper.providers.environments import EnvironmentFailed, EnvironmentRequest, Environments
from servekeeper.store.store import Store


class EnvironmentBuilds:
    def __init__(self, store: Store, environments: Environments, clock: Callable[[], float]) -> None:
        self.store = store
        self.environments = environments
        self.clock = clock

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
        except EnvironmentFailed as exc:
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
