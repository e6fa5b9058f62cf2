"""The Redis servekeeper runs for `gcsFaultTolerance: {backend: redis}` without an address:
Debian's redis-server on the controller's machine, its tables in the state dir with the AOF on
(a restart loses at most a second of writes), a password generated once (in its config file,
mode 0600, never on a command line), bound to loopback and to the address the pool's hosts
reach this machine on. Each cluster's head signs in as a user of its own (`sk-<cluster>`), its
password derived from a key kept beside the server's (never handed out), allowed only its own
namespace's keys (`RAY<cluster>@*`, and a write to `DUMMY`, see `user_keys`) and no admin or
dangerous command: one cluster (or whoever reads its GCS command line) cannot read or wipe
another's tables. The users are kept in `users.json` and written into the config at
every start, so a Redis started again knows them before any head reconnects.

Like an Envoy process, it outlives the controller: a controller killed, or stopped without
`down`, leaves it serving the heads' GCS; the next controller adopts it by its recorded pid.
It is started when a head first needs it and started again (same port, same data) whenever a
look finds it gone; `down` stops it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from servekeeper.providers.base import PermanentProviderError, RetryableProviderError
from servekeeper.providers.ports import PortAllocator

logger = logging.getLogger(__name__)

START_SECONDS = 10.0  # redis-server answers within a second; an AOF replay of a big store takes longer
STOP_SECONDS = 10.0
INSTALL_HINT = "install Debian's redis-server on this machine (apt-get install redis-server)"


@dataclass(frozen=True)
class _State:
    pid: int | None
    port: int | None
    binds: tuple[str, ...]


@dataclass(frozen=True)
class RedisTarget:
    """Where a head's GCS keeps its tables: `address` as its host reaches it, and the password."""

    address: str
    password: str | None = field(repr=False)
    username: str | None = None  # None: the default user (a user's own Redis)


def redis_dir(state_dir: Path) -> Path:
    return state_dir / "redis"


def redis_binary() -> str | None:
    return shutil.which("redis-server") or next(
        (path for path in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(path, os.X_OK)), None
    )


