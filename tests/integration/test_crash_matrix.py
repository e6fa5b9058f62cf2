"""`kill -9` of the controller at each phase of an upgrade, under load (crash points are injected
deterministically by a test hook, not by sleeping and hoping)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servekeeper.faults import CRASH_POINTS
from servekeeper.ports import port_is_free
from servekeeper.testing import Load, Servekeeper, free_port, hello_spec, pid_alive, wait_until

pytestmark = pytest.mark.ray
CLIENTS = 16


@pytest.mark.parametrize("phase", CRASH_POINTS)
def test_controller_killed_at_each_phase_of_an_upgrade(sk: Servekeeper, phase: str) -> None:
    port = free_port()
    sk.up()
    sk.apply(hello_spec("crash", port, msg="v1", ready_delay_s=3))
    assert sk.wait("crash") == 0
    old = sk.clusters()[0]
    sk.kill_controller()
    sk.up(crash_at=phase)

    with Load(f"http://127.0.0.1:{port}/", clients=CLIENTS) as load:
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        doomed = sk.controller_pid()
        sk.apply(hello_spec("crash", port, msg="v2", head_cpus=2, ready_delay_s=3))
        sk.wait_controller_gone(doomed, 120)
        seen = {c["name"]: c for c in sk.clusters()}
        sk.up()
        assert sk.wait("crash") == 0, sk.cli("describe", "crash").stdout
        wait_until(lambda: old["name"] not in [c["name"] for c in sk.clusters()], 90, "the old cluster to go")
        wait_until(lambda: load.result.bodies["v2"] > 20, 30, "v2 responses")
    result = load.result

    assert result.failed == 0, f"{phase}: failed requests {dict(result.failures)}"
    new = sk.get("crash")["activeCluster"]
    assert new["generation"] == 2
    submitted_to = [cluster for cluster, _ in sk.submissions()]
    for name in {*submitted_to}:
        assert submitted_to.count(name) == 1, f"{phase}: config submitted twice to {name}: {sk.submissions()}"
    # Nothing of the old cluster is left: processes, temp dir, ports.
    assert not pid_alive(old["head_pid"])
    assert not Path(old["temp_dir"]).exists()
    wait_until(lambda: port_is_free(old_ports(old)[0]), 10, "the old GCS port to be free")
    assert all(port_is_free(p) for p in old_ports(old))
    # Every cluster the crashed controller knew about is either the new active one or gone.
    for name, cluster in seen.items():
        if name != new["name"]:
            assert not Path(cluster["temp_dir"]).exists(), f"{phase}: temp dir of {name} left behind"


def old_ports(cluster: dict) -> list[int]:  # type: ignore[type-arg]
    import json

    ports = json.loads(cluster["ports_json"])
    return [ports["gcs"], ports["dashboard"], ports["serve_http"]]
