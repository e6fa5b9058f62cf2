"""Zero-downtime upgrades, measured the way the reference measured them.

One Serve app with one deployment of two replicas, each sleeping 15 s before it is healthy;
a Locust load of 100 users (spawn rate 50/s) opening a new connection for every request,
through the ingress; N cluster upgrades in a row. Gate modes (benchmark-only, never a spec
field): `ready` (the product), `healthy` (switch when the apps are healthy but not all RUNNING:
the reference before its fix), `none` (switch as soon as the pending head is up).

With `--host-pool FILE` the HostPool document in FILE is applied first and every cluster goes on
that pool: a head and a worker group of two, so that spread placement gives a pool of three hosts
a node on each, and at most one app replica per node. Each host needs room for two clusters at
once with a head of 2 CPUs (3 CPUs a host). `bench.fleet_zero_downtime` runs this on a fleet of
its own, next to the same on one host.

For each upgrade the report has the time from the apply to TrafficSwitched and to the old
cluster's ClusterDeleted (which includes `--deletion-delay`), from the daemon's events.

    .venv/bin/python -m bench.zero_downtime [--gate ready|healthy|none] [--upgrades 2] [--users 100]
        [--host-pool pool.yaml]
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until

RESULTS = Path(__file__).parent / "results"
LOCUSTFILE = Path(__file__).parent / "locustfile.py"


def spec(
    port: int, version: int, ready_delay: float, replicas: int, pool: str | None = None, deletion_delay: float = 60
) -> dict[str, Any]:
    # Alternate the head's CPUs so that every version is a cluster-shape change (a new cluster).
    document = hello_spec(
        "zdt",
        port,
        msg=f"v{version}",
        head_cpus=1 + version % 2,
        ready_delay_s=ready_delay,
        rayClusterDeletionDelaySeconds=deletion_delay,
    )
    args = document["spec"]["serveConfig"]["applications"][0]["args"]
    args["replicas"] = replicas
    if pool is not None:
        cluster = document["spec"]["rayClusterConfig"]
        cluster["hostPool"] = pool
        cluster["workerGroups"] = [{"name": "cpu", "replicas": 2, "numCpus": 1}]
        args["max_replicas_per_node"] = 1  # the replicas spread over the nodes, so over the hosts
    return document


def moments(sk: Servekeeper) -> list[tuple[float, str, str]]:
    """(time, reason, message) of the service's switches and cluster deletions, oldest first."""
    with sk.db() as db:
        rows = db.execute(
            "SELECT time, reason, message FROM events WHERE service = 'zdt' AND reason IN "
            "('TrafficSwitched', 'ClusterDeleted') ORDER BY id"
        ).fetchall()
    return [(float(t), str(reason), str(message)) for t, reason, message in rows]


def is_deletion_of(cluster: str, reason: str, message: str) -> bool:
    return reason == "ClusterDeleted" and message.split(" ", 1)[0] == cluster  # "<name> stopped and removed"


def cluster_deleted(sk: Servekeeper, cluster: str) -> bool:
    return any(is_deletion_of(cluster, reason, message) for _, reason, message in moments(sk))


def upgrade_times(
    version: int, applied: float, old_cluster: str, since: list[tuple[float, str, str]]
) -> dict[str, Any]:
    """One upgrade's moments, in seconds from its apply: the first switch after it, and the
    deletion of the cluster that was active at the apply."""
    switched = next(t for t, reason, _ in since if reason == "TrafficSwitched")
    deleted = next(t for t, reason, message in since if is_deletion_of(old_cluster, reason, message))
    return {
        "version": version,
        "old_cluster": old_cluster,
        "apply_to_switch_s": round(switched - applied, 2),
        "apply_to_old_deleted_s": round(deleted - applied, 2),
        "switch_to_old_deleted_s": round(deleted - switched, 2),
    }


def pool_name(path: Path) -> str:
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, dict) or document.get("kind") != "HostPool":
        raise SystemExit(f"{path}: not a HostPool document")
    return str(document["metadata"]["name"])


def result_name(args: argparse.Namespace) -> str:
    """The results' file name without extension."""
    if args.name:
        return str(args.name)
    return f"zero_downtime-{args.gate}-{args.upgrades}x" + ("-pool" if args.host_pool else "")


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
    from matplotlib.lines import Line2D

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
    handles = [Line2D([], [], color=c, linestyle="--", label=k) for k, c in colours.items()]
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
    upgrades: list[dict[str, Any]] = []
    pool = pool_name(args.host_pool) if args.host_pool else None
    locust = None

    def version_spec(version: int) -> dict[str, Any]:
        return spec(port, version, args.ready_delay, args.replicas, pool, args.deletion_delay)

    try:
        sk.up(gate=args.gate)
        if args.host_pool:
            sk.cli("apply", "-f", str(args.host_pool))
        sk.apply(version_spec(1))
        assert sk.wait("zdt", timeout=600) == 0, ("the first rollout failed", sk.api_get("zdt").get("failureReason"))
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
            old_cluster = sk.api_get("zdt")["activeCluster"]["name"]
            applied = time.time()
            marks.append({"kind": "apply", "t": applied, "version": version})
            sk.apply(version_spec(version))
            rc = sk.wait("zdt", timeout=600)
            if rc != 0:
                failure = sk.api_get("zdt").get("failureReason")
                raise AssertionError(f"upgrade to v{version} did not complete (wait exit {rc}): {failure}")
            wait_until(
                functools.partial(cluster_deleted, sk, old_cluster),
                args.ready_delay + args.deletion_delay + 120,
                f"the old cluster {old_cluster} to go",
            )
            since = moments(sk)[seen:]
            for t, reason, _ in since:
                marks.append({"kind": "switch" if reason == "TrafficSwitched" else "old deleted", "t": t})
            seen += len(since)
            upgrades.append(upgrade_times(version, applied, old_cluster, since))
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
    name = result_name(args)
    if not args.no_plot:
        plot(
            history,
            marks,
            f"{args.users} users, new connection per request, {args.upgrades} upgrades, "
            f"gate={args.gate}{f', pool {pool}' if pool else ''}: {totals['failures']} failed of {totals['requests']}",
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
        "host_pool": pool,
        "deletion_delay_s": args.deletion_delay,
        **totals,
        "upgrades_timed": upgrades,
        "upgrade_moments": marks,
        "leftover_processes": leftovers,
        "plot": f"bench/results/{name}.png" if not args.no_plot else None,
    }


def add_experiment_arguments(parser: argparse.ArgumentParser, replicas: int = 2) -> None:
    """The experiment's knobs (shared with bench.fleet_zero_downtime)."""
    parser.add_argument("--upgrades", type=int, default=2)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--spawn-rate", type=float, default=50)
    parser.add_argument("--ready-delay", type=float, default=15, help="seconds each replica sleeps before ready")
    parser.add_argument("--replicas", type=int, default=replicas, help="on a pool: at most one per node")
    parser.add_argument("--deletion-delay", type=float, default=60, help="rayClusterDeletionDelaySeconds")
    parser.add_argument("--settle", type=float, default=10, help="seconds of load before and after the upgrades")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gate", choices=["ready", "healthy", "none"], default="ready")
    add_experiment_arguments(parser)
    parser.add_argument("--host-pool", type=Path, help="a HostPool document: applied first, the service goes on it")
    parser.add_argument("--name", help="the results' file name without extension (default from gate, upgrades, pool)")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args)
    write_report(report, args.out_dir / f"{result_name(args)}.json")


def write_report(report: dict[str, Any], out: Path) -> None:
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "upgrade_moments"}, indent=2))


if __name__ == "__main__":
    main()
