"""Cluster processes: starting what an interrupted tick left unstarted, starting again the
worker nodes that exited (as KubeRay recreates a worker pod), and, with GCS fault tolerance, a
head that exited, in place, or, with its tables in Redis, a head whose host stays silent, on
another host; each a bounded number of times."""

from __future__ import annotations

from dataclasses import replace

from servekeeper.core.actions import DeleteCluster, MoveHead, RestartNodes, StartCluster
from servekeeper.core.planner.context import PlanContext
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, NodePlacement

# A worker node whose process exited is started again at most this many times over its
# cluster's life; past it, it stays dead and the cluster's health says so.
MAX_WORKER_RESTARTS = 5


def expected_workers(cluster: ClusterRecord) -> int:
    """The worker nodes the cluster should have: its spec's, or with Ray's autoscaler those
    recorded and not released (a node it asked for is recorded before it starts)."""
    config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
    if config.enableInTreeAutoscaling and cluster.nodes:
        return sum(1 for node in cluster.nodes if node.role == "worker" and not node.stopped)
    return config.worker_count()


def released_between(before: list[ClusterRecord], after: list[ClusterRecord]) -> bool:
    """Whether a node running at the first of two reads of a service's clusters was recorded
    stopped, or left the record, by the second (Ray's autoscaler released it): an observation
    made from the first would take its exit for a death."""

    # By node id, not place: a released node's place may hold a node Ray asked for since (nodes
    # without an id, on pools or in older rows, keep theirs: by place, as negative keys).
    def running(clusters: list[ClusterRecord]) -> set[tuple[str, int]]:
        return {
            (c.name, node.node_id if node.node_id is not None else -1 - i)
            for c in clusters
            for i, node in enumerate(c.nodes)
            if not node.stopped
        }

    kept = {c.name for c in after}  # a cluster deleted meanwhile released nothing
    return not {key for key in running(before) if key[0] in kept} <= running(after)


def restartable(cluster: ClusterRecord, exited: tuple[int, ...]) -> list[NodePlacement]:
    """The worker nodes among `exited` (pids) that may be started again where they were."""
    return [
        node
        for node in cluster.nodes
        if node.role == "worker" and node.pid in exited and not node.stopped and node.restarts < MAX_WORKER_RESTARTS
    ]


def restart_interrupted_work(ctx: PlanContext) -> None:
    """A crash may stop the controller between intent and completion: a deletion is finished,
    a cluster short of its head or workers is started (both idempotent)."""
    for cluster in ctx.clusters.values():
        if cluster.role == ClusterRole.DELETING:
            ctx.do(DeleteCluster(cluster.name, "DeletionResumed"))
        elif cluster.head_pid is None or len(cluster.worker_pids) < expected_workers(cluster):
            ctx.do(StartCluster(cluster.name))


def keeps_gcs_state(cluster: ClusterRecord) -> bool:
    return RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json).gcsFaultTolerance is not None


def restart_exited_heads(ctx: PlanContext) -> None:
    """With GCS fault tolerance, a head whose process exited on a host that answered is started
    again where it was, on the same ports and with the same GCS storage: the workers reconnect
    to it and Serve's controller recovers its apps from it, so the cluster is kept (its health
    still counts: one that stays unhealthy past the threshold is replaced as ever). A head on a
    silent host is unknown (it may still run), never restarted; a head past its restart budget
    stays down, and the cluster is judged without it (HeadDied, or replaced)."""
    for cluster in list(ctx.clusters.values()):
        if cluster.role == ClusterRole.DELETING or not cluster.nodes or cluster.name not in ctx.observation.clusters:
            continue
        observed = ctx.observed(cluster)
        head = cluster.nodes[0]
        if cluster.head_pid is None or head.pid is None or head.stopped or observed.processes_alive:
            continue
        if observed.head_silent_since is not None or head.restarts >= MAX_WORKER_RESTARTS:
            continue
        if not keeps_gcs_state(cluster):
            continue
        ctx.do(RestartNodes(cluster.name, (head.pid,)))
        cause = f": {observed.error}" if observed.error else ""
        ctx.event(
            "HeadRestarting",
            f"the head of {cluster.name} (pid {head.pid}) exited on host {head.host}; starting it again there "
            f"with its GCS state (restart {head.restarts + 1} of at most {MAX_WORKER_RESTARTS}){cause}",
            warning=True,
        )
        restarted = replace(head, pid=None, session_id=None, restarts=head.restarts + 1)
        ctx.set_planned(cluster.with_changes(nodes=(restarted, *cluster.nodes[1:]), head_pid=None))


def move_silent_heads(ctx: PlanContext) -> None:
    """With its GCS tables in Redis, a head whose host stays silent past `headMoveAfterSeconds` is
    started on another host of the pool (as Kubernetes reschedules a head pod): the cluster, its
    apps and its run-time apps are kept, where a replacement would start from nothing after the
    unhealthy threshold. A silent head counts against the same restart budget as an exited one."""
    for cluster in list(ctx.clusters.values()):
        if cluster.role in (ClusterRole.DELETING, ClusterRole.DRAINING) or cluster.pool is None:
            continue
        if cluster.name not in ctx.observation.clusters or not cluster.nodes or cluster.head_pid is None:
            continue
        head = cluster.nodes[0]
        silent_since = ctx.observed(cluster).head_silent_since
        if silent_since is None or head.pid is None or head.stopped or head.restarts >= MAX_WORKER_RESTARTS:
            continue
        fault_tolerance = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json).gcsFaultTolerance
        move_after = fault_tolerance.head_move_after() if fault_tolerance is not None else None
        if move_after is not None and ctx.now - silent_since >= move_after:
            ctx.do(MoveHead(cluster.name, head.host, ctx.now - silent_since))


def restart_workers(ctx: PlanContext, cluster: ClusterRecord, exited: tuple[int, ...]) -> ClusterRecord:
    """Worker nodes whose process exited are started again where they were (as KubeRay
    recreates a worker pod): the cluster is not replaced for a lost worker. Only nodes
    recorded with their placement (any cluster's but a local one stored before local clusters
    had node records) can be, each at most MAX_WORKER_RESTARTS
    times: one that keeps exiting stays dead (the rollout fails, or the active cluster is
    replaced after the unhealthy threshold)."""
    gone = restartable(cluster, exited)
    if not gone:
        return cluster
    ctx.do(RestartNodes(cluster.name, tuple(node.pid for node in gone if node.pid is not None)))
    causes = ctx.observed(cluster).exit_causes
    for node in gone:
        # The node's last log lines: why it exited, so that an operator need not go to the host.
        cause = f": {causes[node.pid]}" if node.pid in causes else ""
        ctx.event(
            "WorkerRestarting",
            f"worker node pid {node.pid} of {cluster.name} on host {node.host} exited; starting it again "
            f"there (restart {node.restarts + 1} of at most {MAX_WORKER_RESTARTS}){cause}",
            warning=True,
        )
    pids = {node.pid for node in gone}
    nodes = tuple(
        replace(n, pid=None, session_id=None, restarts=n.restarts + 1) if n in gone else n for n in cluster.nodes
    )
    updated = cluster.with_changes(nodes=nodes, worker_pids=tuple(p for p in cluster.worker_pids if p not in pids))
    return ctx.set_planned(updated)  # the controller writes it (RestartNodes), from the stored record
