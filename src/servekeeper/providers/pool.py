"""Clusters on a host pool: placement, ports on each host, the cluster's token, and its nodes
started, watched and stopped over SSH (`providers/ssh_nodes.py`).

The controller writes a pool cluster's record (placement and ports) before any node starts,
and each node's pid once it runs, so a restarted controller finds every node again. A node
whose start was cut short is found by its tag and stopped before it is started again; a start
cancelled by a delete still records the node it was launching. A stop records each node it
stopped for sure: its room is free again while the rest of the cluster may still resist.

A host that does not answer is left out of placement (it may come back); one that refuses for
good (host key, login, its python) fails the rollout with that error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

from servekeeper.core.placement import HostRoom, NodeNeed, free_room, node_needs, nodes_taking_room, place
from servekeeper.dataplane import Endpoint
from servekeeper.model.cluster_spec import HeadGroupSpec, RayClusterConfigSpec
from servekeeper.model.hostpool import HostPoolSpec, HostSpec
from servekeeper.model.status import ClusterPorts, ClusterRecord, NodePlacement
from servekeeper.providers.base import ProviderError
from servekeeper.providers.local import _param_args, _resource_args
from servekeeper.providers.ssh import CommandTimeout, HostConnection, SshError
from servekeeper.providers.ssh_nodes import (
    HeadPorts,
    NodeUnreachable,
    RemoteNode,
    SshNodes,
    auth_headers,
    cluster_dir,
    head_argv,
    new_cluster_token,
    read_cluster_token,
    save_cluster_token,
    token_dir,
    token_file,
    worker_argv,
)
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)

LIVENESS_CACHE_SECONDS = 2.0  # an SSH round trip per node per look is too much at 4 looks a second
# A look at a node never holds a tick longer than this: a host cut off the network does not
# refuse, it stays silent, and SSH would wait for its own timeouts and retries.
LIVENESS_TIMEOUT_SECONDS = 4.0
REACH_TIMEOUT_SECONDS = 5.0
ALLOCATE_TIMEOUT_SECONDS = 20.0  # ports probed on each host: a host falling silent must not hold the tick
T = TypeVar("T")


class Liveness(NamedTuple):
    head_alive: bool
    dead_workers: list[int]
    reason: str | None
    exited_workers: tuple[int, ...] = ()  # of the dead: exited on a host that answered


class Shortfall(Exception):
    """The pool cannot hold the cluster now (or has no such pool): the rollout waits."""


class HostRefused(Exception):
    """A host picked for the cluster refuses in a way that waiting does not mend (its host key,
    the login, its python): the rollout fails with it. The message names the host."""


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
    rooms = [HostRoom(h.name, h.resources.cpus, h.resources.gpus, int(h.resources.memoryGiB * 2**30)) for h in hosts]
    chosen = place(node_needs(config), free_room(rooms, []))
    if isinstance(chosen, str):
        return [f"spec.rayClusterConfig: InsufficientCapacity: even the empty pool cannot hold it: {chosen}"]
    return []


class PoolClusters:
    def __init__(
        self, store: Store, state_dir: Path, ssh_nodes: Callable[[Sequence[HostSpec]], SshNodes] = SshNodes
    ) -> None:
        self.store = store
        self._ssh_nodes = ssh_nodes  # tests give a fake of the SSH side
        self.token_dir = token_dir(state_dir)
        self._nodes: dict[str, tuple[str, SshNodes]] = {}  # pool -> (its spec json, its connections)
        self._tokens: dict[str, str] = {}
        # cluster -> (its node pids when read, when, the answer): a node started since is read anew
        self._liveness: dict[str, tuple[tuple[int | None, ...], float, Liveness]] = {}
        # Held from a placement's snapshot of the pool until its record is stored: two clusters
        # created at once must not take the same room and the same ports.
        self.creating = asyncio.Lock()
        self._closing: set[asyncio.Future[list[BaseException | None]]] = set()  # connections of a changed pool

    # -- the pool ----------------------------------------------------------------------------------

    def pool(self, name: str) -> HostPoolSpec:
        record = self.store.get_host_pool(name)
        if record is None:
            raise Shortfall(f"host pool {name!r} does not exist (apply a HostPool named {name!r})")
        return record.spec()

    def ssh(self, pool_name: str) -> SshNodes:
        """The pool's connections; when its spec changed, new ones for the hosts that changed
        (the old ones closed in the background); none when it was deleted."""
        cached = self._nodes.get(pool_name)
        try:
            pool = self.pool(pool_name)
        except Shortfall:
            if cached is not None:
                del self._nodes[pool_name]
                self._close_soon(cached[1].retire())
            raise
        spec_json = pool.to_json()
        if cached is None or cached[0] != spec_json:
            nodes = self._ssh_nodes(pool.spec.hosts)
            if cached is not None:
                self._close_soon(nodes.adopt(cached[1]))
            self._nodes[pool_name] = (spec_json, nodes)
        return self._nodes[pool_name][1]

    def _close_soon(self, connections: list[HostConnection]) -> None:
        if connections:
            task = asyncio.ensure_future(asyncio.gather(*(c.close() for c in connections), return_exceptions=True))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for _, nodes in self._nodes.values():
            await nodes.close()
        self._nodes.clear()
        await asyncio.gather(*self._closing)

    # -- a new cluster -----------------------------------------------------------------------------

    async def new_record(self, draft: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        """`draft` with its nodes placed on the pool's hosts and ports allocated there; raises
        Shortfall when the pool cannot hold it now, HostRefused when a host picked refuses for good."""
        assert config.hostPool is not None
        pool = self.pool(config.hostPool)
        rooms = [
            HostRoom(h.name, h.resources.cpus, h.resources.gpus, int(h.resources.memoryGiB * 2**30))
            for h in pool.spec.hosts
        ]
        placed: list[tuple[str, NodeNeed]] = []
        reserved: set[int] = set()
        for other in self.store.list_clusters():
            reserved.update(other.ports.all_ports())
            if other.pool == config.hostPool:
                placed += [(node.host, need) for node, need in nodes_taking_room(other)]
        ssh = self.ssh(config.hostPool)
        chosen = place(node_needs(config), free_room(rooms, placed))
        unreachable: set[str] = set()
        if not isinstance(chosen, str):
            # Only the hosts picked are probed (a rollout waiting for room probes nothing), and a
            # lost one gets no new node: placed again without it.
            unreachable = await self._unreachable(ssh, sorted(set(chosen)))
            if unreachable:
                rooms = [room for room in rooms if room.name not in unreachable]
                chosen = place(node_needs(config), free_room(rooms, placed))
        if isinstance(chosen, str):
            lost = f" (unreachable: {sorted(unreachable)})" if unreachable else ""
            raise Shortfall(f"host pool {config.hostPool!r}: {chosen}{lost}")
        try:
            return await asyncio.wait_for(self._allocate(draft, config, chosen, reserved), ALLOCATE_TIMEOUT_SECONDS)
        except asyncio.TimeoutError as exc:
            raise ProviderError(f"allocating ports took more than {ALLOCATE_TIMEOUT_SECONDS:g}s") from exc

    async def _allocate(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, chosen: list[str], reserved: set[int]
    ) -> ClusterRecord:
        assert config.hostPool is not None
        ssh = self.ssh(config.hostPool)
        try:
            # Serve's proxies listen on one port on every node: free on all of the cluster's hosts.
            serve_http, serve_grpc = await ssh.ports_free_on_all(sorted(set(chosen)), 2, sorted(reserved))
            reserved.update((serve_http, serve_grpc))
            head_ports, singles = await ssh.node_ports(chosen[0], sorted(reserved), extra=3)
            reserved.update(head_ports.all_ports() + singles)
            node_ports = [head_ports]
            for host in chosen[1:]:
                ports, _ = await ssh.node_ports(host, sorted(reserved))
                reserved.update(ports.all_ports())
                node_ports.append(ports)
        except SshError as exc:
            if not exc.retryable:
                raise HostRefused(str(exc)) from exc
            raise ProviderError(f"allocating ports: {exc}") from exc
        gcs, dashboard, client_server = singles
        nodes = tuple(
            NodePlacement(
                host=host,
                address=ssh.host(host).address,
                role="head" if index == 0 else "worker",
                ports=ports,
                temp_dir=f"{cluster_dir(ssh.host(host), draft.name)}/n{index}",
            )
            for index, (host, ports) in enumerate(zip(chosen, node_ports, strict=True))
        )
        cluster_ports = ClusterPorts(gcs, dashboard, client_server, serve_http, serve_grpc, tuple(node_ports))
        return draft.with_changes(pool=config.hostPool, nodes=nodes, ports=cluster_ports)

    def put_new(self, cluster: ClusterRecord) -> None:
        """Store a new cluster's record (from `new_record`) and save its token with it: the token
        file goes again if the record could not be stored, so that none outlives its cluster."""
        path = save_cluster_token(self.token_dir, cluster.name, new_cluster_token())
        try:
            self.store.put_cluster(cluster)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    async def _unreachable(self, ssh: SshNodes, hosts: list[str]) -> set[str]:
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

    # -- starting, watching, stopping --------------------------------------------------------------

    def headers(self, cluster: ClusterRecord) -> dict[str, str]:
        """What every call to the cluster's dashboard carries (its token)."""
        if cluster.pool is None:
            return {}
        token = self._tokens.get(cluster.name)
        if token is None:
            token = self._tokens[cluster.name] = read_cluster_token(self.token_dir, cluster.name)
        return auth_headers(token)

    def endpoints(self, cluster: ClusterRecord, grpc: bool) -> tuple[Endpoint, ...]:
        port = cluster.ports.serve_grpc if grpc else cluster.ports.serve_http
        # Two nodes on one host share its address and Serve's one proxy port: one endpoint.
        return tuple(dict.fromkeys(Endpoint(node.address, port) for node in cluster.nodes))

    async def start(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: Callable[[ClusterRecord], None]
    ) -> None:
        """Start the nodes not running yet, head first; each node's pid is recorded as it runs."""
        assert cluster.pool is not None
        ssh = self.ssh(cluster.pool)
        token = read_cluster_token(self.token_dir, cluster.name)
        groups = _groups_per_node(config)
        nodes = list(cluster.nodes)

        async def launch(cluster: ClusterRecord, index: int, argv: list[str], token_path: str) -> ClusterRecord:
            node = nodes[index]
            role: Literal["head", "worker"] = "head" if index == 0 else "worker"
            started = await ssh.start_node(
                node.host, role, argv, node.temp_dir, node.ports, token_path, groups[index].env
            )
            nodes[index] = replace(node, pid=started.pid, session_id=started.session_id)
            updated = _with_nodes(cluster, nodes)
            record(updated)
            return updated

        for index, node in enumerate(nodes):
            if node.pid is not None:
                continue
            # A start cut short (controller killed after the launch, before its pid was
            # recorded) may have left this node running: stop it by its tag first.
            await ssh.stop(_remote(node, pid=-1, session_id=-1))
            token_path = await ssh.install_token(node.host, cluster.name, token)
            host = ssh.host(node.host)
            resources = _resources(groups[index])
            if index == 0:
                ports = cluster.ports
                head = HeadPorts(ports.gcs, ports.dashboard, ports.client_server)
                argv = head_argv(host, node.temp_dir, head, node.ports, resources)
            else:
                argv = worker_argv(host, node.temp_dir, cluster.gcs_address, node.ports, resources)
            # A delete cancels this start: a node launched is recorded before the cancel goes on,
            # so that the stop which follows the delete knows it (and stops it by its pid).
            cluster = await _to_the_end(launch(cluster, index, argv, token_path))

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        """Whether the head lives, which workers do not (and of those, which exited on a host
        that answered: they can be started again there), and why, like the local provider's
        checks; read at most every LIVENESS_CACHE_SECONDS. A host that does not answer counts as
        a dead node, never as an exited one (its node may still run there)."""
        cached = self._liveness.get(cluster.name)
        now = time.monotonic()
        pids = tuple(node.pid for node in cluster.nodes)
        if cached is not None and cached[0] == pids and now - cached[1] < LIVENESS_CACHE_SECONDS:
            return cached[2]
        assert cluster.pool is not None
        try:
            ssh = self.ssh(cluster.pool)
        except Shortfall as exc:  # the pool was deleted under it: nothing can be looked at
            return Liveness(False, [], str(exc))
        if not cluster.nodes:  # failed at placement: nothing was ever started
            return Liveness(False, [], None)
        started = [node for node in cluster.nodes if node.pid is not None]

        async def alive(node: NodePlacement) -> tuple[bool, str, bool]:
            """(running, why not, exited for sure)"""
            try:
                running = await asyncio.wait_for(ssh.alive(_remote(node)), LIVENESS_TIMEOUT_SECONDS)
                return running, f"exited on host {node.host}", not running
            except asyncio.TimeoutError:
                return False, f"host {node.host} did not answer within {LIVENESS_TIMEOUT_SECONDS:g}s", False
            except (NodeUnreachable, SshError, ProviderError) as exc:  # ProviderError: host gone from the pool
                return False, f"host {node.host} unreachable: {exc}", False

        answers = await asyncio.gather(*(alive(node) for node in started))
        result: Liveness
        head = cluster.nodes[0]
        if head.pid is None:
            result = Liveness(False, [], None)
        elif not answers[0][0]:
            result = Liveness(False, [], f"head node {answers[0][1]}")
        else:
            dead = [
                (node, why, exited) for node, (ok, why, exited) in zip(started[1:], answers[1:], strict=True) if not ok
            ]
            reason = f"worker node pid {dead[0][0].pid} {dead[0][1]}" if dead else None
            result = Liveness(
                True,
                [node.pid for node, _, _ in dead if node.pid is not None],
                reason,
                tuple(node.pid for node, _, exited in dead if exited and node.pid is not None),
            )
        self._liveness[cluster.name] = (pids, now, result)
        return result

    async def stop(self, cluster: ClusterRecord, record: Callable[[ClusterRecord], None] | None = None) -> list[str]:
        """Stop every node not stopped yet (those never recorded as running too, by their tag);
        what could not be stopped, described (empty when all is gone). Each node stopped for sure
        is recorded as such at once, so that its room counts as free while others still resist."""
        if cluster.pool is None or not cluster.nodes:
            return []
        try:
            ssh = self.ssh(cluster.pool)
        except Shortfall as exc:
            return [str(exc)]
        nodes = list(cluster.nodes)

        async def stop(index: int) -> list[str]:
            node = nodes[index]
            if node.stopped:
                return []
            try:
                left = await ssh.stop(_remote(node))
            except (NodeUnreachable, SshError, ProviderError) as exc:
                return [f"{node.role} node on {node.host}: {exc}"]
            if left:
                return [f"{node.host}:{pid}" for pid in left]
            nodes[index] = replace(node, stopped=True)
            if record is not None:
                record(cluster.with_changes(nodes=tuple(nodes)))
            return []

        leftovers = [item for items in await asyncio.gather(*(stop(i) for i in range(len(nodes)))) for item in items]
        if not leftovers:
            for host in sorted({node.host for node in cluster.nodes}):
                try:  # its token file and logs on the host; nothing runs there any more
                    await ssh.forget_cluster(host, cluster.name)
                except (SshError, ProviderError) as exc:
                    logger.warning("[%s] could not remove its dir on %s: %s", cluster.name, host, exc)
            self._liveness.pop(cluster.name, None)
            self._tokens.pop(cluster.name, None)
            token_file(self.token_dir, cluster.name).unlink(missing_ok=True)
        return leftovers


