"""Clusters on a host pool, the `ClusterProvider` for them: placed (`pool_placement.py`), with
a token of their own (`cluster_token.py`), their nodes started, watched and stopped over SSH
(`ssh_nodes.py`).

A pool cluster's record (placement, ports) is stored before any node starts, and each node's pid
once it runs: a restarted controller finds every node again. A node whose start was cut short is
found by its tag and stopped before it starts again; a start cancelled by a delete still records
the node it launched; a stop records each node stopped for sure (its room is free again)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from servekeeper.core.hooks import Hooks
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.endpoint import Endpoint
from servekeeper.model.hostpool import HostPoolSpec, HostSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import (
    ClusterRecords,
    Liveness,
    PermanentProviderError,
    ProviderError,
    RecordChanges,
    RetryableProviderError,
    nodes_restarting,
    with_nodes,
)
from servekeeper.providers.cluster_token import (
    auth_headers,
    new_cluster_token,
    read_cluster_token,
    save_cluster_token,
    token_dir,
    token_file,
)
from servekeeper.providers.environments import environments_of
from servekeeper.providers.gcs_storage import GcsStorage, head_flags, node_env
from servekeeper.providers.host_environments import HostEnvironments
from servekeeper.providers.local_monitor import NodeApi
from servekeeper.providers.node_argv import HeadPorts, head_argv, worker_argv
from servekeeper.providers.pool_launch import launch_on_pool
from servekeeper.providers.pool_liveness import look
from servekeeper.providers.pool_monitor import PoolMonitors
from servekeeper.providers.pool_moves import MOVED_FIELDS, place_move, stop_left_behind
from servekeeper.providers.pool_nodes import (
    adopt_or_clear,
    groups_per_node,
    head_gcs_answers,
    stop_pool_node,
    to_the_end,
)
from servekeeper.providers.pool_placement import Shortfall, check_pool_kept, place_cluster
from servekeeper.providers.ray_start import group_args
from servekeeper.providers.ssh import HostConnection, SshError
from servekeeper.providers.ssh_nodes import SshNodes
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)

LIVENESS_CACHE_SECONDS = 2.0  # an SSH round trip per node per look is too much at 4 looks a second


class PoolProvider:
    def __init__(
        self,
        store: Store,
        state_dir: Path,
        ssh_nodes: Callable[[Sequence[HostSpec]], SshNodes] = SshNodes,
        gcs_storage: GcsStorage | None = None,
        host_environments: HostEnvironments | None = None,
        node_api: NodeApi | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        self.store = store
        self.hooks = hooks or Hooks()  # faults that tests inject (core/hooks.py); none in production
        self.monitors = PoolMonitors(node_api)  # Ray's autoscaler on the heads (issue 22)
        self.host_environments = host_environments or HostEnvironments(environments_of(state_dir))
        self._ssh_nodes = ssh_nodes  # tests give a fake of the SSH side
        self.gcs_storage = gcs_storage or GcsStorage(state_dir)
        self.token_dir = token_dir(state_dir)
        self._nodes: dict[str, tuple[str, SshNodes]] = {}  # pool -> (its spec json, its connections)
        self._tokens: dict[str, str] = {}
        # cluster -> (its node pids when read, when, the answer): a node started since is read anew
        self._liveness: dict[str, tuple[tuple[int | None, ...], float, Liveness]] = {}
        # Held from a placement's snapshot of the pool until its record is stored: two clusters
        # created at once must not take the same room and the same ports.
        self.creating = asyncio.Lock()
        self._closing: set[asyncio.Future[list[BaseException | None]]] = set()  # connections of a changed pool
        # cluster -> the spec of the pool `new_record` placed it on, until `put_new` stores it
        self._placed_on: dict[str, str] = {}

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

    async def prune_environments(self, keep: Collection[str], read_at: float) -> None:
        for pool in [record.spec() for record in self.store.list_host_pools()]:
            try:  # one pool failing (deleted meanwhile) leaves the others pruned
                await self.host_environments.prune(self.ssh(pool.name), pool.host_names(), keep, read_at)
            except Shortfall as exc:
                logger.warning("host pool %s: environments not pruned: %s", pool.name, exc)

    async def close(self) -> None:
        for _, nodes in self._nodes.values():
            await nodes.close()
        self._nodes.clear()
        await asyncio.gather(*self._closing)

    # -- a new cluster -----------------------------------------------------------------------------

    async def create(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        """`draft` placed on the pool and stored with its token; a cluster a host refuses for
        good is stored failed, without nodes (nothing to stop), so that its rollout fails with
        the host's refusal. Raises Shortfall (or another RetryableProviderError) to wait."""
        assert config.hostPool is not None
        async with self.creating:  # the pool's room and ports, as seen, until stored
            try:
                cluster = await self.new_record(draft, config, records)
            except PermanentProviderError as exc:
                failed = draft.with_changes(pool=config.hostPool, failure_reason=f"StartFailed: {exc}")
                records.put_cluster(failed)
                return failed
            self.put_new(cluster, records)  # intent first (and the cluster's token)
            return cluster

    async def new_record(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        """`draft` with its nodes placed on the pool's hosts and ports allocated there; raises
        Shortfall when the pool cannot hold it now, HostRefused when a host picked refuses for good."""
        assert config.hostPool is not None
        pool = self.pool(config.hostPool)
        self._placed_on.pop(draft.name, None)
        cluster = await place_cluster(pool, self.ssh(config.hostPool), records.list_clusters(), draft, config)
        self._placed_on[cluster.name] = pool.to_json()
        return cluster

    def put_new(self, cluster: ClusterRecord, records: ClusterRecords) -> None:
        """Store a new cluster's record (from `new_record`) and save its token with it: the token
        file goes again if the record could not be stored, so that none outlives its cluster.
        Raises PoolChanged, storing nothing, when its pool changed since `new_record` read it."""
        placed_on = self._placed_on.pop(cluster.name, None)
        path = save_cluster_token(self.token_dir, cluster.name, new_cluster_token())
        try:
            # The pool commands refuse to change or delete a pool only for stored clusters; the
            # placement's SSH calls took seconds: compare the pool under the write lock that
            # stores the record (a pool command in another process included).
            with self.store.transaction():
                assert cluster.pool is not None
                check_pool_kept(cluster, placed_on, self.store.get_host_pool(cluster.pool))
                records.put_cluster(cluster)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

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
        # Two nodes on one host share its address and Serve's one proxy port: one endpoint. A
        # node Ray's autoscaler released has no proxy any more (its place is kept in the record).
        addresses = list(
            dict.fromkeys(node.address for node in cluster.nodes if not node.stopped or node.role == "head")
        )
        # With GCS fault tolerance a head comes back, its proxy ready before it knows a replica:
        # a fallback when other nodes have proxies (see Endpoint.fallback).
        comes_back = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json).gcsFaultTolerance is not None
        fallback = comes_back and len(addresses) > 1
        return tuple(Endpoint(address, port, index == 0 and fallback) for index, address in enumerate(addresses))

    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        return cluster  # every node, the head too, starts over SSH in `start_nodes`

    def needs_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> bool:
        return True  # which nodes run is known on their hosts only: `start_nodes` looks

    def restarted(self, cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
        return nodes_restarting(cluster, pids)

    async def move_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        """The head (and the nodes on its silent host) placed elsewhere and stored (`pool_moves.py`)."""
        assert cluster.pool is not None
        async with self.creating:  # the pool's room and ports, as seen, until stored
            pool = self.pool(cluster.pool)
            moved = await place_move(pool, self.ssh(cluster.pool), self.store.list_clusters(), cluster, config)
            with self.store.transaction():
                check_pool_kept(moved, pool.to_json(), self.store.get_host_pool(cluster.pool))
                current = self.store.get_cluster(cluster.name)
                if current is None or current.nodes != cluster.nodes or current.left_behind != cluster.left_behind:
                    raise RetryableProviderError(f"cluster {cluster.name} changed while its head was placed anew")
                # Only what the move changes: an abort or a promote stored meanwhile stays.
                changes = {key: getattr(moved, key) for key in MOVED_FIELDS}
                stored = self.store.update_cluster(cluster.name, **changes)
            self._liveness.pop(cluster.name, None)
            return stored

    async def start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        """Start the nodes not running yet, head first; each node's pid is recorded as it runs.
        A failure is raised as it is: the controller decides what it means for the cluster."""
        await self._start(cluster, config, record)

    async def _start(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        assert cluster.pool is not None
        ssh = self.ssh(cluster.pool)
        token = read_cluster_token(self.token_dir, cluster.name)
        nodes = list(cluster.nodes)
        groups = groups_per_node(config, nodes)
        head_starts = nodes[0].pid is None
        storage = await self.gcs_storage.target(config, nodes[0].address, cluster.name) if head_starts else None
        own_pythons = await self.host_environments.pythons_on(ssh, [n.host for n in nodes if n.pid is None], config)

        async def launch(
            cluster: ClusterRecord, index: int, argv: list[str], token_path: str, extra_env: dict[str, str]
        ) -> ClusterRecord:
            node = nodes[index]
            role: Literal["head", "worker"] = "head" if index == 0 else "worker"
            env = {**groups[index].env, **extra_env, **node_env(config, role, cluster.name, nodes[0].temp_dir, storage)}
            started = await ssh.start_node(node.host, role, argv, node.temp_dir, node.ports, token_path, env)
            if cluster.ready_at is not None:  # a node added to a running cluster
                self.hooks.reached("node-spawned", cluster)
            nodes[index] = replace(node, pid=started.pid, session_id=started.session_id)
            updated = with_nodes(cluster, nodes)
            record(nodes=updated.nodes)  # the controller writes only this start's nodes into the record
            return updated

        for index, node in enumerate(nodes):
            if node.pid is not None or node.stopped:  # running, or released by Ray's autoscaler
                continue
            if index > 0:
                await head_gcs_answers(ssh, cluster)
            # A start cut short (controller killed after the launch, before its pid was
            # recorded) may have left this node running: adopted (a worker of a head that runs
            # on), else stopped by its tag.
            adopted = await adopt_or_clear(ssh, node, adopt=index > 0 and not head_starts)
            if adopted is not None:
                nodes[index] = adopted
                cluster = with_nodes(cluster, nodes)
                record(nodes=cluster.nodes)
                continue
            token_path = await ssh.install_token(node.host, cluster.name, token)
            host = ssh.host(node.host)
            host = host.model_copy(update={"python": own_pythons.get(node.host, host.python)})  # its `ray start`'s
            resources = group_args(groups[index], node.node_id if config.enableInTreeAutoscaling else None)
            monitor_flags: list[str] = []
            monitor_env: dict[str, str] = {}
            if index == 0 and config.enableInTreeAutoscaling:
                monitor_flags, monitor_env = await self.monitors.install(ssh, cluster, config)
            if index == 0:
                await self.gcs_storage.before_restart(ssh, node, config, storage, cluster.name)
                ports = cluster.ports
                head = HeadPorts(ports.gcs, ports.dashboard, ports.client_server)
                flags = [*head_flags(storage), *monitor_flags]
                argv = head_argv(host, node.temp_dir, head, node.ports, resources, flags)
            else:
                argv = worker_argv(host, node.temp_dir, cluster.gcs_address, node.ports, resources)
            # A delete cancels this start: a node launched is recorded before the cancel goes on,
            # so that the stop which follows the delete knows it (and stops it by its pid).
            cluster = await to_the_end(launch(cluster, index, argv, token_path, monitor_env))

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        """Whether the head lives, which workers do not (of those, which exited on a host that
        answered: started again there), and why; read at most every LIVENESS_CACHE_SECONDS. A
        host that does not answer is a dead node, never an exited one (it may still run there):
        a silent head's host is `head_silent`, unknown rather than dead (`pool_liveness.py`)."""
        cached = self._liveness.get(cluster.name)
        now = time.monotonic()
        pids = tuple(node.pid for node in cluster.nodes)
        if cached is not None and cached[0] == pids and now - cached[1] < LIVENESS_CACHE_SECONDS:
            return cached[2]
        assert cluster.pool is not None
        try:
            ssh = self.ssh(cluster.pool)
        except Shortfall as exc:  # the pool was deleted under it: nothing can be looked at (unknown)
            return Liveness(False, [], str(exc), head_silent=True)
        await self.gcs_storage.keep_up(cluster, RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json))
        result, *_ = await asyncio.gather(
            look(ssh, cluster, self.store),
            stop_left_behind(ssh, self.store, cluster),
            self.monitors.keep_reachable(ssh, cluster),
        )
        self._liveness[cluster.name] = (pids, now, result)
        return result

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        assert cluster.pool is not None
        async with self.creating:  # the pool's room and ports, as seen, until stored
            pool, ssh = self.pool(cluster.pool), self.ssh(cluster.pool)
            return await launch_on_pool(pool, ssh, cluster.name, config, group, count, records)

    async def update_autoscaler(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        assert cluster.pool is not None
        await self.monitors.update_config(self.ssh(cluster.pool), cluster, config)

    async def stop_node(self, cluster: ClusterRecord, index: int) -> None:
        left = await stop_pool_node(self.ssh(cluster.pool or ""), cluster.nodes[index])
        if left:
            raise RetryableProviderError(f"node {index} of {cluster.name} is not stopped yet: {', '.join(left)}")

    async def stop(self, cluster: ClusterRecord, record: RecordChanges | None = None) -> list[str]:
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
            left = await stop_pool_node(ssh, nodes[index])
            if not left and not nodes[index].stopped:
                nodes[index] = replace(nodes[index], stopped=True)
                if record is not None:
                    record(nodes=tuple(nodes))
            return left

        leftovers = [item for items in await asyncio.gather(*(stop(i) for i in range(len(nodes)))) for item in items]
        left = await stop_left_behind(ssh, self.store, cluster)
        leftovers += [f"{node.role} node a head move left on {node.host}: not stopped yet" for node in left]
        if not leftovers:
            config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
            hosts = {node.host for node in (*cluster.nodes, *cluster.left_behind)}
            if config.enableInTreeAutoscaling:  # a launched node may have taken a released one's place elsewhere
                hosts |= set(ssh.host_names())
            for host in sorted(hosts):
                try:  # its token file and logs on the host; nothing runs there any more
                    await ssh.forget_cluster(host, cluster.name)
                except (SshError, ProviderError) as exc:
                    logger.warning("[%s] could not remove its dir on %s: %s", cluster.name, host, exc)
            self._liveness.pop(cluster.name, None)
            self._tokens.pop(cluster.name, None)
            self.monitors.forget(cluster.name)
            token_file(self.token_dir, cluster.name).unlink(missing_ok=True)
            await self.gcs_storage.forget(cluster, config)
        return leftovers
