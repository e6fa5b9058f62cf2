"""A head killed under load on the fleet: replaced (today's default) next to started again in
place with GCS fault tolerance (RocksDB), alternating in one run.

Builds the test fleet (tests.fleet: three network namespaces with sshd on a bridge; needs root,
torn down on exit) and one daemon. Each round applies a service (head pinned on host 1 with no
CPU, two 1-CPU workers, one replica on each), puts `--clients` closed-loop clients (GETs and
POSTs, no resend) through the ingress, SIGKILLs every process of the head, and measures until
the service is Ready again and `--settle` seconds more: requests failed by kind, the longest
time without any answer, and the time until the head (or a replacement) serves again. Then the
service is deleted. `replace` rounds use serviceUnhealthySecondThreshold 5.

    .venv/bin/python -m bench.head_kill [--rounds 2] [--clients 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from tests.fleet import Fleet, fleet_of, fleet_unavailable_reason

from bench.loadgen import exit_cleanly_on_sigterm
from bench.zero_downtime import RESULTS
from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from servekeeper.testing.load import Load

NAME = "headkill"
POOL = "bench"
MODES = ("replace", "gcs")


def spec(fleet: Fleet, port: int, mode: str) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "hostPool": POOL,
        "workingDir": str(HELLO_APP),
        "head": {"numCpus": 0, "host": fleet.hosts[0].name},
        "workerGroups": [{"name": "cpu", "replicas": 2, "numCpus": 1}],
    }
    if mode == "gcs":
        cluster["gcsFaultTolerance"] = {"backend": "rocksdb"}
    app = {
        "name": "hello",
        "route_prefix": "/",
        "import_path": "hello:app",
        "args": {"msg": mode, "replicas": 2},
        "deployments": [{"name": "Hello", "ray_actor_options": {"num_cpus": 1}}],
    }
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": NAME},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": cluster,
            "serveConfig": {"applications": [app]},
            "rayClusterDeletionDelaySeconds": 5,
            "serviceUnhealthySecondThreshold": 5 if mode == "replace" else 300,
        },
    }


def tagged_pids(temp_dir: str) -> list[int]:
    """Every process started for the node (one pid namespace for every fleet host)."""
    tag = f"SERVEKEEPER_NODE={temp_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if tag in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def one_round(sk: Servekeeper, fleet: Fleet, mode: str, clients: int, settle: float) -> dict[str, Any]:
    port = free_port()
    path = sk.workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec(fleet, port, mode)))
    sk.cli("apply", "-f", str(path))
    assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-2000:]
    cluster = sk.api_get(NAME)["activeCluster"]["name"]
    row = next(c for c in sk.clusters() if c["name"] == cluster)
    head_dir = json.loads(row["nodes_json"])[0]["temp_dir"]
    with Load(f"http://127.0.0.1:{port}/", clients=clients, timeout=10) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        pids = tagged_pids(head_dir)
        restarts_before = restarts(sk)
        killed_at = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

        def recovered() -> bool:
            return sk.api_get(NAME)["activeCluster"]["name"] != cluster or restarts(sk) > restarts_before

        wait_until(recovered, 300, "the head started again, or a replacement")
        serving_again_s = time.time() - killed_at
        wait_until(lambda: sk.condition(NAME, "Ready")["status"] == "True", 300, "Ready again")
        ready_again_s = time.time() - killed_at
        time.sleep(settle)
        result = load.stop()
        stopped_at = time.time()
    oks = [when for when, label in result.timeline if when >= killed_at and label in result.bodies]
    marks = [killed_at, *oks, stopped_at]
    gap = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    replaced = sk.api_get(NAME)["activeCluster"]["name"] != cluster
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
    return {
        "mode": mode,
        "replaced": replaced,
        "requests": result.ok + result.failed,
        "failed": result.failed,
        "failures_by_kind": dict(result.failures),
        "by_method": dict(result.by_method),
        "longest_without_answer_s": round(gap, 2),
        "head_or_replacement_serving_s": round(serving_again_s, 1),
        "ready_again_s": round(ready_again_s, 1),
    }


def restarts(sk: Servekeeper) -> int:
    """HeadRestarted events of the service so far (its events outlive a delete: count, compare)."""
    return sk.events(NAME).count("HeadRestarted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="of each mode, alternating")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--settle", type=float, default=3)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    reason = fleet_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"no fleet here: {reason}")
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds: list[dict[str, Any]] = []
    with fleet_of(Path(tempfile.mkdtemp(prefix="skfleet-"))) as fleet:
        sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), Path(tempfile.mkdtemp(prefix="skbench-")))
        sk.up()
        try:
            pool = sk.workdir / "pool.yaml"
            pool.write_text(yaml.safe_dump(fleet.host_pool_document(POOL, cpus=2)))
            sk.cli("apply", "-f", str(pool))
            for _ in range(args.rounds):
                for mode in MODES:
                    rounds.append(one_round(sk, fleet, mode, args.clients, args.settle))
                    print(json.dumps(rounds[-1]), flush=True)
        finally:
            leftovers = sk.down_and_check_nothing_left()
        left_on_hosts = fleet.leftover_processes()
    report = {
        "benchmark": "head_kill",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "summary": {mode: summary([r for r in rounds if r["mode"] == mode]) for mode in MODES},
        "leftover_processes": leftovers,
        "left_on_fleet_hosts": left_on_hosts,
        "rounds": rounds,
    }
    (args.out_dir / "head_kill.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("failed", "longest_without_answer_s", "head_or_replacement_serving_s", "ready_again_s")
    return {
        key: {"mean": round(statistics.mean(r[key] for r in rounds), 2), "all": [r[key] for r in rounds]}
        for key in keys
    }


if __name__ == "__main__":
    main()