async def _to_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end even when the caller is cancelled meanwhile; then the cancel goes on
    (unless `work` failed: its error is the one raised)."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # never cancels `task`
        except asyncio.CancelledError:
            cancelled = True
    if cancelled and not task.cancelled() and task.exception() is None:
        raise asyncio.CancelledError
    return task.result()


def _remote(node: NodePlacement, pid: int | None = None, session_id: int | None = None) -> RemoteNode:
    return RemoteNode(
        host=node.host,
        address=node.address,
        role="head" if node.role == "head" else "worker",
        # -1: no such process (never 0: kernel threads are in session 0)
        pid=pid if pid is not None else (node.pid or -1),
        session_id=session_id if session_id is not None else (node.session_id or -1),
        temp_dir=node.temp_dir,
        log_path=f"{node.temp_dir}.log",
        ports=node.ports,
    )


def _groups_per_node(config: RayClusterConfigSpec) -> list[HeadGroupSpec]:
    groups: list[HeadGroupSpec] = [config.head]
    for group in config.workerGroups:
        groups += [group] * group.replicas
    return groups


def _resources(group: HeadGroupSpec) -> list[str]:
    """The same resource and rayStartParams flags as a local node's."""
    return _resource_args(group) + _param_args(group.rayStartParams)


def _with_nodes(cluster: ClusterRecord, nodes: list[NodePlacement]) -> ClusterRecord:
    pids = [node.pid for node in nodes]
    return cluster.with_changes(
        nodes=tuple(nodes),
        head_pid=pids[0],
        worker_pids=tuple(pid for pid in pids[1:] if pid is not None),
    )