def address_towards(host_address: str) -> str:
    """This machine's address on the route to `host_address` (no packet is sent: a UDP
    socket's connect only picks the route); a name is resolved (this blocks: call it in a thread)."""
    family, _, _, _, address = socket.getaddrinfo(host_address, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def cluster_user(cluster: str) -> str:
    return f"sk-{cluster}"


# A cluster's head may run every command but the admin and dangerous ones; INFO and CLUSTER INFO
# are given back (Ray's GCS client asks them on connecting).
USER_CATEGORIES = ("+@all", "-@admin", "-@dangerous")
USER_COMMANDS = ("+info", "+cluster|info")


def user_keys(cluster: str) -> tuple[str, ...]:
    """Its own namespace's keys, and a write to `DUMMY`: Ray's Redis client deletes that key on
    connecting (to find out whether the Redis is a cluster) and gives up if refused."""
    return (f"~RAY{cluster}@*", "%W~DUMMY")


def user_rule(cluster: str, password: str) -> str:
    """The ACL of a cluster's head, as the config file holds it: its own keys, no channel."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    allowed = " ".join((*user_keys(cluster), "resetchannels", *USER_CATEGORIES, *USER_COMMANDS))
    return f"{cluster_user(cluster)} reset on #{digest} {allowed}"


def render_config(directory: Path, port: int, binds: list[str], password: str, users: tuple[str, ...] = ()) -> str:
    # "-address": bound if this machine still has it (a changed address must not keep the
    # server from starting, and with it every head's GCS).
    optional = [bind if bind in ("127.0.0.1", "::1") else f"-{bind}" for bind in binds]
    return "\n".join(
        [
            f"bind {' '.join(optional)}",
            f"port {port}",
            "protected-mode yes",
            f"requirepass {password}",
            f'dir "{directory / "data"}"',
            "appendonly yes",
            "appendfsync everysec",
            'save ""',  # the AOF is the record; no RDB snapshots besides it
            "daemonize no",
            'logfile ""',  # to stdout: the log file the controller opened for it
            *(f"user {user}" for user in users),
            "",
        ]
    )


class RedisServer:
    """The one redis-server of a state dir (`directory`: its config, data, log and record)."""

    def __init__(self, directory: Path, binary: str | None = None) -> None:
        self.directory = directory
        self._binary = binary
        self._lock = threading.Lock()  # ensure/stop from the loop's worker threads, one at a time

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One start or stop at a time: of this process's threads, and of other processes on the
        state dir (an offline `down` beside a starting daemon)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._lock, open(self.directory / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    @property
    def config_path(self) -> Path:
        return self.directory / "redis.conf"

    def _state(self) -> _State:
        try:
            data = json.loads((self.directory / "server.json").read_text())
            return _State(int(data["pid"]), int(data["port"]), tuple(str(b) for b in data["binds"]))
        except (OSError, ValueError, KeyError, TypeError):
            return _State(None, None, ())

    def _password(self, name: str = "password") -> str:
        path = self.directory / name
        if not path.exists():
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(32))
        return path.read_text().strip()

    def user_password(self, cluster: str) -> str:
        """A cluster's own password, derived from a key of its own that is never handed out (not
        the server's password: before users per cluster, heads were started with that one)."""
        key = self._password("users.key").encode()
        return hmac.new(key, cluster_user(cluster).encode(), hashlib.sha256).hexdigest()

    def _clusters(self) -> list[str]:
        try:
            return [str(name) for name in json.loads((self.directory / "users.json").read_text())]
        except (OSError, ValueError, TypeError):
            return []

    def _keep_clusters(self, clusters: list[str]) -> None:
        written = self.directory / "users.json.new"
        written.write_text(json.dumps(sorted(set(clusters))))
        os.replace(written, self.directory / "users.json")

    def _rules(self) -> tuple[str, ...]:
        return tuple(user_rule(cluster, self.user_password(cluster)) for cluster in self._clusters())

    def _admin(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, password=self._password(), socket_timeout=START_SECONDS)

    def _set_user(self, port: int, cluster: str) -> None:
        """The cluster's user, in the running server too (the next start reads it from the config)."""
        if cluster not in self._clusters():
            self._keep_clusters([*self._clusters(), cluster])
        client = self._admin(port)
        try:
            # The rule as the config file holds it, word for word (typed calls would spell it apart).
            command: Callable[..., object] = client.execute_command  # untyped in redis-py
            command("ACL", "SETUSER", *user_rule(cluster, self.user_password(cluster)).split())
        except (redis.RedisError, OSError) as exc:
            raise RetryableProviderError(f"redis-server on port {port}: the user of {cluster} not set: {exc}") from exc
        finally:
            client.close()

    def forget_user(self, cluster: str) -> None:
        """A deleted cluster's user goes (its namespace was deleted before)."""
        with self._exclusive():
            self._keep_clusters([name for name in self._clusters() if name != cluster])
            port = self._state().port
            if self.pid() is None or port is None:
                return
            client = self._admin(port)
            try:
                client.acl_deluser(cluster_user(cluster))
            finally:
                client.close()

    def pid(self) -> int | None:
        """The recorded redis-server, if it still runs: redis-server rewrites its command line
        to its title, "<its path> <first bind address>:<port>", which names our port."""
        state = self._state()
        pid = state.pid
        if pid is None:
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if status.rsplit(") ", 1)[-1].startswith("Z"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # our own child, exited: reap it
            return None
        title = cmdline.replace(b"\0", b" ") + b" "
        ours = os.path.basename(title.split(b" ", 1)[0]) == b"redis-server" and f":{state.port} ".encode() in title
        return pid if ours else None

    def ensure(self, reached_on: str, cluster: str | None = None) -> RedisTarget:
        """The server running and bound to `reached_on` (started, or started again with that
        address added, keeping its port and data), with `cluster`'s user: the target is that
        user's (the server's own without a cluster); raises RetryableProviderError when it does
        not answer in time, PermanentProviderError when redis-server is not installed."""
        with self._exclusive():
            state = self._state()
            running = self.pid()
            port = state.port
            if running is None or port is None or reached_on not in state.binds:
                if running is not None:
                    self._stop_pid(running)  # bound elsewhere: started again with every address
                # The same port every time: the heads' GCS were started with this address.
                port = port if port is not None else PortAllocator().one()
                self._start(port, sorted({"127.0.0.1", reached_on, *state.binds}))
            if cluster is None:
                return RedisTarget(f"{reached_on}:{port}", self._password())
            self._set_user(port, cluster)
            return RedisTarget(f"{reached_on}:{port}", self.user_password(cluster), cluster_user(cluster))

    def _start(self, port: int, binds: list[str]) -> None:
        binary = self._binary or redis_binary()
        if binary is None:
            raise PermanentProviderError(f"gcsFaultTolerance.backend redis without redis.address: {INSTALL_HINT}")
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.directory / "data").mkdir(mode=0o700, exist_ok=True)
        password = self._password()
        descriptor = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(render_config(self.directory, port, binds, password, self._rules()))
        with open(self.directory / "redis.log", "ab") as log:
            process = subprocess.Popen(
                [binary, str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the controller, like an Envoy process
                close_fds=True,
            )
        state = {"pid": process.pid, "port": port, "binds": binds}
        written = self.directory / "server.json.new"
        written.write_text(json.dumps(state))
        os.replace(written, self.directory / "server.json")  # a reader sees the old record or the new
        logger.info("redis-server for the GCS started: pid %d, port %d, bound to %s", process.pid, port, binds)
        if _serving_pid(port, password, START_SECONDS) != process.pid:
            raise RetryableProviderError(
                f"redis-server (pid {process.pid}) did not serve port {port} within {START_SECONDS:g}s "
                f"(another process may hold the port); see {self.directory / 'redis.log'}"
            )

    def stop(self) -> None:
        """`down`: the server stops (its data stays for the next start)."""
        with self._exclusive():
            pid = self.pid()
            if pid is not None:
                self._stop_pid(pid)

    def _stop_pid(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)  # redis-server flushes its AOF on SIGTERM
        deadline = time.monotonic() + STOP_SECONDS
        while self.pid() == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pid() == pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _serving_pid(port: int, password: str, timeout: float) -> int | None:
    """The pid of the redis-server that answers on loopback `port` with `password` (None: none
    within `timeout`): the one just started, or another process that took the port."""
    deadline = time.monotonic() + timeout
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1, socket_connect_timeout=1)
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError):
                return int(client.info("server")["process_id"])
            time.sleep(0.1)
        return None
    finally:
        client.close()
