"""A head killed under load on one machine: replaced (today's default), GCS fault tolerance
(RocksDB, the head started again in place), a warm standby, a hot standby; side by side,
alternating in one run.

One daemon. Each round applies a service in one mode (replace rounds use
serviceUnhealthySecondThreshold 5), waits until it is Ready (and its standby ready), measures the
memory of the standby's processes, puts `--clients` closed-loop clients (GETs and POSTs, no
resend) through the ingress, SIGKILLs every process of the active cluster, and measures until the
service is Ready again (on another cluster; with GCS FT on the same one, its head started again)
and `--settle` seconds more: requests failed by kind, the longest time without any answer, the
time until Ready again. Then the service is deleted.

    .venv/bin/python -m bench.standby_failover [--rounds 2] [--clients 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.loadgen import exit_cleanly_on_sigterm
from bench.zero_downtime import RESULTS
from servekeeper.providers.local_processes import session_members
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, kill_local_cluster, wait_until
from servekeeper.testing.load import Load

NAME = "failover"
MODES = ("replace", "gcs", "warm", "hot")


def spec(port: int, mode: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"rayClusterDeletionDelaySeconds": 5}
    if mode == "replace":
        extra["serviceUnhealthySecondThreshold"] = 5
    elif mode != "gcs":
        extra["standby"] = {"mode": mode}
    document = hello_spec(NAME, port, msg=mode, **extra)
    if mode == "gcs":
        document["spec"]["rayClusterConfig"]["gcsFaultTolerance"] = {"backend": "rocksdb"}
    return document


def cluster_rss_mb(head_pid: int) -> float:
    """Resident memory of every process of a local cluster (its head's session)."""
    total = 0
    for process in session_members((head_pid,)):
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return round(total / 2**20, 1)


def one_round(sk: Servekeeper, mode: str, clients: int, settle: float) -> dict[str, Any]:
    port = free_port()
    path = sk.workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec(port, mode)))
    sk.cli("apply", "-f", str(path))
    assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-2000:]
    standby_rss = 0.0
    if mode in ("warm", "hot"):
        wait_until(lambda: sk.api_get(NAME)["standby"] == "ready", 300, "the standby ready")
        time.sleep(3)  # its replicas (hot) or its controllers (warm) settled
        standby_rss = cluster_rss_mb(sk.api_get(NAME)["standbyCluster"]["headPid"])
    active = sk.api_get(NAME)["activeCluster"]
    active_rss = cluster_rss_mb(active["headPid"])
    restarts_before = sk.events(NAME).count("HeadRestarted")
    with Load(f"http://127.0.0.1:{port}/", clients=clients, timeout=10) as load:
        wait_until(lambda: load.result.ok > 100, 30, "load to start")
        killed_at = time.time()
        kill_local_cluster(active["headPid"])

        def recovered() -> bool:
            view = sk.api_get(NAME)
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in view["conditions"])
            now = view["activeCluster"] or {}
            if mode == "gcs":  # the same cluster, its head started again
                restarted = sk.events(NAME).count("HeadRestarted") > restarts_before
                return ready and restarted and now.get("headPid") not in (None, active["headPid"])
            return ready and now.get("name") not in (None, active["name"])

        wait_until(recovered, 300, "Ready again")
        ready_again_s = time.time() - killed_at
        same_cluster = sk.api_get(NAME)["activeCluster"]["name"] == active["name"]
        time.sleep(settle)
        result = load.stop()
        stopped_at = time.time()
    oks = [when for when, label in result.timeline if when >= killed_at and label in result.bodies]
    marks = [killed_at, *oks, stopped_at]
    gap = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
    return {
        "mode": mode,
        "requests": result.ok + result.failed,
        "failed": result.failed,
        "failures_by_kind": dict(result.failures),
        "by_method": dict(result.by_method),
        "longest_without_answer_s": round(gap, 2),
        "ready_again_s": round(ready_again_s, 1),
        "same_cluster": same_cluster,
        "active_rss_mb": active_rss,
        "standby_rss_mb": standby_rss,
    }


def alternate_on_one_daemon(
    rounds: int, modes: Sequence[str], one: Callable[[Servekeeper, str], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """`rounds` rounds of every mode in turn on one daemon, each printed as it ends; then the
    daemon is stopped: (the rounds, the processes it left behind)."""
    results: list[dict[str, Any]] = []
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), Path(tempfile.mkdtemp(prefix="skbench-")))
    sk.up()
    try:
        for _ in range(rounds):
            for mode in modes:
                results.append(one(sk, mode))
                print(json.dumps(results[-1]), flush=True)
    finally:
        leftovers = sk.down_and_check_nothing_left()
    return results, leftovers


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("failed", "longest_without_answer_s", "ready_again_s", "standby_rss_mb", "active_rss_mb")
    return {
        key: {"mean": round(statistics.mean(r[key] for r in rounds), 2), "all": [r[key] for r in rounds]}
        for key in keys
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="of each mode, alternating")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--settle", type=float, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds, leftovers = alternate_on_one_daemon(
        args.rounds, args.modes, lambda sk, mode: one_round(sk, mode, args.clients, args.settle)
    )
    report = {
        "benchmark": "standby_failover",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "summary": {mode: summary([r for r in rounds if r["mode"] == mode]) for mode in args.modes},
        "leftover_processes": leftovers,
        "rounds": rounds,
    }
    (args.out_dir / "standby_failover.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
