"""GCS fault tolerance on the fleet (issue 20, item 1), with each backend: the head's GCS keeps its
tables in RocksDB, in the Redis servekeeper runs, or in the user's own Redis (one this test
starts on the fleet's bridge, its password in a servekeeper secret). Every process of the head
SIGKILLed under mixed load; the head is started again in place (same cluster, same host, same
ports), the workers' Serve proxies answer meanwhile, and Serve's controller recovers its apps
(a run-time one too) from the GCS, with no new config PUT. The Redis servekeeper runs is
SIGKILLed first, under the running cluster: started again with its data, nothing is lost. A
deleted cluster's namespace leaves the user's Redis."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load
from tests.fleet import ROOT_ADDRESS, Fleet
from tests.multihost.conftest import apply_yaml
from tests.multihost.test_service_on_fleet import FAILURE_LABELS, tagged_pids

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(600)]

NAME = "kept"
# Serve controller log lines on proxies drained and replicas recovered.
SERVE_RECOVERY = re.compile(r"[Dd]raining proxy|still recovering|Finished recovering|Recovering")
CLIENTS = 16


def spec(fleet: Fleet, port: int, fault_tolerance: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": NAME},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {
                "hostPool": "gcs",
                "workingDir": str(HELLO_APP),
                # No CPU on the head: the replicas run on the workers, which outlive it.
                "head": {"numCpus": 0, "host": fleet.hosts[0].name},
                "workerGroups": [{"name": "cpu", "replicas": 2, "numCpus": 1}],
                "gcsFaultTolerance": fault_tolerance,
            },
            "serveConfig": {
                "applications": [
                    {
                        "name": "hello",
                        "route_prefix": "/",
                        "import_path": "hello:app",
                        "args": {"msg": "kept", "replicas": 2},
                        # A CPU each (the code asks none): on the workers, never on the head.
                        "deployments": [{"name": "Hello", "ray_actor_options": {"num_cpus": 1}}],
                    }
                ]
            },
            "serviceUnhealthySecondThreshold": 300,
        },
    }


def nodes_of(sk: Servekeeper, cluster: str) -> list[dict[str, Any]]:
    row = next(c for c in sk.clusters() if c["name"] == cluster)
    return list(json.loads(row["nodes_json"]))


@contextlib.contextmanager
def users_redis(directory: Path) -> Iterator[tuple[str, str]]:
    """A Redis of the user's on the fleet's bridge (every host reaches it): (address, password)."""
    port, password = free_port(), "the-users-redis-password"
    config = directory / "users-redis.conf"
    config.write_text(
        f"bind {ROOT_ADDRESS}\nport {port}\nrequirepass {password}\ndir {directory}\nappendonly yes\n"
        'save ""\nlogfile ""\n'
    )
    server = subprocess.Popen(["redis-server", str(config)], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: _pings(ROOT_ADDRESS, port, password), 10, "the user's Redis")
        yield f"{ROOT_ADDRESS}:{port}", password
    finally:
        server.kill()
        server.wait()


def _pings(host: str, port: int, password: str) -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(redis.Redis(host=host, port=port, password=password, socket_timeout=1).ping())
    return False


def own_keys(address: str, password: str, cluster: str) -> list[bytes]:
    host, port = address.rsplit(":", 1)
    return list(redis.Redis(host=host, port=int(port), password=password).scan_iter(match=f"RAY{cluster}@*"))


@pytest.mark.parametrize("backend", ["rocksdb", "redis-run-by-servekeeper", "users-redis"])
def test_a_killed_head_is_started_again_in_place_and_serve_recovers_without_a_put(
    pool_daemon: Servekeeper, fleet: Fleet, backend: str, tmp_path: Path
) -> None:
    daemon = pool_daemon
    port = free_port()
    apply_yaml(daemon, fleet.host_pool_document("gcs", cpus=2), "pool")
    with contextlib.ExitStack() as stack:
        fault_tolerance: dict[str, Any] = {"backend": "rocksdb"}
        if backend == "redis-run-by-servekeeper":
            fault_tolerance = {"backend": "redis"}
        elif backend == "users-redis":
            address, password = stack.enter_context(users_redis(tmp_path))
            daemon.cli("secret", "set", "users-redis", "password=-", input=password)
            secret = {"name": "users-redis", "key": "password"}
            fault_tolerance = {"backend": "redis", "redis": {"address": address, "passwordSecret": secret}}
        apply_yaml(daemon, spec(fleet, port, fault_tolerance), f"v1-{backend}")
        assert daemon.wait(NAME, timeout=300) == 0, daemon.cli("events", NAME).stdout[-3000:]
        cluster = daemon.api_get(NAME)["activeCluster"]["name"]
        if backend == "users-redis":
            assert own_keys(address, password, cluster), "the GCS tables are in the user's Redis"
        if backend == "redis-run-by-servekeeper":
            head = nodes_of(daemon, cluster)[0]
            argv = []
            for pid in tagged_pids([head["temp_dir"]]):
                with contextlib.suppress(OSError):  # a process that has just exited
                    argv.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            assert any(b"gcs_server" in line and f"sk-{cluster}".encode() in line for line in argv), (
                "the GCS signs in as the cluster's own Redis user"
            )
        try:
            kill_head_and_check(daemon, cluster, backend, port)
        finally:  # even after a failure: the next backend starts from no service
            daemon.cli("delete", NAME, check=False)
            wait_until(lambda: not daemon.clusters(), 120, "the service's clusters stopped")
        if backend == "users-redis":
            assert own_keys(address, password, cluster) == [], "its namespace went with the cluster"
        if backend == "redis-run-by-servekeeper":
            users = json.loads((daemon.state_dir / "redis" / "users.json").read_text())
            assert cluster not in users, "its Redis user went with the cluster"


def kill_head_and_check(daemon: Servekeeper, cluster: str, backend: str, port: int) -> None:
    # An app made at run time (`serve.run` in a driver): Serve keeps it in the GCS too.
    daemon.cli("job", "submit", NAME, "--working-dir", str(HELLO_APP), "--", "python", "-c", IMPERATIVE)
    puts = len(daemon.submissions())
    if backend == "redis-run-by-servekeeper":
        redis_killed_at = time.time()
        kill_servekeepers_redis(daemon)
        redis_back_at = time.time()
        # Ray's GCS rides out a short loss of its Redis, or exits and is started again in place:
        # either has happened, and the head runs, before the head is killed below.
        time.sleep(10)
        wait_until(lambda: nodes_of(daemon, cluster)[0]["pid"] is not None, 120, "the head running")
        wait_ready(daemon, 120, "Ready with Redis back")
        print(
            f"redis-server SIGKILLed: running again after {redis_back_at - redis_killed_at:.1f}s, the service Ready "
            f"after {time.time() - redis_killed_at:.1f}s; head restarts: {nodes_of(daemon, cluster)[0]['restarts']}"
        )
    head = nodes_of(daemon, cluster)[0]
    restarted_before = daemon.events(NAME).count("HeadRestarted")
    # The kill starts from a settled cluster: every proxy healthy in Envoy's eyes (a head killed
    # while Serve still recovers from the last fault is a second fault, not this test's).
    wait_until(lambda: all_proxies_healthy(daemon), 60, "every proxy healthy in Envoy")
    with EnvoyHealth(daemon) as health, Load(f"http://127.0.0.1:{port}/", clients=CLIENTS, timeout=10) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        killed_at = time.time()
        for pid in tagged_pids([head["temp_dir"]]):  # raylet, GCS, dashboard, Serve's controller: all
            with contextlib.suppress(ProcessLookupError):  # gone with a process killed before it
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: daemon.events(NAME).count("HeadRestarted") > restarted_before, 120, "the head started again")
        restarted_at = time.time()
        wait_ready(daemon, 120, "Ready again")
        ready_at = time.time()
        time.sleep(3)
        result = load.stop()
    longest_gap, client_stalled = result.longest_gap(killed_at)
    events = daemon.cli("events", NAME).stdout
    print(timeline(daemon, result, killed_at, head["temp_dir"], bucket=1))
    print("Envoy's view of the proxies (seconds after the kill):\n" + health.changes(killed_at))
    failed_at = [(round(when - killed_at, 2), label) for when, label in result.timeline if label not in result.bodies]
    print(
        f"failures (seconds after the kill): {failed_at}; head back at {restarted_at - killed_at:.1f}s, "
        f"Ready at {ready_at - killed_at:.1f}s"
    )
    print(
        f"head SIGKILLed with GCS in {backend} under {CLIENTS} clients: started again after "
        f"{restarted_at - killed_at:.1f}s; {result.failed} of {result.failed + result.ok} requests failed "
        f"({dict(result.failures)}); longest time without an answer {longest_gap:.2f}s (the client's own loop "
        f"stood still {client_stalled:.2f}s of it)"
    )
    assert daemon.api_get(NAME)["activeCluster"]["name"] == cluster, "the cluster was kept"
    assert [c["name"] for c in daemon.clusters()] == [cluster], "no new cluster"
    now = nodes_of(daemon, cluster)[0]
    assert (now["host"], now["temp_dir"]) == (head["host"], head["temp_dir"]), "started again in place"
    # Once, or more: on a busy machine a head started again can time out in its own start ("The
    # current node timed out during startup", seen in a CI run) and is then started once more.
    assert now["restarts"] >= head["restarts"] + 1, (now["restarts"], head["restarts"])
    assert now["pid"] != head["pid"] and "HeadRestarting" in events
    assert len(daemon.submissions()) == puts, "Serve recovered its apps from the GCS: no PUT"
    apps = serve_apps(daemon, cluster)
    assert apps["hello"]["status"] == "RUNNING", apps
    assert apps["extra"]["source"] == "imperative", apps
    wait_until(lambda: serve_apps(daemon, cluster)["extra"]["status"] == "RUNNING", 60, "the run-time app")
    # The head's proxy is a fallback (no worker's proxy unhealthy: it takes nothing), so the kill
    # touches no request: 0 failed of ~3,000, 0.23-0.30 s at most without an answer in the three
    # runs since (7.7-16.2 s in 5 of 9 runs before: a head started again held every request Envoy
    # sent it until Serve's controller had recovered). The bounds: at most one second
    # without an answer, failed at most those in flight (one per closed-loop client). A CI run saw
    # 1.82 s once, with nothing failed: the time the test's own client stood still (a starved
    # process on the loaded 2-core machine, measured by its loop's lateness) is not the server's.
    assert result.failed <= CLIENTS, result.failures
    unexplained = longest_gap - client_stalled
    assert unexplained <= 1, f"{longest_gap:.2f}s without an answer ({client_stalled:.2f}s the client's own stall)"
    assert result.by_method["POST"] > 0


def proxy_health(daemon: Servekeeper) -> dict[str, str]:
    """Each upstream proxy of the service's HTTP cluster in Envoy's eyes ("host:port" -> its
    health flags), from the first Envoy's admin."""
    record = json.loads((daemon.state_dir / "dataplane" / "processes.json").read_text())[0]
    text = httpx.get(f"http://127.0.0.1:{record['admin_port']}/clusters", timeout=2, trust_env=False).text
    flags = {}
    for line in text.splitlines():
        name, *rest = line.split("::")
        if name.startswith("http-") and len(rest) == 3 and rest[1] == "health_flags":
            flags[rest[0]] = rest[2]
    return flags


