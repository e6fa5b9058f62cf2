"""What a shadow step costs the clients: the same closed-loop GETs through the ingress with no
mirror, with every request copied to a fast canary, and copied to a slow one (its answers take
`--slow-ms`); alternating in one run, each case `--rounds` times (issue 23's benchmark).

Envoy's own DataPlane (2 processes, as the daemon runs it) in front of two trivial aiohttp
upstreams (stable and canary, each a process of its own); the route is the product's
(`ServiceRoute` with a `Mirror` at 100%). The clients only ever get the stable answer.

    .venv/bin/python -m bench.shadow_latency [--seconds 10] [--clients 16] [--rounds 2] [--slow-ms 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ingress_overhead import answers
from bench.loadgen import LoopResult, closed_loop, exit_cleanly_on_sigterm
from servekeeper.dataplane import Backend, DataPlane, Endpoint, ServiceRoute
from servekeeper.model.routing import Mirror
from servekeeper.providers.ports import PortAllocator
from servekeeper.testing.harness import wait_until

RESULTS = Path(__file__).parent / "results"
CASES = ("none", "mirror-fast", "mirror-slow")

# A trivial upstream answering "<name>" after `delay` seconds (argv: port, name, delay).
UPSTREAM = """
import asyncio, sys
from aiohttp import web
port, name, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
async def answer(request):
    if delay:
        await asyncio.sleep(delay)
    return web.Response(text=name)
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_get("/-/healthz", health)
app.router.add_get("/{tail:.*}", answer)
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""


def start_upstream(port: int, name: str, delay_s: float) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port), name, str(delay_s)])
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/-/healthz"), 15, f"the {name} upstream")
    return process


def route(port: int, backends: tuple[Backend, ...], canary: str | None) -> ServiceRoute:
    weights = {backend.name: (100 if backend.name == "stable" else 0) for backend in backends}
    mirror = Mirror(canary, 100) if canary is not None else None
    return ServiceRoute("shadow", port, backends, weights, mirror=mirror)


async def measure(args: argparse.Namespace, ports: dict[str, int]) -> list[LoopResult]:
    plane = DataPlane(Path(tempfile.mkdtemp(prefix="skbench-")), log_level="warning")
    backends = tuple(Backend(name, (Endpoint("127.0.0.1", port),)) for name, port in ports.items() if name != "ingress")
    url = f"http://127.0.0.1:{ports['ingress']}/"
    targets = {"none": None, "mirror-fast": "fast", "mirror-slow": "slow"}
    results = []
    try:
        await plane.start_or_adopt()
        for _ in range(args.rounds):
            for case in CASES:
                await plane.set_route(route(ports["ingress"], backends, targets[case]))
                await asyncio.to_thread(wait_until, lambda: answers(url), 15, "Envoy to route")
                results.append(await closed_loop(case, url, args.clients, args.seconds))
                print(json.dumps(results[-1].to_json()), flush=True)
    finally:
        await plane.stop()
    return results


def summary(results: list[LoopResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        mine = [r for r in results if r.label == case]
        out[case] = {
            "rps": round(statistics.mean(r.rps for r in mine), 1),
            "p50_ms": round(statistics.mean(r.p50_ms for r in mine), 2),
            "p99_ms": round(statistics.mean(r.p99_ms for r in mine), 2),
            "failures": sum(r.failures for r in mine),
        }
    for case in CASES[1:]:
        out[case]["p50_ratio"] = round(out[case]["p50_ms"] / out["none"]["p50_ms"], 3)
        out[case]["p99_ratio"] = round(out[case]["p99_ms"] / out["none"]["p99_ms"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slow-ms", type=float, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS / "shadow_latency.json")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    allocate = PortAllocator()
    ports = {"stable": allocate.one(), "fast": allocate.one(), "slow": allocate.one(), "ingress": allocate.one()}
    delays = {"stable": 0.0, "fast": 0.0, "slow": args.slow_ms / 1000}
    upstreams = [start_upstream(ports[name], name, delay) for name, delay in delays.items()]
    try:
        results = asyncio.run(measure(args, ports))
    finally:
        for process in upstreams:
            process.terminate()
            process.wait(10)
    report = {
        "benchmark": "shadow_latency",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "seconds_per_phase": args.seconds,
        "slow_canary_ms": args.slow_ms,
        "summary": summary(results),
        "phases": [r.to_json() for r in results],
        "note": "GETs only (every one copied at 100%); the load generator runs on the same 2 cores",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
