"""A hot standby on a host pool (issue 20, item 2): placed on other hosts than the active, it takes
the traffic when the active's host falls off the network under mixed load. A silent host refuses
nothing: the requests hung on it fail by the TCP timeouts of Envoy's upstream sockets (about
4 s), which ejects it, as its health checks do a little later; the controller promotes the
standby once the active has been unhealthy past the threshold, builds the next standby away
from the new active, and stops the lost cluster once its host is back."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load
from tests.fleet import Fleet
from tests.multihost.conftest import apply_yaml
from tests.multihost.test_service_on_fleet import FAILURE_LABELS

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(600)]

NAME = "standing"
CLIENTS = 16


def spec(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": NAME},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {"hostPool": "standby", "workingDir": str(HELLO_APP), "head": {"numCpus": 1}},
            "serveConfig": {
                "applications": [{"name": "hello", "route_prefix": "/", "import_path": "hello:app", "args": {}}]
            },
            "standby": {"mode": "hot"},
            "serviceUnhealthySecondThreshold": 10,
            "rayClusterDeletionDelaySeconds": 5,
            "readinessTimeoutSeconds": 300,
        },
    }


def hosts_of(sk: Servekeeper, cluster: str) -> set[str]:
    row = next(c for c in sk.clusters() if c["name"] == cluster)
    return {node["host"] for node in json.loads(row["nodes_json"])}


def test_a_hot_standby_on_other_hosts_takes_the_traffic_of_a_lost_host(pool_daemon: Servekeeper, fleet: Fleet) -> None:
    sk, port = pool_daemon, free_port()
    apply_yaml(sk, fleet.host_pool_document("standby", cpus=2), "pool")
    apply_yaml(sk, spec(port), "v1")
    assert sk.wait(NAME, timeout=300) == 0
    wait_until(lambda: sk.api_get(NAME)["standby"] == "ready", 300, "the standby ready")
    view = sk.api_get(NAME)
    active, standby = view["activeCluster"]["name"], view["standbyCluster"]["name"]
    (lost_name,) = hosts_of(sk, active)
    assert lost_name not in hosts_of(sk, standby), "the standby shares no host with the active"
    lost = next(host for host in fleet.hosts if host.name == lost_name)

    with Load(f"http://127.0.0.1:{port}/", clients=CLIENTS, timeout=10) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        cut_at = time.time()
        subprocess.run(["ip", "link", "set", lost.veth, "down"], check=True)
        try:
            wait_until(lambda: sk.api_get(NAME)["activeCluster"]["name"] == standby, 120, "the standby promoted")
            promoted_s = time.time() - cut_at
            time.sleep(3)
            result = load.stop()
        finally:
            subprocess.run(["ip", "link", "set", lost.veth, "up"], check=True)
    oks = [when for when, label in result.timeline if when >= cut_at and not label.startswith(FAILURE_LABELS)]
    gap = max(b - a for a, b in zip([cut_at, *oks], oks, strict=False))
    print(
        f"\nactive's host {lost.name} cut off under {CLIENTS} clients: {result.failed} of "
        f"{result.failed + result.ok} failed ({dict(result.failures)}), longest time without an answer "
        f"{gap:.2f}s, standby promoted after {promoted_s:.1f}s"
    )
    # Each client's request in flight on the silent host, and one each sent to it before Envoy
    # ejected it; then the standby answers everything, long before the controller acts.
    assert result.failed <= 2 * CLIENTS, result.failures
    assert gap < 6, f"{gap:.2f}s without an answer"
    assert oks and oks[-1] > cut_at + promoted_s, "answers to the end"
    assert result.by_method["GET"] > 0 and result.by_method["POST"] > 0
    assert "StandbyPromoted" in sk.events(NAME)

    # Back on the network: the lost cluster is stopped, and the next standby runs on other
    # hosts than the new active.
    wait_until(lambda: active not in {c["name"] for c in sk.clusters()}, 180, "the lost cluster stopped")
    wait_until(lambda: sk.api_get(NAME)["standby"] == "ready", 300, "the next standby ready")
    view = sk.api_get(NAME)
    assert view["activeCluster"]["name"] == standby
    assert not hosts_of(sk, standby) & hosts_of(sk, view["standbyCluster"]["name"])
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
