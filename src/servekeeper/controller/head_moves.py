"""A head moved off its silent host (`core.planner.workers.move_silent_heads` asks for it): the
provider places it anew and stores the record; the cluster's start then runs it. A move that
cannot be made now (no host with room, a head pinned to its host) is asked for again at the next
tick and told once per cause, not once per tick."""

from __future__ import annotations

from collections.abc import Callable

from servekeeper.core import actions as act
from servekeeper.core.planner import MAX_WORKER_RESTARTS
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, Event
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.store.store import Store


class HeadMoves:
    def __init__(self, store: Store, provider: ClusterProvider, clock: Callable[[], float]) -> None:
        self.store = store
        self.provider = provider
        self.clock = clock
        self.failures: dict[str, str] = {}  # cluster -> why its head could not move, as last told

    async def move(self, action: act.MoveHead) -> ClusterRecord | None:
        """The cluster with its head placed anew and stored, or None (told why in an event)."""
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None or not cluster.nodes or cluster.nodes[0].host != action.silent_host:
            return None  # gone, or moved already
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        silent = f"its host {action.silent_host} silent for {action.silent_for:.0f}s"
        try:
            moved = await self.provider.move_head(cluster, config)
        except ProviderError as exc:
            if self.failures.get(cluster.name) != str(exc):
                message = f"the head of {cluster.name} ({silent}) cannot move now: {exc}"
                self.store.add_events([Event(cluster.service, self.clock(), "Warning", "HeadMoveFailed", message)])
            self.failures[cluster.name] = str(exc)
            return None
        self.failures.pop(cluster.name, None)
        head = moved.nodes[0]
        message = (
            f"the head of {cluster.name} ({silent}) is started on host {head.host} with its GCS tables in Redis "
            f"(restart {head.restarts} of at most {MAX_WORKER_RESTARTS}); its workers are started again against it, "
            f"and what ran on {action.silent_host} is stopped once that host answers"
        )
        self.store.add_events([Event(cluster.service, self.clock(), "Warning", "HeadMoving", message)])
        return moved
