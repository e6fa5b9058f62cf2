"""Drive a real servekeeper (CLI subprocesses, real Ray, real ingress) and load it: for tests and benchmarks."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import random
import signal
import sqlite3
import string
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from servekeeper.providers.local import tagged_processes
from servekeeper.providers.ports import PortAllocator

REPO = Path(__file__).resolve().parents[3]  # src/servekeeper/testing/harness.py -> the checkout
HELLO_APP = REPO / "examples" / "hello" / "app"
REGISTRY_EXAMPLE = REPO / "examples" / "model-registry"


def hello_spec(
    name: str,
    port: int,
    msg: str = "v1",
    head_cpus: float = 1,
    ready_delay_s: float = 0,
    import_path: str = "hello:app",
    **spec_overrides: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "ingress": {"port": port},
        "rayClusterConfig": {"workingDir": str(HELLO_APP), "head": {"numCpus": head_cpus}},
        "serveConfig": {
            "applications": [
                {
                    "name": "hello",
                    "route_prefix": "/",
                    "import_path": import_path,
                    "args": {"msg": msg, "ready_delay_s": ready_delay_s},
                }
            ]
        },
        "rayClusterDeletionDelaySeconds": 60,
        "readinessTimeoutSeconds": 300,
    }
    spec.update(spec_overrides)
    return {"apiVersion": "servekeeper/v1alpha1", "kind": "RayService", "metadata": {"name": name}, "spec": spec}


MODELS = ["linear-a", "linear-b", "linear-c"]


def registry_spec(
    port: int,
    version: str = "v1",
    cpus: float = 1,
    probes: bool = True,
    applications: str = "declarative",
    unhealthy_threshold: float = 300,
) -> dict[str, Any]:
    document = yaml.safe_load((REGISTRY_EXAMPLE / "service.yaml").read_text())
    spec = document["spec"]
    spec["ingress"]["port"] = port
    spec["rayClusterConfig"]["workingDir"] = str(REGISTRY_EXAMPLE / "app")
    spec["rayClusterConfig"]["head"]["numCpus"] = cpus
    spec["serveConfig"]["applications"][0]["args"]["version"] = version
    spec["readiness"]["applications"] = applications
    if not probes:
        spec["readiness"]["probes"] = []
    spec["serviceUnhealthySecondThreshold"] = unhealthy_threshold
    return dict(document)


def model_urls(port: int) -> list[str]:
    return [f"http://127.0.0.1:{port}/router/models/{name}?x=1,2,3" for name in MODELS]


def models_answer(port: int) -> bool:
    """Every model of the registry example answers through the ingress."""
    try:
        return all(httpx.get(url, timeout=10).status_code == 200 for url in model_urls(port))
    except httpx.HTTPError:
        return False  # a model app that does not exist yet can hold a request


class Servekeeper:
    """One state dir, its daemon, and helpers to look inside it."""

    def __init__(self, state_dir: Path, workdir: Path) -> None:
        self.state_dir = state_dir
        self.workdir = workdir
        self.env = {**os.environ, "SERVEKEEPER_STATE_DIR": str(state_dir)}
        self.env.pop("SERVEKEEPER_UNSAFE_SWITCH_GATE", None)
        self._files = 0

    def cli(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "servekeeper.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"servekeeper {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def up(self, gate: str | None = None, crash_at: str | None = None, fail_config_puts: int = 0) -> None:
        """Start the daemon. `crash_at` arms a crash point for this daemon only (not its successor);
        `fail_config_puts` makes its first N config PUTs of a non-first generation fail like a 503."""
        if gate is not None:
            self.env["SERVEKEEPER_UNSAFE_SWITCH_GATE"] = gate
        saved = dict(self.env)
        if crash_at is not None:
            self.env["SERVEKEEPER_TEST_CRASH_AT"] = crash_at
        if fail_config_puts:
            self.env["SERVEKEEPER_TEST_FAIL_CONFIG_PUTS"] = str(fail_config_puts)
        try:
            self.cli("up", "--detach", timeout=90)
        finally:
            self.env = saved

    def wait_controller_gone(self, pid: int, timeout: float) -> None:
        wait_until(lambda: not _alive(pid), timeout, f"controller {pid} to exit")

    def apply(self, document: dict[str, Any]) -> None:
        self._files += 1
        path = self.workdir / f"spec-{self._files}.yaml"
        path.write_text(yaml.safe_dump(document))
        self.cli("apply", "-f", str(path))

    def wait(self, name: str, timeout: float = 240) -> int:
        return self.cli("wait", name, "--timeout", str(timeout), timeout=timeout + 30, check=False).returncode

    def get(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.cli("get", name, "-o", "json").stdout))

    def _api(self, method: str, path: str, body: Any = None) -> Any:
        info = json.loads((self.state_dir / "api.json").read_text())
        token = (self.state_dir / "token").read_text().strip()
        response = httpx.request(
            method, f"{info['url']}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        response.raise_for_status()
        return response.json()

    def api_get(self, name: str) -> dict[str, Any]:
        """The same view as `get -o json`, straight from the API (no CLI start-up time)."""
        return dict(self._api("GET", f"/api/v1/services/{name}"))

    def api_apply(self, document: dict[str, Any]) -> None:
        """`apply` straight through the API (the document's workingDir must be absolute)."""
        self._api("POST", "/api/v1/services", {"spec": document})

    def condition(self, name: str, condition_type: str) -> dict[str, Any]:
        for condition in self.get(name)["conditions"]:
            if condition["type"] == condition_type:
                return dict(condition)
        raise AssertionError(f"no {condition_type} condition")

    def controller_pid(self) -> int:
        return int((self.state_dir / "controller.pid").read_text())

    def kill_controller(self) -> None:
        pid = self.controller_pid()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 10, "controller to die")

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.state_dir / 'store.db'}?mode=ro", uri=True)

    def clusters(self) -> list[dict[str, Any]]:
        with self.db() as db:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute("SELECT * FROM clusters ORDER BY created_at")]

    def submissions(self) -> list[tuple[str, str]]:
        with self.db() as db:
            return [(row[0], row[1]) for row in db.execute("SELECT cluster, config_hash FROM submissions")]

    def events(self, name: str) -> list[str]:
        with self.db() as db:
            return [row[0] for row in db.execute("SELECT reason FROM events WHERE service = ? ORDER BY id", (name,))]

    def owned_processes(self) -> list[psutil.Process]:
        """Every live process this state dir owns: Ray processes by their tag, plus daemon and ingress."""
        found = {p.pid: p for p in tagged_processes(str(self.state_dir))}
        for process in psutil.process_iter(["cmdline", "status"]):
            try:
                cmdline = " ".join(process.info["cmdline"] or [])
                if str(self.state_dir) in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
                    found[process.pid] = process
            except psutil.Error:
                continue
        return list(found.values())

    def down_and_check_nothing_left(self) -> list[str]:
        self.cli("down", timeout=180, check=False)
        leftovers: list[str] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            alive = self.owned_processes()
            if not alive:
                return []
            time.sleep(0.5)
        for process in self.owned_processes():
            try:
                leftovers.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
                process.kill()
            except psutil.Error:
                continue
        return leftovers


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no port and runs no code)."""
    return _alive(pid)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def free_port() -> int:
    return PortAllocator().one()


@dataclass
class LoadResult:
    ok: int = 0
    # every failed request by "<kind>: <exception>", kind one of connect, reset, timeout, error;
    # or "HTTP <status>", or "echo-mismatch" (a 200 whose POST echo is not the body sent)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    # answers by version: a GET's whole body, a POST's first line (after its echo was checked)
    bodies: collections.Counter[str] = field(default_factory=collections.Counter)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (time, version or failure key)
    by_method: collections.Counter[str] = field(default_factory=collections.Counter)  # ok answers: GET, POST
    # requests still in flight when stop() gave up waiting: cancelled, neither ok nor failed
    abandoned: int = 0

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def failed_of_kind(self, kind: str) -> int:
        return sum(n for key, n in self.failures.items() if key.split(":")[0] == kind)


_BODY_ALPHABET = string.ascii_letters + string.digits + " \n"


def _failure_key(exc: BaseException) -> str:
    """A transport error as "<kind>: <exception name>"."""
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        kind = "timeout"
    elif isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)):
        kind = "connect"  # refused or unreachable: nothing was sent
    elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError, OSError)):
        kind = "reset"  # the connection closed or was reset before a full answer
    else:
        kind = "error"
    return f"{kind}: {type(exc).__name__}"


class Load:
    """Closed-loop clients in a thread of their own, until stopped.

    Honest by construction: the HTTP client never re-sends a request (httpx over httpcore with
    transport retries 0; httpcore only retries a failed *connect*, and with 0 not even that; a
    pooled connection the server closed while idle is dropped before a request is written to it),
    so every request that was sent and lost shows up in `failures`.

    A share `connection_mix` of the clients opens a new connection per request (`Connection: close`,
    like the reference's Locust experiment); the others keep theirs alive. `new_connections=True`
    means all of them. A share `post_share` of requests are POSTs with a random body that the
    hello example echoes after its version line; use `post_share=0` for URLs that do not echo.
    """

    def __init__(
        self,
        url: str | list[str],
        clients: int = 32,
        new_connections: bool = False,
        timeout: float = 30,
        connection_mix: float = 0.5,
        post_share: float = 0.5,
        stop_grace_s: float = 5,
    ) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        self.clients = clients
        self.new_connections = new_connections
        self.connection_mix = 1.0 if new_connections else connection_mix
        self.post_share = post_share
        self.timeout = timeout
        self.stop_grace_s = stop_grace_s
        self.result = LoadResult()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Future[Any] | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        """Let in-flight requests finish for up to `stop_grace_s`, then cancel them (`abandoned`)."""
        self._stop.set()
        self._thread.join(timeout=self.stop_grace_s)
        if self._thread.is_alive() and self._loop is not None and self._main is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join(timeout=5)
        return self.result

    def _new_connection_client(self, index: int) -> bool:
        # spread the two kinds evenly over the clients (and so over the URLs)
        return math.floor((index + 1) * self.connection_mix) > math.floor(index * self.connection_mix)

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        clients = [
            self._client(self.urls[i % len(self.urls)], self._new_connection_client(i), random.Random(i))
            for i in range(self.clients)
        ]
        self._main = asyncio.gather(*clients)
        try:
            await self._main
        except asyncio.CancelledError:
            pass  # stop() ran out of patience; each client counted its abandoned request

    async def _client(self, url: str, new_connection: bool, rng: random.Random) -> None:
        keepalive = 0 if new_connection else 1
        transport = httpx.AsyncHTTPTransport(
            retries=0, limits=httpx.Limits(max_connections=1, max_keepalive_connections=keepalive)
        )
        headers = {"Connection": "close"} if new_connection else {}
        async with httpx.AsyncClient(
            transport=transport, timeout=self.timeout, headers=headers, trust_env=False
        ) as client:
            while not self._stop.is_set():
                if rng.random() < self.post_share:
                    sent = "".join(rng.choices(_BODY_ALPHABET, k=rng.randint(200, 4000)))
                    answered, label = await self._request(client, "POST", url, sent)
                else:
                    answered, label = await self._request(client, "GET", url, None)
                self.result.timeline.append((time.time(), label))
                if not answered:
                    await asyncio.sleep(0.01)  # no hot loop against a refusing port

    async def _request(self, client: httpx.AsyncClient, method: str, url: str, sent: str | None) -> tuple[bool, str]:
        """One request, counted; returns (True, version) or (False, failure key)."""
        try:
            response = await asyncio.wait_for(
                client.request(method, url, content=None if sent is None else sent.encode()), self.timeout
            )
        except asyncio.CancelledError:
            self.result.abandoned += 1
            raise
        except Exception as exc:  # every error is a counted failure, never a dead client
            return self._fail(_failure_key(exc))
        text = response.content.decode("utf-8", errors="replace")
        if response.status_code != 200:
            return self._fail(f"HTTP {response.status_code}")
        version = text
        if sent is not None:
            version, newline, echoed = text.partition("\n")
            if not newline or echoed != sent:
                return self._fail("echo-mismatch")
        self.result.ok += 1
        self.result.by_method[method] += 1
        self.result.bodies[version] += 1
        return True, version

    def _fail(self, key: str) -> tuple[bool, str]:
        self.result.failures[key] += 1
        return False, key
