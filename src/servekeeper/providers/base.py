"""The one interface every cluster provider implements: Ray clusters as local process groups
(`local.py`) and clusters on a host pool over SSH (`pool.py`), picked per cluster by
`router.py`. The controller holds one provider and never asks which one it is.

Errors are one tree, translated at each provider's edge: a `RetryableProviderError` may mend by
itself (the pool is full now, a host does not answer), a `PermanentProviderError` will not
(a host refuses us for good). A bare `ProviderError` is a cluster that could not be started or
stopped, for the reason its message gives.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.endpoint import Endpoint
from servekeeper.model.records import ClusterRecord, NodePlacement


class ProviderError(RuntimeError):
    """A cluster could not be started or stopped; the message says why."""


class RetryableProviderError(ProviderError):
    """Waiting may mend it (no room now, a host silent): the caller tries again later."""


class PermanentProviderError(ProviderError):
    """Waiting will not mend it (a host refuses our key or login, its python is not there)."""


class Liveness(NamedTuple):
    head_alive: bool
    dead_workers: list[int]
    reason: str | None
    exited_workers: tuple[int, ...] = ()  # of the dead: known to have exited, so restartable in place
    # head_alive is False because the head's host did not answer: the head may still run there.
    # Only a head whose host answered "not running" has exited for sure.
    head_silent: bool = False
    silent_workers: tuple[int, ...] = ()  # of the dead: on hosts that did not answer (may still run)
    # (pid, the last lines of its log) of the exited workers: why, for the event that restarts it
    exit_causes: tuple[tuple[int, str], ...] = ()


# Records at once what a start or stop learned of one cluster: `record(**changes)`, the
# changes to its stored record (pids, nodes).
RecordChanges = Callable[..., None]


class ClusterRecords(Protocol):
    """The part of the store a provider sees when it places a new cluster."""

    def list_clusters(self) -> list[ClusterRecord]: ...

    def put_cluster(self, cluster: ClusterRecord) -> None: ...

    def update_cluster(self, name: str, **changes: Any) -> ClusterRecord: ...

    def declared_ports(self) -> set[int]:
        """Ports the services' ingresses declare, which no cluster on this machine may take."""
        ...


