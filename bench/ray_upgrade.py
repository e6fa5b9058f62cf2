"""A Ray-version upgrade under load next to an ordinary upgrade (issue 21), alternating on one
daemon. Each round applies a fresh service on Ray `--from` (its own environment: built in the
first round, found after), puts `--clients` closed-loop clients (GETs and POSTs, no resend)
through the ingress, and rolls a new cluster:

- ordinary: the same Ray, a changed head `env` (a cluster-shape change like any other);
- ray: `rayVersion` dropped, so the new cluster runs the controller's own Ray.

It measures the time from the `apply` API call to every request routed to the new cluster, the
requests failed by kind, and the Ray release each cluster's raylet runs (read from the process).

    .venv/bin/python -m bench.ray_upgrade [--rounds 2] [--clients 32] [--from 2.59.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil

from bench.loadgen import exit_cleanly_on_sigterm
from bench.standby_failover import alternate_on_one_daemon
from bench.warm_spare import switched
from bench.zero_downtime import RESULTS
from servekeeper.providers.local_processes import session_members
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until
from servekeeper.testing.load import Load

NAME = "rayup"
MODES = ("ordinary", "ray")
POLL_S = 0.05


def spec(port: int, msg: str, ray_version: str | None, marker: str) -> dict[str, Any]:
    document = hello_spec(NAME, port, msg=msg, rayClusterDeletionDelaySeconds=5)
    config = document["spec"]["rayClusterConfig"]
    config["head"]["env"] = {"BENCH_MARK": marker}
    if ray_version is not None:
        config["rayVersion"] = ray_version
    return document


def raylet_release(head_pid: int) -> str:
    """The Ray release of the cluster's raylet: the dist-info beside the package its binary is in."""
    for process in session_members((head_pid,)):
        try:
            if process.name() == "raylet":
                site_packages = Path(process.exe()).parents[5]  # <site>/ray/core/src/ray/raylet/raylet
                (found,) = site_packages.glob("ray-*.dist-info")
                return found.name.removeprefix("ray-").removesuffix(".dist-info")
        except (psutil.Error, ValueError):
            continue
    return "unknown"


def one_round(sk: Servekeeper, mode: str, clients: int, old_ray: str) -> dict[str, Any]:
    port = free_port()
    sk.api_apply(spec(port, "v1", old_ray, "one"))
    assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-2000:]
    before = raylet_release(sk.api_get(NAME)["activeCluster"]["headPid"])
    changed = spec(port, "v2", old_ray, "two") if mode == "ordinary" else spec(port, "v2", None, "one")
    with Load(f"http://127.0.0.1:{port}/", clients=clients, timeout=30) as load:
        wait_until(lambda: load.result.ok > 100, 30, "load to start")
        started = time.perf_counter()
        sk.api_apply(changed)  # straight to the API: not the CLI's start-up
        while not switched(sk, NAME):
            time.sleep(POLL_S)
        apply_to_switch = time.perf_counter() - started
        wait_until(lambda: load.result.timeline[-1][1] == "v2", 30, "the new version answers")
        time.sleep(2)
        result = load.stop()
    after = raylet_release(sk.api_get(NAME)["activeCluster"]["headPid"])
    sk.cli("delete", NAME)
    wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
    return {
        "mode": mode,
        "ray": f"{before} -> {after}",
        "apply_to_switch_s": round(apply_to_switch, 2),
        "requests": result.ok + result.failed,
        "failed": result.failed,
        "failures_by_kind": dict(result.failures),
        "by_method": dict(result.by_method),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="of each mode, alternating")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--from", dest="old_ray", default="2.59.0", help="the Ray the service starts on")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds, leftovers = alternate_on_one_daemon(
        args.rounds, MODES, lambda sk, mode: one_round(sk, mode, args.clients, args.old_ray)
    )
    means = {
        mode: round(statistics.mean(r["apply_to_switch_s"] for r in rounds if r["mode"] == mode), 2) for mode in MODES
    }
    report = {
        "benchmark": "ray_upgrade",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "controller_ray": version("ray"),
        "mean_apply_to_switch_s": means,
        "ray_over_ordinary": round(means["ray"] / means["ordinary"], 3),
        "failed": {mode: [r["failed"] for r in rounds if r["mode"] == mode] for mode in MODES},
        "leftover_processes": leftovers,
        "rounds": rounds,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "ray_upgrade.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
