"""The ingress process under faults: a worker killed with SIGKILL, malformed HTTP, restarts.

These run the real ingress supervisor and workers as processes, in front of a real HTTP
upstream on loopback whose requests take a second each, so that what is in flight at the
moment of a kill is known exactly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servekeeper.ports import PortAllocator
from servekeeper.testing import wait_until

SLOW_UPSTREAM = """
import asyncio, sys
from aiohttp import web
async def slow(request):
    await asyncio.sleep(float(request.query.get("s", "1")))
    return web.Response(text="ok")
app = web.Application()
app.router.add_get("/", slow)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


class IngressProcess:
    def __init__(self, state_dir: Path) -> None:
        (state_dir / "token").write_text("t")
        self.headers = {"Authorization": "Bearer t"}
        self.control_port = PortAllocator().one()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "servekeeper.ingress.server",
                "--state-dir",
                str(state_dir),
                "--control-port",
                str(self.control_port),
                "--workers",
                "2",
            ],
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(self._answers, 20, "the ingress control API")

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url("/healthz"), headers=self.headers).status_code == 200
        except httpx.TransportError:
            return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.control_port}{path}"

    def workers(self) -> list[dict]:  # type: ignore[type-arg]
        return list(httpx.get(self.url("/workers"), headers=self.headers, timeout=10).json()["workers"])

    def route(self, port: int, upstream: str) -> None:
        body = {"port": port, "active": "u", "upstreams": {"u": upstream}}
        response = httpx.put(self.url("/routes/svc"), json=body, headers=self.headers, timeout=10)
        response.raise_for_status()

    def stop(self) -> None:
        with_group = os.getpgid(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(with_group, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def upstream() -> Iterator[str]:
    port = PortAllocator().one()
    process = subprocess.Popen([sys.executable, "-c", SLOW_UPSTREAM, str(port)])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _up(url), 20, "the upstream")
    yield url
    process.terminate()
    process.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/?s=0").status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def ingress(tmp_path: Path) -> Iterator[IngressProcess]:
    process = IngressProcess(tmp_path)
    yield process
    process.stop()
    assert process.process.returncode is not None


async def _keepalive_load(url: str, clients: int, stop: asyncio.Event, outcomes: list[str]) -> None:
    # One persistent connection per client: a kill can only cut the requests in flight on it.
    # httpx never retries on its own (aiohttp silently re-sends an idempotent request whose
    # pooled connection died), so every request cut is counted.
    async def client() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(limits=limits, timeout=30) as session:
            while not stop.is_set():
                try:
                    response = await session.get(url)
                    outcomes.append("ok" if response.status_code == 200 else f"HTTP {response.status_code}")
                except httpx.TransportError as exc:
                    outcomes.append(type(exc).__name__)

    await asyncio.gather(*(client() for _ in range(clients)))


def test_killing_one_worker_loses_exactly_its_in_flight_requests_and_it_restarts(
    ingress: IngressProcess, upstream: str
) -> None:
    port = PortAllocator().one()
    ingress.route(port, upstream)
    outcomes: list[str] = []

    async def scenario() -> tuple[int, float]:
        stop = asyncio.Event()
        load = asyncio.create_task(_keepalive_load(f"http://127.0.0.1:{port}/?s=1", 24, stop, outcomes))
        await asyncio.sleep(2.5)  # every client is now waiting on a one-second request
        workers = await asyncio.to_thread(ingress.workers)
        victim = max(workers, key=lambda w: w["inflight"])
        assert victim["inflight"] > 0
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        while True:
            now = await asyncio.to_thread(ingress.workers)
            replaced = [w for w in now if w["index"] == victim["index"]][0]
            if replaced["pid"] != victim["pid"] and replaced["ready"]:
                break
            await asyncio.sleep(0.02)
        restart_seconds = time.monotonic() - killed_at
        await asyncio.sleep(3)
        stop.set()
        await load
        return victim["inflight"], restart_seconds

    in_flight_on_victim, restart_seconds = asyncio.run(scenario())
    lost = [o for o in outcomes if o != "ok"]
    print(
        f"\nworker killed with {in_flight_on_victim} requests in flight: {len(lost)} lost, "
        f"replaced and serving after {restart_seconds:.2f}s"
    )
    assert len(lost) == in_flight_on_victim, f"lost {lost}, the worker had {in_flight_on_victim} in flight"
    assert restart_seconds < 1.0
    assert outcomes.count("ok") > 24


def test_malformed_http_is_rejected_and_others_are_still_served(ingress: IngressProcess, upstream: str) -> None:
    port = PortAllocator().one()
    ingress.route(port, upstream)
    for garbage in (
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"\x00\x01\x02\x03" * 100,
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(garbage)
            answer = conn.recv(1024)
        assert answer == b"" or answer.split(b"\r\n")[0] in (b"HTTP/1.0 400 Bad Request", b"HTTP/1.1 400 Bad Request")
    assert httpx.get(f"http://127.0.0.1:{port}/?s=0").text == "ok"


def test_a_route_on_a_busy_port_is_refused_and_nothing_changes(ingress: IngressProcess, upstream: str) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        body = {"port": busy, "active": "u", "upstreams": {"u": upstream}}
        response = httpx.put(ingress.url("/routes/svc"), json=body, headers=ingress.headers, timeout=10)
        assert response.status_code == 409
    routes = httpx.get(ingress.url("/routes"), headers=ingress.headers).json()["services"]
    assert routes == {}
