"""A faulty release rolled out as a canary with analysis, against the same release with NewCluster.

Two services in one daemon, both v1 (healthy) first; then, one after the other, each under the
same Locust load (the honest client of bench/locustfile.py: no retries, GET and POST with an echo
check, exact totals by kind at exit) gets a v2 that answers 500 to a share of its requests:

- `canary`: `upgradeStrategy: Canary` with steps [setWeight w, pause p]... and analysis (success
  rate from Envoy's per-cluster counters); counted from the apply until `--window` seconds after
  the abort;
- `newcluster`: `type: NewCluster` (`serveConfigUpdate: NewCluster`, so v2 also gets a cluster of
  its own): counted over the same length of time from the apply; v2 takes all the traffic once
  ready and keeps failing.

The phases run one after the other, not side by side, so that each has the two cores to itself
and both see the same load; the other service's idle v1 cluster runs through both phases.
Locust's totals start when all its users run (`--reset-stats`); the apply follows within a couple
of seconds (`lead_s` in the results) while v1 alone serves, so that lead adds requests, not failures.

    .venv/bin/python -m bench.canary_faulty [--users 100] [--window 30] [--weights 10 50] [--pause 60] [--replicas 2]
"""

from __future__ import annotations

import argparse
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
from bench.zero_downtime import LOCUSTFILE, RESULTS, read_final, read_history
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until

CANARY, NEW_CLUSTER = "canary", "newcluster"


def spec(
    name: str, port: int, msg: str, strategy: dict[str, Any], replicas: int, error_rate: float = 0
) -> dict[str, Any]:
    document = hello_spec(
        name, port, msg=msg, upgradeStrategy=strategy, serveConfigUpdate="NewCluster", rayClusterDeletionDelaySeconds=30
    )
    document["spec"]["serveConfig"]["applications"][0]["args"].update(replicas=replicas, error_rate=error_rate)
    return document


def canary_strategy(args: argparse.Namespace) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    for weight in args.weights:
        steps += [{"setWeight": weight}, {"pause": {"duration": f"{args.pause:g}s"}}]
    analysis = {
        "interval": f"{args.interval:g}s",
        "minRequests": args.min_requests,
        "successRate": {"min": args.success_min},
        "failureLimit": args.failure_limit,
    }
    return {"type": "Canary", "canary": {"steps": steps, "analysis": analysis}}


def events(sk: Servekeeper, service: str, since: float) -> list[dict[str, Any]]:
    with sk.db() as db:
        rows = db.execute(
            "SELECT time, reason, message FROM events WHERE service = ? AND time >= ? ORDER BY id", (service, since)
        ).fetchall()
    return [{"t": float(t), "reason": str(reason), "message": str(message)} for t, reason, message in rows]


def first_event(sk: Servekeeper, service: str, since: float, reasons: set[str], timeout: float) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((e for e in events(sk, service, since) if e["reason"] in reasons), None)

    wait_until(found, timeout, f"{service}: one of {sorted(reasons)}")
    event = found()
    assert event is not None
    return event


class Locust:
    """One headless Locust process against one port; its totals count from when all users run."""

    def __init__(self, port: int, args: argparse.Namespace) -> None:
        self.users = args.users
        self.csv_prefix = Path(tempfile.mkdtemp()) / "locust"
        self.final_stats = self.csv_prefix.with_name("final.json")
        self.reset_at = 0.0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--reset-stats"]
            + ["-u", str(args.users), "-r", str(args.spawn_rate), "--host", f"http://127.0.0.1:{port}"]
            + ["--csv", str(self.csv_prefix), "--csv-full-history", "--only-summary", "--loglevel", "WARNING"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "SERVEKEEPER_LOCUST_FINAL": str(self.final_stats)},
        )

    def wait_all_users(self, timeout: float = 60) -> None:
        def running() -> bool:
            try:
                history = read_history(self.csv_prefix)
            except FileNotFoundError:
                return False
            return bool(history) and int(history[-1]["User Count"]) >= self.users

        wait_until(running, timeout, "every Locust user to run")
        self.reset_at = float(read_history(self.csv_prefix)[-1]["Timestamp"])
        time.sleep(1.0)  # the stats are reset when spawning completes, at most a history row ago

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def result(self) -> dict[str, Any]:
        return {**read_final(self.final_stats), "history": read_history(self.csv_prefix)}


def failed_by_period(history: list[dict[str, str]], moments: list[tuple[str, float]]) -> dict[str, int]:
    """Failures Locust counted between consecutive moments, from its once-a-second cumulative
    history (so to the second; the exact totals are the final ones). The first moment is the
    stats reset, where the count is 0."""

    def cumulative(moment: float) -> int:
        rows = [row for row in history if float(row["Timestamp"]) <= moment]
        return int(rows[-1]["Total Failure Count"]) if rows else 0

    counts = [0] + [cumulative(moment) for _, moment in moments[1:]]
    return {
        f"{start} to {end}": counts[index + 1] - counts[index]
        for index, ((start, _), (end, _)) in enumerate(zip(moments, moments[1:], strict=False))
    }


