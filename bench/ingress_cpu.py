"""Ingress CPU per request and added latency: Envoy (servekeeper.dataplane) against the Python
ingress (servekeeper.ingress), side by side in one run, at the same fixed request rate below
saturation, against a trivial upstream answering "ok". Rounds alternate direct / Envoy / Python.

CPU is the user+system time of every ingress process (both Envoy processes; the Python
supervisor and its workers) over a round, divided by the requests answered in it. Added latency
is the proxied p50/p99 minus the direct p50/p99 of the same round.

    .venv/bin/python -m bench.ingress_cpu [--rate 400] [--seconds 10] [--rounds 2] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from servekeeper.dataplane import Backend, DataPlane, Endpoint, ServiceRoute
from servekeeper.ingress.client import IngressClient, spawn_ingress, stop_ingress, wait_healthy
from servekeeper.ports import PortAllocator

RESULTS = Path(__file__).parent / "results"
TRIVIAL_SERVER = """
import sys
from aiohttp import web
async def ok(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_get("/", ok)
app.router.add_get("/-/healthz", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


async def fixed_rate(url: str, rate: float, seconds: float, connections: int, pids: list[int]) -> dict[str, Any]:
    """Open loop: request i is sent at start + i/rate whatever the answers do (keep-alive pool);
    latency is measured from that scheduled moment, so queueing shows."""
    latencies: list[float] = []
    failures = 0
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(int(rate)):  # warm up the connections and the proxy
            async with session.get(url) as response:
                await response.read()

        async def one(scheduled: float) -> None:
            nonlocal failures
            try:
                async with session.get(url) as response:
                    await response.read()
                    if response.status != 200:
                        failures += 1
                        return
                latencies.append((time.perf_counter() - scheduled) * 1000)
            except aiohttp.ClientError:
                failures += 1

        cpu_before = cpu_seconds(pids)
        start = time.perf_counter()
        tasks = []
        for index in range(int(rate * seconds)):
            scheduled = start + index / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(pids) - cpu_before
    answered = len(latencies)
    return {
        "requests": answered,
        "failures": failures,
        "achieved_rps": round(answered / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.50), 3),
        "p99_ms": round(percentile(latencies, 0.99), 3),
        "cpu_s": round(cpu, 4),
        "cpu_us_per_request": round(cpu / answered * 1e6, 1) if pids and answered else None,
    }


def python_ingress_pids(supervisor_pid: int) -> list[int]:
    try:
        return [supervisor_pid] + [child.pid for child in psutil.Process(supervisor_pid).children(recursive=True)]
    except psutil.Error:
        return [supervisor_pid]


async def run(rate: float, seconds: float, rounds: int, connections: int) -> dict[str, Any]:
    ports = PortAllocator()
    upstream_port, envoy_port, python_port = ports.one(), ports.one(), ports.one()
    upstream = subprocess.Popen([sys.executable, "-c", TRIVIAL_SERVER, str(upstream_port)])
    state_dir = Path(tempfile.mkdtemp(prefix="skbench-"))
    plane = DataPlane(state_dir, processes=2, log_level="warning")
    (state_dir / "token").write_text(secrets.token_hex(16))
    ingress_pid: int | None = None
    session = aiohttp.ClientSession()
    try:
        await asyncio.sleep(1.0)  # the upstream imports aiohttp
        await plane.start_or_adopt()
        backend = Backend("up", (Endpoint("127.0.0.1", upstream_port),))
        await plane.set_route(ServiceRoute("bench", envoy_port, (backend,), {"up": 100}))
        ingress_pid, control_port = spawn_ingress(state_dir, [upstream_port, envoy_port, python_port])
        client = IngressClient(session, control_port, (state_dir / "token").read_text().strip())
        await wait_healthy(client, ingress_pid)
        await client.set_route("bench", python_port, "up", {"up": f"http://127.0.0.1:{upstream_port}"})

        envoy_pids = [p.pid for p in plane.processes()]
        targets = {
            "direct": (upstream_port, []),
            "envoy": (envoy_port, envoy_pids),
            "python": (python_port, python_ingress_pids(ingress_pid)),
        }
        rounds_out: list[dict[str, Any]] = []
        for round_index in range(rounds):
            for label, (port, pids) in targets.items():
                result = await fixed_rate(f"http://127.0.0.1:{port}/", rate, seconds, connections, pids)
                rounds_out.append({"round": round_index, "target": label, **result})
                print(f"  round {round_index} {label:7s} {result}", flush=True)
    finally:
        await session.close()
        await plane.stop()
        if ingress_pid is not None:
            await stop_ingress(ingress_pid)
        upstream.terminate()
        upstream.wait()
    return summarise(rounds_out, rate, seconds, rounds, connections)


def summarise(
    rounds: list[dict[str, Any]], rate: float, seconds: float, count: int, connections: int
) -> dict[str, Any]:
    def mean(target: str, key: str) -> float:
        values = [r[key] for r in rounds if r["target"] == target and r[key] is not None]
        return sum(values) / len(values)

    summary: dict[str, Any] = {}
    for target in ("envoy", "python"):
        summary[target] = {
            "cpu_us_per_request": round(mean(target, "cpu_us_per_request"), 1),
            "p50_added_ms": round(mean(target, "p50_ms") - mean("direct", "p50_ms"), 3),
            "p99_added_ms": round(mean(target, "p99_ms") - mean("direct", "p99_ms"), 3),
            "failures": sum(r["failures"] for r in rounds if r["target"] == target),
        }
    ratio = summary["envoy"]["cpu_us_per_request"] / summary["python"]["cpu_us_per_request"]
    summary["envoy_cpu_share_of_python"] = round(ratio, 3)
    summary["targets_met"] = {
        "envoy_cpu_at_most_half_of_python": ratio <= 0.5,
        "envoy_p99_added_at_most_1ms": summary["envoy"]["p99_added_ms"] <= 1.0,
    }
    return {
        "config": {"rate_rps": rate, "seconds": seconds, "rounds": count, "connections": connections},
        "summary": summary,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=400)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="a 2-second CI-sized run; results not written")
    parser.add_argument("--output", type=Path, default=RESULTS / "ingress_cpu.json")
    args = parser.parse_args()
    if args.smoke:
        args.rate, args.seconds, args.rounds = 200, 2, 1
    result = asyncio.run(run(args.rate, args.seconds, args.rounds, args.connections))
    summary = result["summary"]
    print(json.dumps(summary, indent=1))
    if not args.smoke:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {args.output}")


if __name__ == "__main__":
    main()
