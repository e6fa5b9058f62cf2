"""GCS fault tolerance on the fleet (issue 20, item 1): the head's GCS keeps its tables in
RocksDB; every process of the head SIGKILLed under mixed load; the head is started again in
place (same cluster, same host, same ports), the workers' Serve proxies answer meanwhile, and
Serve's controller recovers its apps from the GCS, with no new config PUT."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load
from tests.fleet import Fleet
from tests.multihost.conftest import apply_yaml
from tests.multihost.test_service_on_fleet import FAILURE_LABELS, tagged_pids

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(600)]

NAME = "kept"
CLIENTS = 16


def spec(fleet: Fleet, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": NAME},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {
                "hostPool": "gcs",
                "workingDir": str(HELLO_APP),
                # No CPU on the head: the replicas run on the workers, which outlive it.
                "head": {"numCpus": 0, "host": fleet.hosts[0].name},
                "workerGroups": [{"name": "cpu", "replicas": 2, "numCpus": 1}],
                "gcsFaultTolerance": {"backend": "rocksdb"},
            },
            "serveConfig": {
                "applications": [
                    {
                        "name": "hello",
                        "route_prefix": "/",
                        "import_path": "hello:app",
                        "args": {"msg": "kept", "replicas": 2},
                        # A CPU each (the code asks none): on the workers, never on the head.
                        "deployments": [{"name": "Hello", "ray_actor_options": {"num_cpus": 1}}],
                    }
                ]
            },
            "serviceUnhealthySecondThreshold": 300,
        },
    }


def nodes_of(sk: Servekeeper, cluster: str) -> list[dict[str, Any]]:
    row = next(c for c in sk.clusters() if c["name"] == cluster)
    return list(json.loads(row["nodes_json"]))


def test_a_killed_head_is_started_again_in_place_and_serve_recovers_without_a_put(
    pool_daemon: Servekeeper, fleet: Fleet
) -> None:
    daemon = pool_daemon
    port = free_port()
    apply_yaml(daemon, fleet.host_pool_document("gcs", cpus=2), "pool")
    apply_yaml(daemon, spec(fleet, port), "v1")
    assert daemon.wait(NAME, timeout=300) == 0, daemon.cli("events", NAME).stdout[-3000:]
    cluster = daemon.api_get(NAME)["activeCluster"]["name"]
    head = nodes_of(daemon, cluster)[0]
    # An app made at run time (`serve.run` in a driver): Serve keeps it in the GCS too.
    daemon.cli("job", "submit", NAME, "--working-dir", str(HELLO_APP), "--", "python", "-c", IMPERATIVE)
    puts = len(daemon.submissions())
    with Load(f"http://127.0.0.1:{port}/", clients=CLIENTS, timeout=10) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        killed_at = time.time()
        for pid in tagged_pids([head["temp_dir"]]):  # raylet, GCS, dashboard, Serve's controller: all
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "HeadRestarted" in daemon.events(NAME), 120, "the head started again")
        restarted_at = time.time()
        wait_until(lambda: daemon.condition(NAME, "Ready")["status"] == "True", 120, "Ready again")
        time.sleep(3)
        result = load.stop()
    oks = [when for when, label in result.timeline if when >= killed_at and not label.startswith(FAILURE_LABELS)]
    longest_gap = max((b - a for a, b in zip([killed_at, *oks], oks, strict=False)), default=0.0)
    events = daemon.cli("events", NAME).stdout
    failed_at = [(round(when - killed_at, 2), label) for when, label in result.timeline if label not in result.bodies]
    print(f"failures (seconds after the kill): {failed_at}; head back at {restarted_at - killed_at:.1f}s")
    print(
        f"head SIGKILLed with GCS on RocksDB under {CLIENTS} clients: started again after "
        f"{restarted_at - killed_at:.1f}s; {result.failed} of {result.failed + result.ok} requests failed "
        f"({dict(result.failures)}); longest time without an answer {longest_gap:.2f}s"
    )
    assert daemon.api_get(NAME)["activeCluster"]["name"] == cluster, "the cluster was kept"
    assert [c["name"] for c in daemon.clusters()] == [cluster], "no new cluster"
    now = nodes_of(daemon, cluster)[0]
    assert (now["host"], now["temp_dir"], now["restarts"]) == (head["host"], head["temp_dir"], 1)
    assert now["pid"] != head["pid"] and "HeadRestarting" in events
    assert len(daemon.submissions()) == puts, "Serve recovered its apps from the GCS: no PUT"
    apps = serve_apps(daemon, cluster)
    assert apps["hello"]["status"] == "RUNNING", apps
    assert apps["extra"]["source"] == "imperative", apps
    wait_until(lambda: serve_apps(daemon, cluster)["extra"]["status"] == "RUNNING", 60, "the run-time app")
    # Those in flight on the head's proxy when it died (its connections reset: Envoy answers 503;
    # closed-loop clients pile up on the slowest proxy, so up to every client's one request), and
    # a few around it (measured: 16 and 18 of ~2,900 with 16 clients, most at the kill itself).
    assert result.failed <= 2 * CLIENTS, result.failures
    # The workers' proxies answer while the head is down, but not always: measured 0.21-0.39 s in
    # 4 runs, and 7.7-8.2 s without any answer in 3 others (the workers' proxies held requests
    # until the GCS was back; cause inside Ray, not pinned down, see issue 20). A replacement from
    # nothing costs 33-68 s; the goal is under 1 s.
    assert longest_gap < 15, f"{longest_gap:.2f}s without an answer"
    assert result.by_method["POST"] > 0


IMPERATIVE = (
    "import hello; from ray import serve; "
    "serve.run(hello.app({'msg': 'extra'}), name='extra', route_prefix='/extra', blocking=False)"
)


def serve_apps(sk: Servekeeper, cluster: str) -> dict[str, Any]:
    """Serve's applications, from the cluster's dashboard (with its token)."""
    token = (sk.state_dir / "tokens" / f"{cluster}.token").read_text().strip()
    answer = httpx.get(
        f"{sk.api_get(NAME)['activeCluster']['dashboardUrl']}/api/serve/applications/",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    return dict(answer.json()["applications"])
