"""Upgrade latency against its lower bound, measured side by side in one run.

lower bound: a bare `ray start --head` + Serve config PUT + every app RUNNING and routed,
             with no servekeeper (what any upgrade must at least wait for);
upgrade:     `servekeeper apply` of a new cluster shape -> 100% of traffic on the new cluster.

  .venv/bin/python -m bench.upgrade_latency [--rounds 2] [--ready-delay 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.core.serve_config import build_serve_config
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord
from servekeeper.model.spec import parse_spec
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.ports import PortAllocator
from servekeeper.rayapi.serve_api import RetryableServeError, ServeClient
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec

RESULTS = Path(__file__).parent / "results"
POLL_S = 0.05


async def bare_head_and_deploy(ready_delay: float) -> dict[str, float]:
    """Start a head, PUT the config, wait until the app is RUNNING and routed. No servekeeper."""
    spec = parse_spec(hello_spec("bare", 8000, msg="v2", head_cpus=2, ready_delay_s=ready_delay))
    suffix = secrets.token_hex(4)
    state = Path(tempfile.mkdtemp(prefix="skbare-"))
    cluster = ClusterRecord(
        name=f"bare-{suffix}",
        service="bare",
        generation=1,
        cluster_spec_hash="",
        role=ClusterRole.PENDING,
        cluster_spec_json=spec.spec.rayClusterConfig.model_dump_json(),
        ports=PortAllocator().cluster(0),
        temp_dir=f"/tmp/sk-b{suffix}",
        log_dir=str(state / "logs"),
        created_at=time.time(),
    )
    provider = LocalProvider()
    async with aiohttp.ClientSession() as session:
        serve = ServeClient(session)
        started = time.perf_counter()
        cluster = provider.start_head(cluster, spec.spec.rayClusterConfig)
        try:
            while True:
                try:
                    await serve.applications(cluster.dashboard_url)
                    break
                except RetryableServeError:
                    await asyncio.sleep(POLL_S)
            dashboard_up = time.perf_counter()
            await serve.put_config(cluster.dashboard_url, build_serve_config(spec, cluster))
            put_done = time.perf_counter()
            while True:
                apps = await serve.applications(cluster.dashboard_url)
                routes = await serve.proxy_routes(cluster.serve_url)
                if apps.get("hello") and apps["hello"].status.value == "RUNNING" and "/" in routes:
                    done = time.perf_counter()
                    return {
                        "total_s": round(done - started, 2),
                        "start_to_dashboard_s": round(dashboard_up - started, 2),
                        "put_s": round(put_done - dashboard_up, 2),
                        "put_to_running_s": round(done - put_done, 2),
                    }
                await asyncio.sleep(POLL_S)
        finally:
            await provider.stop(cluster)


def servekeeper_upgrade(sk: Servekeeper, port: int, generation: int, ready_delay: float) -> dict[str, Any]:
    cpus = 1 + (generation + 1) % 2  # gen 1: 1 CPU, gen 2: 2, gen 3: 1...: every round needs a new cluster
    document = hello_spec("lat", port, msg=f"v{generation}", head_cpus=cpus, ready_delay_s=ready_delay)
    started_wall = time.time()
    started = time.perf_counter()
    sk.api_apply(document)  # straight to the API: the CLI's own start-up is not the upgrade
    while True:
        view = sk.api_get("lat")
        active = view["activeCluster"]
        if active and active["generation"] == view["generation"] and view["ingress"]["routedTo"] == active["name"]:
            break
        time.sleep(POLL_S)
    total = time.perf_counter() - started
    with sk.db() as db:
        rows = db.execute("SELECT reason, time FROM events WHERE service = 'lat' ORDER BY id DESC LIMIT 12").fetchall()
        applied_at = db.execute(
            "SELECT config_submitted_at FROM clusters WHERE service = 'lat' ORDER BY created_at DESC LIMIT 1"
        ).fetchone()[0]
    moments = {reason: at for reason, at in reversed(rows)}  # the latest of each
    created, submitted, switched = (moments.get(k) for k in ("ClusterCreating", "ConfigSubmitted", "TrafficSwitched"))
    breakdown = {}
    if created and submitted and switched and applied_at:
        breakdown = {
            "apply_to_create_s": round(created - started_wall, 2),
            "create_to_put_s": round(submitted - created, 2),
            "put_s": round(applied_at - submitted, 2),
            "put_to_switch_s": round(switched - applied_at, 2),
            "switch_seen_s": round(started_wall + total - switched, 2),
        }
    return {"apply_to_full_traffic_s": round(total, 2), **breakdown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ready-delay", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "upgrade_latency.json")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    port = free_port()
    rounds = []
    try:
        sk.up()
        sk.apply(hello_spec("lat", port, msg="v1", head_cpus=1, ready_delay_s=args.ready_delay))
        assert sk.wait("lat") == 0
        for number in range(args.rounds):
            bare = asyncio.run(bare_head_and_deploy(args.ready_delay))
            # Let the previous old cluster finish draining so the two measurements see the same machine.
            time.sleep(4)
            upgrade = servekeeper_upgrade(sk, port, number + 2, args.ready_delay)
            rounds.append(
                {
                    "lower_bound_s": bare["total_s"],
                    "lower_bound_parts": bare,
                    **upgrade,
                    "ratio": round(upgrade["apply_to_full_traffic_s"] / bare["total_s"], 3),
                    "over_bound_s": round(upgrade["apply_to_full_traffic_s"] - bare["total_s"], 2),
                }
            )
            print(rounds[-1], flush=True)
            time.sleep(4)
    finally:
        sk.down_and_check_nothing_left()
    report = {
        "benchmark": "upgrade_latency",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ready_delay_s": args.ready_delay,
        "rounds": rounds,
        "mean_ratio": round(sum(r["ratio"] for r in rounds) / len(rounds), 3),
        "mean_over_bound_s": round(sum(r["over_bound_s"] for r in rounds) / len(rounds), 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
