"""`kill -9` of the controller at each phase of an upgrade, under load (crash points are injected
deterministically by a test hook, not by sleeping and hoping).

One service goes through one upgrade per group of crash points (the cluster shape alternates, so
each is a new cluster): a daemon armed to die at the first point, then its successor, resuming
that upgrade, armed to die at the next, and so on, then a fresh daemon that must finish it: zero
failed requests, the config sent once to the new cluster (twice when a crash came between its
audit and its PUT), nothing of the old cluster left. Every crash point is in one group; a resumed
upgrade is crashed again, and again, so recovery from a recovery is tested too. (Each point alone,
and every point again from a crash: the simulator's crash matrix in tests/unit.)
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servekeeper.core.hooks import CRASH_POINTS
from servekeeper.providers.ports import port_is_free
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, pid_alive, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray
CLIENTS = 16
NAME = "crash"


class Service:
    def __init__(self, sk: Servekeeper) -> None:
        self.sk = sk
        self.port = free_port()
        self.version = 1

    def next_spec(self) -> dict[str, Any]:
        self.version += 1
        head_cpus = 2 if self.version % 2 == 0 else 1  # a new shape each time: a new cluster
        return hello_spec(NAME, self.port, msg=f"v{self.version}", head_cpus=head_cpus, ready_delay_s=3)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("crash"))
    sk.up()
    context = Service(sk)
    try:
        sk.apply(hello_spec(NAME, context.port, msg="v1", ready_delay_s=3))
        assert sk.wait(NAME) == 0
        yield context
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


# Within a group each point comes after the one before in an upgrade, and is still ahead once the
# crash before it is resumed ("waiting-for-ready" only leads: a resumed daemon may find the apps
# ready already). Two groups: two upgrades for the eight points (CI time), the first crashed five
# times over.
CRASH_GROUPS = (
    ("cluster-intent-written", "pending-started", "config-audited", "config-submitted", "route-switched"),
    ("waiting-for-ready", "draining", "deleting-old"),
)


def test_the_groups_cover_every_crash_point_once_in_upgrade_order() -> None:
    assert sorted(point for group in CRASH_GROUPS for point in group) == sorted(CRASH_POINTS)
    for group in CRASH_GROUPS:
        assert [CRASH_POINTS.index(point) for point in group] == sorted(CRASH_POINTS.index(point) for point in group)


@pytest.mark.parametrize("phases", CRASH_GROUPS, ids=["+".join(group) for group in CRASH_GROUPS])
def test_controller_killed_at_several_phases_of_an_upgrade(service: Service, phases: tuple[str, ...]) -> None:
    sk = service.sk
    phase = "+".join(phases)
    old = sk.clusters()[0]
    # A removed cluster's audit rows go with it (bounded growth): count the PUTs of clusters new
    # in this test, and the clusters created, from the events (they stay).
    clusters_before = {cluster for cluster, _ in sk.submissions()} | {c["name"] for c in sk.clusters()}
    with sk.db() as db:
        last_event = db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0]
    sk.kill_controller()
    sk.up(crash_at=phases[0])

    with Load(f"http://127.0.0.1:{service.port}/", clients=CLIENTS) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        doomed = sk.controller_pid()
        spec = service.next_spec()
        sk.apply(spec)
        sk.wait_controller_gone(doomed, 120)
        seen = {c["name"]: c for c in sk.clusters()}
        for point in phases[1:]:
            try:
                sk.up(crash_at=point)
            except AssertionError:  # it resumes at once: it may die at its point before `up` saw it announce itself
                assert not sk.controller_alive(), "`up` failed, but not by the armed crash"
            sk.wait_controller_gone(sk.controller_pid(), 120)
            seen.update({c["name"]: c for c in sk.clusters()})
        sk.up()
        assert sk.wait(NAME) == 0, sk.cli("describe", NAME).stdout
        wait_until(lambda: old["name"] not in [c["name"] for c in sk.clusters()], 90, "the old cluster to go")
        version = f"v{service.version}"
        wait_until(lambda: load.result.bodies[version] > 20, 30, f"{version} responses")
    result = load.result

    assert result.failed == 0, f"{phase}: failed requests {dict(result.failures)}"
    assert result.by_method["GET"] > 0 and result.by_method["POST"] > 0
    new = sk.get(NAME)["activeCluster"]
    assert new["generation"] == sk.get(NAME)["generation"] and new["name"] != old["name"]
    audited = [cluster for cluster, _ in sk.submissions() if cluster not in clusters_before]
    # Audited before it is sent: a crash between the audit and the PUT leaves one row unsent.
    expected = 2 if "config-audited" in phases else 1
    assert audited == [new["name"]] * expected, f"{phase}: config PUTs {sk.submissions()}"
    # At most one cluster made for the upgrade, the crash notwithstanding (a crash right after its
    # intent was written may come before its event is stored): no PUT went to another one.
    with sk.db() as db:
        created = db.execute(
            "SELECT COUNT(*) FROM events WHERE service = ? AND reason = 'ClusterCreating' AND id > ?",
            (NAME, last_event),
        ).fetchone()[0]
    assert created <= 1, f"{phase}: {created} clusters created"
    # Nothing of the old cluster is left: processes, temp dir, ports.
    assert not pid_alive(old["head_pid"])
    assert not Path(old["temp_dir"]).exists()
    wait_until(lambda: port_is_free(_ports(old)[0]), 10, "the old GCS port to be free")
    assert all(port_is_free(p) for p in _ports(old))
    # Every cluster the crashed controller knew about is either the new active one or gone.
    for name, cluster in seen.items():
        if name != new["name"]:
            assert not Path(cluster["temp_dir"]).exists(), f"{phase}: temp dir of {name} left behind"


def _ports(cluster: dict[str, Any]) -> list[int]:
    ports = json.loads(cluster["ports_json"])
    return [ports["gcs"], ports["dashboard"], ports["serve_http"]]
