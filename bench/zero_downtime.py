"""Zero-downtime upgrades, measured the way the reference measured them.

One Serve app with one deployment of two replicas, each sleeping 15 s before it is healthy;
a Locust load of 100 users (spawn rate 50/s) opening a new connection for every request,
through the ingress; N cluster upgrades in a row. Gate modes (benchmark-only, never a spec
field): `ready` (the product), `healthy` (switch when the apps are healthy but not all RUNNING:
the reference before its fix), `none` (switch as soon as the pending head is up).

    .venv/bin/python -m bench.zero_downtime [--gate ready|healthy|none] [--upgrades 2] [--users 100]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.testing import Servekeeper, free_port, hello_spec, wait_until

RESULTS = Path(__file__).parent / "results"
LOCUSTFILE = Path(__file__).parent / "locustfile.py"


def spec(port: int, version: int, ready_delay: float, replicas: int) -> dict[str, Any]:
    # Alternate the head's CPUs so that every version is a cluster-shape change (a new cluster).
    document = hello_spec("zdt", port, msg=f"v{version}", head_cpus=1 + version % 2, ready_delay_s=ready_delay)
    document["spec"]["serveConfig"]["applications"][0]["args"]["replicas"] = replicas
    return document


def moments(sk: Servekeeper) -> list[tuple[float, str]]:
    with sk.db() as db:
        rows = db.execute(
            "SELECT time, reason FROM events WHERE service = 'zdt' AND reason IN "
            "('TrafficSwitched', 'ClusterDeleted') ORDER BY id"
        ).fetchall()
    return [(float(t), str(reason)) for t, reason in rows]


def deleted_count(sk: Servekeeper) -> int:
    return sum(1 for _, reason in moments(sk) if reason == "ClusterDeleted")


def read_history(prefix: Path) -> list[dict[str, str]]:
    with open(f"{prefix}_stats_history.csv") as handle:
        return [row for row in csv.DictReader(handle) if row["Name"] == "Aggregated"]


def read_final(path: Path) -> dict[str, Any]:
    """Locust's exact totals, written by the locustfile when Locust exits (its `_stats.csv` and
    `_failures.csv` are refreshed once a second while it runs, never at shutdown)."""
    try:
        final = json.loads(path.read_text())
    except FileNotFoundError:
        raise AssertionError(f"Locust wrote no final stats to {path} (did it exit cleanly?)") from None
    kinds: dict[str, int] = {}
    for error in final["failures_by_kind"]:
        kind = error["error"][:160]
        kinds[kind] = kinds.get(kind, 0) + int(error["occurrences"])
    return {
        "requests": int(final["requests"]),
        "failures": int(final["failures"]),
        "p50_ms": float(final["p50_ms"]),
        "p99_ms": float(final["p99_ms"]),
        "rps": float(final["rps"]),
        "by_method": final["by_method"],
        "failures_by_kind": kinds,
    }


def plot(history: list[dict[str, str]], marks: list[dict[str, Any]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = float(history[0]["Timestamp"])
    times = [float(row["Timestamp"]) - start for row in history]
    rps = [float(row["Requests/s"]) for row in history]
    fails = [float(row["Failures/s"]) for row in history]
    p99 = [float(row["99%"]) if row["99%"] not in ("N/A", "") else 0.0 for row in history]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    top.plot(times, rps, label="requests/s", color="tab:blue")
    top.plot(times, fails, label="failures/s", color="tab:red")
    top.set_ylabel("per second")
    top.legend(loc="upper left")
    bottom.plot(times, p99, label="p99 latency (ms, recent window)", color="tab:purple")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("seconds since the load started")
    bottom.legend(loc="upper left")
    colours = {"apply": "tab:gray", "switch": "tab:green", "old deleted": "tab:orange"}
    for mark in marks:
        for axis in (top, bottom):
            axis.axvline(mark["t"] - start, color=colours[mark["kind"]], linestyle="--", linewidth=1)
    handles = [plt.Line2D([], [], color=c, linestyle="--", label=k) for k, c in colours.items()]
    top.legend(handles=top.get_legend_handles_labels()[0] + handles, loc="upper left", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    port = free_port()
    csv_prefix = Path(tempfile.mkdtemp()) / "locust"
    final_stats = csv_prefix.with_name("final.json")
    marks: list[dict[str, Any]] = []
    locust = None
    try:
        sk.up(gate=args.gate)
        sk.apply(spec(port, 1, args.ready_delay, args.replicas))
        assert sk.wait("zdt", timeout=600) == 0, "the first rollout failed"
        locust = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(LOCUSTFILE),
                "--headless",
                "-u",
                str(args.users),
                "-r",
                str(args.spawn_rate),
                "--host",
                f"http://127.0.0.1:{port}",
                "--csv",
                str(csv_prefix),
                "--csv-full-history",
                "--only-summary",
                "--loglevel",
                "WARNING",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "SERVEKEEPER_LOCUST_FINAL": str(final_stats)},
        )
        time.sleep(args.settle)
        seen = len(moments(sk))
        for version in range(2, args.upgrades + 2):
            marks.append({"kind": "apply", "t": time.time(), "version": version})
            sk.apply(spec(port, version, args.ready_delay, args.replicas))
            rc = sk.wait("zdt", timeout=600)
            wait_until(lambda n=version - 1: deleted_count(sk) >= n, args.ready_delay + 120, "the old cluster to go")
            for t, reason in moments(sk)[seen:]:
                marks.append({"kind": "switch" if reason == "TrafficSwitched" else "old deleted", "t": t})
            seen = len(moments(sk))
            if rc != 0:
                raise AssertionError(f"upgrade to v{version} did not complete (wait exit {rc})")
        time.sleep(args.settle)
    finally:
        if locust is not None:
            locust.send_signal(signal.SIGTERM)
            try:
                locust.wait(60)
            except subprocess.TimeoutExpired:
                locust.kill()
        leftovers = sk.down_and_check_nothing_left()
    totals = read_final(final_stats)
    history = read_history(csv_prefix)
    name = f"zero_downtime-{args.gate}-{args.upgrades}x"
    if not args.no_plot:
        plot(
            history,
            marks,
            f"{args.users} users, new connection per request, {args.upgrades} upgrades, "
            f"gate={args.gate}: {totals['failures']} failed of {totals['requests']}",
            args.out_dir / f"{name}.png",
        )
    return {
        "benchmark": "zero_downtime",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gate": args.gate,
        "upgrades": args.upgrades,
        "users": args.users,
        "spawn_rate": args.spawn_rate,
        "replica_ready_delay_s": args.ready_delay,
        "replicas": args.replicas,
        **totals,
        "upgrade_moments": marks,
        "leftover_processes": leftovers,
        "plot": f"bench/results/{name}.png" if not args.no_plot else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gate", choices=["ready", "healthy", "none"], default="ready")
    parser.add_argument("--upgrades", type=int, default=2)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--spawn-rate", type=float, default=50)
    parser.add_argument("--ready-delay", type=float, default=15, help="seconds each replica sleeps before ready")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--settle", type=float, default=10, help="seconds of load before and after the upgrades")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args)
    out = args.out_dir / f"zero_downtime-{args.gate}-{args.upgrades}x.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "upgrade_moments"}, indent=2))


if __name__ == "__main__":
    main()
