from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import psutil
import pytest

from servekeeper.dataplane import Backend, DataPlane, Endpoint, ServiceRoute
from servekeeper.dataplane.admin import AdminClient, ProcessConfig
from servekeeper.providers.ports import PortAllocator
from tests.dataplane.upstream import Upstream

PlaneFactory = Callable[..., Awaitable[DataPlane]]
UpstreamFactory = Callable[[str], Awaitable[Upstream]]
GrpcFactory = Callable[[str], Awaitable["GrpcUpstream"]]


def kill_envoys_under(state_dir: Path) -> list[int]:
    """Every Envoy whose bootstrap lives under state_dir, by pid: whatever a test did or failed to do."""
    killed = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if any(str(state_dir) in arg for arg in cmdline) and any(arg.endswith("bootstrap.json") for arg in cmdline):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.info["pid"], signal.SIGKILL)
            killed.append(process.info["pid"])
    return killed


@pytest.fixture
async def upstream() -> AsyncIterator[UpstreamFactory]:
    started: list[Upstream] = []

    async def make(name: str) -> Upstream:
        server = await Upstream(name).start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


class GrpcUpstream:
    """A gRPC server whose one method `/echo.Echo/Say` answers `<name>:<request>` (raw bytes in and
    out: a generic handler, no generated code)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server = grpc.aio.server()
        self.endpoint = Endpoint("127.0.0.1", free_port())

    async def start(self) -> GrpcUpstream:
        async def say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return self.name.encode() + b":" + request

        handler = grpc.method_handlers_generic_handler("echo.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)})
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"{self.endpoint.host}:{self.endpoint.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)


@pytest.fixture
async def grpc_server() -> AsyncIterator[GrpcFactory]:
    started: list[GrpcUpstream] = []

    async def make(name: str) -> GrpcUpstream:
        server = await GrpcUpstream(name).start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


@pytest.fixture
async def make_plane(tmp_path: Path) -> AsyncIterator[PlaneFactory]:
    planes: list[DataPlane] = []

    async def make(processes: int = 2, start: bool = True, **kwargs: object) -> DataPlane:
        plane = DataPlane(tmp_path, processes=processes, **kwargs)  # type: ignore[arg-type]
        planes.append(plane)
        if start:
            await plane.start_or_adopt()
        return plane

    yield make
    for plane in planes:
        with contextlib.suppress(Exception):
            await plane.stop()
    leftovers = kill_envoys_under(tmp_path)
    assert not leftovers, f"Envoy processes left running: {leftovers}"


def route(service: str, port: int, backends: list[Backend], weights: dict[str, int], **kwargs: object) -> ServiceRoute:
    return ServiceRoute(service, port, tuple(backends), weights, **kwargs)  # type: ignore[arg-type]


def free_port() -> int:
    return PortAllocator().one()


async def process_configs(plane: DataPlane) -> list[ProcessConfig]:
    """What every Envoy process of the plane has applied, read with a client of the test's own."""
    async with aiohttp.ClientSession() as session:
        admin = AdminClient(session)
        return [await admin.config(info.admin_port) for info in plane.processes()]


async def admin_get(port: int, path: str) -> Any:
    async with aiohttp.ClientSession() as session:
        return await AdminClient(session).get(port, path)


async def inflight_until(
    plane: DataPlane, check: Callable[[dict[str, int]], bool], timeout: float = 5, service: str = "svc"
) -> None:
    """Polls routes() until the service's in-flight counts pass `check`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        inflight = (await plane.routes())[service].inflight
        if check(inflight):
            return
        assert asyncio.get_running_loop().time() < deadline, f"in-flight counts stayed {inflight}"
        await asyncio.sleep(0.05)
