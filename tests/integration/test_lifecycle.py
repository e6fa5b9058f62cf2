"""Real Ray clusters, the real ingress, a real SQLite store: one service's life on one daemon, in
order: the first apply, a change in place, a shape change held back by `upgradeStrategy: None`,
then delete."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from servekeeper.providers.local_processes import session_members
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, pid_alive, wait_until

pytestmark = pytest.mark.ray

NAME = "hello"


class Service:
    def __init__(self, sk: Servekeeper, workdir: Path) -> None:
        self.sk = sk
        self.port = free_port()
        # A value a shell would execute: it must reach Ray as plain data.
        self.shell_was_used = workdir / "shell-was-used"

    def spec(self, msg: str, **overrides: Any) -> dict[str, Any]:
        document = hello_spec(NAME, self.port, msg=msg, **overrides)
        evil = f"$(touch {self.shell_was_used}); `touch {self.shell_was_used}`"
        document["spec"]["rayClusterConfig"]["head"]["env"] = {"EVIL": evil}
        return document


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    workdir = tmp_path_factory.mktemp("lifecycle")
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), workdir)
    sk.up()
    try:
        yield Service(sk, workdir)
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def test_first_apply_serves_through_the_ingress_and_reports_status(service: Service) -> None:
    sk, port = service.sk, service.port
    sk.apply(service.spec("v1"))
    assert sk.wait(NAME) == 0
    assert not service.shell_was_used.exists()

    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v1"
    view = sk.get(NAME)
    assert view["name"] == NAME
    assert view["generation"] == view["observedGeneration"] == 1
    conditions = {c["type"]: c for c in view["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["UpgradeInProgress"]["status"] == "False"
    assert conditions["RolloutFailed"]["status"] == "False"
    assert conditions["ClusterSpecOutdated"]["status"] == "False"
    assert all({"type", "status", "reason", "message", "lastTransitionTime"} <= set(c) for c in conditions.values())
    assert view["ingress"]["url"] == f"http://127.0.0.1:{port}"
    assert view["pendingCluster"] is None
    active = view["activeCluster"]
    assert active["trafficPercent"] == 100
    assert active["generation"] == 1
    assert active["address"].startswith("127.0.0.1:")
    assert active["applications"]["hello"] == {"status": "RUNNING", "source": "declarative", "message": ""}
    # The cluster's own Serve endpoint answers too, bypassing the ingress.
    assert httpx.get(active["serveUrl"] + "/").text == "v1"
    assert httpx.get(active["dashboardUrl"] + "/api/serve/applications/").status_code == 200
    # The dashboard, the GCS and every other socket of the cluster listen on loopback only. One
    # exception Ray does not let us configure: each Serve replica's inter-deployment gRPC server
    # binds "[::]:0" (hard-coded in ray/serve/_private/replica.py).
    processes = {process.pid: process for process in session_members((active["headPid"],))}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == "LISTEN" and c.pid in processes]
    loopback = ("127.0.0.1", "::ffff:127.0.0.1")
    ports = {c.laddr.port for c in listening if c.laddr.ip in loopback}
    assert int(active["address"].split(":")[1]) in ports
    assert int(active["dashboardUrl"].rsplit(":", 1)[1]) in ports
    exposed = [
        (c.laddr.ip, c.laddr.port, processes[c.pid].name())
        for c in listening
        if c.laddr.ip not in loopback and not processes[c.pid].name().startswith("ray::ServeReplica")
    ]
    assert exposed == [], f"cluster sockets not on loopback: {exposed}"
    # Human-readable commands work on the same state.
    described = sk.cli("describe", NAME).stdout
    assert "Ready" in described and "hello" in described and "TrafficSwitched" in described
    assert "ClusterCreating" in sk.cli("events", NAME).stdout


def test_serve_config_change_applies_in_place_and_is_never_resubmitted(service: Service) -> None:
    sk, port = service.sk, service.port
    first_cluster = sk.get(NAME)["activeCluster"]["name"]

    sk.apply(service.spec("v1-patched"))
    assert sk.wait(NAME) == 0
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/").text == "v1-patched", 60, "the patched response")
    view = sk.get(NAME)
    assert view["generation"] == 2
    assert view["activeCluster"]["name"] == first_cluster, "a Serve-config-only change must not roll a cluster"
    assert [c["name"] for c in sk.clusters()] == [first_cluster]

    # A controller restart must not PUT the same config again.
    submissions_before = sk.submissions()
    sk.kill_controller()
    sk.up()
    assert sk.wait(NAME) == 0
    assert sk.submissions() == submissions_before
    assert len(submissions_before) == 2  # v1 then v1-patched, once each


def test_upgrade_strategy_none_reports_outdated_and_delete_stops_everything(service: Service) -> None:
    sk, port = service.sk, service.port
    cluster = sk.clusters()[0]

    sk.apply(service.spec("v1-patched", head_cpus=2, upgradeStrategy={"type": "None"}))
    assert sk.wait(NAME, timeout=60) == 1
    outdated = sk.condition(NAME, "ClusterSpecOutdated")
    assert outdated["status"] == "True"
    assert "upgradeStrategy" in outdated["message"]
    assert [c["name"] for c in sk.clusters()] == [cluster["name"]], "no new cluster may be created"
    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v1-patched"

    sk.cli("delete", NAME)
    wait_until(lambda: sk.clusters() == [], 60, "the service's clusters to be deleted")
    wait_until(lambda: not pid_alive(cluster["head_pid"]), 10, "the head to exit")
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/").status_code != 200 if _listening(port) else True,
        10,
        "the route to be removed",
    )
    assert NAME not in sk.cli("get").stdout


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
        return True
    except httpx.TransportError:
        return False
