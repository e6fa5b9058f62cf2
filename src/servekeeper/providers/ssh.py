"""SSH to the hosts of a pool (asyncssh): one connection object per host, every call through it.

Commands are argument lists, quoted once here with `shlex.join`; nothing from a spec is ever
pasted into a shell string. Host keys are checked against the host's `knownHostsFile` only: an
unknown or changed key is refused (no auto-accept), as is a missing known_hosts file. No
~/.ssh/config and no agent are read: what the HostPool says is all that is used.

Errors are split like the rest of servekeeper's adapters: `retryable` ones (the host does not
answer, the connection dropped, a command timed out) may go away by themselves; the others (host
key refused, authentication refused, a command that failed) need a person.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import platform
import random
import secrets
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import asyncssh

from servekeeper.model.hostpool import HostSpec
from servekeeper.providers.remote import node_agent_source

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_SECONDS = 60.0
KEEPALIVE_SECONDS = 15.0
# Channels (sessions) open at once on one connection, together under OpenSSH's MaxSessions (10
# by default), which refuses the one beyond it; the commands past a bound wait for a free one.
# QUICK_CHANNELS are kept for quick looks (is a node alive, its log's tail) apart from the
# MAX_CHANNELS of every other command: a look never waits behind slow ones (a stop holds its
# channel through TERM, KILL and up to 30 s), so a busy host does not look like a silent one.
MAX_CHANNELS = 7
QUICK_CHANNELS = 2
T = TypeVar("T")

# Run with the host's `python -c`: what Ray compares between the nodes of one cluster.
VERSIONS_SCRIPT = """
import importlib.metadata, json, sys
try:
    ray = importlib.metadata.version("ray")
except importlib.metadata.PackageNotFoundError:
    ray = None
print(json.dumps({"python": ".".join(map(str, sys.version_info[:3])), "ray": ray}))
"""


# A channel refused for these on a live connection is one too many, not a missing subsystem.
CHANNEL_SHORTAGE = frozenset({asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, asyncssh.OPEN_RESOURCE_SHORTAGE})
TEMPORARY_REMOVE_SECONDS = 5.0  # a dying connection must not hold a failed write


class SshError(RuntimeError):
    """Something about a host over SSH failed; `host` names it, `retryable` says whether trying
    again later may help."""

    retryable = False

    def __init__(self, host: str, message: str) -> None:
        self.host = host
        super().__init__(f"host {host}: {message}")


class HostUnreachable(SshError):
    retryable = True


class CommandTimeout(SshError):
    retryable = True


class ChannelRefused(SshError):
    """Logged in, but the host refused one more channel (a session) on the connection: sshd's
    MaxSessions reached, or its resources short. The connection serves the commands in flight;
    this one may go again once a channel is free."""

    retryable = True


class HostKeyRefused(SshError):
    """The host's key is not the one its known_hosts file holds (or there is none)."""


class AuthenticationRefused(SshError):
    pass


class SessionRefused(SshError):
    """Logged in, but the host refused a session of the kind asked for (SFTP)."""


class CommandFailed(SshError):
    def __init__(self, host: str, argv: Sequence[str], exit_status: int | None, stderr: str) -> None:
        self.argv = list(argv)
        self.exit_status = exit_status
        self.stderr = stderr
        tail = stderr.strip()[-600:] or "(no error output)"
        super().__init__(host, f"{argv[0]} exited with status {exit_status}: {tail}")


@dataclass(frozen=True)
class RemoteResult:
    exit_status: int | None
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Copied:
    """What a copy to a host sent: the files it lacked (or held with another hash)."""

    files: int
    bytes: int


@dataclass(frozen=True)
class Versions:
    python: str
    ray: str | None
    # minor version -> path: what a cluster with its own environment (pythonVersion) may use
    interpreters: dict[str, str] = field(default_factory=dict)


def controller_versions() -> Versions:
    """This process's Python and Ray (read without importing Ray)."""
    return Versions(python=platform.python_version(), ray=importlib.metadata.version("ray"))


def version_mismatch(host: str, remote: Versions, local: Versions) -> str | None:
    """Why `host` cannot be in one cluster with the controller (Ray wants the same Ray and the
    same Python, to the patch level, on every node), or None."""
    problems = []
    if remote.ray != local.ray:
        problems.append(f"Ray {remote.ray or '(not installed)'} (the controller has Ray {local.ray})")
    if remote.python != local.python:
        problems.append(f"Python {remote.python} (the controller has Python {local.python})")
    if not problems:
        return None
    return f"host {host} has " + " and ".join(problems)