class ClusterProvider(Protocol):
    async def create(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        """Place `draft` (its ports, its nodes) and store its record before anything starts
        (intent first); two creations never take the same room or ports. Raises
        RetryableProviderError when it cannot be placed now, PermanentProviderError when it
        never will be as specified."""
        ...

    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        """The part of a start done inside a tick, without waiting: a local head is spawned (the
        record returned has its `head_pid`); a cluster whose nodes all start over the network
        comes back unchanged. Raises ProviderError or OSError: the start failed."""
        ...

    def needs_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> bool:
        """Is there a node left for `start_nodes` to start?"""
        ...

    async def start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        """Start the nodes not running yet (idempotent after a crash); `record(nodes=...)` gets
        every node as this start knows them, at once each time a pid is new: the caller keeps only
        those this start launched (`launched_into`) and derives the pids from them. Raises what
        stopped a node's start; the controller decides what it means (a pending cluster's rollout
        fails; a serving cluster stays one node short and is started again)."""
        ...

    def restarted(self, cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
        """The record with these exited worker nodes cleared, to be started again in place."""
        ...

    async def move_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        """The cluster with its head, and every node on the head's (silent) host, placed on other
        hosts, its workers to be started again against the new head, stored before anything
        starts; what was left on the silent host is stopped once it answers. Raises
        RetryableProviderError when no host can take them now, PermanentProviderError when
        the head cannot move at all (it runs on this machine)."""
        ...

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        """Whether the head runs, which workers do not, and why; never holds a tick long."""
        ...

    def endpoints(self, cluster: ClusterRecord, grpc: bool) -> tuple[Endpoint, ...]:
        """Where the cluster's Serve proxies listen (HTTP, or gRPC), for the data plane."""
        ...

    def headers(self, cluster: ClusterRecord) -> dict[str, str]:
        """What every call to the cluster's dashboard (Serve REST, packages) carries."""
        ...

    async def stop_node(self, cluster: ClusterRecord, index: int) -> None:
        """Stop node `index` of the cluster (a worker Ray's autoscaler released); raises
        RetryableProviderError while it may still run (its host did not answer)."""
        ...

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        """`count` more worker nodes of `group` for Ray's autoscaler: placed (ports of their own;
        on a pool, a host with room) and recorded unstarted in one write (intent: the next tick
        starts them); the record as stored, and their ids, never used before in the cluster (on a
        pool, of as many as fit, at least one: Ray asks again for the rest).
        Raises `autoscaling.NodeRequestRefused` (`NodeRoomShort`: no room now) or ProviderError."""
        ...

    async def update_autoscaler(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        """Give Ray's autoscaler of the cluster `config`'s bounds (its monitor re-reads its config
        at each look); raises PermanentProviderError where there is no such autoscaler."""
        ...

    async def stop(self, cluster: ClusterRecord, record: RecordChanges | None = None) -> Sequence[int | str]:
        """Stop every process of the cluster; what is still alive afterwards (empty when all is
        gone). `record` gets each part stopped for sure at once (its room is free again)."""
        ...

    async def close(self) -> None:
        """Let go of connections; running clusters are left running."""
        ...

    async def prune_environments(self, keep: Collection[str], read_at: float) -> None:
        """Delete the copies of environments (by key) not in `keep` that this provider put
        elsewhere (a pool's hosts); the controller's own are pruned by the controller. `keep`
        was read from the store at `read_at` (time.monotonic()): an environment a cluster asked
        for since is kept too."""
        ...


def headers_kwargs(provider: ClusterProvider, cluster: ClusterRecord) -> dict[str, Any]:
    """Keyword arguments of a Serve API call to `cluster`: its auth headers, when it has any."""
    headers = provider.headers(cluster)
    return {"headers": headers} if headers else {}


def with_nodes(cluster: ClusterRecord, nodes: Iterable[NodePlacement]) -> ClusterRecord:
    """The record with these node records, its head and worker pids read from them."""
    placed = tuple(nodes)
    pids = [node.pid for node in placed]
    return cluster.with_changes(
        nodes=placed, head_pid=pids[0], worker_pids=tuple(pid for pid in pids[1:] if pid is not None)
    )


def launched_into(current: ClusterRecord, original: ClusterRecord, nodes: Sequence[NodePlacement]) -> ClusterRecord:
    """The nodes a start launched (their pid changed since `original`, the record it began
    from) written into `current`, the record as stored now: a tick may have cleared another
    node's pid meanwhile (a restart), which must not come back; and nodes recorded after the
    start began (Ray's autoscaler asked for them) stay, for a later start."""
    if not current.nodes or len(current.nodes) < len(nodes):
        return with_nodes(current, nodes)
    launched = {i for i, (a, b) in enumerate(zip(original.nodes, nodes, strict=False)) if a.pid != b.pid}
    if not original.nodes:  # a record stored before its nodes were: every node given is news
        launched = set(range(len(nodes)))
    # A node released meanwhile stays stopped, holding the session the start spawned for it: the
    # node API's next call stops that session (commands/nodes.py), nothing runs on unrecorded.
    # So does one whose place was given to another node since (released, then the place reused):
    # recorded again at the end, stopped, with its session.
    displaced = {i for i in launched if current.nodes[i].node_id != nodes[i].node_id}
    merged = [
        (replace(node, session_id=nodes[i].session_id) if node.stopped else nodes[i])
        if i in launched - displaced
        else node
        for i, node in enumerate(current.nodes[: len(nodes)])
    ]
    recorded = {node.node_id for node in current.nodes}  # each later call of the same start gives it again
    left = [
        replace(nodes[i], stopped=True, pid=None)
        for i in sorted(displaced)
        if nodes[i].session_id is not None and nodes[i].node_id not in recorded
    ]
    return with_nodes(current, (*merged, *current.nodes[len(nodes) :], *left))


def nodes_restarting(cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
    """The record with the nodes of these exited processes cleared (no pid, one restart more),
    to be started again where they were; a head among them leaves `head_pid` unset."""
    gone = set(pids)
    nodes = tuple(
        replace(node, pid=None, session_id=None, restarts=node.restarts + 1) if node.pid in gone else node
        for node in cluster.nodes
    )
    return with_nodes(cluster, nodes)
