"""Port allocation for clusters side by side on one machine.

Ports are drawn from 20000-32767: above Ray's default worker range (10002-19999), which other
Ray clusters on the machine use, and below the kernel's ephemeral range (32768+), which any
outgoing connection may take. A port is taken only if it binds on every address right now and
no stored cluster of ours holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Iterable

from servekeeper.model.records import ClusterPorts, NodePorts

PORT_LOW = 20000
PORT_HIGH = 32767
WORKER_PORTS_PER_NODE = 48


class PortsExhausted(RuntimeError):
    pass


def port_is_free(port: int) -> bool:
    """Nothing listens on it. SO_REUSEADDR: connections of a stopped server lingering in
    TIME_WAIT do not make a port busy (the servers we start bind it that way too)."""
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


async def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts TCP connections on host:port within `timeout` (polled)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 0.5)
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.25)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
    return False


class PortAllocator:
    def __init__(self, reserved: Iterable[int] = (), rng: random.Random | None = None) -> None:
        self._taken = set(reserved)
        self._rng = rng or random.Random()

    def _usable(self, port: int) -> bool:
        return port not in self._taken and port_is_free(port)

    def one(self) -> int:
        for _ in range(2000):
            port = self._rng.randint(PORT_LOW, PORT_HIGH)
            if self._usable(port):
                self._taken.add(port)
                return port
        raise PortsExhausted(f"no free port found in {PORT_LOW}-{PORT_HIGH}")

    def block(self, size: int) -> range:
        for _ in range(500):
            start = self._rng.randint(PORT_LOW, PORT_HIGH - size)
            ports = range(start, start + size)
            if all(self._usable(port) for port in ports):
                self._taken.update(ports)
                return ports
        raise PortsExhausted(f"no free block of {size} ports found in {PORT_LOW}-{PORT_HIGH}")

    def node(self) -> NodePorts:
        workers = self.block(WORKER_PORTS_PER_NODE)
        return NodePorts(
            node_manager=self.one(),
            object_manager=self.one(),
            metrics_export=self.one(),
            agent_listen=self.one(),
            agent_grpc=self.one(),
            runtime_env_agent=self.one(),
            min_worker=workers.start,
            max_worker=workers.stop - 1,
        )

    def cluster(self, worker_nodes: int) -> ClusterPorts:
        return ClusterPorts(
            gcs=self.one(),
            dashboard=self.one(),
            client_server=self.one(),
            serve_http=self.one(),
            serve_grpc=self.one(),
            node_ports=tuple(self.node() for _ in range(1 + worker_nodes)),
        )
