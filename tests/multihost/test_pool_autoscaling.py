"""Node autoscaling on a host pool (issue 22), end to end on the sshd fleet: the head (host-1)
runs Ray's own monitor, which reaches servekeeper's node API through an SSH remote forward on its
host; servekeeper places each node Ray asks for like any pool node, starts it over SSH and stops
it when Ray releases it.

Three hosts of 2 CPUs. Another service's cluster holds 1 CPU of host-3. The autoscaled service
starts with its head only (1 CPU: one replica); its group takes 2-CPU workers (0 to 2), one per
host (each node runs Serve's proxy on the cluster's ports). Serve's own autoscaling (1 to 5
replicas of 1 CPU) under 32 mixed clients asks for more replicas than the head holds: Ray asks
for two nodes, host-2 gets one, and host-3 has no room for the other (the other cluster's CPU
is never taken): the group reports the shortfall. Once the load stops, Serve scales its
replicas down and Ray releases the idle node after idleTimeoutSeconds. Nothing fails."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load, LoadResult
from tests.fleet import Fleet
from tests.multihost.conftest import apply_yaml

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(900)]

NAME = "elastic"
HOLDER = "holder"
POOL = "elastic"
IDLE_SECONDS = 15
REQUEST_SECONDS = 0.5  # each answer takes this long: queueing shows in the latency
POLL_S = 0.25


def service(name: str, port: int, config: dict[str, Any], args: dict[str, Any], **app: Any) -> dict[str, Any]:
    hello = {"name": "hello", "route_prefix": "/", "import_path": "hello:app", "args": args, **app}
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {"hostPool": POOL, "workingDir": str(HELLO_APP), **config},
            "serveConfig": {"applications": [hello]},
            "readinessTimeoutSeconds": 300,
        },
    }


def holder_spec(fleet: Fleet, port: int) -> dict[str, Any]:
    """Another service, holding 1 CPU of host-3."""
    return service(HOLDER, port, {"head": {"numCpus": 1, "host": fleet.hosts[2].name}}, {"msg": "holder"})


def elastic_spec(fleet: Fleet, port: int) -> dict[str, Any]:
    group = {"name": "cpu", "replicas": 0, "minReplicas": 0, "maxReplicas": 2, "numCpus": 2}
    config = {
        "head": {"numCpus": 1, "host": fleet.hosts[0].name},
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"idleTimeoutSeconds": IDLE_SECONDS},
        "workerGroups": [group],
    }
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 5,
        "target_ongoing_requests": 2,
        "upscale_delay_s": 1,
        "downscale_delay_s": 5,
        "look_back_period_s": 5,  # Serve averages the load over 30 s by default: a slow scale-down
    }
    deployment = {
        "name": "Hello",
        "num_replicas": "auto",
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": 16,
        "ray_actor_options": {"num_cpus": 1},
    }
    return service(NAME, port, config, {"msg": "v1", "delay_s": REQUEST_SECONDS}, deployments=[deployment])


def events_of(sk: Servekeeper) -> list[tuple[str, str]]:
    """The service's events, (reason, message): whole, as the table would wrap them."""
    with sk.db() as db:
        return list(db.execute("SELECT reason, message FROM events WHERE service = ? ORDER BY id", (NAME,)))


def cluster_of(sk: Servekeeper, service_name: str) -> dict[str, Any]:
    name = sk.api_get(service_name)["activeCluster"]["name"]
    return next(c for c in sk.clusters() if c["name"] == name)


def workers(sk: Servekeeper) -> list[dict[str, Any]]:
    """The autoscaled cluster's worker nodes running (as recorded)."""
    nodes = json.loads(cluster_of(sk, NAME)["nodes_json"])
    return [n for n in nodes if n["role"] == "worker" and not n["stopped"] and n["pid"] is not None]


