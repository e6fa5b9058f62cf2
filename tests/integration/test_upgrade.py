"""Zero-downtime cluster upgrades on real Ray clusters, under concurrent load through the ingress."""

from __future__ import annotations

import pytest

from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, pid_alive, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray

READY_DELAY_S = 10  # replicas take this long to become ready: the window the gate must cover
CLIENTS = 32


def _first_rollout(sk: Servekeeper, name: str, port: int) -> dict:  # type: ignore[type-arg]
    sk.apply(hello_spec(name, port, msg="v1", ready_delay_s=READY_DELAY_S))
    assert sk.wait(name) == 0
    return sk.clusters()[0]


def _old_cluster_gone(sk: Servekeeper, old: dict) -> bool:  # type: ignore[type-arg]
    names = [c["name"] for c in sk.clusters()]
    return old["name"] not in names and not pid_alive(old["head_pid"])


def test_cluster_upgrade_under_load_drops_nothing(sk: Servekeeper) -> None:
    port = free_port()
    sk.up()
    old = _first_rollout(sk, "upgrade", port)

    with Load(f"http://127.0.0.1:{port}/", clients=CLIENTS) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        sk.apply(hello_spec("upgrade", port, msg="v2", head_cpus=2, ready_delay_s=READY_DELAY_S))
        assert sk.wait("upgrade") == 0
        wait_until(lambda: _old_cluster_gone(sk, old), 90, "the old cluster to drain and go")
        wait_until(lambda: load.result.bodies["v2"] > 50, 30, "v2 responses")
    result = load.result

    assert result.failed == 0, f"failed requests: {dict(result.failures)}"
    assert result.bodies["v1"] > 0 and result.bodies["v2"] > 0
    first_v2 = min(t for t, body in result.timeline if body == "v2")
    # The switch is atomic: after the first v2, only requests already in flight (at most one
    # per client) can still answer v1.
    assert sum(1 for t, body in result.timeline if body == "v1" and t > first_v2) <= CLIENTS
    view = sk.get("upgrade")
    assert view["activeCluster"]["generation"] == 2 and view["pendingCluster"] is None
    assert not pid_alive(old["head_pid"])
    assert "ClusterDrained" in sk.events("upgrade")
