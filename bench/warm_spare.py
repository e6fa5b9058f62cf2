"""A Serve config rolled on a new cluster under load: without a standby (a cluster started for
the rollout) and with a warm standby (the rollout takes it: only the config PUT and the
replicas' start remain); side by side, alternating in one run (issue 20, item 3).

One daemon. Each round applies a fresh service in one mode (`serveConfigUpdate: NewCluster`;
the warm mode also waits for its standby), puts `--clients` closed-loop clients (GETs and POSTs,
no resend) through the ingress, applies a new Serve config, and measures the time from the
`apply` API call to every request routed to the new cluster, and the requests failed by kind.
Then the service is deleted.

    .venv/bin/python -m bench.warm_spare [--rounds 2] [--clients 16] [--ready-delay 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.loadgen import exit_cleanly_on_sigterm
from bench.standby_failover import alternate_on_one_daemon, cluster_rss_mb
from bench.zero_downtime import RESULTS
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until
from servekeeper.testing.load import Load

NAME = "spare"
MODES = ("cold", "warm")
POLL_S = 0.05


def spec(port: int, mode: str, msg: str, ready_delay: float) -> dict[str, Any]:
    extra: dict[str, Any] = {"serveConfigUpdate": "NewCluster", "rayClusterDeletionDelaySeconds": 5}
    if mode == "warm":
        extra["standby"] = {"mode": "warm"}
    return hello_spec(NAME, port, msg=msg, ready_delay_s=ready_delay, **extra)


def switched(sk: Servekeeper, name: str = NAME) -> bool:
    """Every request routed to a cluster of the service's newest generation."""
    view = sk.api_get(name)
    active = view["activeCluster"]
    return bool(active) and active["generation"] == view["generation"] and view["ingress"]["routedTo"] == active["name"]


def one_round(sk: Servekeeper, mode: str, clients: int, ready_delay: float) -> dict[str, Any]:
    port = free_port()
    sk.api_apply(spec(port, mode, "v1", ready_delay))
    assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-2000:]
    standby_rss = 0.0
    if mode == "warm":
        wait_until(lambda: sk.api_get(NAME)["standby"] == "ready", 300, "the warm standby ready")
        time.sleep(3)  # its controllers settled
        standby_rss = cluster_rss_mb(sk.api_get(NAME)["standbyCluster"]["headPid"])
    with Load(f"http://127.0.0.1:{port}/", clients=clients, timeout=30) as load:
        wait_until(lambda: load.result.ok > 100, 30, "load to start")
        started, started_wall = time.perf_counter(), time.time()
        sk.api_apply(spec(port, mode, "v2", ready_delay))  # straight to the API: not the CLI's start-up
        while not switched(sk):
            time.sleep(POLL_S)
        apply_to_switch = time.perf_counter() - started
        wait_until(lambda: load.result.timeline[-1][1] == "v2", 30, "the new version answers")
        time.sleep(2)
        result = load.stop()
    with sk.db() as db:  # this round's events only: a deleted service's events are kept a while
        query = "SELECT COUNT(*) FROM events WHERE service = ? AND reason = 'StandbyTaken' AND time >= ?"
        taken = db.execute(query, (NAME, started_wall)).fetchone()[0] > 0
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
    return {
        "mode": mode,
        "apply_to_switch_s": round(apply_to_switch, 2),
        "standby_taken": taken,
        "requests": result.ok + result.failed,
        "failed": result.failed,
        "failures_by_kind": dict(result.failures),
        "by_method": dict(result.by_method),
        "standby_rss_mb": standby_rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="of each mode, alternating")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--ready-delay", type=float, default=5.0, help="seconds each replica takes to be ready")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds, leftovers = alternate_on_one_daemon(
        args.rounds, MODES, lambda sk, mode: one_round(sk, mode, args.clients, args.ready_delay)
    )
    means = {
        mode: round(statistics.mean(r["apply_to_switch_s"] for r in rounds if r["mode"] == mode), 2) for mode in MODES
    }
    report = {
        "benchmark": "warm_spare",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "ready_delay_s": args.ready_delay,
        "mean_apply_to_switch_s": means,
        "warm_over_cold": round(means["warm"] / means["cold"], 3),
        "failed": {mode: [r["failed"] for r in rounds if r["mode"] == mode] for mode in MODES},
        "leftover_processes": leftovers,
        "rounds": rounds,
    }
    (args.out_dir / "warm_spare.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
