"""KubeRay manifests on real Ray: KubeRay's own samples applied with `apply -f` and answering on
their routes, an upgrade seen through `get -o kuberay`, the GPU sample refused, a job's run-time
app surviving an in-place update and a controller kill -9, and `env` for a local `ray.init()`.

One daemon for the module: each cluster start costs tens of seconds on 2 cores, so the steps
build on each other in order (pytest runs a module's tests in file order).

The samples run unchanged on the Ray they declare (`rayVersion: "2.52.0"`), which their import maps
to an environment of its own built with uv; only the `servekeeper.io/ingress-port` annotation (the
issue's own override) is added, to pick a free port. The samples' resources are kept (head 2 CPUs,
one worker): Ray's CPUs are logical, so they fit on 2 cores."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from servekeeper.testing.harness import Servekeeper, exported_environment, free_port, wait_until

pytestmark = pytest.mark.ray

DATA = Path(__file__).resolve().parents[1] / "data" / "kuberay"
SAMPLES_RAY = "2.52.0"  # the rayVersion the samples declare
NAME = "rayservice-sample"


@pytest.fixture(scope="module")
def sk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servekeeper]:
    state_dir = Path(tempfile.mkdtemp(prefix="skstate-"))
    workdir = tmp_path_factory.mktemp("kuberay")
    (workdir / "samples").mkdir()
    # the samples name ../apps/test_dag, relative to their own folder
    (workdir / "apps").symlink_to(DATA / "apps")
    harness = Servekeeper(state_dir, workdir)
    harness.up()
    try:
        yield harness
    finally:
        leftovers = harness.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


def sample_file(sk: Servekeeper, name: str, port: int | None = None, edit: Any = None) -> Path:
    """The sample as KubeRay ships it (plus an ingress port when given), beside ../apps."""
    text = (DATA / "samples" / name).read_text()
    if edit is not None:
        text = edit(text)
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    if port is not None:
        documents[0]["metadata"]["annotations"] = {"servekeeper.io/ingress-port": str(port)}
    path = sk.workdir / "samples" / name
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path


def post(port: int, route: str, body: Any) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{route}/", json=body, timeout=10)


def kuberay_status(sk: Servekeeper) -> dict[str, Any]:
    return dict(json.loads(sk.cli("get", NAME, "-o", "kuberay").stdout)["status"])


def test_gpu_sample_is_refused_with_insufficient_capacity(sk: Servekeeper) -> None:
    result = sk.cli("apply", "-f", str(sample_file(sk, "ray-service.stable-diffusion.yaml")), check=False)
    assert result.returncode == 1
    assert "numGpus: InsufficientCapacity" in result.stderr and "GPU" in result.stderr
    assert sk.cli("get", "-o", "json").stdout.strip() == "[]"


def test_sample_runs_and_answers_on_its_routes(sk: Servekeeper, port: int) -> None:
    sk.cli("apply", "-f", str(sample_file(sk, "ray-service.sample.yaml", port)))
    assert sk.wait(NAME, timeout=300) == 0
    assert float(post(port, "/fruit", ["MANGO", 2]).text) == 6  # price 3 from user_config
    assert post(port, "/calc", ["ADD", 1]).text == "4 pizzas please!"
    described = sk.cli("describe", NAME).stdout
    assert "Ignored on this provider" in described and "workerGroupSpecs[0].maxReplicas" in described
    status = kuberay_status(sk)
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "True", "NonZeroServeEndpoints"),
        ("UpgradeInProgress", "False", "NoPendingCluster"),
    ]
    assert set(status["activeServiceStatus"]["applicationStatuses"]) == {"fruit_app", "math_app"}
    dashboard = sk.get(NAME)["activeCluster"]["dashboardUrl"]
    assert httpx.get(f"{dashboard}/api/version", timeout=10).json()["ray_version"] == SAMPLES_RAY


def test_job_app_is_imperative_and_survives_an_in_place_update_and_kill9(sk: Servekeeper, port: int) -> None:
    job = sk.cli(
        "job", "submit", NAME, "--working-dir", str(DATA / "job"), "--", "python", "deploy.py", timeout=240, check=False
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "jobapp deployed" in job.stdout

    def jobapp_answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/job", timeout=5).text == "deployed by a job"
        except httpx.HTTPError:
            return False

    wait_until(jobapp_answers, 60, "the job's app to answer through the ingress")
    assert sk.get(NAME)["activeCluster"]["applications"]["jobapp"]["source"] == "imperative"
    active = sk.get(NAME)["activeCluster"]["name"]

    # a Serve-config-only change: applied in place, and the run-time app stays
    sk.cli(
        "apply",
        "-f",
        str(sample_file(sk, "ray-service.sample.yaml", port, lambda t: t.replace("price: 3", "price: 4"))),
    )
    assert sk.wait(NAME, timeout=180) == 0
    wait_until(lambda: float(post(port, "/fruit", ["MANGO", 2]).text) == 8, 60, "the new price")
    assert sk.get(NAME)["activeCluster"]["name"] == active
    assert jobapp_answers()

    sk.kill_controller()
    sk.up()
    assert sk.wait(NAME, timeout=120) == 0
    view = sk.get(NAME)
    assert view["activeCluster"]["name"] == active
    assert view["activeCluster"]["applications"]["jobapp"]["source"] == "imperative"
    assert jobapp_answers()


def test_env_lets_a_local_ray_init_connect(sk: Servekeeper) -> None:
    env = exported_environment(sk.cli("env", NAME).stdout)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    driver = "import ray; ray.init(); print(int(ray.cluster_resources()['CPU'])); ray.shutdown()"
    python = shutil.which("python", path=env["PATH"])  # the cluster environment's, which `env` puts first
    assert python is not None
    result = subprocess.run([python, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "3"  # the sample's head (2) and worker (1)


def test_upgrade_shows_both_service_statuses_in_kuberay_shape(sk: Servekeeper, port: int) -> None:
    old = sk.get(NAME)["activeCluster"]["name"]
    # the different-port sample: same name, a smaller head, so a new cluster
    sk.cli("apply", "-f", str(sample_file(sk, "ray-service.different-port.yaml", port)))
    seen: dict[str, Any] = {}

    def upgrading() -> bool:
        status = kuberay_status(sk)
        conditions = {c["type"]: c for c in status["conditions"]}
        if conditions["UpgradeInProgress"]["status"] == "True" and status["pendingServiceStatus"]:
            seen.update(status)
            return True
        return False

    wait_until(upgrading, 120, "UpgradeInProgress in get -o kuberay")
    assert seen["activeServiceStatus"]["rayClusterName"] == old
    assert seen["activeServiceStatus"]["trafficRoutedPercent"] == 100
    assert seen["pendingServiceStatus"]["rayClusterName"] != old
    assert seen["pendingServiceStatus"]["trafficRoutedPercent"] == 0
    assert [c["reason"] for c in seen["conditions"]] == ["NonZeroServeEndpoints", "BothActivePendingClustersExist"]
    assert sk.wait(NAME, timeout=300) == 0
    assert float(post(port, "/fruit", ["PEAR", 3]).text) == 3
    assert kuberay_status(sk)["activeServiceStatus"]["rayClusterName"] != old
