"""The zero-downtime experiment on one host and on a fleet of three, one after the other in one run.

Builds the test fleet (tests.fleet: three network namespaces with sshd on a bridge; needs root,
torn down on exit), then runs bench.zero_downtime twice with the same load, replicas and upgrades:
first on this machine alone (the head only), then on the fleet (a head and two workers, a node
per host, at most one replica per node). Reports both, and fleet/one-host ratios.

The fleet's hosts share this machine's cores, memory and filesystem; only the network stack
(addresses, routes, sshd) is each host's own. The ratios show what the pool path costs (SSH
starts, three Ray nodes instead of one, traffic across the bridge), not what more machines buy.

    .venv/bin/python -m bench.fleet_zero_downtime [--upgrades 3] [--users 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from tests.fleet import fleet_of, fleet_unavailable_reason

from bench.loadgen import exit_cleanly_on_sigterm
from bench.zero_downtime import add_experiment_arguments, run

POOL = "fleet"


def mean_of(report: dict[str, Any], key: str) -> float:
    return statistics.fmean(upgrade[key] for upgrade in report["upgrades_timed"])


def summary(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": report["requests"],
        "by_method": report["by_method"],
        "failures": report["failures"],
        "failures_by_kind": report["failures_by_kind"],
        "rps": report["rps"],
        "p50_ms": report["p50_ms"],
        "p99_ms": report["p99_ms"],
        "upgrades": [
            {key: upgrade[key] for key in ("version", "apply_to_switch_s", "apply_to_old_deleted_s")}
            for upgrade in report["upgrades_timed"]
        ],
        "mean_apply_to_switch_s": round(mean_of(report, "apply_to_switch_s"), 2),
        "mean_apply_to_old_deleted_s": round(mean_of(report, "apply_to_old_deleted_s"), 2),
    }


def ratios(one_host: dict[str, Any], fleet: dict[str, Any]) -> dict[str, float | None]:
    keys = ("requests", "rps", "p50_ms", "p99_ms", "mean_apply_to_switch_s", "mean_apply_to_old_deleted_s")
    return {key: round(fleet[key] / one_host[key], 2) if one_host[key] else None for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_experiment_arguments(parser, replicas=3)
    parser.add_argument("--host-cpus", type=float, default=4, help="each fleet host's CPUs in the HostPool")
    args = parser.parse_args()
    if args.upgrades < 1:
        parser.error("--upgrades: at least 1 (the comparison is of upgrade times)")
    reason = fleet_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"no fleet here: {reason}")
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with fleet_of(Path(tempfile.mkdtemp(prefix="skfleet-"))) as fleet:
        pool_file = fleet.directory / "pool.yaml"
        pool_file.write_text(yaml.safe_dump(fleet.host_pool_document(POOL, cpus=args.host_cpus)))
        common = {**vars(args), "gate": "ready"}
        one_host = run(
            argparse.Namespace(**common, host_pool=None, name=f"fleet_zero_downtime-one-host-{args.upgrades}x")
        )
        on_fleet = run(
            argparse.Namespace(**common, host_pool=pool_file, name=f"fleet_zero_downtime-fleet-{args.upgrades}x")
        )
        left_on_hosts = fleet.leftover_processes()
    variants = {"one_host": summary(one_host), "fleet": summary(on_fleet)}
    report = {
        "benchmark": "fleet_zero_downtime",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "users": args.users,
        "spawn_rate": args.spawn_rate,
        "upgrades": args.upgrades,
        "replicas": args.replicas,
        "replica_ready_delay_s": args.ready_delay,
        "deletion_delay_s": args.deletion_delay,
        "fleet_host_cpus": args.host_cpus,
        **variants,
        "ratio_fleet_to_one_host": ratios(variants["one_host"], variants["fleet"]),
        "leftover_processes": {"one_host": one_host["leftover_processes"], "fleet": on_fleet["leftover_processes"]},
        "left_on_fleet_hosts": left_on_hosts,
        "runs": {"one_host": one_host, "fleet": on_fleet},
    }
    out = args.out_dir / f"fleet_zero_downtime-{args.upgrades}x.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
