"""A head that moves host (issue 20: "Redis is for heads that may move host"): the head's host is
cut off the network under mixed load; once silent past `headMoveAfterSeconds` the head is started
on another host with its GCS tables from the Redis servekeeper runs, the workers are started
again against it, and Serve's controller recovers its apps (a run-time one too) without a PUT:
the same cluster, no replacement. When the lost host is back, the old head left there is stopped."""

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
from tests.multihost.test_gcs_restart import IMPERATIVE, serve_apps, timeline, wait_ready
from tests.multihost.test_service_on_fleet import FAILURE_LABELS, tagged_pids

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(600)]

NAME = "kept"  # the name test_gcs_restart's helpers read
CLIENTS = 16
MOVE_AFTER = 5


def spec(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": NAME},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {
                "hostPool": "moves",
                "workingDir": str(HELLO_APP),
                "head": {"numCpus": 0},  # the replicas run on the workers
                "workerGroups": [{"name": "cpu", "replicas": 2, "numCpus": 1}],
                "gcsFaultTolerance": {"backend": "redis", "headMoveAfterSeconds": MOVE_AFTER},
            },
            "serveConfig": {
                "applications": [
                    {
                        "name": "hello",
                        "route_prefix": "/",
                        "import_path": "hello:app",
                        "args": {"msg": "moved", "replicas": 2},
                        "deployments": [{"name": "Hello", "ray_actor_options": {"num_cpus": 1}}],
                    }
                ]
            },
            "serviceUnhealthySecondThreshold": 300,
        },
    }


def record_of(sk: Servekeeper, cluster: str) -> dict[str, Any]:
    return next(c for c in sk.clusters() if c["name"] == cluster)


def test_a_head_whose_host_is_cut_off_moves_with_its_tables_and_serve_recovers(
    pool_daemon: Servekeeper, fleet: Fleet
) -> None:
    sk, port = pool_daemon, free_port()
    apply_yaml(sk, fleet.host_pool_document("moves", cpus=2), "pool")
    apply_yaml(sk, spec(port), "v1")
    assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-3000:]
    cluster = sk.api_get(NAME)["activeCluster"]["name"]
    sk.cli("job", "submit", NAME, "--working-dir", str(HELLO_APP), "--", "python", "-c", IMPERATIVE)
    puts = len(sk.submissions())
    head = json.loads(record_of(sk, cluster)["nodes_json"])[0]
    lost = next(host for host in fleet.hosts if host.name == head["host"])

    with Load(f"http://127.0.0.1:{port}/", clients=CLIENTS, timeout=10) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        cut_at = time.time()
        subprocess.run(["ip", "link", "set", lost.veth, "down"], check=True)
        try:
            wait_until(lambda: "HeadMoving" in sk.events(NAME), 120, "the head moving")
            moved_at = time.time()
            wait_until(lambda: "HeadRestarted" in sk.events(NAME), 120, "the moved head running")
            wait_ready(sk, 180, "Ready after the move")
            ready_at = time.time()
            time.sleep(3)
            result = load.stop()
            nodes = json.loads(record_of(sk, cluster)["nodes_json"])
            assert json.loads(record_of(sk, cluster)["left_behind_json"]), "the old head may still run there"
        finally:
            subprocess.run(["ip", "link", "set", lost.veth, "up"], check=True)
    oks = [when for when, label in result.timeline if when >= cut_at and not label.startswith(FAILURE_LABELS)]
    gap = max((b - a for a, b in zip([cut_at, *oks], oks, strict=False)), default=0.0)
    print(
        f"\nhead's host {lost.name} cut off under {CLIENTS} clients: the head moved after {moved_at - cut_at:.1f}s "
        f"to {nodes[0]['host']}, Ready after {ready_at - cut_at:.1f}s; {result.failed} of "
        f"{result.failed + result.ok} failed ({dict(result.failures)}), longest time without an answer {gap:.2f}s"
    )
    print(timeline(sk, result, cut_at, nodes[0]["temp_dir"]))
    assert [c["name"] for c in sk.clusters()] == [cluster], "the same cluster: no replacement"
    assert nodes[0]["host"] != lost.name and nodes[0]["restarts"] >= 1
    assert all(node["host"] != lost.name for node in nodes), "nothing of it on the lost host"
    assert len(sk.submissions()) == puts, "Serve recovered its apps from the GCS in Redis: no PUT"
    wait_until(lambda: serve_apps(sk, cluster)["extra"]["status"] == "RUNNING", 60, "the run-time app")
    assert serve_apps(sk, cluster)["hello"]["status"] == "RUNNING"
    assert oks and oks[-1] > ready_at, "answers again after the move"
    assert result.by_method["GET"] > 0 and result.by_method["POST"] > 0

    # The host is back: what the move left there is stopped, nothing of the old head runs on.
    wait_until(lambda: json.loads(record_of(sk, cluster)["left_behind_json"]) == [], 60, "the old head stopped")
    assert tagged_pids([head["temp_dir"]]) == []
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
    users = json.loads((sk.state_dir / "redis" / "users.json").read_text())
    assert cluster not in users, "its Redis user went with the cluster"
