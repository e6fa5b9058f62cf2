"""Issue 19, defect 0, as a new user met it: three hosts of 2 CPUs each behind stock sshd, the
head pinned on host 1 and two workers, 8 reconnecting clients through the ingress, then an
`apply` of a changed head env. The new cluster fits beside the old one only just (every host
runs a node of each), and the machine is busy; the upgrade must still happen, dropping nothing.
A worker whose `ray start` gives up under that load is started again in place, its cause
(its log's last lines) in the event."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load
from tests.fleet import Fleet
from tests.multihost.conftest import apply_yaml
from tests.multihost.test_service_on_fleet import tagged_pids

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(900)]

NAME = "tight"
POOL = "twocpu"


def spec(fleet: Fleet, port: int, version: int) -> dict[str, Any]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": NAME},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {
                "hostPool": POOL,
                "workingDir": str(HELLO_APP),
                "head": {"numCpus": 1, "host": fleet.hosts[0].name, "env": {"RELEASE": str(version)}},
                "workerGroups": [{"name": "cpu", "replicas": 2, "numCpus": 1}],
            },
            "serveConfig": {
                "applications": [
                    {
                        "name": "hello",
                        "route_prefix": "/",
                        "import_path": "hello:app",
                        "args": {"msg": f"v{version}", "replicas": 2},
                    }
                ]
            },
        },
    }


def test_a_head_env_upgrade_on_three_two_cpu_hosts_under_load_happens_and_drops_nothing(
    pool_daemon: Servekeeper, fleet: Fleet
) -> None:
    daemon = pool_daemon
    port = free_port()
    apply_yaml(daemon, fleet.host_pool_document(POOL, cpus=2), "pool")
    apply_yaml(daemon, spec(fleet, port, 1), "v1")
    assert daemon.wait(NAME, timeout=300) == 0, daemon.cli("events", NAME).stdout[-3000:]
    old = dict(daemon.api_get(NAME)["activeCluster"])
    old_dirs = node_dirs_of(daemon, old["name"])
    with busy_cores(2), Load(f"http://127.0.0.1:{port}/", clients=8, new_connections=True, timeout=10) as load:
        wait_until(lambda: load.result.ok > 30, 30, "load to start")
        applied_at = time.monotonic()
        apply_yaml(daemon, spec(fleet, port, 2), "v2")
        code = daemon.wait(NAME, timeout=600)
        switched_s = time.monotonic() - applied_at
        time.sleep(2)
        result = load.stop()
    events = daemon.cli("events", NAME).stdout
    print(
        f"head env upgrade on 3 hosts of 2 CPUs under 8 reconnecting clients: switched after {switched_s:.1f}s; "
        f"{result.failed} of {result.failed + result.ok} requests failed ({dict(result.failures)}); node restarts "
        f"{events.count('WorkerRestarting')}, head restarts {events.count('HeadRestarting')}"
    )
    assert code == 0, (daemon.api_get(NAME).get("failureReason"), events[-4000:])
    assert daemon.api_get(NAME)["activeCluster"]["name"] != old["name"], events[-4000:]
    assert "RolloutFailed" not in events, events[-4000:]
    # Seen in 1 of 6 runs: a worker's `ray start` gave up on a loaded machine (Ray waits a fixed
    # 30 s for its raylet to register with the GCS: "The current node timed out during
    # startup"). It is started again where it was, its log's last lines in the event, and the
    # upgrade goes on (89 s to the switch, 0 failed).
    with daemon.db() as db:
        query = "SELECT message FROM events WHERE service = ? AND reason = 'WorkerRestarting'"
        restarts = [row[0] for row in db.execute(query, (NAME,))]
    # Every restart names its cause: the node's last log lines after "(restart N of at most M): ".
    assert all(re.search(r"\(restart \d+ of at most \d+\): \S", message) for message in restarts), restarts
    assert result.failed == 0, result.failures
    assert result.bodies["v2"] > 0 and result.by_method["POST"] > 0
    wait_until(lambda: old["name"] not in {c["name"] for c in daemon.clusters()}, 120, "the old cluster gone")
    assert not tagged_pids(old_dirs), "no process of the old cluster is left on any host"
    apply_delete(daemon)


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """Other work on the hosts (one machine's cores under every host): `count` busy loops, so
    that SSH commands and Ray's start answer slowly, as on a loaded pool host."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def node_dirs_of(sk: Servekeeper, cluster: str) -> list[str]:
    row = next(c for c in sk.clusters() if c["name"] == cluster)
    return [node["temp_dir"] for node in json.loads(row["nodes_json"])]


def apply_delete(sk: Servekeeper) -> None:
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 120, "the service's clusters stopped")
