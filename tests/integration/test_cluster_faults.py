"""Cluster faults on real Ray: a dead active head, and pending clusters that cannot come up."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, kill_local_cluster, pid_alive, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray


def test_dead_active_head_is_reported_at_once_answered_503_fast_and_replaced(sk: Servekeeper) -> None:
    port = free_port()
    sk.up()
    sk.apply(hello_spec("phoenix", port, serviceUnhealthySecondThreshold=5))
    assert sk.wait("phoenix") == 0
    dead = sk.get("phoenix")["activeCluster"]

    with Load(f"http://127.0.0.1:{port}/", clients=8, timeout=10) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        killed_at = time.time()
        kill_local_cluster(dead["headPid"])
        wait_until(lambda: sk.condition("phoenix", "Ready")["status"] == "False", 5, "Ready to turn False")
        reported_after = time.time() - killed_at
        started = time.monotonic()
        answer = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert answer.status_code == 503
        assert time.monotonic() - started < 1.0, "no cluster ready: the ingress must answer at once"
        wait_until(lambda: sk.get("phoenix")["activeCluster"]["name"] != dead["name"], 120, "a replacement")
        wait_until(lambda: load.result.timeline[-1][1] == "v1", 30, "service to come back")
    timeline = sorted(load.result.timeline)
    failures = [t for t, outcome in timeline if outcome != "v1"]
    kinds = [outcome for _, outcome in timeline if outcome != "v1"]
    # Requests in flight when the head died are cut (502, at most one per client); every later
    # one is answered 503 at once until the replacement serves.
    assert set(kinds) <= {"HTTP 502", "HTTP 503"}, set(kinds)
    assert kinds.count("HTTP 502") <= 8
    seconds_without_service = max(failures) - min(failures)
    print(
        f"\nhead killed: Ready=False after {reported_after:.1f}s, "
        f"{seconds_without_service:.1f}s without service, {len(failures)} requests answered 503"
    )
    assert "ClusterUnhealthy" in sk.events("phoenix")
    with sk.db() as db:
        created = [m for (m,) in db.execute("SELECT message FROM events WHERE reason = 'ClusterCreating' ORDER BY id")]
    assert any("ActiveUnhealthy" in message for message in created), created
    assert sk.condition("phoenix", "Ready")["status"] == "True"
    assert not pid_alive(dead["headPid"])


def test_pending_clusters_that_cannot_come_up_fail_the_rollout_and_v1_keeps_serving(sk: Servekeeper) -> None:
    port = free_port()
    sk.up()
    sk.apply(hello_spec("sturdy", port, msg="v1"))
    assert sk.wait("sturdy") == 0
    active = sk.get("sturdy")["activeCluster"]["name"]
    generation = 1

    def fails(document: dict, *causes: str) -> None:  # type: ignore[type-arg]
        nonlocal generation
        generation += 1
        sk.apply(document)
        assert sk.wait("sturdy", timeout=180) == 1, f"generation {generation} should have failed"
        failed = sk.condition("sturdy", "RolloutFailed")
        assert failed["status"] == "True"
        assert any(cause in f"{failed['reason']}: {failed['message']}" for cause in causes), failed
        wait_until(lambda: [c["name"] for c in sk.clusters()] == [active], 60, "the failed cluster to go")

    with Load(f"http://127.0.0.1:{port}/", clients=16) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        # A bad rayStartParam: `ray start` exits at once; its own error is the cause shown.
        bad_param = hello_spec("sturdy", port, head_cpus=2)
        bad_param["spec"]["rayClusterConfig"]["head"]["rayStartParams"] = {"object-store-memory": "lots"}
        fails(bad_param, "object-store-memory")
        # A worker node that dies while the head is fine.
        dying_worker = hello_spec("sturdy", port, head_cpus=2)
        dying_worker["spec"]["rayClusterConfig"]["workerGroups"] = [
            {"name": "cpu", "replicas": 1, "numCpus": 1, "rayStartParams": {"object-store-memory": "lots"}}
        ]
        fails(dying_worker, "WorkerDied")
        # An app that cannot deploy (an import path that names no module; a constructor that raises
        # takes the same path, DEPLOY_FAILED): Serve's own message (or its status) is the cause.
        missing = hello_spec("sturdy", port, head_cpus=2, import_path="hello_missing:app")
        fails(missing, "hello_missing", "DEPLOY_FAILED")
        assert sk.condition("sturdy", "Ready")["status"] == "True", "v1 still serves: the service stays Ready"
        # A port the pending cluster needs is taken: its Serve proxy cannot listen, so it never gets ready.
        taken = hello_spec("sturdy", port, head_cpus=2, readinessTimeoutSeconds=25)
        sk.apply(taken)
        wait_until(lambda: len(sk.clusters()) == 2, 30, "the pending cluster's record")
        pending = [c for c in sk.clusters() if c["name"] != active][0]
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", json.loads(pending["ports_json"])["serve_http"]))
            squatter.listen()
            assert sk.wait("sturdy", timeout=180) == 1
        failed = sk.condition("sturdy", "RolloutFailed")
        assert failed["reason"] == "ReadinessTimeout", failed
        wait_until(lambda: [c["name"] for c in sk.clusters()] == [active], 60, "the failed cluster to go")
    assert load.result.failed == 0, f"failed requests: {dict(load.result.failures)}"
    assert set(load.result.bodies) == {"v1"}
    assert sk.get("sturdy")["activeCluster"]["name"] == active
