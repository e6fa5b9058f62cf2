"""What a pool node is on its host: where it lives, its `ray start` command, and the record
that finds it again (pid, session, temp dir) to stop exactly it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from servekeeper.model.hostpool import HostSpec
from servekeeper.model.records import NodePlacement, NodePorts
from servekeeper.providers.ray_start import node_port_args


@dataclass(frozen=True)
class RemoteNode:
    """A Ray node we started on a host: enough to find it again, and to stop exactly it."""

    host: str  # the host's name in the pool
    address: str
    role: Literal["head", "worker"]
    pid: int
    session_id: int
    temp_dir: str
    log_path: str
    ports: NodePorts

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ports": asdict(self.ports)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RemoteNode:
        return cls(**{**data, "ports": NodePorts(**data["ports"])})


@dataclass(frozen=True)
class HeadPorts:
    gcs: int
    dashboard: int
    client_server: int


def cluster_dir(host: HostSpec, cluster: str) -> str:
    """Where a cluster keeps its nodes on `host`: short (Ray nests unix sockets under it)."""
    short = cluster if len(cluster) <= 24 else f"{cluster[:15]}-{hashlib.sha256(cluster.encode()).hexdigest()[:8]}"
    return f"{host.workDir.rstrip('/')}/{short}"


def _ray_start(
    host: HostSpec, temp_dir: str, ports: NodePorts, flags: Sequence[str], resources: Sequence[str]
) -> list[str]:
    """`ray start --block` through the host's python (its `ray` script may not be on any PATH)."""
    return [
        host.python,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        *flags,
        f"--node-ip-address={host.address}",
        *node_port_args(ports),
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *resources,
    ]


def head_argv(
    host: HostSpec,
    temp_dir: str,
    head: HeadPorts,
    ports: NodePorts,
    resources: Sequence[str] = (),
    storage_flags: Sequence[str] = (),
) -> list[str]:
    flags = [
        *storage_flags,
        "--head",
        f"--port={head.gcs}",
        f"--dashboard-port={head.dashboard}",
        f"--dashboard-host={host.address}",
        f"--ray-client-server-port={head.client_server}",
    ]
    return _ray_start(host, temp_dir, ports, flags, resources)


def worker_argv(
    host: HostSpec, temp_dir: str, gcs_address: str, ports: NodePorts, resources: Sequence[str] = ()
) -> list[str]:
    return _ray_start(host, temp_dir, ports, [f"--address={gcs_address}"], resources)


# How long a worker's raylet waits for a head that went away before it exits: with GCS fault
# tolerance the head is started again in place, and its workers must still be there for it.
GCS_RECONNECT_SECONDS = 300


def gcs_storage_dir(head_temp_dir: str) -> str:
    """Beside the head's temp dir, not in it: a node's stop removes its temp dir, and the head
    started again in place must find its tables; the cluster's dir (removed once the whole
    cluster is stopped) holds both."""
    return f"{head_temp_dir}.gcs"


def remote_node(node: NodePlacement, pid: int | None = None, session_id: int | None = None) -> RemoteNode:
    """The node as its host knows it; `pid`/`session_id` override the recorded ones."""
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
