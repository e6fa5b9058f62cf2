"""A hot standby on one machine, real Ray behind real Envoy (issue 20, item 2).

One daemon and one service are shared by the tests of this module, which run in order: the
active's head is killed (with the controller down, so the data plane alone fails over), then an
upgrade, then the standby is killed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servekeeper.core.planner.standby import REBUILD_AFTER_TAKEOVER_SECONDS
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, kill_local_cluster, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray

NAME = "twin"
CLIENTS = 32


class Shared:
    def __init__(self, sk: Servekeeper, port: int) -> None:
        self.sk = sk
        self.port = port
        self.url = f"http://127.0.0.1:{port}/"

    def spec(self, msg: str, **head: Any) -> dict[str, Any]:
        document = hello_spec(NAME, self.port, msg=msg, standby={"mode": "hot"}, rayClusterDeletionDelaySeconds=20)
        document["spec"]["rayClusterConfig"]["head"].update(head)
        return document

    def view(self) -> dict[str, Any]:
        return self.sk.api_get(NAME)

    def messages(self, reason: str, since: float) -> list[str]:
        return self.messages_of(NAME, reason, since)

    def messages_of(self, service: str, reason: str, since: float) -> list[str]:
        with self.sk.db() as db:
            rows = db.execute(
                "SELECT message FROM events WHERE service = ? AND reason = ? AND time >= ? ORDER BY id",
                (service, reason, since),
            ).fetchall()
        return [row[0] for row in rows]

    def wait_standby_ready(self, timeout: float = 180) -> dict[str, Any]:
        wait_until(lambda: self.view()["standby"] == "ready", timeout, "a ready standby")
        standby = self.view()["standbyCluster"]
        assert standby is not None
        return dict(standby)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    state_dir = Path(tempfile.mkdtemp(prefix="skstate-"))
    sk = Servekeeper(state_dir, tmp_path_factory.mktemp("standby"))
    sk.up()
    context = Shared(sk, free_port())
    try:
        sk.apply(context.spec("v1"))
        assert sk.wait(NAME) == 0
        yield context
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def test_a_killed_active_head_fails_over_in_the_data_plane_even_with_the_controller_down(shared: Shared) -> None:
    standby = shared.wait_standby_ready()
    active = shared.view()["activeCluster"]
    assert active is not None and standby["trafficPercent"] == 0
    with Load(shared.url, clients=CLIENTS, timeout=10) as load:
        wait_until(lambda: load.result.ok > 200, 30, "load to start")
        shared.sk.kill_controller()  # kill -9: the failover must not need it
        killed_at = time.time()
        kill_local_cluster(active["headPid"])
        killed_by = time.time()  # its processes die one by one: a request can reach one meanwhile
        time.sleep(4)  # the ingress alone serves from the standby meanwhile
        served_alone = [label for when, label in load.result.timeline if killed_at + 1 < when]
        shared.sk.up()
        wait_until(lambda: shared.view()["activeCluster"]["name"] == standby["name"], 30, "the standby promoted")
        time.sleep(2)
        result = load.stop()
    gap, client_stalled = result.longest_gap(killed_at - 1, killed_at + 6)
    after_kill = [(when, label) for when, label in result.timeline if when > killed_at]
    after = [label for _, label in after_kill]
    failed = [label for label in after if label != "v1"]
    print(
        f"\nhot standby: longest gap {gap:.2f}s, {len(failed)} failed of {len(after)} after the kill: {result.failures}"
        f"\n{result.failed_answers}"
    )
    assert gap - client_stalled <= 1.0, f"{gap:.2f}s without an answer ({client_stalled:.2f}s the client's own stall)"
    # Only requests in flight on the dying cluster fail, cut off as it dies (Envoy's words for a
    # reset after the request was sent); none that came after it was gone. About one per client:
    # more when a client's next request reached a listener not yet closed by the dying process.
    late = [(round(when - killed_by, 2), label) for when, label in after_kill if when > killed_by + 1.0]
    assert all(label == "v1" for _, label in late), [failure for failure in late if failure[1] != "v1"]
    assert all("reset reason: connection" in said for said in result.failed_answers), result.failed_answers
    assert len(failed) <= 2 * CLIENTS, result.failed_answers
    assert served_alone and set(served_alone) == {"v1"}, "the standby answered while the controller was down"
    [promoted] = shared.messages("StandbyPromoted", killed_at)
    assert f"the head of {active['name']} exited" in promoted
    # No replacement built from nothing; the one cluster created since is the next standby.
    assert all("ActiveUnhealthy" not in m for m in shared.messages("ClusterCreating", killed_at))
    replacement = shared.wait_standby_ready()
    assert replacement["name"] not in (active["name"], standby["name"])
    assert shared.sk.condition(NAME, "Ready")["status"] == "True"


def test_an_upgrade_with_a_standby_drops_nothing_and_rebuilds_it_with_the_new_spec(shared: Shared) -> None:
    before = shared.wait_standby_ready()
    applied = time.time()
    with Load(shared.url, clients=16, timeout=30) as load:
        shared.sk.apply(shared.spec("v2", env={"RELEASE": "2"}))  # a cluster-shape change: a new cluster
        assert shared.sk.wait(NAME, timeout=300) == 0
        time.sleep(2)
        result = load.stop()
    assert result.failed == 0, result.failures
    assert {"v1", "v2"} <= set(result.bodies)
    standby = shared.wait_standby_ready()
    active = shared.view()["activeCluster"]
    assert standby["name"] != before["name"] and standby["generation"] == active["generation"]
    rows = {row["name"]: row for row in shared.sk.clusters()}
    assert rows[standby["name"]]["cluster_spec_hash"] == rows[active["name"]]["cluster_spec_hash"]
    assert shared.messages("StandbyReplaced", applied), "the old spec's standby was replaced"


def test_a_standby_that_dies_is_rebuilt_and_the_active_never_notices(shared: Shared) -> None:
    standby = shared.wait_standby_ready()
    active = shared.view()["activeCluster"]
    killed_at = time.time()
    with Load(shared.url, clients=8, timeout=10) as load:
        kill_local_cluster(standby["headPid"])
        wait_until(lambda: shared.messages("StandbyReplaced", killed_at), 30, "the dead standby replaced")
        replacement = shared.wait_standby_ready()
        result = load.stop()
    assert result.failed == 0, result.failures
    assert replacement["name"] != standby["name"]
    assert shared.view()["activeCluster"]["name"] == active["name"]
    assert "StandbyDied" in shared.messages("StandbyReplaced", killed_at)[0]


def test_a_warm_standby_is_scaled_up_and_takes_over(shared: Shared) -> None:
    shared.sk.cli("delete", NAME)  # its clusters make room for a service of its own
    wait_until(lambda: not shared.sk.clusters(), 120, "the first service's clusters gone")
    port = free_port()
    shared.sk.apply(hello_spec("warm", port, msg="v-warm", standby={"mode": "warm"}))
    assert shared.sk.wait("warm") == 0
    wait_until(lambda: shared.sk.api_get("warm")["standby"] == "ready", 180, "the warm standby ready")
    view = shared.sk.api_get("warm")
    active, standby = view["activeCluster"], view["standbyCluster"]
    assert standby["trafficPercent"] == 0 and standby["name"] != active["name"]
    with Load(f"http://127.0.0.1:{port}/", clients=16, timeout=10) as load:
        wait_until(lambda: load.result.ok > 100, 30, "load to start")
        killed_at = time.time()
        kill_local_cluster(active["headPid"])
        wait_until(lambda: "StandbyPromoted" in shared.sk.events("warm"), 60, "the warm standby promoted")
        wait_until(lambda: load.result.timeline[-1][1] == "v-warm", 30, "answers again")
        time.sleep(max(0.0, killed_at + 22 - time.time()))
        result = load.stop()
    gap, _ = result.longest_gap(killed_at, killed_at + 20)
    with shared.sk.db() as db:
        query = "SELECT time, reason FROM events WHERE service = 'warm' AND time >= ?"
        steps = db.execute(query, (killed_at,)).fetchall()
    timeline = ", ".join(f"{reason} +{when - killed_at:.1f}s" for when, reason in steps)
    print(f"\nwarm standby: {gap:.1f}s without an answer after the kill ({timeline}); {dict(result.failures)}")
    # Issue 20 asks for 10 s. Measured 3.5 s: traffic moves 3-4 s after the kill, once Ray shows a
    # replica RUNNING. (It was 13.9-14.2 s while the next standby's head started at the takeover
    # and took both cores from the cluster that had just taken the traffic: now it waits 15 s.)
    assert gap <= 10.0, f"{gap:.1f}s without an answer after the kill"
    promoted = min(when for when, reason in steps if reason == "StandbyPromoted")
    built = [when for when, reason in steps if reason == "ClusterCreating"]
    waited = REBUILD_AFTER_TAKEOVER_SECONDS - 1  # (a tick's slack)
    assert all(when >= promoted + waited for when in built), "the next standby waits: no head start at the takeover"
    late = {label for when, label in result.timeline if when > killed_at + 20}
    assert late == {"v-warm"}, late
    assert "StandbyScalingUp" in shared.sk.events("warm")


def test_a_config_rolled_on_a_new_cluster_takes_the_warm_standby(shared: Shared) -> None:
    """Item 3 (warm spares): the rollout's new cluster is the standby, already running Serve;
    only the config PUT and the replicas' start remain. Follows the warm takeover above."""
    port = shared.sk.api_get("warm")["ingress"]["port"]
    wait_until(lambda: shared.sk.api_get("warm")["standby"] == "ready", 180, "the next warm standby ready")
    view = shared.sk.api_get("warm")
    active, spare = view["activeCluster"], view["standbyCluster"]
    applied_at = time.time()
    with Load(f"http://127.0.0.1:{port}/", clients=16, timeout=30) as load:
        wait_until(lambda: load.result.ok > 100, 30, "load to start")
        shared.sk.apply(
            hello_spec("warm", port, msg="v-warm2", standby={"mode": "warm"}, serveConfigUpdate="NewCluster")
        )
        wait_until(lambda: shared.sk.api_get("warm")["activeCluster"]["name"] == spare["name"], 120, "the spare active")
        switched_in = time.time() - applied_at
        wait_until(lambda: load.result.timeline[-1][1] == "v-warm2", 30, "the new version answers")
        time.sleep(2)
        result = load.stop()
    print(f"\nwarm spare: apply -> traffic on the taken standby in {switched_in:.1f}s; {dict(result.failures)}")
    assert result.failed == 0, result.failures
    assert {"v-warm", "v-warm2"} <= set(result.bodies)
    assert shared.messages_of("warm", "StandbyTaken", applied_at)
    creating = [m for m in shared.messages_of("warm", "ClusterCreating", applied_at) if "standby" not in m]
    assert not creating, f"a cluster was started for the rollout: {creating}"
    assert shared.sk.api_get("warm")["activeCluster"]["name"] != active["name"]
    wait_until(lambda: shared.sk.api_get("warm")["standby"] == "ready", 180, "a new warm standby after the rollout")
    assert shared.sk.api_get("warm")["standbyCluster"]["name"] not in (active["name"], spare["name"])
