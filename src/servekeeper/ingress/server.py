"""The ingress process: a supervisor and its proxy workers, apart from the controller.

The supervisor starts N workers (default 2) that share every service port with SO_REUSEPORT,
restarts a worker that dies (within a second), and serves the control API the controller uses:
a route change is written to the route file first, then pushed to every worker, and
acknowledged once they all have it; in-flight counts are summed over the workers. A worker
started later reads the route file and serves at once. The ingress never needs the controller
to serve: killing the controller, even with SIGKILL, drops nothing; killing one worker loses
only the requests it had in flight.

Usage: python -m servekeeper.ingress.server --state-dir DIR --control-port PORT [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from servekeeper.ingress.proxy import SHUTDOWN_GRACE_SECONDS, Ingress, token_middleware
from servekeeper.ports import PortAllocator

logger = logging.getLogger("servekeeper.ingress")
WORKER_TIMEOUT = aiohttp.ClientTimeout(total=5, sock_connect=1)
MONITOR_SECONDS = 0.05


@dataclass
class Worker:
    index: int
    control_port: int
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid


class Supervisor:
    def __init__(self, state_dir: Path, token: str, worker_count: int) -> None:
        self.state_dir = state_dir
        self.token = token
        self.worker_count = worker_count
        self.routes_file = state_dir / "ingress-routes.json"
        self.routes: dict[str, dict[str, Any]] = self._load()
        self.workers: dict[int, Worker] = {}
        self.restarts = 0
        self.session: aiohttp.ClientSession | None = None
        self._headers = {"Authorization": f"Bearer {token}"}
        self._stopping = False

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            return dict(json.loads(self.routes_file.read_text()))
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        tmp = self.routes_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.routes))
        os.replace(tmp, self.routes_file)

    def _spawn(self, index: int) -> Worker:
        taken = [w.control_port for w in self.workers.values()]
        control_port = PortAllocator(taken).one()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "servekeeper.ingress.server",
                "--worker",
                "--state-dir",
                str(self.state_dir),
                "--control-port",
                str(control_port),
            ],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        worker = Worker(index=index, control_port=control_port, process=process)
        self.workers[index] = worker
        logger.info("ingress worker %d started, pid %d", index, process.pid)
        return worker

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=WORKER_TIMEOUT)
        for index in range(self.worker_count):
            self._spawn(index)
        await asyncio.gather(*(self._wait_ready(w) for w in self.workers.values()))

    async def _wait_ready(self, worker: Worker, timeout: float = 20) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and worker.process.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await self._call(worker, "GET", "/healthz")
                return True
            await asyncio.sleep(0.02)
        return False

    async def monitor(self) -> None:
        while not self._stopping:
            for index, worker in list(self.workers.items()):
                if worker.process.poll() is not None and not self._stopping:
                    logger.warning(
                        "ingress worker %d (pid %d) exited with %s; restarting",
                        index,
                        worker.pid,
                        worker.process.returncode,
                    )
                    self.restarts += 1
                    self._spawn(index)
            await asyncio.sleep(MONITOR_SECONDS)

    async def _call(self, worker: Worker, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        assert self.session is not None
        url = f"http://127.0.0.1:{worker.control_port}{path}"
        async with self.session.request(method, url, json=payload, headers=self._headers) as response:
            return response.status, await response.json(content_type=None)

    async def _fan_out(self, method: str, path: str, payload: Any = None) -> list[tuple[Worker, int, Any]]:
        """Ask every live worker. A worker that is restarting is skipped: it reads the file."""

        async def one(worker: Worker) -> tuple[Worker, int, Any] | None:
            try:
                status, data = await self._call(worker, method, path, payload)
                return worker, status, data
            except (aiohttp.ClientError, TimeoutError):
                return None

        answers = await asyncio.gather(*(one(w) for w in list(self.workers.values())))
        return [answer for answer in answers if answer is not None]

    # -- control API ---------------------------------------------------------------------

    def control_app(self) -> web.Application:
        app = web.Application(middlewares=[token_middleware(self.token)])
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/workers", self._workers)
        app.router.add_get("/routes", self._get_routes)
        app.router.add_put("/routes/{service}", self._put_route)
        app.router.add_delete("/routes/{service}", self._delete_route)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "pid": os.getpid(), "restarts": self.restarts})

    async def _workers(self, request: web.Request) -> web.Response:
        answers = {w.index: data for w, status, data in await self._fan_out("GET", "/routes") if status == 200}
        listing = []
        for index, worker in sorted(self.workers.items()):
            routes = answers.get(index, {}).get("services", {})
            inflight = sum(u["inflight"] for r in routes.values() for u in r["upstreams"].values())
            listing.append(
                {
                    "index": index,
                    "pid": worker.pid,
                    "controlPort": worker.control_port,
                    "ready": index in answers,
                    "inflight": inflight,
                }
            )
        return web.json_response({"workers": listing, "restarts": self.restarts})

    async def _get_routes(self, request: web.Request) -> web.Response:
        merged: dict[str, Any] = {}
        for _, status, data in await self._fan_out("GET", "/routes"):
            if status != 200:
                continue
            for service, route in data["services"].items():
                into = merged.setdefault(service, {"port": route["port"], "active": route["active"], "upstreams": {}})
                for name, upstream in route["upstreams"].items():
                    total = into["upstreams"].setdefault(
                        name, {"url": upstream["url"], "inflight": 0, "total": 0, "failedConnects": 0}
                    )
                    for key in ("inflight", "total", "failedConnects"):
                        total[key] += upstream[key]
        # A route the workers have not reported (all restarting) is still the route in force.
        for service, route in self.routes.items():
            merged.setdefault(
                service,
                {
                    "port": route["port"],
                    "active": route["active"],
                    "upstreams": {
                        name: {"url": url, "inflight": 0, "total": 0, "failedConnects": 0}
                        for name, url in route["upstreams"].items()
                    },
                },
            )
        return web.json_response({"pid": os.getpid(), "services": merged})

    async def _put_route(self, request: web.Request) -> web.Response:
        service = request.match_info["service"]
        try:
            data = await request.json()
            route = {
                "port": int(data["port"]),
                "active": data.get("active"),
                "upstreams": {str(k): str(v) for k, v in dict(data["upstreams"]).items()},
            }
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"bad route: {exc!r}"}, status=400)
        if route["active"] is not None and route["active"] not in route["upstreams"]:
            return web.json_response({"error": "active must be one of upstreams"}, status=400)
        previous = self.routes.get(service)
        self.routes[service] = route
        self._save()
        answers = await self._fan_out("PUT", f"/routes/{service}", route)
        for _, status, body in answers:
            if status != 200:
                await self._roll_back(service, previous)
                return web.json_response(body, status=status)
        return web.json_response(route)

    async def _roll_back(self, service: str, previous: dict[str, Any] | None) -> None:
        """The file must never hold a route that a worker could not take (its port was busy)."""
        if previous is None:
            self.routes.pop(service, None)
            self._save()
            await self._fan_out("DELETE", f"/routes/{service}")
        else:
            self.routes[service] = previous
            self._save()
            await self._fan_out("PUT", f"/routes/{service}", previous)

    async def _delete_route(self, request: web.Request) -> web.Response:
        service = request.match_info["service"]
        self.routes.pop(service, None)
        self._save()
        await self._fan_out("DELETE", f"/routes/{service}")
        return web.json_response({"ok": True})

    async def stop(self) -> None:
        self._stopping = True
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_GRACE_SECONDS + 2
        while loop.time() < deadline and any(w.process.poll() is None for w in self.workers.values()):
            await asyncio.sleep(0.05)
        for worker in self.workers.values():
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()
        if self.session is not None:
            await self.session.close()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _serve_control(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host="127.0.0.1", port=port).start()
    return runner


async def run_supervisor(state_dir: Path, control_port: int, worker_count: int) -> None:
    token = (state_dir / "token").read_text().strip()
    supervisor = Supervisor(state_dir, token, worker_count)
    await supervisor.start()
    control = await _serve_control(supervisor.control_app(), control_port)
    logger.info("ingress supervisor on 127.0.0.1:%d, pid %d, %d workers", control_port, os.getpid(), worker_count)
    monitor = asyncio.create_task(supervisor.monitor())
    await _until_signalled()
    await control.cleanup()
    await supervisor.stop()
    monitor.cancel()


async def run_worker(state_dir: Path, control_port: int) -> None:
    token = (state_dir / "token").read_text().strip()
    ingress = Ingress(state_dir, token, persist=False)
    await ingress.start()
    control = await _serve_control(ingress.control_app(), control_port)
    parent = os.getppid()

    async def orphaned() -> None:
        # A worker whose supervisor is gone exits: nothing would restart or steer it.
        while os.getppid() == parent:
            await asyncio.sleep(1)

    waiters = [asyncio.create_task(_until_signalled()), asyncio.create_task(orphaned())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    # Graceful: stop taking control calls, let requests in flight finish (bounded), then exit.
    await control.cleanup()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_GRACE_SECONDS
    while ingress.inflight_total() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await ingress.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import uvloop  # installed with ray[serve]; a faster loop for the data plane

    if args.worker:
        uvloop.run(run_worker(args.state_dir, args.control_port))
    else:
        uvloop.run(run_supervisor(args.state_dir, args.control_port, max(1, args.workers)))


if __name__ == "__main__":
    main()
