"""Soak: many upgrades in a row under load. Zero failed requests, controller memory and file
descriptors flat, nothing left behind (process, port, temp dir).

    .venv/bin/python -m bench.soak [--upgrades 20] [--clients 16]

A CI-sized variant (2 upgrades, 32 clients, replicas 8 s from ready) runs in
tests/integration/test_soak.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.providers.ports import port_is_free
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until
from servekeeper.testing.load import Load

RESULTS = Path(__file__).parent / "results"


def run_soak(upgrades: int, clients: int, ready_delay: float = 2.0) -> dict[str, Any]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="sksoak-")), Path(tempfile.mkdtemp()))
    port = free_port()
    samples: list[dict[str, float]] = []
    every_cluster: dict[str, dict[str, Any]] = {}
    leftovers: list[str] = []
    try:
        sk.up()
        sk.apply(hello_spec("soak", port, msg="v1", ready_delay_s=ready_delay))
        assert sk.wait("soak") == 0
        controller = psutil.Process(sk.controller_pid())

        def snapshot() -> int:
            """Remember every cluster ever seen (for the leak checks); return how many exist now."""
            clusters = sk.clusters()
            for cluster in clusters:
                every_cluster[cluster["name"]] = cluster
            return len(clusters)

        started = time.monotonic()
        with Load(f"http://127.0.0.1:{port}/", clients=clients) as load:
            wait_until(lambda: load.result.ok > 20, 30, "load to start")
            for version in range(2, upgrades + 2):
                sk.apply(
                    hello_spec(
                        "soak", port, msg=f"v{version}", head_cpus=1 + (version + 1) % 2, ready_delay_s=ready_delay
                    )
                )
                wait_until(lambda: snapshot() == 2, 60, "the pending cluster to appear")
                assert sk.wait("soak", timeout=300) == 0, f"upgrade to v{version} failed"
                wait_until(lambda: snapshot() == 1, 120, "the old cluster to go")
                samples.append(
                    {
                        "upgrade": version - 1,
                        "seconds": round(time.monotonic() - started, 1),
                        "controller_rss_mb": round(controller.memory_info().rss / 1e6, 1),
                        "controller_fds": controller.num_fds(),
                    }
                )
            snapshot()
        result = load.result
        drained = sk.events("soak").count("ClusterDrained")
    finally:
        leftovers = sk.down_and_check_nothing_left()
    left_temp_dirs = [c["temp_dir"] for c in every_cluster.values() if Path(c["temp_dir"]).exists()]
    busy_ports = [p for c in every_cluster.values() for p in _ports(c) if not port_is_free(p)]
    return {
        "upgrades": upgrades,
        "clients": clients,
        "requests_ok": result.ok,
        "failed": result.failed,
        "failures_by_kind": dict(result.failures),
        "old_answers_after_switch": _old_answers_after_switch(result.timeline, upgrades),
        "clusters_drained": drained,
        "samples": samples,
        "rss_growth_mb": round(samples[-1]["controller_rss_mb"] - samples[0]["controller_rss_mb"], 1),
        "fd_growth": samples[-1]["controller_fds"] - samples[0]["controller_fds"],
        "clusters_created": len(every_cluster),
        "leftover_processes": leftovers,
        "leftover_temp_dirs": left_temp_dirs,
        "ports_still_bound": busy_ports,
    }


def _old_answers_after_switch(timeline: list[tuple[float, str]], upgrades: int) -> list[int]:
    """Per upgrade, how many answers of the old version came after the first of the new one: the
    switch is atomic, so only requests already in flight (at most one per client) can."""
    counts = []
    for version in range(2, upgrades + 2):
        first_new = min(t for t, body in timeline if body == f"v{version}")
        counts.append(sum(1 for t, body in timeline if body == f"v{version - 1}" and t > first_new))
    return counts


def _ports(cluster: dict[str, Any]) -> list[int]:
    ports = json.loads(cluster["ports_json"])
    return [ports["gcs"], ports["dashboard"], ports["serve_http"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upgrades", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    report = {"benchmark": "soak", "date": time.strftime("%Y-%m-%d %H:%M:%S"), **run_soak(args.upgrades, args.clients)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
