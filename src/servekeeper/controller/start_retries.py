"""Node starts that failed on a serving cluster, tried again after a pause that doubles from the
first to the last (not every tick: one event per try, so history is not pushed out). Each try
counts as a restart of the nodes still down: one budget per node, MAX_WORKER_RESTARTS over its
cluster's life whatever the cause, kept in the record across controller restarts; spent, the
node stays down and the cluster's health says so. A permanent error (a head's GCS tables gone)
is not tried again: waiting will not mend it.

With Ray's autoscaler, a worker whose start is given up is released instead (recorded stopped,
as a release by Ray is): left down, it would be listed to Ray as pending for ever, and Ray would
count it against its demand and never ask for another. Released, Ray asks again at its own pace,
for a node with an id and a budget of its own; what its start may have left running is stopped
at the monitor's next call, as after any release (commands/nodes.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from servekeeper.core.planner import MAX_WORKER_RESTARTS
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, Event, NodePlacement
from servekeeper.providers.base import PermanentProviderError, with_nodes
from servekeeper.store.store import Store

START_RETRY_FIRST_SECONDS = 5.0
START_RETRY_MAX_SECONDS = 300.0


class StartRetries:
    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        # cluster -> (node starts failed in a row, when the next try may run; inf: none left)
        self.pending: dict[str, tuple[int, float]] = {}

    def failed(self, cluster: ClusterRecord, error: Exception) -> str:
        """Schedule the next try of a node start that failed; what the event says of it."""
        current = self.store.get_cluster(cluster.name) or cluster
        tries = max((node.restarts for node in down_nodes(current)), default=0)
        failures = self.pending.get(cluster.name, (0, 0.0))[0] + 1
        if isinstance(error, PermanentProviderError):
            self.pending[cluster.name] = (failures, math.inf)
            return self._given_up(current, "not tried again (waiting will not mend it)")
        if tries >= MAX_WORKER_RESTARTS:
            self.pending[cluster.name] = (failures, math.inf)
            return self._given_up(current, f"no tries left (restart {tries} of at most {MAX_WORKER_RESTARTS})")
        # (the exponent capped: a count without a restart budget, a record without nodes, keeps growing)
        delay = min(START_RETRY_FIRST_SECONDS * 2 ** min(failures - 1, 16), START_RETRY_MAX_SECONDS)
        self.pending[cluster.name] = (failures, self.clock() + delay)
        return f"trying again in {delay:g}s (restart {tries} of at most {MAX_WORKER_RESTARTS})"

    def _given_up(self, cluster: ClusterRecord, why: str) -> str:
        """What the event says of a start given up; Ray's autoscaler's nodes among those down
        are released (see the module's docstring), the others stay down."""
        kept, released = released_when_given_up(cluster)
        if not released:
            return f"{why}: the node stays down"
        self.store.update_cluster(cluster.name, nodes=kept.nodes, worker_pids=kept.worker_pids)
        if not down_nodes(kept):  # nothing left to try: a node Ray asks for next is started at once
            self.pending.pop(cluster.name, None)
        ids = ", ".join(str(node_id) for node_id in released)
        message = f"{why}: node(s) {ids} of {cluster.name} released, so Ray's autoscaler may ask for others"
        event = Event(cluster.service, self.clock(), "Warning", "NodeRemoved", message)
        self.store.add_events([event])
        return f"{why}: node(s) {ids} released for Ray's autoscaler to ask again"

    def due(self, cluster: ClusterRecord) -> ClusterRecord | None:
        """The cluster to start, or None while its failed start waits for its next try; a try
        that is due counts as a restart of each node still down."""
        retry = self.pending.get(cluster.name)
        if retry is None:
            return cluster
        if self.clock() < retry[1]:
            return None
        down = down_nodes(cluster)
        nodes = tuple(replace(node, restarts=node.restarts + 1) if node in down else node for node in cluster.nodes)
        return self.store.update_cluster(cluster.name, nodes=nodes)

    def forget(self, cluster: str) -> None:
        self.pending.pop(cluster, None)


def down_nodes(cluster: ClusterRecord) -> list[NodePlacement]:
    """The nodes of a cluster not running (their start failed, or is due): workers, and a head
    started again in place (GCS fault tolerance)."""
    return [node for node in cluster.nodes if node.pid is None and not node.stopped]


def released_when_given_up(cluster: ClusterRecord) -> tuple[ClusterRecord, list[int]]:
    """`cluster` with the worker nodes down that Ray's autoscaler manages recorded stopped (each
    keeps its session, if its start left one: stopped at the monitor's next call), and their ids;
    unchanged without Ray's autoscaler."""
    if not RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json).enableInTreeAutoscaling:
        return cluster, []
    down = [node for node in down_nodes(cluster) if node.role == "worker" and node.node_id is not None]
    nodes = (replace(node, stopped=True, pid=None) if node in down else node for node in cluster.nodes)
    return with_nodes(cluster, nodes), [node.node_id for node in down if node.node_id is not None]
