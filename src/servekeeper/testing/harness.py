"""Drive a real servekeeper (CLI subprocesses, real Ray, real ingress): for tests and benchmarks. The load
client that measures it is in load.py."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from servekeeper.client.common import LOCK_FILE_NAME
from servekeeper.providers.local_processes import session_members, tagged_processes
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

    def cli(
        self, *args: str, timeout: float = 300, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "servekeeper.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
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
        # From the API: tests poll conditions, and `get` (the CLI's own view) is tested on its own.
        for condition in self.api_get(name)["conditions"]:
            if condition["type"] == condition_type:
                return dict(condition)
        raise AssertionError(f"no {condition_type} condition")

    def controller_pid(self) -> int:
        return int((self.state_dir / "controller.pid").read_text())

    def controller_alive(self) -> bool:
        """Whether a controller holds the state dir's lock (whatever `controller.pid` says)."""
        return state_dir_locked(self.state_dir)

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
            return [(row[0], row[1]) for row in db.execute("SELECT cluster, config_hash FROM submissions ORDER BY id")]

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


def state_dir_locked(state_dir: Path) -> bool:
    """Whether a process (a controller, an offline `down`) holds the state dir's lock now."""
    with open(state_dir / LOCK_FILE_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def kill_local_cluster(head_pid: int) -> None:
    """Like the machine losing the head: every process of a local cluster, at once, SIGKILL."""
    for process in session_members((head_pid,)):
        try:
            process.kill()
        except psutil.Error:
            continue


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


def exported_environment(exports: str) -> dict[str, str]:
    """This process's environment with `servekeeper env`'s `export` lines applied (`$PATH` and
    the like expanded against it): what a shell that ran them would give a driver."""
    env = dict(os.environ)
    for line in exports.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = os.path.expandvars(shlex.split(value)[0])  # PATH=<env>/bin:"$PATH"
    return env
