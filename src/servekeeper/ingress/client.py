"""The controller's side of the ingress: start or adopt the process, and steer its routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from servekeeper.ports import PortAllocator
from servekeeper.status import IngressRouteObservation

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=5, sock_connect=1)


class IngressError(RuntimeError):
    pass


class IngressClient:
    def __init__(self, session: aiohttp.ClientSession, control_port: int, token: str) -> None:
        self._session = session
        self.control_port = control_port
        self._headers = {"Authorization": f"Bearer {token}"}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    async def _call(self, method: str, path: str, payload: Any = None) -> Any:
        try:
            async with self._session.request(
                method, self.base_url + path, json=payload, headers=self._headers, timeout=CONTROL_TIMEOUT
            ) as response:
                data = await response.json(content_type=None)
                if response.status >= 300:
                    raise IngressError(f"ingress {method} {path} answered {response.status}: {data}")
                return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise IngressError(f"ingress {method} {path} failed: {exc!r}") from exc

    async def healthy(self) -> bool:
        try:
            await self._call("GET", "/healthz")
            return True
        except IngressError:
            return False

    async def routes(self) -> dict[str, IngressRouteObservation]:
        data = await self._call("GET", "/routes")
        observed = {}
        for service, route in data["services"].items():
            upstreams = route["upstreams"]
            observed[service] = IngressRouteObservation(
                active=route["active"],
                upstreams=frozenset(upstreams),
                inflight={name: u["inflight"] for name, u in upstreams.items()},
            )
        return observed

    async def raw_routes(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/routes"))

    async def set_route(self, service: str, port: int, active: str, upstreams: dict[str, str]) -> None:
        await self._call("PUT", f"/routes/{service}", {"port": port, "active": active, "upstreams": upstreams})

    async def remove_route(self, service: str) -> None:
        await self._call("DELETE", f"/routes/{service}")


def _alive(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and "servekeeper.ingress.server" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def spawn_ingress(state_dir: Path, reserved_ports: list[int]) -> tuple[int, int]:
    """Start the ingress in a session of its own, so that it outlives the controller."""
    control_port = PortAllocator(reserved_ports).one()
    log = open(state_dir / "ingress.log", "ab")
    with log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "servekeeper.ingress.server",
                "--state-dir",
                str(state_dir),
                "--control-port",
                str(control_port),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    return process.pid, control_port


async def wait_healthy(client: IngressClient, pid: int, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await client.healthy():
            return
        if not _alive(pid):
            raise IngressError("the ingress process exited at start; see ingress.log in the state dir")
        await asyncio.sleep(0.1)
    raise IngressError(f"the ingress did not answer within {timeout:g}s")


def ingress_alive(pid: int) -> bool:
    return _alive(pid)


async def stop_ingress(pid: int, timeout: float = 15.0) -> None:
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline and _alive(pid):
        await asyncio.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
