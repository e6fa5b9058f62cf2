"""A fake of the SSH side of host pools (`SshNodes`): a fleet of pretend hosts shared by every
`SshNodes` the code under test makes, with controls to steer it; no connection is opened.

Controls: `refuse[host]` / `silent[host]` (what a probe of that host raises), `fail_launch[host]`
(what a launch there raises), `logs[temp_dir]` (what a node logged), `launch_gate` (a node launch
waits for it on the host; cancelling the caller does not stop it), `leftovers[temp_dir]` (pids a
stop of that node leaves alive), `gcs_lost` (GCS storage dirs found empty), `taken_ports[host]` (ports
bound there by something else), `connections[host]` (delete one to mimic a new connection). It
keeps `forwards` ((host, socket path) -> where to), `running` (temp dir -> the node), `envs` (temp dir -> its
launch's env), `tokens` (path -> content), `files` (path -> content and mode, written over
"SFTP"), `stopped` (the nodes each stop got) and the `calls` it got.

Below it, `FakeSshConnection`: an asyncssh connection with only an SFTP client over a local
directory, for what `HostConnection` does with files."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import asyncssh

from servekeeper.model.hostpool import HostSpec
from servekeeper.model.records import NodePorts
from servekeeper.providers.node_argv import RemoteNode, cluster_dir
from servekeeper.providers.node_log import last_lines
from servekeeper.providers.ssh import HostConnection, HostUnreachable, SshError
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes
from tests.unit.test_hostpool import host


class FakeFleet:
    def __init__(self) -> None:
        self.refuse: dict[str, SshError] = {}
        self.silent: set[str] = set()
        self.launch_gate: asyncio.Event | None = None
        self.fail_launch: dict[str, SshError] = {}  # a launch on that host raises it
        self.logs: dict[str, str] = {}  # temp dir -> what its node logged
        self.launching = asyncio.Event()  # set once a launch has begun (and waits for the gate)
        self.leftovers: dict[str, list[int]] = {}
        self.gcs_lost: set[str] = set()  # GCS storage dirs whose session is gone (a rebooted host)
        self.gcs_silent: set[str] = set()  # hosts whose head's GCS does not answer
        self.taken_ports: dict[str, set[int]] = {}  # host -> ports bound there by something else
        self.envs: dict[str, dict[str, str]] = {}  # temp dir -> the env of its last launch
        self.argvs: dict[str, list[str]] = {}  # temp dir -> the argv of its last launch
        self.running: dict[str, RemoteNode] = {}
        self.tokens: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []  # (method, host or temp dir)
        self.stopped: list[RemoteNode] = []  # what each stop was asked to stop (pid -1: by its tag)
        self.launches: list[asyncio.Future[RemoteNode]] = []
        self.made: list[FakeSshNodes] = []
        self.interpreters: dict[str, dict[str, str]] = {}  # host -> its Pythons (default: 3.11 only)
        self.files: dict[str, tuple[bytes, int]] = {}  # path -> (content, mode), written to any host
        self.forwards: dict[tuple[str, str], str] = {}  # (host, socket path) -> where it forwards to
        self.connections: dict[str, Any] = {}  # host -> its open "asyncssh" connection (drop one: a new one)
        self._pids = itertools.count(7000)
        self._ports = itertools.count(20000)

    def __call__(self, hosts: Sequence[HostSpec]) -> FakeSshNodes:
        nodes = FakeSshNodes(self, hosts)
        self.made.append(nodes)
        return nodes

    async def launch_on_host(
        self, host: HostSpec, role: Literal["head", "worker"], temp_dir: str, ports: NodePorts
    ) -> RemoteNode:
        self.launching.set()
        if self.launch_gate is not None:
            await self.launch_gate.wait()
        pid = self.pid()
        node = RemoteNode(host.name, host.address, role, pid, pid, temp_dir, f"{temp_dir}.log", ports)
        self.running[temp_dir] = node
        return node

    async def settle(self) -> None:
        """Let every launch sent end (the gate opened)."""
        if self.launch_gate is not None:
            self.launch_gate.set()
        await asyncio.gather(*self.launches)

    def port(self) -> int:
        return next(self._ports)

    def pid(self) -> int:
        return next(self._pids)


class FakeHostConnection(HostConnection):
    """A connection whose files and forwards land in the fleet (a silent host raises)."""

    def __init__(self, fleet: FakeFleet, host: HostSpec) -> None:
        super().__init__(host)
        self.fleet = fleet

    def _answer(self, call: str, path: str) -> None:
        self.fleet.calls.append((call, path))
        if self.host.name in self.fleet.silent:
            raise HostUnreachable(self.host.name, "cannot connect: timed out")

    async def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        self._answer("write", path)
        self.fleet.files[path] = (data, mode)

    async def put_file(self, local: Path, path: str, mode: int = 0o644) -> None:
        self._answer("put", path)
        self.fleet.files[path] = (local.read_bytes(), mode)

    async def connected(self) -> Any:
        self._answer("connected", self.host.name)
        if self.host.name not in self.fleet.connections:
            self.fleet.connections[self.host.name] = FakeForwardingConnection(self.fleet, self.host.name)
        return self.fleet.connections[self.host.name]


class FakeForwardingConnection:
    """An open asyncssh connection to a fleet host that forwards socket files (into the fleet's
    `forwards`: (host, path) -> "dest_host:dest_port") and removes files over SFTP."""

    def __init__(self, fleet: FakeFleet, host: str) -> None:
        self.fleet = fleet
        self.host = host

    def is_closed(self) -> bool:
        return False

    @contextlib.asynccontextmanager
    async def start_sftp_client(self) -> AsyncIterator[Any]:
        connection = self

        class Sftp:
            async def remove(self, path: str) -> None:
                connection.fleet.calls.append(("remove", path))
                if path not in connection.fleet.files:
                    raise asyncssh.SFTPNoSuchFile(path)
                del connection.fleet.files[path]

        yield Sftp()

    async def forward_remote_path_to_port(self, path: str, dest_host: str, dest_port: int) -> Any:
        self.fleet.calls.append(("forward", path))
        self.fleet.forwards[(self.host, path)] = f"{dest_host}:{dest_port}"
        self.fleet.files[path] = (b"<socket>", 0o600)
        forwards, key = self.fleet.forwards, (self.host, path)

        class Listener:
            def close(self) -> None:
                forwards.pop(key, None)

        return Listener()


class FakeSshNodes(SshNodes):
    def __init__(self, fleet: FakeFleet, hosts: Sequence[HostSpec]) -> None:
        super().__init__(hosts)
        self.fleet = fleet
        self.closed = False

    def connection(self, name: str) -> HostConnection:
        if name not in self._connections:
            self._connections[name] = FakeHostConnection(self.fleet, self.host(name))
        return self._connections[name]

    async def make_dirs(self, host: str, directories: Sequence[str]) -> None:
        self.fleet.calls.extend(("make_dirs", directory) for directory in directories)

    async def close(self) -> None:
        self.closed = True

    async def interpreters(self, host: str) -> dict[str, str]:
        self.fleet.calls.append(("interpreters", host))
        return self.fleet.interpreters.get(host, {"3.11": "/usr/bin/python3.11"})

    async def probe(self, host: str, timeout: float) -> None:
        self.fleet.calls.append(("probe", host))
        if host in self.fleet.refuse:
            raise self.fleet.refuse[host]
        if host in self.fleet.silent:
            raise HostUnreachable(host, "cannot connect: timed out")

    async def ports_free_on_all(self, hosts: Sequence[str], count: int, reserved: Sequence[int] = ()) -> list[int]:
        return [self.fleet.port() for _ in range(count)]

    async def ports_free(self, host: str, candidates: Sequence[int]) -> list[int]:
        return [port for port in candidates if port not in self.fleet.taken_ports.get(host, ())]

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
        self.fleet.envs[temp_dir] = dict(env or {})
        self.fleet.argvs[temp_dir] = list(argv)
        if host in self.fleet.fail_launch:
            raise self.fleet.fail_launch[host]
        # The command is on its way: the host starts the node whatever becomes of this call.
        on_host = asyncio.ensure_future(self.fleet.launch_on_host(self.host(host), role, temp_dir, ports))
        self.fleet.launches.append(on_host)
        return await asyncio.shield(on_host)

    async def gcs_answers(self, host: str, port: int, timeout: float) -> bool:
        self.fleet.calls.append(("gcs_answers", host))
        return host not in self.fleet.gcs_silent

    async def gcs_state_kept(self, host: str, storage_dir: str) -> bool:
        self.fleet.calls.append(("gcs_kept", storage_dir))
        return storage_dir not in self.fleet.gcs_lost

    async def alive(self, node: RemoteNode, timeout: float | None = None) -> bool:
        if node.host in self.fleet.silent:
            raise NodeUnreachable(node.host, f"cannot tell whether pid {node.pid} lives: timed out")
        return node.temp_dir in self.fleet.running

    async def unrecorded_leader(self, host: str, temp_dir: str) -> int | None:
        self.fleet.calls.append(("leaders", temp_dir))
        if host in self.fleet.silent:
            raise NodeUnreachable(host, "cannot look for an unrecorded node: timed out")
        running = self.fleet.running.get(temp_dir)
        return None if running is None else running.pid

    async def last_lines(self, node: RemoteNode, hide: Collection[str] = (), timeout: float | None = None) -> str:
        if node.host in self.fleet.silent:
            raise NodeUnreachable(node.host, f"cannot read the log of pid {node.pid}: timed out")
        return last_lines(self.fleet.logs.get(node.temp_dir, ""), hide=hide)

    async def stop(self, node: RemoteNode) -> list[int]:
        self.fleet.calls.append(("stop", node.temp_dir))
        if node.host in self.fleet.silent:
            raise NodeUnreachable(node.host, f"cannot stop pid {node.pid}: timed out")
        self.fleet.stopped.append(node)
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


class FakeSftp:
    """asyncssh's SFTP client over a local directory (the calls write_file makes); `ops` lists
    (operation, path) in order, `fail_write` makes the next write raise."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str]] = []
        self.fail_write: Exception | None = None

    async def __aenter__(self) -> FakeSftp:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    @contextlib.asynccontextmanager
    async def open(self, path: str, mode: str, attrs: asyncssh.SFTPAttrs) -> AsyncIterator[Any]:
        self.ops.append((f"open-{mode}", path))
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if "x" in mode else os.O_TRUNC)
        descriptor = os.open(path, flags, attrs.permissions or 0o644)
        sftp = self

        class Remote:
            async def write(self, data: bytes) -> None:
                if sftp.fail_write is not None:
                    raise sftp.fail_write
                os.write(descriptor, data)

        try:
            yield Remote()
        finally:
            os.close(descriptor)

    async def chmod(self, path: str, mode: int) -> None:
        self.ops.append(("chmod", path))
        os.chmod(path, mode)

    async def posix_rename(self, old: str, new: str) -> None:
        self.ops.append(("rename", f"{old} -> {new}"))
        os.replace(old, new)

    async def remove(self, path: str) -> None:
        self.ops.append(("remove", path))
        os.remove(path)


class FakeSshConnection:
    """An open asyncssh connection that only has SFTP (put in a HostConnection's `_connection`)."""

    def __init__(self) -> None:
        self.sftp = FakeSftp()
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed

    def start_sftp_client(self) -> FakeSftp:
        return self.sftp

    def close(self) -> None:
        self.closed = True

    async def wait_closed(self) -> None:
        return None
