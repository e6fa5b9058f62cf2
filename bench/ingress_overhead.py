"""Ingress overhead: the same closed-loop load straight to a cluster's Serve proxy and through
the ingress, alternating A/B/A/B in one run; plus a trivial upstream that shows the proxy's own
ceiling.

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

from bench.loadgen import LoopResult, closed_loop, exit_cleanly_on_sigterm
from servekeeper.ports import PortAllocator
from servekeeper.testing import Servekeeper, free_port, hello_spec

RESULTS = Path(__file__).parent / "results"

TRIVIAL_SERVER = """
import sys
from aiohttp import web
async def ok(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_get("/", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


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


def trivial_case(args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="skbench-"))
    (state / "token").write_text("bench")
    upstream_port, control_port, ingress_port = (PortAllocator().one() for _ in range(3))
    upstream = subprocess.Popen([sys.executable, "-c", TRIVIAL_SERVER, str(upstream_port)])
    ingress = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servekeeper.ingress.server",
            "--state-dir",
            str(state),
            "--control-port",
            str(control_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        headers = {"Authorization": "Bearer bench"}
        for _ in range(100):
            try:
                httpx.put(
                    f"http://127.0.0.1:{control_port}/routes/bench",
                    headers=headers,
                    json={"port": ingress_port, "active": "u", "upstreams": {"u": f"http://127.0.0.1:{upstream_port}"}},
                )
                httpx.get(f"http://127.0.0.1:{upstream_port}/")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        results = asyncio.run(
            alternate(
                f"http://127.0.0.1:{upstream_port}/",
                f"http://127.0.0.1:{ingress_port}/",
                args.clients,
                args.seconds,
                args.rounds,
            )
        )
    finally:
        for process in (upstream, ingress):
            process.terminate()
            process.wait(10)
    return {"phases": [r.to_json() for r in results], **ab(results, "direct", "ingress")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "ingress_overhead.json")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    report = {
        "benchmark": "ingress_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "seconds_per_phase": args.seconds,
        "ray_proxy": ray_proxy_case(args),
        "trivial_upstream": trivial_case(args),
        "note": "the load generator runs on the same 2 cores as the servers",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items()}, indent=2))


if __name__ == "__main__":
    main()