def dashboard(sk: Servekeeper, path: str) -> Any:
    active = sk.api_get(NAME)["activeCluster"]
    token = (sk.state_dir / "tokens" / f"{active['name']}.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.get(f"{active['dashboardUrl']}{path}", headers=headers, timeout=5).json()


def replica_states(sk: Servekeeper) -> list[str]:
    apps = dashboard(sk, "/api/serve/applications/")["applications"]
    deployment = apps.get("hello", {}).get("deployments", {}).get("Hello", {})
    return [replica["state"] for replica in deployment.get("replicas", [])]


def alive_nodes(sk: Servekeeper) -> int:
    summary = dashboard(sk, "/nodes?view=summary")["data"]["summary"]
    return sum(1 for node in summary if node["raylet"]["state"] == "ALIVE")


def p99(result: LoadResult, start: float, end: float) -> float | None:
    window = sorted(seconds for at, seconds in result.latencies if start <= at < end)
    return window[min(len(window) - 1, int(len(window) * 0.99))] if len(window) >= 20 else None


def recovered_after(result: LoadResult, moments: dict[str, float], quiet_p99: float) -> str:
    """When the p99 of 3-second windows first came back within 25% of the quiet one, from the
    first pending replica (on 2 cores shared by every host it may not: CPU, not queueing)."""
    start, end = int(moments["pending"]), int(moments["running"]) + 10
    for moment in range(start, end):
        window = p99(result, moment, moment + 3)
        if window is not None and window <= 1.25 * quiet_p99:
            return f"after {moment - moments['pending']:.1f} s"
    return "not within the run"


def scale_up_moments(sk: Servekeeper, replicas: int, timeout: float) -> dict[str, float]:
    """Wall-clock moments: a replica first pending, a second node ALIVE in Ray, `replicas` RUNNING."""
    moments: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states, now = replica_states(sk), time.time()
        if "pending" not in moments and any(state != "RUNNING" for state in states):
            moments["pending"] = now
        if "node_alive" not in moments and alive_nodes(sk) >= 2:
            moments["node_alive"] = now
        if states.count("RUNNING") >= replicas and {"pending", "node_alive"} <= set(moments):
            moments["running"] = now
            return moments
        time.sleep(POLL_S)
    raise AssertionError(f"{replicas} replicas not RUNNING after {timeout:g} s: {moments}, {replica_states(sk)}")


def test_ray_scales_a_pool_cluster_onto_hosts_with_room_and_releases_the_idle_node(
    pool_daemon: Servekeeper, fleet: Fleet
) -> None:
    sk, port = pool_daemon, free_port()
    apply_yaml(sk, fleet.host_pool_document(POOL, cpus=2), "pool")
    apply_yaml(sk, holder_spec(fleet, free_port()), "holder")
    apply_yaml(sk, elastic_spec(fleet, port), "elastic")
    for name in (HOLDER, NAME):
        assert sk.wait(name, timeout=300) == 0, sk.cli("events", name).stdout[-3000:]
    holder = cluster_of(sk, HOLDER)
    assert workers(sk) == [] and replica_states(sk) == ["RUNNING"]  # one replica, on the head
    url = f"http://127.0.0.1:{port}/"

    with Load(url, clients=2, post_share=0.5) as quiet:  # below Serve's target: one replica is enough
        time.sleep(8)
        before = quiet.stop()
    before_p99 = p99(before, 0, time.time())
    assert before.failed == 0 and before_p99 is not None, before.failures

    with Load(url, clients=32, post_share=0.5, timeout=30) as load:
        started = time.time()
        moments = scale_up_moments(sk, replicas=3, timeout=240)
        time.sleep(10)  # three replicas serve for a while: the latency they give
        busy = load.stop()
    one_replica_p99 = p99(busy, started + 3, moments["node_alive"])
    scaled_p99 = p99(busy, moments["running"], moments["running"] + 10)
    assert scaled_p99 is not None and one_replica_p99 is not None
    back = recovered_after(busy, moments, before_p99)
    events = sk.cli("events", NAME).stdout
    node_s, running_s = moments["node_alive"] - moments["pending"], moments["running"] - moments["pending"]
    print(
        f"pool scale-up under 32 clients: pending -> node ALIVE {node_s:.1f} s, -> 3 replicas RUNNING "
        f"{running_s:.1f} s; p99 {before_p99:.2f} s before the load, {one_replica_p99:.2f} s on one replica, "
        f"{scaled_p99:.2f} s on three; within 25% of the quiet p99 {back}; {busy.ok} ok, failed {dict(busy.failures)}"
    )
    assert busy.failed == 0, (busy.failures, busy.failed_answers)
    assert busy.by_method["GET"] > 0 and busy.by_method["POST"] > 0
    [worker] = workers(sk)
    assert worker["host"] == fleet.hosts[1].name, "host-1 runs the head, host-3 has 1 CPU: the node goes to host-2"
    assert "NodeAdded" in {reason for reason, _ in events_of(sk)}
    short = [message for reason, message in events_of(sk) if reason == "InsufficientCapacity"]
    assert any(fleet.hosts[2].name in message for message in short), (short, events[-3000:])
    untouched = cluster_of(sk, HOLDER)
    assert (untouched["name"], untouched["nodes_json"]) == (holder["name"], holder["nodes_json"]), "the other cluster"
    assert scaled_p99 < one_replica_p99

    with Load(url, clients=2, post_share=0.5) as after:  # the load gone: Serve scales down, Ray releases the node
        stopped = time.time()
        wait_until(lambda: workers(sk) == [], 180, "the idle node released")
        released = time.time() - stopped
        time.sleep(2)
        calm = after.stop()
    print(f"scale-down: the node released {released:.1f} s after the load stopped; {calm.ok} ok, {dict(calm.failures)}")
    assert calm.failed == 0, (calm.failures, calm.failed_answers)
    assert released >= IDLE_SECONDS, "Ray keeps an idle node idleTimeoutSeconds"
    assert "NodeRemoved" in {reason for reason, _ in events_of(sk)}


def test_deleted_services_leave_nothing_of_the_monitor_on_the_hosts(pool_daemon: Servekeeper, fleet: Fleet) -> None:
    sk = pool_daemon
    for name in (NAME, HOLDER):
        sk.cli("delete", name)
    wait_until(lambda: not sk.clusters(), 120, "the services' clusters stopped")
    # the monitor's files (the node token among them) went with the cluster's dir on the head's host
    assert not list(Path(fleet.hosts[0].work_dir).glob("*/autoscaler")), "nothing of the monitor left"
