"""Node autoscaling on one machine (issue 22), end to end on real Ray: the head runs Ray's own
monitor, which asks servekeeper's node API for worker nodes; servekeeper records and starts them
like any node, and stops the ones Ray releases. A cluster that starts with no worker gets ready
only once Ray asked for the node its replica needs; more replicas get more nodes, up to
maxReplicas; an upgrade at peak (a canary whose capacity follows its traffic) starts the new
cluster with the active's node count, and Ray follows the replicas on both clusters; fewer
replicas leave idle nodes that Ray releases after idleTimeoutSeconds; a change of minReplicas
alone keeps the cluster and Ray follows it; nothing fails."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from bench.node_autoscaling import NAME, scale_down, scale_up, spec

from servekeeper.providers.local_nodes import NODE_TAG_ENV
from servekeeper.testing.harness import Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray

IDLE_SECONDS = 10


@pytest.fixture(scope="module")
def sk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servekeeper]:
    daemon = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("autoscaling"))
    daemon.up()
    try:
        yield daemon
    finally:
        leftovers = daemon.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def running_workers(sk: Servekeeper, cluster_name: str | None = None) -> list[dict[str, Any]]:
    name = cluster_name or sk.api_get(NAME)["activeCluster"]["name"]
    (cluster,) = [c for c in sk.clusters() if c["name"] == name]
    nodes = json.loads(cluster["nodes_json"])
    return [n for n in nodes if n["role"] == "worker" and not n["stopped"] and n["pid"] is not None]


def test_ray_asks_for_the_nodes_its_replicas_need_and_releases_idle_ones(sk: Servekeeper) -> None:
    port = free_port()
    started = time.monotonic()
    sk.apply(spec(port, 1, idle_seconds=IDLE_SECONDS))
    assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-3000:]
    print(f"ready with a node Ray asked for after {time.monotonic() - started:.1f} s")
    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v1"
    assert [(n["group"], n["node_id"]) for n in running_workers(sk)] == [("cpu", 1)]
    assert "NodeAdded" in sk.events(NAME)

    with Load(f"http://127.0.0.1:{port}/", clients=8, post_share=0.5) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        # in place: Serve asks for replicas no node has room for (the benchmark's own measure)
        up = scale_up(sk, port, 3, "v1", idle_seconds=IDLE_SECONDS, max_nodes=3)
        assert sk.wait(NAME, timeout=180) == 0
        assert len(running_workers(sk)) == 3
        print(f"scale-up, seconds from the change: {up}")
        assert "pending_s" in up and up["node_asked_s"] <= up["node_alive_s"] <= up["replica_running_s"], up
        upgrade_at_peak_as_a_canary_whose_capacity_follows_traffic(sk, port)
        down = scale_down(sk, port, 1, "v2", idle_seconds=IDLE_SECONDS, max_nodes=3)
        print(f"scale-down, seconds from the change: {down}")
        assert down["node_released_s"] >= IDLE_SECONDS, "Ray waits idleTimeoutSeconds before a release"
        assert len(running_workers(sk)) == 1
        # Bounds only: the cluster is kept, and Ray's monitor, re-reading its config, scales to them
        kept = sk.api_get(NAME)["activeCluster"]["name"]
        sk.apply(spec(port, 1, "v2", idle_seconds=IDLE_SECONDS, min_nodes=2, max_nodes=3))
        wait_until(lambda: len(running_workers(sk)) == 2, 120, "a node Ray asked for to meet minReplicas")
        assert sk.api_get(NAME)["activeCluster"]["name"] == kept and len(sk.clusters()) == 1
        assert "AutoscalerBoundsChanged" in sk.events(NAME)
        sk.apply(spec(port, 1, "v2", idle_seconds=IDLE_SECONDS, max_nodes=3))  # back to 0: the idle node goes
        wait_until(lambda: len(running_workers(sk)) == 1, 120, "the node above the old minimum released")
        assert sk.api_get(NAME)["activeCluster"]["name"] == kept
        time.sleep(2)
        result = load.stop()
    print(f"under load: {result.ok} ok, {dict(result.failures)}")
    assert result.failed == 0, result.failures
    assert result.by_method["GET"] > 0 and result.by_method["POST"] > 0
    assert "NodeRemoved" in sk.events(NAME)
    assert set(result.bodies) == {"v1", "v2"}
    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v2"


def worker_nodes(sk: Servekeeper, cluster_name: str) -> list[dict[str, Any]]:
    """The cluster's worker nodes on record and not released (started or about to be)."""
    clusters = [c for c in sk.clusters() if c["name"] == cluster_name]
    nodes = json.loads(clusters[0]["nodes_json"]) if clusters else []
    return [n for n in nodes if n["role"] == "worker" and not n["stopped"]]


