"""Faults of a service on a small host pool, through a real daemon, under mixed load: a pool too
small for two clusters (the rollout waits, the active keeps serving, a host added lets it
proceed), SSH failing mid-start (the rollout fails with the SSH error, every node it started is
stopped), and kill -9 of the controller mid-upgrade (finished after `up`, each node started
once). One daemon, one service, upgraded from test to test in this order."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load
from tests.fleet import Fleet
from tests.multihost.test_service_on_fleet import tagged_pids

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(600)]

NAME = "faults"
POOL = "small"
# One whole CPU per node; hosts 1 and 2 hold one node each: the pool holds one cluster.
ONE_CLUSTER = {"host-1": 1.0, "host-2": 1.0, "host-3": 2.0}


class Shared:
    def __init__(self, sk: Servekeeper, fleet: Fleet, port: int) -> None:
        self.sk = sk
        self.fleet = fleet
        self.port = port
        self.version = 1

    def spec(self, head_host: str | None = None) -> dict[str, Any]:
        head: dict[str, Any] = {"numCpus": 1, "env": {"VERSION": str(self.version)}}  # a new cluster each time
        if head_host is not None:
            head["host"] = head_host
        return {
            "apiVersion": "servekeeper/v1alpha1",
            "kind": "RayService",
            "metadata": {"name": NAME},
            "spec": {
                "ingress": {"port": self.port},
                "rayClusterConfig": {
                    "hostPool": POOL,
                    "workingDir": str(HELLO_APP),
                    "head": head,
                    "workerGroups": [{"name": "cpu", "replicas": 1, "numCpus": 1}],
                },
                "serveConfig": {
                    "applications": [
                        {
                            "name": "hello",
                            "route_prefix": "/",
                            "import_path": "hello:app",
                            "args": {"msg": f"v{self.version}", "replicas": 2, "max_replicas_per_node": 1},
                        }
                    ]
                },
                "rayClusterDeletionDelaySeconds": 5,
                "readinessTimeoutSeconds": 300,
                "serviceUnhealthySecondThreshold": 300,
            },
        }

    def apply(self, document: dict[str, Any], label: str) -> None:
        path = self.sk.workdir / f"{label}.yaml"
        path.write_text(yaml.safe_dump(document))
        self.sk.cli("apply", "-f", str(path))

    def pool(self, hosts: list[str]) -> None:
        self.apply(self.fleet.host_pool_document(POOL, cpus=ONE_CLUSTER, hosts=hosts), f"pool-{len(hosts)}")

    def upgrade(self, head_host: str | None = None) -> None:
        self.version += 1
        self.apply(self.spec(head_host), f"v{self.version}")

    def active(self) -> dict[str, Any]:
        return dict(self.sk.api_get(NAME)["activeCluster"])

    def row(self, cluster: str) -> dict[str, Any]:
        return next(c for c in self.sk.clusters() if c["name"] == cluster)

    def nodes(self, cluster: str) -> list[dict[str, Any]]:
        return list(json.loads(self.row(cluster)["nodes_json"]))

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.sk.api_get(NAME)["conditions"] if c["type"] == kind)

    def wait_ready(self, timeout: float = 300) -> None:
        assert self.sk.wait(NAME, timeout=timeout) == 0, (
            self.sk.api_get(NAME).get("failureReason"),
            self.sk.cli("events", NAME).stdout[-3000:],
        )


@pytest.fixture(scope="module")
def shared(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("faults"))
    sk.up()
    context = Shared(sk, fleet, free_port())
    try:
        context.pool(["host-1", "host-2"])
        context.apply(context.spec(), "v1")
        context.wait_ready()
        yield context
    finally:
        fleet.hosts[1].set_sftp(True)
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"
        on_hosts = fleet.leftovers_described()
        assert not on_hosts, f"left on the hosts: {on_hosts}"


def test_a_pool_too_small_for_two_clusters_waits_then_proceeds_when_a_host_is_added(shared: Shared) -> None:
    old = shared.active()
    assert {node["host"] for node in shared.nodes(old["name"])} == {"host-1", "host-2"}
    with Load(f"http://127.0.0.1:{shared.port}/", clients=8) as load:
        shared.upgrade()
        wait_until(
            lambda: shared.condition("UpgradeInProgress")["reason"] == "InsufficientCapacity", 60, "the wait for room"
        )
        waiting = shared.condition("UpgradeInProgress")
        assert "numCpus" in waiting["message"] or "CPU" in waiting["message"], waiting
        time.sleep(5)
        assert [c["name"] for c in shared.sk.clusters()] == [old["name"]], "no cluster started without room"
        assert load.result.ok > 0 and load.result.failed == 0, "the active keeps serving"
        shared.pool(["host-1", "host-2", "host-3"])  # a host joins: the new cluster fits on it
        shared.wait_ready()
        wait_until(lambda: load.result.bodies[f"v{shared.version}"] > 10, 30, "the new version answering")
        result = load.stop()
    print(f"pool too small: waited with {waiting['message']!r}; {result.ok} ok, {result.failed} failed")
    assert result.failed == 0, result.failures
    assert result.by_method["GET"] > 0 and result.by_method["POST"] > 0
    new = shared.active()
    assert {node["host"] for node in shared.nodes(new["name"])} == {"host-3"}, "placed where the room is"
    assert "InsufficientCapacity" in shared.sk.events(NAME)


def test_ssh_failing_mid_start_fails_the_rollout_and_stops_what_it_started(shared: Shared) -> None:
    before = shared.active()
    shared.fleet.hosts[1].set_sftp(False)  # host-2 accepts logins and commands, but no file can be written
    try:
        with Load(f"http://127.0.0.1:{shared.port}/", clients=8) as load:
            known = {c["name"] for c in shared.sk.clusters()}
            shared.upgrade(head_host="host-1")  # the head starts on host-1, then its worker on host-2 fails
            wait_until(lambda: shared.sk.api_get(NAME).get("failureReason"), 120, "the rollout to fail")
            failure = str(shared.sk.api_get(NAME)["failureReason"])
            failed = next(c for c in shared.sk.clusters() if c["name"] not in known)
            dirs = [node["temp_dir"] for node in json.loads(failed["nodes_json"])]
            wait_until(lambda: failed["name"] not in {c["name"] for c in shared.sk.clusters()}, 120, "its cleanup")
            time.sleep(2)
            result = load.stop()
    finally:
        shared.fleet.hosts[1].set_sftp(True)
    print(f"SSH failing mid-start: {failure!r}; {result.ok} ok, {result.failed} failed")
    assert "host-2" in failure and "StartFailed" in failure, failure
    assert not tagged_pids(dirs), "the head started on host-1 is stopped"
    assert result.failed == 0, result.failures
    assert shared.active()["name"] == before["name"], "the active keeps serving"
    assert "RolloutFailed" in shared.sk.events(NAME)


def test_controller_killed_mid_upgrade_finishes_after_up_with_each_node_started_once(shared: Shared) -> None:
    sk = shared.sk
    old = shared.active()
    sk.kill_controller()
    sk.up(crash_at="pending-started")  # dies once the pending head runs, before its worker starts
    with Load(f"http://127.0.0.1:{shared.port}/", clients=8) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        doomed = sk.controller_pid()
        shared.upgrade()
        sk.wait_controller_gone(doomed, 120)
        pending = next(c for c in sk.clusters() if c["role"] == "pending")
        started_before_crash = [node["pid"] for node in json.loads(pending["nodes_json"])]
        sk.up()
        shared.wait_ready()
        wait_until(lambda: old["name"] not in {c["name"] for c in sk.clusters()}, 120, "the old cluster to go")
        wait_until(lambda: load.result.bodies[f"v{shared.version}"] > 10, 30, "the new version answering")
        result = load.stop()
    assert result.failed == 0, result.failures
    new = shared.active()
    assert new["name"] == pending["name"]
    nodes = shared.nodes(new["name"])
    assert started_before_crash[0] is not None and started_before_crash[0] == nodes[0]["pid"], "the head kept"
    for node in nodes:
        log = Path(f"{node['temp_dir']}.log").read_text(errors="replace")
        starts = log.count("Ray runtime started")
        assert starts == 1, f"node {node['temp_dir']} on {node['host']} started {starts} times"
