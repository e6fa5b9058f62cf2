"""Real Ray clusters as local process groups: the embedded default.

Every node is `ray start --block` in a session of its own (`setsid`), so the node's pid is also
the session id of every process it spawns, the actor workers included (they take process
groups of their own, but stay in the session). Stopping a cluster is therefore exact: signal
the sessions it owns, never anything else. Never `ray stop`: it kills every cluster on the
machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from servekeeper.core.hooks import Hooks
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.endpoint import Endpoint
from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.autoscaling import launch_here, scaled_like
from servekeeper.providers.base import (
    ClusterRecords,
    Liveness,
    PermanentProviderError,
    ProviderError,
    RecordChanges,
    nodes_restarting,
    with_nodes,
)
from servekeeper.providers.environments import Environment, Environments
from servekeeper.providers.gcs_storage import node_env
from servekeeper.providers.local_monitor import NodeApi, monitor_files, write_autoscaling_config
from servekeeper.providers.local_nodes import (
    NODE_TAG_ENV,
    check_gcs_kept,
    forget_running_cluster,
    head_command,
    log_name,
    node_tag,
    nodes_of,
    placed_nodes,
    ray_executable,
    stop_leftovers,
    wait_for_earlier_raylets,
    worker_command,
    worker_group_of,
)
from servekeeper.providers.local_processes import (
    OWNER_ENV,
    alive_members,
    is_our_node,
    kill_all,
    our_sessions,
    private_temp_dir,
    session_is_ours,
    session_members,
    unrecorded_leader,
)
from servekeeper.providers.node_argv import gcs_storage_dir
from servekeeper.providers.node_log import TAIL_BYTES, hidden_values, last_lines
from servekeeper.providers.ports import PortAllocator, wait_for_port
from servekeeper.providers.remote.node_agent import open_log

logger = logging.getLogger(__name__)

TERM_GRACE_SECONDS = 3.0
KILL_GRACE_SECONDS = 3.0
HEAD_GCS_WAIT_SECONDS = 60.0


def _environment(
    cluster: ClusterRecord, index: int, extra: dict[str, str], loopback_only: bool, own: Environment | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    if own is not None:  # the cluster's own Ray and Python first, as if its virtualenv were active
        env["PATH"] = os.pathsep.join([str(own.ray.parent), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(own.path)
    env.update(extra)
    # Every process of the cluster inherits this tag, actor workers included: a last-resort
    # way to find stragglers that left the cluster's sessions.
    env[OWNER_ENV] = cluster.log_dir
    env[NODE_TAG_ENV] = node_tag(cluster, index)  # and of its node: what a node left behind
    if loopback_only:
        # Ray then keeps the node on 127.0.0.1: GCS, raylet and agents bind to loopback only.
        # It also refuses extra nodes, so clusters with worker groups use the host's address.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


class LocalProvider:
    def __init__(
        self, hooks: Hooks | None = None, environments: Environments | None = None, node_api: NodeApi | None = None
    ) -> None:
        self.hooks = hooks or Hooks()
        self.environments = environments  # None: every cluster runs the controller's own Ray
        self.node_api = node_api  # None: no cluster of it is autoscaled (Ray's monitor has no one to ask)
        # Children we started in this process: reaped so they do not linger as zombies.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def _spawn(self, command: list[str], env: dict[str, str], log_path: Path) -> int:
        log_path.parent.mkdir(parents=True, exist_ok=True)  # in the state dir, 0700
        with os.fdopen(open_log(str(log_path)), "ab") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self._children[process.pid] = process
        return process.pid

    def _reap(self) -> None:
        # Liveness looks run in worker threads, several clusters at once: another may have
        # reaped the same child between our copy of the dict and our look.
        for pid, process in list(self._children.items()):
            if process.poll() is not None:
                self._children.pop(pid, None)

    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        """Spawn the head (no waiting); the caller records its pid before anything else. A head
        started again in place (GCS fault tolerance) is left to `start_nodes`: it first stops
        what the old head left and checks its tables, which takes longer than a tick may."""
        nodes = nodes_of(cluster)
        if nodes[0].restarts > 0:
            return cluster
        private_temp_dir(cluster.temp_dir)
        pid = self._spawn_node(cluster, config, 0)
        logger.info("[%s/%s] head started, pid %d", cluster.service, cluster.name, pid)
        return with_nodes(cluster, (replace(nodes[0], pid=pid, session_id=pid), *nodes[1:]))

    def _spawn_node(self, cluster: ClusterRecord, config: RayClusterConfigSpec, index: int) -> int:
        """Start node `index` (0: the head) of the cluster; its pid, also its session id."""
        node = nodes_of(cluster)[index]
        log_path = Path(cluster.log_dir) / log_name(config, node, index)
        environment = self._environment_of(config)
        ray = str(environment.ray) if environment is not None else ray_executable()
        if index == 0:
            extra = {**config.head.env, **node_env(config, "head", cluster.name, cluster.temp_dir, None)}
            command = head_command(cluster, config.head, ray, config.enableInTreeAutoscaling)
            if config.enableInTreeAutoscaling:
                if self.node_api is None:
                    raise PermanentProviderError("autoscaling needs the daemon's node API (run the cluster under `up`)")
                flags, monitor_env = monitor_files(cluster, config, self.node_api)
                command, extra = [*command, *flags], {**extra, **monitor_env}
            env = _environment(cluster, 0, extra, loopback_only=config.max_worker_count() == 0, own=environment)
            return self._spawn(command, env, log_path)
        group = worker_group_of(config, node, index)
        extra = {**group.env, **node_env(config, "worker", cluster.name, cluster.temp_dir, None)}
        env = _environment(cluster, index, extra, loopback_only=False, own=environment)
        return self._spawn(worker_command(cluster, node, group, ray, config.enableInTreeAutoscaling), env, log_path)

    def _environment_of(self, config: RayClusterConfigSpec) -> Environment | None:
        if not config.has_own_environment():
            return None
        if self.environments is None:
            raise PermanentProviderError("this controller builds no environments: rayVersion, pythonVersion, pip")
        return self.environments.lookup(config)

    def needs_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> bool:
        return any(node.pid is None and not node.stopped for node in nodes_of(cluster))

    async def start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        """Start the nodes not running yet (the workers; a head started again in place), the
        workers once the head's GCS accepts connections. `record` gets each new pid at once, so
        a crash never leaves an unknown process; it gets every node as this start knows them,
        and the controller keeps only those this start launched (`launched_into`)."""
        nodes = list(nodes_of(cluster))
        head_started = False
        for index, node in enumerate(nodes):
            if node.pid is not None or node.stopped:
                continue
            if index == 0:
                await asyncio.to_thread(check_gcs_kept, cluster)
                forget_running_cluster(cluster.temp_dir)
                head_started = True
            elif not await wait_for_port("127.0.0.1", cluster.ports.gcs, HEAD_GCS_WAIT_SECONDS):
                raise ProviderError(f"the head's GCS did not open port {cluster.ports.gcs}; see {cluster.log_dir}")
            else:
                await wait_for_earlier_raylets(nodes[:index])
            pid = await self._adopt_or_spawn(cluster, config, index, adopt=index > 0 and not head_started)
            # its name stored (a row written before names were: by its place, which may change)
            nodes[index] = replace(node, pid=pid, session_id=pid, log=log_name(config, node, index))
            cluster = with_nodes(cluster, nodes)
            record(nodes=cluster.nodes)

    async def _adopt_or_spawn(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, index: int, adopt: bool
    ) -> int:
        """Node `index`'s pid: with `adopt`, a worker a dead controller spawned and never recorded
        is adopted (Ray knows it already: stopping it would make Ray ask for another); otherwise
        what an exited node left (its raylet, its ports; a start cut short) goes first, then it is
        started: never a second node beside the first. Not after the head was started again by
        the same start: that worker's raylet lost the GCS it joined, and would exit after Ray's
        reconnect timeout to be started again then."""
        tag = node_tag(cluster, index)
        adopted = await asyncio.to_thread(unrecorded_leader, tag, cluster.temp_dir) if adopt else None
        if adopted is not None:
            logger.info(
                "[%s/%s] node %d runs unrecorded (pid %d): adopted", cluster.service, cluster.name, index, adopted
            )
            return adopted
        await asyncio.to_thread(stop_leftovers, tag)
        # (the temp dir is not checked again: the head's first start made it, and Ray opened it)
        pid = self._spawn_node(cluster, config, index)
        if cluster.ready_at is not None:
            self.hooks.reached("node-spawned", cluster)
        return pid

    async def create(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        if config.hostPool is not None:  # only the router chooses; a pool spec never runs here by mistake
            raise PermanentProviderError(f"cluster {draft.name} is for host pool {config.hostPool!r}, not this machine")
        return store_with_local_ports(draft, config, records, placed_nodes)

    def restarted(self, cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
        return nodes_restarting(cluster.with_changes(nodes=nodes_of(cluster)), pids)

    async def move_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        raise PermanentProviderError(f"the head of {cluster.name} runs on this machine: no other host to move to")

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        # Process checks and log reads block: in a worker thread, never on the loop.
        return await asyncio.to_thread(process_liveness, self, cluster)

    def endpoints(self, cluster: ClusterRecord, grpc: bool) -> tuple[Endpoint, ...]:
        return (Endpoint("127.0.0.1", cluster.ports.serve_grpc if grpc else cluster.ports.serve_http),)

    def headers(self, cluster: ClusterRecord) -> dict[str, str]:
        return {}  # a local cluster listens on loopback only, without token authentication

    async def close(self) -> None:
        return None

    async def prune_environments(self, keep: Collection[str], read_at: float) -> None:
        return None  # its nodes run the controller's own environments, pruned by the controller

    def processes_alive(self, cluster: ClusterRecord) -> bool:
        self._reap()
        return cluster.head_pid is not None and self._running(cluster.head_pid, cluster.temp_dir)

    def dead_workers(self, cluster: ClusterRecord) -> list[int]:
        """Worker nodes that were started and are gone (this machine answers: they exited)."""
        self._reap()
        return [pid for pid in cluster.worker_pids if not self._running(pid, cluster.temp_dir)]

    def _running(self, pid: int, temp_dir: str) -> bool:
        # A child of ours not reaped yet is alive for sure (its pid cannot be reused before we
        # reap it); /proc is read only for nodes adopted after a restart.
        return pid in self._children or is_our_node(pid, temp_dir)

    def exit_reason(self, cluster: ClusterRecord, worker_pid: int | None = None) -> str:
        """The last lines `ray start` logged, for a node that exited: the cause users need."""
        log_file = "head.log"
        pids = [node.pid for node in nodes_of(cluster)]
        if worker_pid is not None and worker_pid in pids:
            config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
            index = pids.index(worker_pid)
            log_file = log_name(config, nodes_of(cluster)[index], index)
        try:
            with open(Path(cluster.log_dir) / log_file, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - TAIL_BYTES))
                # No store here: which env values came from secrets is unknown, so more is hidden.
                return last_lines(log.read().decode(errors="replace"), hide=hidden_values(cluster, None))
        except OSError:
            return "no log"

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        return launch_here(cluster, config, group, count, records)

    async def update_autoscaler(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        """The monitor's config rewritten: it reads it again at its next look (each second)."""
        if not config.enableInTreeAutoscaling:
            raise PermanentProviderError(f"{cluster.name} runs no autoscaler to give bounds to")
        await asyncio.to_thread(write_autoscaling_config, cluster, config)

    async def stop_node(self, cluster: ClusterRecord, index: int) -> None:
        """Node `index`: SIGTERM to its session while it is ours, a grace to exit, then what is
        left of it killed by its tag (Ray's autoscaler releases idle nodes it drained first)."""
        session = nodes_of(cluster)[index].session_id
        if session is not None and await asyncio.to_thread(session_is_ours, session, cluster.temp_dir, cluster.log_dir):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(session, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + TERM_GRACE_SECONDS
            while loop.time() < deadline:
                members = await asyncio.to_thread(session_members, (session,))
                if not members:
                    break
                await asyncio.sleep(0.25)
        await asyncio.to_thread(stop_leftovers, node_tag(cluster, index))
        self._reap()

    async def stop(self, cluster: ClusterRecord, record: RecordChanges | None = None) -> list[int]:
        sessions = await asyncio.to_thread(our_sessions, cluster)
        for session in sessions:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(session, signal.SIGTERM)
        self.hooks.reached("deleting-old", cluster)
        await self._wait_gone(sessions, cluster.log_dir, TERM_GRACE_SECONDS)
        # gcs_server, the raylet and the actor workers often outlive SIGTERM: kill what is left,
        # each actor worker by pid since it sits in a process group of its own.
        await asyncio.to_thread(kill_all, sessions, cluster.log_dir)
        leftovers = await self._wait_gone(sessions, cluster.log_dir, KILL_GRACE_SECONDS)
        self._reap()
        await asyncio.to_thread(shutil.rmtree, cluster.temp_dir, True)
        await asyncio.to_thread(shutil.rmtree, gcs_storage_dir(cluster.temp_dir), True)  # GCS FT's tables
        if leftovers:
            logger.warning("[%s/%s] processes survived SIGKILL: %s", cluster.service, cluster.name, leftovers)
        return leftovers

    async def _wait_gone(self, sessions: tuple[int, ...], log_dir: str, timeout: float) -> list[int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._reap()
            # A scan of /proc: in a worker thread, never on the loop that serves ticks and the API.
            alive = await asyncio.to_thread(alive_members, sessions, log_dir)
            if not alive or loop.time() >= deadline:
                return alive
            await asyncio.sleep(0.25)


def store_with_local_ports(
    draft: ClusterRecord,
    config: RayClusterConfigSpec,
    records: ClusterRecords,
    nodes: Callable[[ClusterRecord, RayClusterConfigSpec], tuple[NodePlacement, ...]] | None = None,
    allocator: Callable[[Iterable[int]], PortAllocator] = PortAllocator,
) -> ClusterRecord:
    """`draft` with ports free on this machine and taken by no other cluster (and its `nodes`
    records, placed on those ports), stored. A port a service's ingress declares is never
    taken, bound or not: Ray holding it would keep that ingress from ever listening."""
    clusters = records.list_clusters()
    reserved = [port for other in clusters for port in other.ports.all_ports()]
    reserved += records.declared_ports()
    scaled = scaled_like(config, draft.service, clusters)
    if scaled is not config:  # recorded as started: its nodes are placed from it
        config, draft = scaled, draft.with_changes(cluster_spec_json=scaled.model_dump_json())
    # The nodes it starts with: Ray's autoscaler's nodes get theirs as they are launched.
    cluster = draft.with_changes(ports=allocator(reserved).cluster(worker_nodes=config.worker_count()))
    if nodes is not None:
        cluster = cluster.with_changes(nodes=nodes(cluster, config))
    records.put_cluster(cluster)  # intent first: a crash from here on leaves nothing unknown
    return cluster


class ProcessChecks(Protocol):
    def processes_alive(self, cluster: ClusterRecord) -> bool: ...

    def dead_workers(self, cluster: ClusterRecord) -> list[int]: ...

    def exit_reason(self, cluster: ClusterRecord, worker_pid: int | None = None) -> str: ...


def process_liveness(checks: ProcessChecks, cluster: ClusterRecord) -> Liveness:
    """A local cluster's liveness from its process checks and, for a node gone, its log."""
    if not checks.processes_alive(cluster):
        reason = checks.exit_reason(cluster) if cluster.head_pid is not None else None
        return Liveness(False, [], reason)
    dead = checks.dead_workers(cluster)
    if dead:
        causes = tuple((pid, checks.exit_reason(cluster, pid)) for pid in dead)
        # This machine always answers: a worker gone has exited, and may be started again in place.
        return Liveness(True, dead, f"worker pid {dead[0]} exited: {causes[0][1]}", tuple(dead), exit_causes=causes)
    return Liveness(True, [], None)
