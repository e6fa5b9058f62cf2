"""Where a new pool cluster goes: its nodes placed on the pool's hosts that answer, and its
ports allocated on those hosts, none taken by another cluster.

A host that does not answer is left out of placement (it may come back); one that refuses for
good (host key, login, its python) fails the rollout with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence

from servekeeper.core.placement import HostRoom, NodeNeed, free_room, node_needs, nodes_taking_room, place
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.hostpool import HostPoolRecord, HostPoolSpec
from servekeeper.model.records import ClusterPorts, ClusterRecord, NodePlacement, NodePorts
from servekeeper.providers.base import PermanentProviderError, RetryableProviderError
from servekeeper.providers.environments import EnvironmentRequest
from servekeeper.providers.node_argv import cluster_dir
from servekeeper.providers.ssh import CommandTimeout, SshError
from servekeeper.providers.ssh_nodes import SshNodes
from servekeeper.store.store import Store

REACH_TIMEOUT_SECONDS = 5.0
ALLOCATE_TIMEOUT_SECONDS = 20.0  # ports probed on each host: a host falling silent must not hold the tick


class Shortfall(RetryableProviderError):
    """The pool cannot hold the cluster now (or has no such pool): the rollout waits."""


class HostRefused(PermanentProviderError):
    """A host picked for the cluster refuses in a way that waiting does not mend (its host key,
    the login, its python): the rollout fails with it. The message names the host."""


class PoolChanged(RetryableProviderError):
    """The pool a cluster was being placed on was changed or deleted before its record was
    stored: nothing is stored, the next tick places it again on the pool as it is then."""


def check_pool_kept(cluster: ClusterRecord, placed_on: str | None, current: HostPoolRecord | None) -> None:
    """Raise PoolChanged unless `current` (the cluster's pool as stored now) still is the pool
    spec `placed_on` the cluster was placed on (None: only that it still exists)."""
    if current is None:
        raise PoolChanged(f"host pool {cluster.pool!r} was deleted while cluster {cluster.name!r} was placed on it")
    if placed_on is not None and current.spec().to_json() != placed_on:
        raise PoolChanged(
            f"host pool {cluster.pool!r} was changed while cluster {cluster.name!r} was placed on it; "
            "it is placed again on the pool as it is now"
        )


def host_rooms(pool: HostPoolSpec) -> list[HostRoom]:
    return [
        HostRoom(h.name, h.resources.cpus, h.resources.gpus, int(h.resources.memoryGiB * 2**30))
        for h in pool.spec.hosts
    ]


async def place_cluster(
    pool: HostPoolSpec, ssh: SshNodes, others: list[ClusterRecord], draft: ClusterRecord, config: RayClusterConfigSpec
) -> ClusterRecord:
    """`draft` with its nodes placed on the pool's hosts and ports allocated there, beside
    `others` (every cluster stored); raises Shortfall when the pool cannot hold it now,
    HostRefused when a host picked refuses for good."""
    assert config.hostPool is not None
    rooms = host_rooms(pool)
    placed: list[tuple[str, NodeNeed]] = []
    reserved: set[int] = set()
    siblings: set[str] = set()  # hosts of the service's other clusters
    for other in others:
        reserved.update(other.ports.all_ports())
        if other.pool == config.hostPool:
            taking = nodes_taking_room(other)
            placed += [(node.host, need) for node, need in taking]
            if other.service == draft.service and other.name != draft.name:
                siblings.update(node.host for node, _ in taking)
    avoid = frozenset(siblings)
    chosen = place(node_needs(config), free_room(rooms, placed), avoid, config.enableInTreeAutoscaling)
    unreachable: set[str] = set()
    lacking: set[str] = set()
    if not isinstance(chosen, str):
        # Only the hosts picked are probed (a rollout waiting for room probes nothing), and a
        # lost one, or one without the environment's Python, gets no new node: placed again without it.
        unreachable = await unreachable_hosts(ssh, sorted(set(chosen)))
        lacking = await hosts_without_python(ssh, sorted(set(chosen) - unreachable), config)
        if unreachable or lacking:
            rooms = [room for room in rooms if room.name not in unreachable | lacking]
            chosen = place(node_needs(config), free_room(rooms, placed), avoid, config.enableInTreeAutoscaling)
    if isinstance(chosen, str):
        if lacking:  # no wait mends it: a host gets an interpreter by hand
            python = f"Python {own_python_of(config)}"
            raise HostRefused(f"host pool {config.hostPool!r}: {chosen}; no {python} on hosts {sorted(lacking)}")
        lost = f" (unreachable: {sorted(unreachable)})" if unreachable else ""
        raise Shortfall(f"host pool {config.hostPool!r}: {chosen}{lost}")
    try:
        allocating = _allocate(ssh, draft, config, chosen, reserved)
        return await asyncio.wait_for(allocating, ALLOCATE_TIMEOUT_SECONDS)
    except asyncio.TimeoutError as exc:
        raise RetryableProviderError(f"allocating ports took more than {ALLOCATE_TIMEOUT_SECONDS:g}s") from exc


async def _allocate(
    ssh: SshNodes, draft: ClusterRecord, config: RayClusterConfigSpec, chosen: list[str], reserved: set[int]
) -> ClusterRecord:
    with host_errors("allocating ports"):
        # Serve's proxies listen on one port on every node: free on all of the cluster's hosts.
        serve_http, serve_grpc = await ssh.ports_free_on_all(sorted(set(chosen)), 2, sorted(reserved))
        reserved.update((serve_http, serve_grpc))
        head_ports, singles = await ssh.node_ports(chosen[0], sorted(reserved), extra=3)
        reserved.update(head_ports.all_ports() + singles)
        node_ports = [head_ports, *await node_ports_on(ssh, chosen[1:], reserved)]
    gcs, dashboard, client_server = singles
    nodes = tuple(
        NodePlacement(
            host=host,
            address=ssh.host(host).address,
            role="head" if index == 0 else "worker",
            ports=ports,
            temp_dir=f"{cluster_dir(ssh.host(host), draft.name)}/n{index}",
            group=group,
            node_id=index,  # Ray's autoscaler's id for it (the head's is 0), as on one machine
        )
        for index, (host, ports, group) in enumerate(zip(chosen, node_ports, _group_names(config), strict=True))
    )
    cluster_ports = ClusterPorts(gcs, dashboard, client_server, serve_http, serve_grpc, tuple(node_ports))
    return draft.with_changes(pool=config.hostPool, nodes=nodes, ports=cluster_ports)


@contextlib.contextmanager
def host_errors(what: str) -> Iterator[None]:
    """An SshError as placement tells it: a host that refuses us (HostRefused: the pool's spec
    must change) or one that does not answer now (retryable)."""
    try:
        yield
    except SshError as exc:
        if not exc.retryable:
            raise HostRefused(str(exc)) from exc
        raise RetryableProviderError(f"{what}: {exc}") from exc


async def node_ports_on(ssh: SshNodes, hosts: Sequence[str], reserved: set[int]) -> list[NodePorts]:
    """A node's own ports on each of `hosts`, none of `reserved` (which takes them)."""
    allocated = []
    for host in hosts:
        ports, _ = await ssh.node_ports(host, sorted(reserved))
        reserved.update(ports.all_ports())
        allocated.append(ports)
    return allocated


def _group_names(config: RayClusterConfigSpec) -> list[str | None]:
    """Each node's group in placement order (None: the head)."""
    return [None, *(group.name for group in config.workerGroups for _ in range(group.replicas))]


def own_python_of(config: RayClusterConfigSpec) -> str | None:
    """The Python minor version a cluster's own environment needs on its hosts; None for a
    cluster on the hosts' own Ray and Python."""
    request = EnvironmentRequest.of(config)
    return request.python if request is not None else None


async def hosts_without_python(ssh: SshNodes, hosts: list[str], config: RayClusterConfigSpec) -> set[str]:
    """Of `hosts`, those without the interpreter the cluster's own environment needs (a host
    whose answer fails is left to the node start, which names its error)."""
    python = own_python_of(config)
    if python is None:
        return set()

    async def lacks(host: str) -> bool:
        try:
            return python not in await ssh.interpreters(host)
        except (SshError, ValueError, LookupError):  # an answer that fails or does not read
            return False

    answers = await asyncio.gather(*(lacks(host) for host in hosts))
    return {host for host, lacking in zip(hosts, answers, strict=True) if lacking}


async def unreachable_hosts(ssh: SshNodes, hosts: list[str]) -> set[str]:
    """The hosts that do not answer now (placed without them: they may come back); a host
    that refuses (host key, login, a command failing) raises HostRefused."""

    async def failure(name: str) -> SshError | None:
        try:
            await asyncio.wait_for(ssh.probe(name, REACH_TIMEOUT_SECONDS), REACH_TIMEOUT_SECONDS + 1)
        except asyncio.TimeoutError:
            return CommandTimeout(name, f"no answer within {REACH_TIMEOUT_SECONDS + 1:g}s")
        except SshError as exc:
            return exc
        return None

    failures = await asyncio.gather(*(failure(name) for name in hosts))
    refused = [exc for exc in failures if exc is not None and not exc.retryable]
    if refused:
        raise HostRefused(str(refused[0])) from refused[0]
    return {name for name, exc in zip(hosts, failures, strict=True) if exc is not None}


def pool_problems(store: Store, config: RayClusterConfigSpec) -> list[str]:
    """What makes a spec on a host pool impossible (not merely waiting for room), by field."""
    assert config.hostPool is not None
    record = store.get_host_pool(config.hostPool)
    if record is None:
        return [f"spec.rayClusterConfig.hostPool: host pool {config.hostPool!r} does not exist; apply it first"]
    hosts = record.spec().spec.hosts
    names = {host.name for host in hosts}
    problems = []
    groups = [("spec.rayClusterConfig.head", config.head)]
    groups += [(f"spec.rayClusterConfig.workerGroups.{i}", g) for i, g in enumerate(config.workerGroups)]
    for path, group in groups:
        if group.host is not None and group.host not in names:
            problems.append(f"{path}.host: {group.host!r} is not a host of pool {config.hostPool!r} ({sorted(names)})")
    if problems:
        return problems
    chosen = place(node_needs(config), free_room(host_rooms(record.spec()), []))
    if isinstance(chosen, str):
        return [f"spec.rayClusterConfig: InsufficientCapacity: even the empty pool cannot hold it: {chosen}"]
    return []