def summarise(locust: Locust, applied: float, ended: float, marks: dict[str, float]) -> dict[str, Any]:
    totals = locust.result()
    history = totals.pop("history")
    moments = [("stats reset", locust.reset_at), ("apply", applied), *marks.items(), ("end", ended + 1.0)]
    kinds: dict[str, int] = {}
    for kind, count in totals["failures_by_kind"].items():
        # "CatchResponseError('HTTP 500')" -> "HTTP 500": the locustfile's own words.
        label = kind.removeprefix("CatchResponseError(").removesuffix(")").strip("'\"")
        kinds[label] = kinds.get(label, 0) + count
    return {
        **totals,
        "failures_by_kind": kinds,
        "share_failed": totals["failures"] / totals["requests"] if totals["requests"] else None,
        "lead_s": round(applied - locust.reset_at),
        "window_s": round(ended - applied, 1),
        "failed_by_period_to_the_second": failed_by_period(history, sorted(moments, key=lambda item: item[1])),
    }


def canary_phase(sk: Servekeeper, port: int, args: argparse.Namespace) -> dict[str, Any]:
    locust = Locust(port, args)
    try:
        locust.wait_all_users()
        applied = time.time()
        sk.apply(spec(CANARY, port, "v2", canary_strategy(args), args.replicas, error_rate=args.error_rate))
        traffic = first_event(sk, CANARY, applied, {"CanaryWeight"}, timeout=300)
        steps_s = len(args.weights) * (args.pause + 30) + 60
        ended_by = first_event(sk, CANARY, applied, {"RolloutAborted", "TrafficSwitched"}, timeout=steps_s)
        if ended_by["reason"] != "RolloutAborted":
            raise AssertionError(f"the faulty canary was promoted: {ended_by}")
        ended = ended_by["t"] + args.window
        time.sleep(max(0.0, ended - time.time()))
    finally:
        locust.stop()
    seen = events(sk, CANARY, applied)
    return {
        **summarise(locust, applied, ended, {"canary traffic": traffic["t"], "abort": ended_by["t"]}),
        "apply_to_canary_traffic_s": round(traffic["t"] - applied, 1),
        "canary_traffic_to_abort_s": round(ended_by["t"] - traffic["t"], 1),
        "abort_message": ended_by["message"],
        "events": [{**e, "t": round(e["t"] - applied, 2)} for e in seen],
    }


def new_cluster_phase(sk: Servekeeper, port: int, args: argparse.Namespace, window_s: float) -> dict[str, Any]:
    locust = Locust(port, args)
    try:
        locust.wait_all_users()
        applied = time.time()
        sk.apply(spec(NEW_CLUSTER, port, "v2", {"type": "NewCluster"}, args.replicas, error_rate=args.error_rate))
        ended = applied + window_s
        time.sleep(max(0.0, ended - time.time()))
    finally:
        locust.stop()
    seen = events(sk, NEW_CLUSTER, applied)
    switched = next((e["t"] for e in seen if e["reason"] == "TrafficSwitched"), None)
    if switched is None:
        raise AssertionError(f"v2 never took the traffic within {window_s:.0f}s: {seen}")
    return {
        **summarise(locust, applied, ended, {"switch": switched}),
        "apply_to_switch_s": round(switched - applied, 1),
        "events": [{**e, "t": round(e["t"] - applied, 2)} for e in seen],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    ports = {CANARY: free_port(), NEW_CLUSTER: free_port()}
    try:
        sk.up()
        sk.apply(spec(CANARY, ports[CANARY], "v1", canary_strategy(args), args.replicas))
        sk.apply(spec(NEW_CLUSTER, ports[NEW_CLUSTER], "v1", {"type": "NewCluster"}, args.replicas))
        for name in ports:
            assert sk.wait(name, timeout=600) == 0, f"{name}: v1 did not roll out"
        canary = canary_phase(sk, ports[CANARY], args)
        new_cluster = new_cluster_phase(sk, ports[NEW_CLUSTER], args, canary["window_s"])
    finally:
        leftovers = sk.down_and_check_nothing_left()
    return {
        "benchmark": "canary_faulty",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "users": args.users,
        "spawn_rate": args.spawn_rate,
        "replicas": args.replicas,
        "error_rate": args.error_rate,
        "window_after_abort_s": args.window,
        "canary_strategy": canary_strategy(args),
        "canary": canary,
        "newcluster": new_cluster,
        "leftover_processes": leftovers,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        "| strategy | window | requests | failed | failed by kind | share failed | time to abort |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in ((CANARY, "Canary + analysis"), (NEW_CLUSTER, "NewCluster")):
        phase = report[name]
        kinds = ", ".join(f"{kind} {count}" for kind, count in phase["failures_by_kind"].items()) or "-"
        by_method = ", ".join(f"{count['requests']:,} {method}" for method, count in phase["by_method"].items())
        abort = f"{phase['canary_traffic_to_abort_s']} s" if name == CANARY else "never"
        lines.append(
            f"| {label} | {phase['window_s']} s | {phase['requests']:,} ({by_method}) | {phase['failures']:,} | "
            f"{kinds} | {phase['share_failed'] * 100:.2f}% | {abort} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--spawn-rate", type=float, default=50)
    parser.add_argument("--window", type=float, default=30, help="seconds counted after the abort")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of each version (section 1 has 2)")
    parser.add_argument("--error-rate", type=float, default=0.2, help="share of v2's answers that are 500")
    parser.add_argument("--weights", type=int, nargs="+", default=[10, 50], help="the canary's setWeight steps")
    parser.add_argument("--pause", type=float, default=60, help="seconds of pause after each setWeight")
    parser.add_argument("--interval", type=float, default=5, help="analysis interval, seconds")
    parser.add_argument("--min-requests", type=int, default=50)
    parser.add_argument("--success-min", type=float, default=0.95)
    parser.add_argument("--failure-limit", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args)
    out = args.out_dir / f"canary_faulty-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"abort: {report['canary']['abort_message']}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