def all_proxies_healthy(daemon: Servekeeper) -> bool:
    try:
        flags = proxy_health(daemon)
    except (httpx.HTTPError, OSError, ValueError, IndexError):  # Envoy's admin busy: asked again
        return False
    return bool(flags) and all(value == "healthy" for value in flags.values())


class EnvoyHealth:
    """Envoy's health flags of the proxies, polled every 0.2 s in a thread: when each changed."""

    def __init__(self, daemon: Servekeeper) -> None:
        self.daemon = daemon
        self.seen: list[tuple[float, dict[str, str]]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> EnvoyHealth:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _poll(self) -> None:
        while not self.stopped.wait(0.2):
            with contextlib.suppress(httpx.HTTPError, OSError, ValueError, IndexError):
                flags = proxy_health(self.daemon)
                if not self.seen or self.seen[-1][1] != flags:
                    self.seen.append((time.time(), flags))

    def changes(self, since: float) -> str:
        return "\n".join(f"{when - since:7.1f}s {flags}" for when, flags in self.seen)


def wait_ready(daemon: Servekeeper, timeout: float, what: str) -> None:
    """Wait for Ready; on a timeout, say why not: the condition, the nodes, the last events."""
    try:
        wait_until(lambda: daemon.condition(NAME, "Ready")["status"] == "True", timeout, what)
    except AssertionError as timed_out:
        ready = daemon.condition(NAME, "Ready")
        nodes = [(c["name"], c["role"], c["nodes_json"]) for c in daemon.clusters()]
        events = daemon.cli("events", NAME, check=False).stdout[-4000:]
        raise AssertionError(f"{timed_out}: Ready is {ready}; clusters {nodes}; events:\n{events}") from None


def kill_servekeepers_redis(daemon: Servekeeper) -> None:
    """SIGKILL of the Redis servekeeper runs, under the running cluster: started again (same port,
    its AOF replayed) by the next look; the head's kill that follows needs what it holds."""
    record = json.loads((daemon.state_dir / "redis" / "server.json").read_text())
    os.kill(record["pid"], signal.SIGKILL)
    time.sleep(1)

    def started_again() -> bool:
        now = json.loads((daemon.state_dir / "redis" / "server.json").read_text())
        return now["pid"] != record["pid"] and now["port"] == record["port"] and os.path.exists(f"/proc/{now['pid']}")

    wait_until(started_again, 30, "the Redis servekeeper runs, started again")


IMPERATIVE = (
    "import hello; from ray import serve; "
    "serve.run(hello.app({'msg': 'extra'}), name='extra', route_prefix='/extra', blocking=False)"
)


def serve_apps(sk: Servekeeper, cluster: str) -> dict[str, Any]:
    """Serve's applications, from the cluster's dashboard (with its token)."""
    token = (sk.state_dir / "tokens" / f"{cluster}.token").read_text().strip()
    answer = httpx.get(
        f"{sk.api_get(NAME)['activeCluster']['dashboardUrl']}/api/serve/applications/",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    return dict(answer.json()["applications"])


def timeline(sk: Servekeeper, result: Any, cut_at: float, head_dir: str, bucket: int = 5) -> str:
    """What happened when (seconds after `cut_at`): the events, the answers per `bucket` seconds,
    and what the head's GCS said of dead nodes."""
    with sk.db() as db:
        rows = db.execute("SELECT time, reason, message FROM events WHERE service = ? ORDER BY id", (NAME,))
        lines = [f"{t - cut_at:7.1f}s {reason}: {message[:2000]}" for t, reason, message in rows if t >= cut_at - 1]
    buckets: dict[int, dict[str, int]] = {}
    for when, label in result.timeline:
        if when >= cut_at:
            counts = buckets.setdefault(int((when - cut_at) // bucket) * bucket, {})
            kind = label if label.startswith(FAILURE_LABELS) else "ok"
            counts[kind] = counts.get(kind, 0) + 1
    lines += [f"{start:4d}-{start + bucket}s {counts}" for start, counts in sorted(buckets.items())]
    logs = Path(head_dir) / "session_latest" / "logs"
    if (logs / "gcs_server.out").exists():
        said = [
            line
            for line in (logs / "gcs_server.out").read_text(errors="replace").splitlines()
            if "dead" in line.lower()
        ]
        lines += said[:20]
    # What Serve's controller did with the proxies while it recovered (a drained proxy answers 503
    # to Envoy's health check) and how long its replicas took to recover.
    for log in sorted((logs / "serve").glob("controller_*.log")):
        lines += [line for line in log.read_text(errors="replace").splitlines() if SERVE_RECOVERY.search(line)][:40]
    return "\n".join(lines)
