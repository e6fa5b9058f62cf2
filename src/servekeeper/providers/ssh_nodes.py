"""Ray nodes on the hosts of a pool, over SSH: start, watch and stop exactly the nodes we own.

Each node is `ray start --block` in a session of its own (`setsid`) on its host, with its own
`--temp-dir`, ports allocated on that host, and `--node-ip-address` set to the host's address.
The node agent (`providers/remote/node_agent.py`, run by the host's `python -c`) does the work on the
host; what it acts on reaches it as JSON on stdin, never in a command line or a shell string
(the env of a group may hold secrets, and argv is public to every user of a host through `ps`).

Every node runs with Ray's token authentication: `RAY_AUTH_MODE=token` and
`RAY_AUTH_TOKEN_PATH` pointing at a 0600 file written over SFTP; the token itself is never in
an argv or an environment. Ray's dashboard, job and Serve REST endpoints and its gRPC services
then refuse callers without `Authorization: Bearer <token>`.

Stopping a node signals its session (TERM, wait, KILL, verify), plus any straggler that left
the session but still carries the node's tag in its environment. Never `ray stop`: it kills
every Ray cluster on the host.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal

from servekeeper.model.hostpool import HostSpec
from servekeeper.model.records import NodePorts
from servekeeper.providers.base import ProviderError
from servekeeper.providers.node_argv import RemoteNode, cluster_dir
from servekeeper.providers.node_log import TAIL_BYTES, last_lines
from servekeeper.providers.ports import PORT_HIGH, PORT_LOW, WORKER_PORTS_PER_NODE, wait_for_port
from servekeeper.providers.remote import node_agent_source
from servekeeper.providers.ssh import Copied, HostConnection, HostUnreachable, SshError, with_retries

logger = logging.getLogger(__name__)

NODE_TAG_ENV = "SERVEKEEPER_NODE"  # every process of a node inherits it: the node's temp dir
TOKEN_FILE_NAME = "auth_token"
TERM_GRACE_SECONDS = 3.0
KILL_GRACE_SECONDS = 3.0


class NodeUnreachable(HostUnreachable):
    """A node's host did not answer; the node may still run there. Retry later; never forget it."""


# -- the provider's SSH side -------------------------------------------------------------------------


