"""Every cluster its own Ray (issue 21), on one machine: a service declared on Ray 2.59.0 (not the
controller's 2.60.0) gets an environment built with uv, and its nodes' processes run 2.59.0
(read from the processes, not the spec). Upgraded to the controller's Ray under 32 mixed
clients: 0 failed, the versions in order, the old cluster drained; then undone to 2.59.0 (its
environment already built) with 0 failed. An environment that cannot resolve fails its rollout
with uv's message naming the package; the active is untouched. `env` and `job submit` give a
driver the cluster's own Python and Ray."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from servekeeper.providers.local_processes import session_members
from servekeeper.testing.harness import Servekeeper, exported_environment, free_port, hello_spec, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray

NAME = "ownray"
OLD_RAY = "2.59.0"
CLIENTS = 32
MISSING = "servekeeper-no-such-package-4f2a"


def spec(port: int, msg: str, ray_version: str | None, pip: list[str] | None = None) -> dict[str, Any]:
    document = hello_spec(NAME, port, msg=msg, rayClusterDeletionDelaySeconds=5)
    config = document["spec"]["rayClusterConfig"]
    if ray_version is not None:
        config["rayVersion"] = ray_version
    if pip:
        config["pip"] = pip
    return document


def ray_versions(head_pid: int) -> dict[str, set[str]]:
    """The Ray release each system process of the cluster runs, by process name: read from the
    `ray-<version>.dist-info` beside the package its binary (or script) lives in."""
    found: dict[str, set[str]] = {}
    for process in session_members((head_pid,)):
        try:
            name, exe = process.name(), process.exe()
        except psutil.Error:
            continue
        if name not in ("gcs_server", "raylet"):
            continue
        # <site-packages>/ray/core/src/ray/{gcs/gcs_server, raylet/raylet}
        site_packages = Path(exe).parents[5]
        found.setdefault(name, set()).update(
            p.name.removeprefix("ray-").removesuffix(".dist-info") for p in site_packages.glob("ray-*.dist-info")
        )
    return found


@pytest.fixture(scope="module")
def sk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servekeeper]:
    daemon = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("ownray"))
    daemon.up()
    try:
        yield daemon
    finally:
        leftovers = daemon.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def upgrade_under_load(sk: Servekeeper, port: int, change: Any) -> tuple[Any, dict[str, Any]]:
    """Run `change` under 32 mixed clients; the load's result and the new active cluster, once
    the old one is gone."""
    before = sk.api_get(NAME)["activeCluster"]["name"]
    with Load(f"http://127.0.0.1:{port}/", clients=CLIENTS, post_share=0.5) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        change()
        wait_until(lambda: sk.api_get(NAME)["activeCluster"]["name"] != before, 300, "the switch")
        assert sk.wait(NAME, timeout=120) == 0
        wait_until(lambda: len(sk.clusters()) == 1, 120, "the old cluster drained and deleted")
        result = load.stop()
    return result, sk.api_get(NAME)["activeCluster"]


def messages(sk: Servekeeper, reason: str) -> list[str]:
    with sk.db() as db:
        rows = db.execute("SELECT message FROM events WHERE service = ? AND reason = ? ORDER BY id", (NAME, reason))
        return [row[0] for row in rows]


def old_after_new(timeline: list[tuple[float, str]], old: str, new: str) -> int:
    first_new = min(t for t, body in timeline if body == new)
    return sum(1 for t, body in timeline if body == old and t > first_new)


def test_a_service_on_its_own_ray_upgrades_and_undoes_with_nothing_failed(sk: Servekeeper) -> None:
    port = free_port()
    sk.apply(spec(port, "v1", OLD_RAY))
    assert sk.wait(NAME, timeout=400) == 0
    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v1"
    first = sk.api_get(NAME)["activeCluster"]
    assert ray_versions(first["headPid"]) == {"gcs_server": {OLD_RAY}, "raylet": {OLD_RAY}}
    ready = messages(sk, "EnvironmentReady")
    assert messages(sk, "EnvironmentBuilding") and len(ready) == 1 and f"Ray {OLD_RAY}" in ready[0], ready
    print(ready[0])

    result, second = upgrade_under_load(sk, port, lambda: sk.apply(spec(port, "v2", None)))
    print(f"upgrade {OLD_RAY} -> {version('ray')}: {result.ok} ok, {dict(result.failures)}, {dict(result.bodies)}")
    assert result.failed == 0, result.failures
    assert result.by_method["POST"] > 0
    assert old_after_new(result.timeline, "v1", "v2") <= CLIENTS, "switched at once: only those in flight"
    assert ray_versions(second["headPid"]) == {"gcs_server": {version("ray")}, "raylet": {version("ray")}}
    assert "ClusterDrained" in sk.cli("events", NAME).stdout

    result, third = upgrade_under_load(sk, port, lambda: sk.cli("undo", NAME))
    print(f"undo to {OLD_RAY}: {result.ok} ok, {dict(result.failures)}, {dict(result.bodies)}")
    assert result.failed == 0, result.failures
    assert old_after_new(result.timeline, "v2", "v1") <= CLIENTS
    assert ray_versions(third["headPid"]) == {"gcs_server": {OLD_RAY}, "raylet": {OLD_RAY}}
    # Kept after its cluster's deletion (a kept revision uses it), so the undo built nothing.
    assert len(messages(sk, "EnvironmentBuilding")) == 1, messages(sk, "EnvironmentBuilding")


def test_env_and_job_submit_give_a_driver_the_clusters_own_ray(sk: Servekeeper, tmp_path: Path) -> None:
    env = exported_environment(sk.cli("env", NAME).stdout)
    python = shutil.which("python", path=env["PATH"])
    assert python is not None and "environments" in python, python
    driver = "import ray; ray.init(); print(ray.__version__, ray.cluster_resources()['CPU']); ray.shutdown()"
    result = subprocess.run([python, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2] == OLD_RAY, result.stdout
    (tmp_path / "which.py").write_text("import ray, sys; print('job on', ray.__version__, sys.executable)\n")
    job = sk.cli("job", "submit", NAME, "--working-dir", str(tmp_path), "--", "python", "which.py", timeout=180)
    assert f"job on {OLD_RAY}" in job.stdout, job.stdout + job.stderr


def test_an_environment_that_cannot_resolve_fails_the_rollout_and_leaves_the_active(sk: Servekeeper) -> None:
    port = sk.api_get(NAME)["ingress"]["url"].rsplit(":", 1)[1]
    active = sk.api_get(NAME)["activeCluster"]["name"]
    sk.apply(spec(int(port), "v3", OLD_RAY, pip=[MISSING]))
    wait_until(lambda: sk.condition(NAME, "RolloutFailed")["status"] == "True", 180, "the rollout to fail")
    failed = messages(sk, "EnvironmentFailed")
    assert len(failed) == 1 and MISSING in failed[0].split("failed:", 1)[1], failed  # uv's own words name it
    print(failed[0])
    assert sk.api_get(NAME)["activeCluster"]["name"] == active
    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v1"