async def with_retries(
    operation: Callable[[], Awaitable[T]],
    *,
    attempts: int = 3,
    first_delay: float = 0.5,
    max_delay: float = 5.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Run `operation`, again after a retryable SshError, with exponential backoff and jitter."""
    delay = first_delay
    for attempt in range(1, attempts + 1):
        try:
            return await operation()
        except SshError as exc:
            if not exc.retryable or attempt == attempts:
                raise
            logger.info("%s; retrying in %.1fs (attempt %d of %d)", exc, delay, attempt + 1, attempts)
        await sleep(delay * random.uniform(0.8, 1.2))
        delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable")


class HostConnection:
    """One SSH connection to one host, opened on first use and again after it dropped."""

    def __init__(
        self,
        host: HostSpec,
        command_timeout: float = COMMAND_TIMEOUT_SECONDS,
        max_channels: int = MAX_CHANNELS,
        quick_channels: int = QUICK_CHANNELS,
    ) -> None:
        self.host = host
        self.command_timeout = command_timeout
        self._channels = asyncio.Semaphore(max_channels)
        self._quick_channels = asyncio.Semaphore(quick_channels)
        self._connection: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()
        self._retired = False

    @property
    def where(self) -> str:
        return f"{self.host.name} ({self.host.address}:{self.host.ssh.port})"

    async def __aenter__(self) -> HostConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
            await connection.wait_closed()

    def retire(self) -> None:
        """No new connection from here on (the host's entry in its pool changed and another
        object serves it): a call that still comes gets HostUnreachable. Close it after."""
        self._retired = True

    async def connected(self) -> asyncssh.SSHClientConnection:
        """The open connection (opened now if it is not), for what this class does not wrap."""
        return await self._connect()

    async def _connect(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._retired:
                raise HostUnreachable(self.where, "its entry in the host pool changed; this connection is retired")
            if self._connection is not None and not self._connection.is_closed():
                return self._connection
            ssh = self.host.ssh
            known_hosts = ssh.known_hosts_path()
            if not known_hosts.is_file():
                raise HostKeyRefused(
                    self.where, f"its known_hosts file {known_hosts} does not exist; no host key can be verified"
                )
            try:
                self._connection = await asyncssh.connect(
                    self.host.address,
                    ssh.port,
                    username=ssh.user,
                    client_keys=[str(ssh.identity_path())],
                    known_hosts=str(known_hosts),
                    config=[],  # no ~/.ssh/config: the HostPool is the whole truth
                    agent_path=None,
                    connect_timeout=ssh.connectTimeoutSeconds,
                    login_timeout=ssh.connectTimeoutSeconds,
                    keepalive_interval=KEEPALIVE_SECONDS,
                )
            except asyncssh.HostKeyNotVerifiable as exc:
                raise HostKeyRefused(
                    self.where,
                    f"its host key is not the one in {known_hosts} ({exc.reason}); refused. If the host is "
                    "new or was reinstalled, check its key's fingerprint and add it to that file",
                ) from exc
            except asyncssh.PermissionDenied as exc:
                raise AuthenticationRefused(
                    self.where, f"user {ssh.user} with key {ssh.identity_path()} was refused: {exc.reason}"
                ) from exc
            except (OSError, asyncio.TimeoutError, asyncssh.DisconnectError) as exc:
                if isinstance(exc, OSError) and exc.filename is not None:  # the key file
                    raise AuthenticationRefused(self.where, f"cannot read {exc.filename}: {exc.strerror}") from exc
                raise HostUnreachable(self.where, f"cannot connect: {_describe(exc)}") from exc
            except asyncssh.KeyImportError as exc:
                raise AuthenticationRefused(self.where, f"the key {ssh.identity_path()} is unusable: {exc}") from exc
            return self._connection

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        input: str | None = None,
        check: bool = True,
        quick: bool = False,
    ) -> RemoteResult:
        """Run `argv` on the host (quoted once, here). With `check`, a non-zero exit raises
        CommandFailed. A `quick` command (one that answers at once: a look) takes one of the
        channels kept for those, never waiting behind slow commands; its `timeout` starts once
        it holds one, and covers opening the channel (a silent host never confirms it)."""
        if not argv:
            raise ValueError("an empty command")
        command = shlex.join(argv)
        limit = timeout or self.command_timeout
        connection = await self._connect()
        try:
            async with self._quick_channels if quick else self._channels:
                answer = connection.run(command, input=input, timeout=limit, check=False, encoding="utf-8")
                completed = await (asyncio.wait_for(answer, limit) if quick else answer)
        except asyncssh.TimeoutError as exc:
            raise CommandTimeout(self.where, f"{argv[0]} did not finish within {exc}") from exc
        except asyncio.TimeoutError as exc:  # before OSError, which it is since Python 3.11
            raise CommandTimeout(self.where, f"{argv[0]} got no answer within {limit:g}s") from exc
        except asyncssh.ChannelOpenError as exc:
            if not connection.is_closed():  # the login lives and serves the commands in flight
                raise ChannelRefused(self.where, f"refused a channel for {argv[0]}: {exc.reason}") from exc
            await self.close()
            raise HostUnreachable(self.where, f"connection lost: {_describe(exc)}") from exc
        except (OSError, asyncssh.DisconnectError) as exc:
            await self.close()
            raise HostUnreachable(self.where, f"connection lost: {_describe(exc)}") from exc
        result = RemoteResult(completed.exit_status, str(completed.stdout or ""), str(completed.stderr or ""))
        if check and result.exit_status != 0:
            raise CommandFailed(self.where, argv, result.exit_status, result.stderr)
        return result

    async def run_python(self, script: str, *args: str, timeout: float | None = None) -> str:
        """Run `script` with the host's `python -c`, arguments as argv; returns its output."""
        return (await self.run([self.host.python, "-c", script, *args], timeout=timeout)).stdout

    async def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Write a file over SFTP, created with `mode` before a byte is written (a secret is
        never readable by others, not even for a moment). Written under a new name, then renamed
        over `path` (atomic): a process that reads `path` meanwhile (a node of the same cluster
        on that host reading its token) finds the old file or the new one, never an empty one."""

        async def write(sftp: asyncssh.SFTPClient, temporary: str) -> None:
            async with sftp.open(temporary, "xb", asyncssh.SFTPAttrs(permissions=mode)) as remote:
                await remote.write(data)

        await self._sftp_write(path, mode, write)

    async def put_file(self, local: Path, path: str, mode: int = 0o644) -> None:
        """Copy the local file `local` to `path` over SFTP, atomically as `write_file` does."""

        async def put(sftp: asyncssh.SFTPClient, temporary: str) -> None:
            await sftp.put(str(local), temporary)

        await self._sftp_write(path, mode, put)

    async def _sftp_write(
        self, path: str, mode: int, write: Callable[[asyncssh.SFTPClient, str], Awaitable[None]]
    ) -> None:
        connection = await self._connect()
        temporary = f"{path}.{secrets.token_hex(4)}.tmp"
        try:
            async with self._channels, connection.start_sftp_client() as sftp:
                try:
                    await write(sftp, temporary)
                    await sftp.chmod(temporary, mode)  # exactly `mode`, whatever the host's umask
                    await sftp.posix_rename(temporary, path)
                except BaseException:  # a cancel too: no temporary left behind
                    with contextlib.suppress(Exception):  # best effort: the write's error is the one to tell
                        await asyncio.wait_for(sftp.remove(temporary), TEMPORARY_REMOVE_SECONDS)
                    raise
        except asyncssh.SFTPError as exc:
            raise CommandFailed(self.where, ["sftp-write", path], None, str(exc.reason)) from exc
        except asyncssh.ChannelOpenError as exc:
            if not connection.is_closed() and exc.code in CHANNEL_SHORTAGE:
                raise ChannelRefused(self.where, f"refused a channel for SFTP: {exc.reason}") from exc
            if not connection.is_closed():  # logged in, but no SFTP: sshd without its sftp subsystem
                raise SessionRefused(
                    self.where, f"refused an SFTP session ({exc.reason}); its sshd must allow the sftp subsystem"
                ) from exc
            await self.close()
            raise HostUnreachable(self.where, f"connection lost: {_describe(exc)}") from exc
        except (OSError, asyncssh.DisconnectError) as exc:
            await self.close()
            raise HostUnreachable(self.where, f"connection lost: {_describe(exc)}") from exc

    async def versions(self) -> Versions:
        output = await self.run_python(VERSIONS_SCRIPT)
        try:
            answer = json.loads(output.strip().splitlines()[-1])
            found = await self.run([self.host.python, "-c", node_agent_source(), "interpreters"], input="{}")
            interpreters = json.loads(found.stdout.strip().splitlines()[-1])["interpreters"]
            return Versions(python=str(answer["python"]), ray=answer["ray"], interpreters=dict(interpreters))
        except (ValueError, KeyError, IndexError) as exc:
            raise CommandFailed(self.where, [self.host.python], 0, f"unexpected version output {output!r}") from exc


async def check_host(host: HostSpec) -> Versions:
    """Connect to `host` (host key verified) and read its Python and Ray versions."""
    async with HostConnection(host) as connection:
        return await with_retries(connection.versions, attempts=2)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncssh.DisconnectError):
        return exc.reason
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