class SshNodes:
    """Starts, watches and stops Ray nodes on the hosts of a pool, one connection per host."""

    def __init__(self, hosts: Sequence[HostSpec]) -> None:
        self._hosts = {host.name: host for host in hosts}
        self._connections: dict[str, HostConnection] = {}

    def host(self, name: str) -> HostSpec:
        try:
            return self._hosts[name]
        except KeyError:
            raise ProviderError(f"host {name!r} is not in the pool") from None

    def host_names(self) -> list[str]:
        return list(self._hosts)

    def connection(self, name: str) -> HostConnection:
        if name not in self._connections:
            self._connections[name] = HostConnection(self.host(name))
        return self._connections[name]

    def adopt(self, old: SshNodes) -> list[HostConnection]:
        """Take over `old`'s connections to the hosts whose entry is the same here (a call on
        them may be under way); the others are retired and returned, for the caller to close."""
        retired = []
        for name, connection in old._connections.items():
            if self._hosts.get(name) == connection.host and name not in self._connections:
                self._connections[name] = connection
            else:
                connection.retire()
                retired.append(connection)
        return retired

    def retire(self) -> list[HostConnection]:
        """Every connection, retired (its pool is gone), for the caller to close."""
        connections = list(self._connections.values())
        for connection in connections:
            connection.retire()
        self._connections.clear()
        return connections

    async def close(self) -> None:
        for connection in self._connections.values():
            await connection.close()
        self._connections.clear()

    async def _call(
        self, host: str, command: str, request: Mapping[str, Any], timeout: float | None = None, quick: bool = False
    ) -> Any:
        connection = self.connection(host)
        argv = [connection.host.python, "-c", node_agent_source(), command]

        async def once() -> Any:
            result = await connection.run(argv, input=json.dumps(request), timeout=timeout, quick=quick)
            return json.loads(result.stdout.strip().splitlines()[-1])

        return await with_retries(once)

    async def probe(self, host: str, timeout: float) -> None:
        """Run the host's python once, not retried: raises SshError when the host does not answer
        (retryable) or refuses us (host key, login, a python that is not there)."""
        connection = self.connection(host)
        await connection.run([connection.host.python, "-c", "0"], timeout=timeout)

    async def allocate_ports(self, host: str, count: int, reserved: Sequence[int] = ()) -> tuple[list[int], range]:
        """`count` ports free on the host (bound to nothing there, not `reserved`), and a block
        of WORKER_PORTS_PER_NODE for Ray's workers, in servekeeper's range (ports.py)."""
        request = {
            "count": count,
            "block": WORKER_PORTS_PER_NODE,
            "reserved": sorted(reserved),
            "low": PORT_LOW,
            "high": PORT_HIGH,
        }
        answer = await self._call(host, "ports", request)
        if len(answer["ports"]) < count or answer["block"] is None:
            raise ProviderError(f"host {host}: not enough free ports in {PORT_LOW}-{PORT_HIGH}")
        start = int(answer["block"])
        return [int(port) for port in answer["ports"]], range(start, start + WORKER_PORTS_PER_NODE)

    async def ports_free_on_all(self, hosts: Sequence[str], count: int, reserved: Sequence[int] = ()) -> list[int]:
        """`count` ports free on every one of `hosts`: Serve's HTTP and gRPC proxies listen on
        the same port on every node of a cluster (`http_options.port` is cluster-wide)."""
        taken = set(reserved)
        for _ in range(10):
            candidates, _ = await self.allocate_ports(hosts[0], count * 4, sorted(taken))
            common = candidates
            for host in hosts[1:]:
                common = await self.ports_free(host, common)
            if len(common) >= count:
                return common[:count]
            taken.update(candidates)
        raise ProviderError(f"no {count} ports free on all of {', '.join(hosts)} in {PORT_LOW}-{PORT_HIGH}")

    async def ports_free(self, host: str, candidates: Sequence[int]) -> list[int]:
        """Those of `candidates` bound to nothing on `host`."""
        answer = await self._call(host, "free", {"candidates": list(candidates)})
        return [int(port) for port in answer["free"]]

    async def node_ports(self, host: str, reserved: Sequence[int] = (), extra: int = 0) -> tuple[NodePorts, list[int]]:
        """A node's ports on `host`, and `extra` more (a head's GCS, dashboard, ...)."""
        singles, block = await self.allocate_ports(host, 6 + extra, reserved)
        ports = NodePorts(
            node_manager=singles[0],
            object_manager=singles[1],
            metrics_export=singles[2],
            agent_listen=singles[3],
            agent_grpc=singles[4],
            runtime_env_agent=singles[5],
            min_worker=block.start,
            max_worker=block.stop - 1,
        )
        return ports, singles[6:]

    async def install_token(self, host: str, cluster: str, token: str) -> str:
        """Write the cluster's token to a 0600 file in a 0700 dir on `host` (SFTP); its path.
        Replaced atomically: a node of the cluster may already run on that host and read it."""
        directory = cluster_dir(self.host(host), cluster)
        await self._call(host, "prepare", {"dirs": [directory]})
        path = f"{directory}/{TOKEN_FILE_NAME}"
        connection = self.connection(host)
        await with_retries(lambda: connection.write_file(path, token.encode(), mode=0o600))
        return path

    async def make_dirs(self, host: str, directories: Sequence[str]) -> None:
        """Make `directories` on `host` (0700, each component checked), if missing."""
        await self._call(host, "prepare", {"dirs": list(directories)})

    async def interpreters(self, host: str) -> dict[str, str]:
        """The host's Python interpreters by minor version ("3.11" -> its path there)."""
        answer = await self._call(host, "interpreters", {}, quick=True)
        return {str(minor): str(path) for minor, path in answer["interpreters"].items()}

    async def sync_files(self, host: str, directory: str, files: Mapping[str, tuple[Path, str]], mode: int) -> Copied:
        """Copy to `directory` on `host` the `files` (name -> local path, sha256) it lacks or
        holds with another hash; what was copied."""
        held = (await self._call(host, "hashes", {"dir": directory}))["files"]
        missing = [name for name, (_, sha) in files.items() if held.get(name) != sha]
        connection = self.connection(host)
        for name in missing:
            await with_retries(partial(connection.put_file, files[name][0], f"{directory}/{name}", mode))
        return Copied(len(missing), sum(files[name][0].stat().st_size for name in missing))

    async def gcs_answers(self, host: str, port: int, timeout: float) -> bool:
        """Does the head's GCS on `host` accept connections (within `timeout`)? Straight from the
        controller, which reaches the head's address as the workers and the dashboard calls do."""
        return await wait_for_port(self.host(host).address, port, timeout)

    async def gcs_state_kept(self, host: str, storage_dir: str) -> bool:
        """Does the head's GCS storage on `host` still hold its cluster's session?"""
        answer = await self._call(host, "gcs_kept", {"dir": storage_dir})
        return bool(answer["kept"])

    async def forget_cluster(self, host: str, cluster: str) -> None:
        """Remove the cluster's dir on `host` (its token file and node logs); call it once every
        node of the cluster on that host is stopped."""
        spec = self.host(host)
        await self._call(host, "forget", {"dir": cluster_dir(spec, cluster), "work_dir": spec.workDir})

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
        """Launch `argv` (a `ray start --block`) in a session of its own on `host`, with token
        auth; returns as soon as it runs (the node joins its cluster on its own)."""
        spec = self.host(host)
        log_path = f"{temp_dir}.log"
        node_env = dict(env or {})
        node_env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path, NODE_TAG_ENV: temp_dir})
        await self._call(host, "prepare", {"dirs": [temp_dir]})
        # Not retried: a launch whose answer was lost may have started a node. The caller
        # records intent first and finds the node by its tag if it must (see `alive`).
        connection = self.connection(host)
        result = await connection.run(
            [spec.python, "-c", node_agent_source(), "launch"],
            input=json.dumps({"argv": list(argv), "env": node_env, "log": log_path, "cwd": temp_dir}),
        )
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        node = RemoteNode(
            host=host,
            address=spec.address,
            role=role,
            pid=int(answer["pid"]),
            session_id=int(answer["sid"]),
            temp_dir=temp_dir,
            log_path=log_path,
            ports=ports,
        )
        logger.info("[%s] %s node started on %s, pid %d", Path(temp_dir).name, role, host, node.pid)
        return node

    async def alive(self, node: RemoteNode, timeout: float | None = None) -> bool:
        """Is the node's `ray start` still running (the same process: pid and temp dir match)?
        Raises NodeUnreachable if its host does not answer (within `timeout` of a channel held)."""
        try:
            request = {"pid": node.pid, "sid": node.session_id, "marker": node.temp_dir}
            answer = await self._call(node.host, "alive", request, timeout, quick=True)  # never behind a stop
        except SshError as exc:
            if exc.retryable:
                raise NodeUnreachable(exc.host, f"cannot tell whether pid {node.pid} lives: {exc}") from exc
            raise
        return bool(answer["alive"])

    async def unrecorded_leader(self, host: str, temp_dir: str) -> int | None:
        """The `ray start` of the node of `temp_dir` on `host` if it runs though its launch was
        never recorded (a controller killed in between); it leads its own session. None when
        none runs, or more than one (what a start cut short left: stopped by their tag instead).
        Raises NodeUnreachable if the host does not answer."""
        try:
            answer = await self._call(host, "leaders", {"marker": temp_dir}, quick=True)
        except SshError as exc:
            if exc.retryable:
                raise NodeUnreachable(exc.host, f"cannot look for an unrecorded node in {temp_dir}: {exc}") from exc
            raise
        pids = [int(pid) for pid in answer["pids"]]
        return pids[0] if len(pids) == 1 else None

    async def last_lines(self, node: RemoteNode, hide: Collection[str] = (), timeout: float | None = None) -> str:
        """The last lines of the node's log (why it exited), bounded, `hide` blanked out
        (`node_log.last_lines`). Raises NodeUnreachable if its host does not answer."""
        try:
            request = {"log": node.log_path, "bytes": TAIL_BYTES}
            answer = await self._call(node.host, "tail", request, timeout, quick=True)
        except SshError as exc:
            if exc.retryable:
                raise NodeUnreachable(exc.host, f"cannot read the log of pid {node.pid}: {exc}") from exc
            raise
        return last_lines(answer["tail"], hide=hide) if answer["tail"] else f"no log ({answer.get('error', 'empty')})"

    async def stop(self, node: RemoteNode) -> list[int]:
        """TERM the node's session, wait, KILL what is left (stragglers found by the node's tag
        too), and verify. Returns pids that survived (empty when all went well). Raises
        NodeUnreachable (retryable) when the host does not answer: the node is not forgotten."""
        request = {
            "sid": node.session_id,
            "marker": node.temp_dir,
            "term_grace": TERM_GRACE_SECONDS,
            "kill_grace": KILL_GRACE_SECONDS,
        }
        try:
            answer = await self._call(node.host, "stop", request, timeout=TERM_GRACE_SECONDS + KILL_GRACE_SECONDS + 30)
        except SshError as exc:
            if exc.retryable:
                raise NodeUnreachable(
                    exc.host, f"could not stop the {node.role} node (pid {node.pid}, {node.temp_dir}): {exc}"
                ) from exc
            raise
        left = [int(pid) for pid in answer["left"]]
        if left:
            logger.warning("[%s] processes survived SIGKILL on %s: %s", node.temp_dir, node.host, left)
        return left
