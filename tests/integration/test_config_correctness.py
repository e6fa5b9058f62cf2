"""A change counts as applied only when Ray reports it; code is packaged at apply.

One daemon and one service (real Ray, real ingress, real SQLite) are shared by the tests of this
module, which run in order: each changes the service in place and checks what users see.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from servekeeper.providers.local_processes import tagged_processes
from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, hello_spec, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray

NAME = "verify"
UNHEALTHY_THRESHOLD_S = 3


class Shared:
    def __init__(self, sk: Servekeeper, port: int, app_dir: Path) -> None:
        self.sk = sk
        self.port = port
        self.app_dir = app_dir

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def spec(self, msg: str, **args: Any) -> dict[str, Any]:
        document = hello_spec(NAME, self.port, msg=msg, serviceUnhealthySecondThreshold=UNHEALTHY_THRESHOLD_S)
        document["spec"]["rayClusterConfig"]["workingDir"] = str(self.app_dir)
        document["spec"]["serveConfig"]["applications"][0]["args"].update(args)
        return document

    def active(self) -> dict[str, Any]:
        return dict(self.sk.get(NAME)["activeCluster"])


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    state_dir = Path(tempfile.mkdtemp(prefix="skstate-"))
    workdir = tmp_path_factory.mktemp("verify")
    app_dir = workdir / "app"
    shutil.copytree(HELLO_APP, app_dir)
    sk = Servekeeper(state_dir, workdir)
    # The first PUT of each later generation fails as a 503 would: every change must be retried.
    sk.up(fail_config_puts=1)
    context = Shared(sk, free_port(), app_dir)
    try:
        sk.apply(context.spec("v1"))
        assert sk.wait(NAME) == 0
        yield context
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def _puts_to(sk: Servekeeper, cluster: str) -> list[str]:
    return [config_hash for name, config_hash in sk.submissions() if name == cluster]


def test_in_place_change_whose_put_fails_is_retried_and_wait_ends_when_it_answers(shared: Shared) -> None:
    sk = shared.sk
    cluster = shared.active()["name"]
    sk.apply(shared.spec("v2"))
    assert sk.wait(NAME) == 0
    # No sleep: `wait` returned, so the very next request must answer with the new config.
    assert httpx.get(shared.url, timeout=10).text == "v2"
    assert "ConfigSubmitRetry" in sk.events(NAME), "the injected 503 was seen and retried"
    puts = _puts_to(sk, cluster)
    assert len(puts) == 3 and puts[1] == puts[2], "v1 once, then v2 twice (the failed PUT and its retry)"
    assert shared.active()["name"] == cluster, "in place: no new cluster"
    for msg in ("v3", "v4"):
        sk.apply(shared.spec(msg))
        assert sk.wait(NAME) == 0
        assert httpx.get(shared.url, timeout=10).text == msg


def test_controller_killed_between_audit_and_put_applies_the_change_after_restart(shared: Shared) -> None:
    sk = shared.sk
    cluster = shared.active()["name"]
    sk.kill_controller()
    sk.up(crash_at="config-audited")
    pid = sk.controller_pid()
    sk.apply(shared.spec("v5"))
    sk.wait_controller_gone(pid, 60)
    assert httpx.get(shared.url, timeout=10).text == "v4", "the crashed daemon never sent the PUT"
    audited = _puts_to(sk, cluster)[-1]
    sk.up()
    assert sk.wait(NAME) == 0
    assert httpx.get(shared.url, timeout=10).text == "v5"
    assert _puts_to(sk, cluster)[-2:] == [audited, audited], "audited, not sent; then sent once"


def test_rejected_in_place_change_fails_the_rollout_and_the_old_config_keeps_serving(shared: Shared) -> None:
    sk = shared.sk
    cluster = shared.active()["name"]
    rejected = shared.spec("v6")
    # Ray's own schema refuses a negative replica count (HTTP 4xx): nothing changes on the cluster.
    rejected["spec"]["serveConfig"]["applications"][0]["deployments"] = [{"name": "Hello", "num_replicas": -3}]
    sk.apply(rejected)
    assert sk.wait(NAME, timeout=60) == 1
    failed = sk.condition(NAME, "RolloutFailed")
    assert failed["status"] == "True" and failed["reason"] == "ConfigRejected", failed
    assert "num_replicas" in failed["message"], "Ray's own error is shown"
    assert httpx.get(shared.url, timeout=10).text == "v5"
    _no_new_cluster_for(shared, cluster, 3 * UNHEALTHY_THRESHOLD_S)


def test_in_place_change_that_fails_to_deploy_restores_the_last_good_config(shared: Shared) -> None:
    sk = shared.sk
    cluster = shared.active()["name"]
    sk.apply(shared.spec("v7", fail_on_start=True))  # the constructor raises: DEPLOY_FAILED
    assert sk.wait(NAME, timeout=120) == 1
    failed = sk.condition(NAME, "RolloutFailed")
    assert failed["reason"] == "AppFailed" and "fails on start" in failed["message"], failed
    # Ray stopped the old replica for the broken one; servekeeper put the last good config back.
    wait_until(lambda: _answer(shared.url) == "v5", 90, "the last good config to serve again")
    assert "ConfigSubmitted" in sk.events(NAME)
    _no_new_cluster_for(shared, cluster, 3 * UNHEALTHY_THRESHOLD_S)
    assert sk.condition(NAME, "Ready")["status"] == "True"


def test_code_on_disk_reaches_no_running_cluster_and_apply_rolls_it_out(shared: Shared) -> None:
    sk = shared.sk
    sk.apply(shared.spec("v8"))
    assert sk.wait(NAME) == 0
    cluster = shared.active()
    hello = shared.app_dir / "hello.py"
    hello.write_text(hello.read_text().replace("return self.msg\n", 'return self.msg + "-edited"\n'))
    # The replica restarts (killed): it must import the code that was applied, not the file on disk.
    replica = _replica_pid(sk, cluster["name"])
    psutil.Process(replica).kill()
    wait_until(lambda: _replica_pid(sk, cluster["name"], not_pid=replica) is not None, 120, "a new replica")
    wait_until(lambda: _answer(shared.url) is not None, 120, "the restarted replica to answer")
    assert _answer(shared.url) == "v8"
    with Load(shared.url, clients=16) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        sk.apply(shared.spec("v8"))  # the same spec: only the code changed
        assert sk.wait(NAME) == 0
        wait_until(lambda: load.result.bodies["v8-edited"] > 20, 60, "answers from the new code")
    result = load.result
    assert result.failed == 0, f"failed requests: {dict(result.failures)}"
    assert result.by_method["GET"] > 0 and result.by_method["POST"] > 0
    view = sk.get(NAME)
    assert view["generation"] == view["observedGeneration"]
    assert view["activeCluster"]["name"] == cluster["name"], "a code change is applied in place by default"
    assert view["activeCluster"]["packageHash"] != cluster["packageHash"]


def _answer(url: str) -> str | None:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def _replica_pid(sk: Servekeeper, cluster: str, not_pid: int | None = None) -> int | None:
    log_dir = str(sk.state_dir / "clusters" / cluster)
    for process in tagged_processes(log_dir):
        try:
            if "ServeReplica:hello" in " ".join(process.cmdline()) and process.pid != not_pid:
                return process.pid
        except psutil.Error:
            continue
    return None


def _no_new_cluster_for(shared: Shared, cluster: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        names = [c["name"] for c in shared.sk.clusters()]
        assert names == [cluster], f"a replacement cluster was started: {names}"
        time.sleep(0.5)
