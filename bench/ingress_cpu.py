"""Ingress CPU per request and added latency: the Envoy data plane (servekeeper.dataplane, as the
daemon runs it) against going straight to the upstream, at a fixed request rate below
saturation, against a trivial upstream answering "ok". Rounds alternate idle / direct / Envoy.

CPU is the user+system time of every Envoy process over a round, divided by the requests
answered in it. Envoy also spends CPU with no traffic at all (stats flushes, health checks of
the upstream every second, timers), so each round also measures the processes idle for as
long, and `marginal_cpu_us_per_request` is what the requests themselves cost. The trivial upstream's
own CPU per request in the direct rounds is reported beside it, as a yardstick of what one
request costs on this machine. Added latency is the proxied p50/p99 minus the direct p50/p99.

The deleted Python ingress (servekeeper.ingress) was compared side by side with Envoy by this
script before it was deleted; that run is kept in bench/results/ingress_cpu-vs-python.json.

    .venv/bin/python -m bench.ingress_cpu [--rate 400] [--seconds 10] [--rounds 2] [--processes 2] [--smoke]
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

import aiohttp
import psutil

from servekeeper.dataplane import Backend, DataPlane, Endpoint, ServiceRoute
from servekeeper.providers.ports import PortAllocator

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
    """CPU time of every thread of these processes, in ns from the scheduler (/proc/<pid>/task/
    <tid>/schedstat) where Linux has it: psutil's user+system tick at 10 ms, too coarse for a
    process that is almost idle."""
    total = 0.0
    for pid in pids:
        tasks = list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
        try:
            if tasks:
                total += sum(int(task.read_text().split()[0]) for task in tasks) / 1e9
            else:
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
        except (OSError, psutil.Error):
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
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
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


async def idle(seconds: float, pids: list[int]) -> dict[str, Any]:
    before = cpu_seconds(pids)
    await asyncio.sleep(seconds)
    return {"requests": 0, "failures": 0, "cpu_s": round(cpu_seconds(pids) - before, 4)}


async def run(rate: float, seconds: float, rounds: int, connections: int, processes: int) -> dict[str, Any]:
    ports = PortAllocator()
    upstream_port, envoy_port = ports.one(), ports.one()
    upstream = subprocess.Popen([sys.executable, "-c", TRIVIAL_SERVER, str(upstream_port)])
    plane = DataPlane(Path(tempfile.mkdtemp(prefix="skbench-")), processes=processes, log_level="warning")
    try:
        await asyncio.sleep(1.0)  # the upstream imports aiohttp
        await plane.start_or_adopt()
        backend = Backend("up", (Endpoint("127.0.0.1", upstream_port),))
        await plane.set_route(ServiceRoute("bench", envoy_port, (backend,), {"up": 100}))
        envoy_pids = [p.pid for p in plane.processes()]
        rounds_out: list[dict[str, Any]] = []
        for round_index in range(rounds):
            result = await idle(seconds, envoy_pids)
            rounds_out.append({"round": round_index, "target": "idle", **result})
            # The upstream's own CPU in the direct rounds: a yardstick of what a request costs on this machine.
            for label, port, pids in (("direct", upstream_port, [upstream.pid]), ("envoy", envoy_port, envoy_pids)):
                result = await fixed_rate(f"http://127.0.0.1:{port}/", rate, seconds, connections, pids)
                rounds_out.append({"round": round_index, "target": label, **result})
            print(f"  round {round_index}: {rounds_out[-3:]}", flush=True)
    finally:
        await plane.stop()
        upstream.terminate()
        upstream.wait()
    return summarise(rounds_out, rate, seconds, rounds, connections, processes)


def summarise(
    rounds: list[dict[str, Any]], rate: float, seconds: float, count: int, connections: int, processes: int
) -> dict[str, Any]:
    def mean(target: str, key: str) -> float:
        values = [r[key] for r in rounds if r["target"] == target and r[key] is not None]
        return sum(values) / len(values)

    envoy_requests = mean("envoy", "requests")
    cpu_per_request = mean("envoy", "cpu_s") / envoy_requests * 1e6
    marginal = (mean("envoy", "cpu_s") - mean("idle", "cpu_s")) / envoy_requests * 1e6
    envoy = {
        "cpu_us_per_request": round(cpu_per_request, 1),
        "idle_cpu_ms_per_s": round(mean("idle", "cpu_s") / seconds * 1000, 2),
        "marginal_cpu_us_per_request": round(marginal, 1),
        "p50_added_ms": round(mean("envoy", "p50_ms") - mean("direct", "p50_ms"), 3),
        "p99_added_ms": round(mean("envoy", "p99_ms") - mean("direct", "p99_ms"), 3),
        "failures": sum(r["failures"] for r in rounds if r["target"] in ("direct", "envoy")),
    }
    upstream = {"cpu_us_per_request": round(mean("direct", "cpu_s") / mean("direct", "requests") * 1e6, 1)}
    return {
        "config": {
            "rate_rps": rate,
            "seconds": seconds,
            "rounds": count,
            "connections": connections,
            "envoy_processes": processes,
        },
        "summary": {
            "envoy": envoy,
            "trivial_aiohttp_upstream": upstream,
            "targets_met": {"envoy_p99_added_at_most_1ms": envoy["p99_added_ms"] <= 1.0},
        },
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=400)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2, help="Envoy processes (the daemon runs 2)")
    parser.add_argument("--smoke", action="store_true", help="a 2-second CI-sized run; written only with --output")
    parser.add_argument("--output", type=Path, help="default: bench/results/ingress_cpu.json (not with --smoke)")
    args = parser.parse_args()
    if args.smoke:
        args.rate, args.seconds, args.rounds = 200, 2, 1
    result = asyncio.run(run(args.rate, args.seconds, args.rounds, args.connections, args.processes))
    result = {"benchmark": "ingress_cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"), **result}
    print(json.dumps(result["summary"], indent=1))
    if args.output is None and not args.smoke:
        args.output = RESULTS / "ingress_cpu.json"
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {args.output}")


if __name__ == "__main__":
    main()
