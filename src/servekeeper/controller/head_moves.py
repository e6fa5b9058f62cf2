"""A head moved off its silent host (`core.planner.workers.move_silent_heads` asks for it): the
provider places it anew and stores the record; the cluster's start then runs it. A move that
cannot be made now (no host with room, a head pinned to its host) is tried again after a delay
that doubles up to a minute (each try probes hosts under the pool's placement lock, which every
other cluster's start waits for), and told once per cause, not once per try."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from servekeeper.core import actions as act
from servekeeper.core.planner import MAX_WORKER_RESTARTS
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, Event
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.store.store import Store

FIRST_RETRY_SECONDS = 5.0
LONGEST_RETRY_SECONDS = 60.0


@dataclass(frozen=True)
class MoveFailure:
    message: str  # why, as last told
    tries: int
    next_try_at: float


class HeadMoves:
    def __init__(self, store: Store, provider: ClusterProvider, clock: Callable[[], float]) -> None:
        self.store = store
        self.provider = provider
        self.clock = clock
        self.failures: dict[str, MoveFailure] = {}  # cluster -> its head's last failed move

    async def move(self, action: act.MoveHead) -> ClusterRecord | None:
        """The cluster with its head placed anew and stored, or None (told why in an event)."""
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None or not cluster.nodes or cluster.nodes[0].host != action.silent_host:
            return None  # gone, or moved already
        failed = self.failures.get(cluster.name)
        if failed is not None and self.clock() < failed.next_try_at:
            return None
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        silent = f"its host {action.silent_host} silent for {action.silent_for:.0f}s"
        try:
            moved = await self.provider.move_head(cluster, config)
        except ProviderError as exc:
            tries = failed.tries + 1 if failed is not None else 1
            delay = min(FIRST_RETRY_SECONDS * 2 ** (tries - 1), LONGEST_RETRY_SECONDS)
            if failed is None or failed.message != str(exc):
                message = f"the head of {cluster.name} ({silent}) cannot move now: {exc}; trying again in {delay:.0f}s"
                self.store.add_events([Event(cluster.service, self.clock(), "Warning", "HeadMoveFailed", message)])
            self.failures[cluster.name] = MoveFailure(str(exc), tries, self.clock() + delay)
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

    def forget(self, cluster: str) -> None:
        """A deleted cluster's failed move is dropped: the entries never pile up."""
        self.failures.pop(cluster, None)
