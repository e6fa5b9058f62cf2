"""Cluster faults on real Ray: a dead active head, and pending clusters that cannot come up."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from servekeeper.testing.harness import (
    HELLO_APP,
    Servekeeper,
    free_port,
    hello_spec,
    kill_local_cluster,
    pid_alive,
    wait_until,
)
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

    # Eight clients: the claim is that v1 keeps serving with nothing failed, not capacity (16 made
    # each pending head start 3x slower on 2 cores). An app that cannot deploy (DEPLOY_FAILED, its
    # message as the cause) is test_config_correctness's; a pending cluster's failure path is one
    # for every cause (the planner's unit tests).
    with Load(f"http://127.0.0.1:{port}/", clients=8) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        # A bad rayStartParam: `ray start` exits at once; its own error is the cause shown.
        bad_param = hello_spec("sturdy", port, head_cpus=2)
        bad_param["spec"]["rayClusterConfig"]["head"]["rayStartParams"] = {"object-store-memory": "lots"}
        fails(bad_param, "object-store-memory")
        # A worker node that dies while the head is fine: started again in place, it keeps dying
        # (no CPU on the head: the app needs the worker, so the cluster cannot get ready meanwhile).
        dying_worker = hello_spec("sturdy", port, head_cpus=0)
        # (a CPU for the replica: the code asks none, and would run on the head without the worker)
        replica = [{"name": "Hello", "ray_actor_options": {"num_cpus": 1}}]
        dying_worker["spec"]["serveConfig"]["applications"][0]["deployments"] = replica
        dying_worker["spec"]["rayClusterConfig"]["workerGroups"] = [
            {"name": "cpu", "replicas": 1, "numCpus": 1, "rayStartParams": {"object-store-memory": "lots"}}
        ]
        fails(dying_worker, "WorkerDied")
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


IMPERATIVE = (
    "import hello; from ray import serve; "
    "serve.run(hello.app({'msg': 'extra'}), name='extra', route_prefix='/extra', blocking=False)"
)


def test_with_gcs_fault_tolerance_a_killed_head_and_worker_are_started_again_in_place(sk: Servekeeper) -> None:
    """GCS fault tolerance on this machine (RocksDB): every process of the head SIGKILLed under
    load, the head is started again on the same ports with its tables, Serve recovers its apps
    (a run-time one too) without a PUT, and the cluster is kept; a worker killed is started
    again in place too (as KubeRay recreates a worker pod)."""
    port = free_port()
    sk.up()
    document = hello_spec("kept", port, serviceUnhealthySecondThreshold=300)
    config = document["spec"]["rayClusterConfig"]
    config["gcsFaultTolerance"] = {"backend": "rocksdb"}
    config["workerGroups"] = [{"name": "cpu", "replicas": 1, "numCpus": 1}]
    sk.apply(document)
    assert sk.wait("kept") == 0
    cluster = sk.get("kept")["activeCluster"]
    sk.cli("job", "submit", "kept", "--working-dir", str(HELLO_APP), "--", "python", "-c", IMPERATIVE)
    puts = len(sk.submissions())
    with Load(f"http://127.0.0.1:{port}/", clients=8, timeout=10) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        killed_at = time.time()
        kill_local_cluster(cluster["headPid"])
        wait_until(lambda: "HeadRestarted" in sk.events("kept"), 120, "the head started again")
        head_back = time.time() - killed_at
        wait_until(lambda: sk.condition("kept", "Ready")["status"] == "True", 120, "Ready again")
        wait_until(lambda: load.result.timeline[-1][1] == "v1", 60, "answers again")
        answering = time.time() - killed_at
        result = load.stop()
    failed = [when for when, outcome in result.timeline if when >= killed_at and outcome != "v1"]
    print(
        f"\nlocal head SIGKILLed with GCS in RocksDB under 8 clients: started again after {head_back:.1f}s, "
        f"answering after {answering:.1f}s; {result.failed} of {result.failed + result.ok} failed "
        f"({dict(result.failures)}), {max(failed, default=killed_at) - killed_at:.1f}s without an answer"
    )
    now = sk.get("kept")["activeCluster"]
    assert now["name"] == cluster["name"] and [c["name"] for c in sk.clusters()] == [cluster["name"]]
    assert now["headPid"] != cluster["headPid"] and not pid_alive(cluster["headPid"])
    assert len(sk.submissions()) == puts, "Serve recovered its apps from the GCS: no PUT"
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/extra", timeout=5).text == "extra", 60, "the run-time app")
    assert result.by_method["POST"] > 0
    # Serve's proxy runs on the head only here: requests fail until it is back (502 in flight,
    # 503 while no endpoint answers, a timeout for one the dying proxy held).
    kinds = {kind.split(":")[0] for kind in result.failures}
    assert kinds <= {"HTTP 502", "HTTP 503", "timeout", "reset"}, result.failures
    # A reset only for a request the proxy was answering as it was killed (its headers already
    # passed on, so Envoy can only cut the answer): at most one per client, at the kill.
    resets = [when - killed_at for when, outcome in result.timeline if outcome.startswith("reset")]
    assert len(resets) <= 8 and all(0 <= after < 3 for after in resets), resets

    (worker,) = now["workerPids"]
    kill_local_cluster(worker)
    wait_until(lambda: "WorkerRestarting" in sk.events("kept"), 60, "the worker started again")
    wait_until(lambda: sk.get("kept")["activeCluster"]["workerPids"] not in ([], [worker]), 60, "a new worker pid")
    wait_until(lambda: sk.condition("kept", "Ready")["status"] == "True", 60, "Ready with the worker back")
    nodes = json.loads(sk.clusters()[0]["nodes_json"])
    # Once, or more: on a busy machine a node started again can time out in its own start.
    assert [node["role"] for node in nodes] == ["head", "worker"] and min(n["restarts"] for n in nodes) >= 1, nodes
    assert [c["name"] for c in sk.clusters()] == [cluster["name"]] and len(sk.submissions()) == puts
