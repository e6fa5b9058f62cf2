"""A fake of the SSH side of host pools (`SshNodes`): a fleet of pretend hosts shared by every
`SshNodes` the code under test makes, with controls to steer it; no connection is opened.

Controls: `refuse[host]` / `silent[host]` (what a probe of that host raises), `launch_gate` (a
node launch waits for it), `leftovers[temp_dir]` (pids a stop of that node leaves alive). It
keeps `running` (temp dir -> the node), `tokens` (path -> content) and the `calls` it got."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from servekeeper.hostpool import HostSpec
from servekeeper.providers.ssh_nodes import RemoteNode, SshNodes, cluster_dir
from servekeeper.ssh import HostUnreachable, SshError
from servekeeper.status import NodePorts
from tests.unit.test_hostpool import host


class FakeFleet:
    def __init__(self) -> None:
        self.refuse: dict[str, SshError] = {}
        self.silent: set[str] = set()
        self.launch_gate: asyncio.Event | None = None
        self.launching = asyncio.Event()  # set once a launch has begun (and waits for the gate)
        self.leftovers: dict[str, list[int]] = {}
        self.running: dict[str, RemoteNode] = {}
        self.tokens: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []  # (method, host or temp dir)
        self.made: list[FakeSshNodes] = []
        self._pids = itertools.count(7000)
        self._ports = itertools.count(20000)

    def __call__(self, hosts: Sequence[HostSpec]) -> FakeSshNodes:
        nodes = FakeSshNodes(self, hosts)
        self.made.append(nodes)
        return nodes

    def port(self) -> int:
        return next(self._ports)

    def pid(self) -> int:
        return next(self._pids)


class FakeSshNodes(SshNodes):
    def __init__(self, fleet: FakeFleet, hosts: Sequence[HostSpec]) -> None:
        super().__init__(hosts)
        self.fleet = fleet
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    async def probe(self, host: str, timeout: float) -> None:
        self.fleet.calls.append(("probe", host))
        if host in self.fleet.refuse:
            raise self.fleet.refuse[host]
        if host in self.fleet.silent:
            raise HostUnreachable(host, "cannot connect: timed out")

    async def ports_free_on_all(self, hosts: Sequence[str], count: int, reserved: Sequence[int] = ()) -> list[int]:
        return [self.fleet.port() for _ in range(count)]

    async def node_ports(self, host: str, reserved: Sequence[int] = (), extra: int = 0) -> tuple[NodePorts, list[int]]:
        singles = [self.fleet.port() for _ in range(6 + extra)]
        ports = NodePorts(*singles[:6], min_worker=30000, max_worker=30047)
        return ports, singles[6:]

    async def install_token(self, host: str, cluster: str, token: str) -> str:
        path = f"{cluster_dir(self.host(host), cluster)}/auth_token"
        self.fleet.tokens[path] = token
        return path

    async def forget_cluster(self, host: str, cluster: str) -> None:
        self.fleet.calls.append(("forget", host))

    async def start_node(
        self,
        host: str,
        role: Literal["head", "worker"],
        argv: Sequence[str],
        temp_dir: str,
        ports: NodePorts,
        token_path: str,
        env: Mapping[str, str] | None = None,
    ) -> RemoteNode:
        self.fleet.calls.append(("launch", temp_dir))
        self.fleet.launching.set()
        if self.fleet.launch_gate is not None:
            await self.fleet.launch_gate.wait()
        pid = self.fleet.pid()
        node = RemoteNode(host, self.host(host).address, role, pid, pid, temp_dir, f"{temp_dir}.log", ports)
        self.fleet.running[temp_dir] = node
        return node

    async def alive(self, node: RemoteNode) -> bool:
        return node.temp_dir in self.fleet.running

    async def stop(self, node: RemoteNode) -> list[int]:
        self.fleet.calls.append(("stop", node.temp_dir))
        left = self.fleet.leftovers.get(node.temp_dir, [])
        if not left:
            self.fleet.running.pop(node.temp_dir, None)
        return list(left)


def pool_document(*hosts: tuple[str, float], pool: str = "fleet") -> dict[str, Any]:
    """A HostPool of hosts (name, cpus) with 64 GiB and no GPU each."""
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "HostPool",
        "metadata": {"name": pool},
        "spec": {
            "hosts": [
                {**host(name, f"10.0.0.{index + 11}"), "resources": {"cpus": cpus, "gpus": 0, "memoryGiB": 64}}
                for index, (name, cpus) in enumerate(hosts)
            ]
        },
    }
