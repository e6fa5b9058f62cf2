"""Ingress overhead: the same closed-loop load straight to a cluster's Serve proxy and through
the ingress (the Envoy data plane), alternating A/B/A/B in one run; plus a trivial upstream that
shows the proxy's own ceiling.

The Ray case goes through the Envoy processes the daemon itself started for the service (the
product's path: `servekeeper up`, `apply`, the service's port); the trivial case starts a
DataPlane of its own, as the daemon does (2 processes), routed to a minimal aiohttp server.

    .venv/bin/python -m bench.ingress_overhead [--seconds 10] [--clients 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.ingress_cpu import TRIVIAL_SERVER
from bench.loadgen import LoopResult, closed_loop, exit_cleanly_on_sigterm
from servekeeper.dataplane import Backend, DataPlane, Endpoint, ServiceRoute
from servekeeper.providers.ports import PortAllocator
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until

RESULTS = Path(__file__).parent / "results"


def ab(results: list[LoopResult], direct: str, proxied: str) -> dict[str, Any]:
    a = [r for r in results if r.label == direct]
    b = [r for r in results if r.label == proxied]
    a_rps = sum(r.rps for r in a) / len(a)
    b_rps = sum(r.rps for r in b) / len(b)
    return {
        "direct_rps": round(a_rps, 1),
        "ingress_rps": round(b_rps, 1),
        "throughput_ratio": round(b_rps / a_rps, 3),
        "p50_added_ms": round(sum(r.p50_ms for r in b) / len(b) - sum(r.p50_ms for r in a) / len(a), 2),
        "p99_added_ms": round(sum(r.p99_ms for r in b) / len(b) - sum(r.p99_ms for r in a) / len(a), 2),
        "failures": sum(r.failures for r in a + b),
    }


async def alternate(direct_url: str, ingress_url: str, clients: int, seconds: float, rounds: int) -> list[LoopResult]:
    results = []
    for _ in range(rounds):
        results.append(await closed_loop("direct", direct_url, clients, seconds))
        results.append(await closed_loop("ingress", ingress_url, clients, seconds))
    return results


def ray_proxy_case(args: argparse.Namespace) -> dict[str, Any]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    port = free_port()
    try:
        sk.up()
        sk.apply(hello_spec("bench", port, msg="ok"))
        assert sk.wait("bench") == 0
        serve_url = sk.get("bench")["activeCluster"]["serveUrl"] + "/"
        results = asyncio.run(
            alternate(serve_url, f"http://127.0.0.1:{port}/", args.clients, args.seconds, args.rounds)
        )
    finally:
        sk.down_and_check_nothing_left()
    return {"phases": [r.to_json() for r in results], **ab(results, "direct", "ingress")}


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


async def through_envoy(upstream_port: int, ingress_port: int, args: argparse.Namespace) -> list[LoopResult]:
    plane = DataPlane(Path(tempfile.mkdtemp(prefix="skbench-")), log_level="warning")
    try:
        await plane.start_or_adopt()
        backend = Backend("trivial", (Endpoint("127.0.0.1", upstream_port),))
        await plane.set_route(ServiceRoute("bench", ingress_port, (backend,), {"trivial": 100}))
        ingress_url = f"http://127.0.0.1:{ingress_port}/"
        # Envoy takes the upstream once its first health check passed.
        await asyncio.to_thread(wait_until, lambda: answers(ingress_url), 15, "Envoy to route to the upstream")
        return await alternate(
            f"http://127.0.0.1:{upstream_port}/", ingress_url, args.clients, args.seconds, args.rounds
        )
    finally:
        await plane.stop()


def trivial_case(args: argparse.Namespace) -> dict[str, Any]:
    ports = PortAllocator()
    upstream_port, ingress_port = ports.one(), ports.one()
    upstream = subprocess.Popen([sys.executable, "-c", TRIVIAL_SERVER, str(upstream_port)])
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{upstream_port}/"), 15, "the trivial upstream")
        results = asyncio.run(through_envoy(upstream_port, ingress_port, args))
    finally:
        upstream.terminate()
        upstream.wait(10)
    return {"phases": [r.to_json() for r in results], **ab(results, "direct", "ingress")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "ingress_overhead.json")
    parser.add_argument("--trivial-only", action="store_true", help="only the trivial upstream (no Ray)")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    report = {
        "benchmark": "ingress_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ingress": "Envoy (servekeeper.dataplane), 2 processes",
        "clients": args.clients,
        "seconds_per_phase": args.seconds,
        "ray_proxy": None if args.trivial_only else ray_proxy_case(args),
        "trivial_upstream": trivial_case(args),
        "note": "the load generator runs on the same 2 cores as the servers",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items()}, indent=2))


if __name__ == "__main__":
    main()
