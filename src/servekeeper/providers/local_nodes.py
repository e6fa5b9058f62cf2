"""A local cluster's nodes as records, like a pool cluster's: where each runs (this machine, its
ports, the cluster's temp dir), its pid once started, and its restarts. With them the planner
starts an exited local worker again where it was, and, with GCS fault tolerance, the head, on
the same ports and with the same RocksDB tables, as it does on a pool.

Each node's processes carry a tag of their own (its log's path) in their environment: what a
node left behind when its `ray start` was killed (a raylet, a gcs_server holding the head's
ports) is found by it and stopped before the node starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from servekeeper.model.cluster_spec import HeadGroupSpec, RayClusterConfigSpec, WorkerGroupSpec
from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.base import PermanentProviderError, ProviderError, RetryableProviderError
from servekeeper.providers.node_argv import gcs_storage_dir
from servekeeper.providers.ray_start import node_port_args, param_args, resource_args, with_node_id

logger = logging.getLogger(__name__)

LOCAL_HOST = "localhost"  # the host name of every node of a cluster on this machine
NODE_TAG_ENV = "SERVEKEEPER_NODE_LOG"
LEFTOVER_WAIT_SECONDS = 3.0


def ray_executable() -> str:
    candidate = Path(sys.executable).parent / "ray"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("ray")
    if found is None:
        raise ProviderError("the 'ray' command was not found next to this Python or on PATH")
    return found


def head_command(cluster: ClusterRecord, head: HeadGroupSpec, ray: str, autoscaled: bool = False) -> list[str]:
    """`ray`: the command of the cluster's environment (`ray_executable()`: the controller's).
    `autoscaled`: the node carries its id for Ray's autoscaler (the head's is 0)."""
    ports = cluster.ports
    return [
        ray,
        "start",
        "--head",
        "--block",
        f"--port={ports.gcs}",
        f"--dashboard-port={ports.dashboard}",
        "--dashboard-host=127.0.0.1",
        "--node-ip-address=127.0.0.1",
        f"--ray-client-server-port={ports.client_server}",
        *node_port_args(ports.node_ports[0]),
        f"--temp-dir={cluster.temp_dir}",
        *resource_args(head),
        "--disable-usage-stats",
        *param_args(with_node_id(head.rayStartParams, 0 if autoscaled else None)),
    ]


def worker_command(
    cluster: ClusterRecord, node: NodePlacement, group: WorkerGroupSpec, ray: str, autoscaled: bool = False
) -> list[str]:
    return [
        ray,
        "start",
        "--block",
        f"--address=127.0.0.1:{cluster.ports.gcs}",
        "--node-ip-address=127.0.0.1",
        *node_port_args(node.ports),
        f"--temp-dir={cluster.temp_dir}",
        *resource_args(group),
        "--disable-usage-stats",
        *param_args(with_node_id(group.rayStartParams, node.node_id if autoscaled else None)),
    ]


def placed_nodes(cluster: ClusterRecord, config: RayClusterConfigSpec) -> tuple[NodePlacement, ...]:
    """The cluster's nodes, head first, each on its own ports of `cluster.ports`; none started."""
    groups: list[str | None] = [None, *(group.name for group in config.workerGroups for _ in range(group.replicas))]
    names = log_names(config)
    return tuple(
        NodePlacement(
            host=LOCAL_HOST,
            address="127.0.0.1",
            role="head" if group is None else "worker",
            ports=cluster.ports.node_ports[index],
            temp_dir=cluster.temp_dir,
            group=group,
            node_id=index,
            log=names[index],
        )
        for index, group in enumerate(groups)
    )


def nodes_of(cluster: ClusterRecord) -> tuple[NodePlacement, ...]:
    """The cluster's node records. One stored before local clusters had them gets them from its
    pids, in the order its nodes were started (each pid is also its node's session id)."""
    if cluster.nodes:
        return cluster.nodes
    nodes = placed_nodes(cluster, RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json))
    pids = [cluster.head_pid, *cluster.worker_pids]
    return tuple(
        replace(node, pid=pids[index], session_id=pids[index]) if index < len(pids) else node
        for index, node in enumerate(nodes)
    )


def worker_groups(config: RayClusterConfigSpec) -> list[WorkerGroupSpec]:
    """The worker group of each worker node, in node order (node 1 is the first worker)."""
    return [group for group in config.workerGroups for _replica in range(group.replicas)]


def worker_group_of(config: RayClusterConfigSpec, node: NodePlacement, index: int) -> WorkerGroupSpec:
    """The group of worker node `index`: as recorded, else (a row written before nodes kept
    their group) by its place in the spec's order."""
    if node.group is None:
        return worker_groups(config)[index - 1]
    return next(group for group in config.workerGroups if group.name == node.group)


def log_names(config: RayClusterConfigSpec) -> list[str]:
    """Each node's log file in the cluster's log dir, head first: a node started again appends."""
    workers = [f"worker-{group.name}-{n}.log" for group in config.workerGroups for n in range(group.replicas)]
    return ["head.log", *workers]