def upgrade_at_peak_as_a_canary_whose_capacity_follows_traffic(sk: Servekeeper, port: int) -> None:
    """The new cluster starts with the active's three nodes, not its replicas (0). At 50% each
    cluster's Serve runs two replicas of three (capacityFollowsTraffic): Ray releases the idle
    node of each; the promotion's 100% makes Ray ask for the third node again."""
    old = sk.api_get(NAME)["activeCluster"]["name"]
    document = spec(port, 3, "v2", idle_seconds=IDLE_SECONDS, max_nodes=3)
    steps = [{"setWeight": 50}, {"pause": {}}]
    document["spec"]["upgradeStrategy"] = {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}
    sk.api_apply(document)
    pending: list[str] = []

    def pending_cluster() -> bool:
        view = sk.api_get(NAME).get("pendingCluster")
        pending.extend([view["name"]] if view else [])
        return bool(pending)

    wait_until(pending_cluster, 60, "the canary's cluster")
    new = pending[0]
    assert len(worker_nodes(sk, new)) == 3, "started with the active's node count"
    counts: set[tuple[int, int]] = set()

    def both_released_one() -> bool:
        counts.add((len(running_workers(sk, old)), len(running_workers(sk, new))))
        return (2, 2) in counts

    wait_until(both_released_one, 240, "Ray releasing the node each cluster's 50% leaves idle")
    print(f"worker nodes (old, new) seen during the canary: {sorted(counts)}")
    sk.cli("promote", NAME)
    wait_until(lambda: sk.api_get(NAME)["activeCluster"]["name"] == new, 240, "the promotion")
    assert sk.wait(NAME, timeout=180) == 0
    assert len(running_workers(sk)) == 3, "Ray asked for the third node again at 100%"
    wait_until(lambda: len(sk.clusters()) == 1, 120, "the old cluster drained and deleted")


def raylets_by_node(cluster: dict[str, Any]) -> dict[str, list[int]]:
    """The raylet pids of the cluster's nodes on this machine, by the node's tag (its log file)."""
    found: dict[str, list[int]] = {}
    for process in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            tag = process.environ().get(NODE_TAG_ENV, "")
            if process.info["name"] == "raylet" and tag.startswith(cluster["log_dir"]):
                found.setdefault(tag, []).append(process.pid)
    return found


def test_a_controller_killed_as_it_starts_a_node_ray_asked_for_starts_it_once_after_up(sk: Servekeeper) -> None:
    """kill -9 of the controller between a launched node's spawn and its record: after `up`,
    exactly one node runs for that request: the one the dead controller spawned, adopted (Ray
    knows it already), not a second beside it; none orphaned."""
    port = int(sk.api_get(NAME)["ingress"]["url"].rsplit(":", 1)[1])
    (running,) = [n["node_id"] for n in running_workers(sk)]
    removed = sk.events(NAME).count("NodeRemoved")
    sk.kill_controller()
    sk.up(crash_at="node-spawned")
    sk.apply(spec(port, 2, "v2", idle_seconds=IDLE_SECONDS, max_nodes=3))  # in place: Ray asks for a second node
    wait_until(lambda: not sk.controller_alive(), 180, "the controller killed as it started the node")
    (cluster,) = sk.clusters()
    # the node the dead controller spawned runs on, unrecorded: its raylet comes up
    wait_until(lambda: len(raylets_by_node(cluster)) == 3, 60, "the unrecorded node's raylet")
    spawned = raylets_by_node(cluster)
    recorded = [n for n in json.loads(cluster["nodes_json"]) if n["role"] == "worker" and not n["stopped"]]
    (asked,) = [n["node_id"] for n in recorded if n["node_id"] != running]  # Ray's one request
    assert [n["pid"] is None for n in recorded] == [n["node_id"] == asked for n in recorded], "spawned, unrecorded"
    sk.up()
    assert sk.wait(NAME, timeout=240) == 0, sk.cli("events", NAME).stdout[-3000:]
    wait_until(lambda: len(running_workers(sk)) == 2, 120, "the node Ray asked for running")
    (cluster,) = sk.clusters()
    assert sorted(n["node_id"] for n in running_workers(sk)) == sorted([running, asked]), "one node for the request"
    after = raylets_by_node(cluster)
    print(f"raylets before up {spawned}, after {after}")
    assert after == spawned, "the node the dead controller spawned was adopted: the same processes, none beside it"
    assert sk.events(NAME).count("NodeRemoved") == removed, "Ray did not give up on its node"
    assert httpx.get(f"http://127.0.0.1:{port}/").text == "v2"