def log_name(config: RayClusterConfigSpec, node: NodePlacement, index: int) -> str:
    """Node `index`'s log file: as named when it was placed; in a row written before names were
    kept, a node the spec lists by its place, one Ray's autoscaler asked for since by its id."""
    if node.log is not None:
        return node.log
    names = log_names(config)
    return names[index] if index < len(names) else launched_log_name(node.group, node.node_id)


def launched_log_name(group: str | None, node_id: int | None) -> str:
    """The log file of a node Ray's autoscaler asked for: by its id, never used twice in a cluster."""
    return f"worker-{group}-id{node_id}.log"


def node_tag(cluster: ClusterRecord, index: int) -> str:
    config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
    return os.path.join(cluster.log_dir, log_name(config, nodes_of(cluster)[index], index))


def stop_leftovers(tag: str) -> None:
    """SIGKILL what is left of a node whose `ray start` exited (found by its tag), and wait for
    it to be gone: a second node must never start beside the first (its ports, its GCS store).
    Blocks: run it in a worker thread."""
    deadline = time.monotonic() + LEFTOVER_WAIT_SECONDS
    while True:
        left = processes_tagged(NODE_TAG_ENV, tag.__eq__)
        if not left:
            return
        if time.monotonic() >= deadline:
            raise RetryableProviderError(
                f"processes {[p.pid for p in left]} of the node logging to {tag} did not stop; not starting it again"
            )
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        time.sleep(0.1)


def processes_tagged(env_name: str, accepts: Callable[[str], bool]) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment variable `env_name` is set to a value
    `accepts` takes: the tag every process of a node, or of a cluster, inherits."""
    found = []
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            tag = process.environ().get(env_name, "")
            if tag and process.info["status"] != psutil.STATUS_ZOMBIE and accepts(tag):
                found.append(process)
    return found


def forget_running_cluster(temp_dir: str) -> None:
    """Before a head starts again: `ray start --head` refuses to start where its temp dir names a
    running cluster at its address ("already running"), and finds one in any process naming
    `--gcs-address=` that address: the surviving workers' raylets do, on this machine. The note
    of the last cluster started goes (the workers do not need it: they are given the address)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(temp_dir, "ray_current_cluster"))


def check_gcs_kept(cluster: ClusterRecord) -> None:
    """A head started again in place needs its RocksDB tables (Ray writes the session's name
    there at the first start): without them it would come up as a new, empty cluster with none
    of the service's apps, so it is not started (the cluster stays down and is replaced)."""
    storage = gcs_storage_dir(cluster.temp_dir)
    if not os.path.isfile(os.path.join(storage, "session_name")):
        raise PermanentProviderError(
            f"the GCS state of the head of {cluster.name} is gone ({storage}): "
            "it is not started again on an empty store"
        )


RAYLET_SOCKET_WAIT_SECONDS = 60.0
_SOCKET_POLL_SECONDS = 0.2
_SOCKET_FLAGS = ("--raylet_socket_name=", "--store_socket_name=")


def raylet_socket_paths(pid: int) -> list[str] | None:
    """The raylet and plasma-store socket paths the node `ray start` (`pid`) gave its raylet,
    read from the raylet's command line; None while it has no raylet (or has exited)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                paths = [arg.partition("=")[2] for arg in child.cmdline() if arg.startswith(_SOCKET_FLAGS)]
                if len(paths) == len(_SOCKET_FLAGS):
                    return paths
    return None


async def wait_for_raylet_sockets(pid: int, timeout: float) -> bool:
    """Whether the node `ray start` (`pid`) started has bound its raylet and plasma-store
    sockets within `timeout`; False at once when it exits. The next node of the machine must
    wait for it: `ray start` names its sockets after the first name not yet on disk, seconds
    before its raylet binds them, so two nodes started together take the same names and the
    second dies on `bind: Address already in use` (seen with Ray 2.52: a worker started when
    the head's GCS opened, 2.3 s before the head's sockets were bound)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _running(pid):
        paths = await asyncio.to_thread(raylet_socket_paths, pid)  # a /proc scan: off the loop
        if paths is not None and all(Path(path).exists() for path in paths):
            return True
        await asyncio.sleep(_SOCKET_POLL_SECONDS)
    return False


async def wait_for_earlier_raylets(earlier: list[NodePlacement]) -> None:
    """A node starts only once the nodes before it bound their sockets (their names are taken
    then); one bound for them all: a node that never shows its sockets (gone, or not a `ray
    start` we can read) delays the next by RAYLET_SOCKET_WAIT_SECONDS at most, once."""
    deadline = time.monotonic() + RAYLET_SOCKET_WAIT_SECONDS
    for node in earlier:
        if node.pid is None or node.stopped:
            continue
        if not await wait_for_raylet_sockets(node.pid, max(0.0, deadline - time.monotonic())):
            logger.warning("node pid %d showed no bound raylet sockets: starting the next node anyway", node.pid)


def _running(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False
