"""Route switches: acknowledged by every process, make before break, connections kept."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import httpx
import pytest

from servekeeper.dataplane import Backend, DataPlaneError
from tests.dataplane.conftest import (
    PlaneFactory,
    UpstreamFactory,
    free_port,
    inflight_until,
    process_configs,
    route,
)


async def test_switch_is_acknowledged_by_every_process_and_keeps_keepalive_connections(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    a, b = await upstream("a"), await upstream("b")
    plane = await make_plane()
    port = free_port()
    backend_a, backend_b = Backend("a", (a.endpoint,)), Backend("b", (b.endpoint,))
    await plane.set_route(route("svc", port, [backend_a], {"a": 100}))

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as client:
        sockets = set()

        async def ask() -> str:
            response = await client.get("/", extensions={"trace": trace})
            return response.text

        async def trace(event: str, info: dict[str, object]) -> None:
            if event == "connection.connect_tcp.complete":
                stream = info["return_value"]
                sockets.add(stream.get_extra_info("client_addr"))  # type: ignore[attr-defined]

        assert [await ask() for _ in range(5)] == ["a"] * 5
        await plane.set_route(route("svc", port, [backend_a, backend_b], {"a": 0, "b": 100}))
        assert [await ask() for _ in range(5)] == ["b"] * 5
        assert len(sockets) == 1, f"the client reconnected across the switch: {sockets}"

    observed = await plane.routes()
    assert observed["svc"].weights == {"a": 0, "b": 100}
    assert observed["svc"].in_sync and observed["svc"].active == "b"
    assert observed["svc"].to_ingress().upstreams == frozenset({"a", "b"})

    for config in await process_configs(plane):
        assert config.route_weights["http-svc"] == {"http-a": 0, "http-b": 100}
        assert {"http-a", "http-b"} <= config.active_clusters

    # Draining done: the old backend leaves the route, and its cluster leaves every process.
    await plane.set_route(route("svc", port, [backend_b], {"b": 100}))
    for config in await process_configs(plane):
        assert config.active_clusters == {"http-b"}


async def test_inflight_counts_slow_requests_and_open_websockets_over_every_process(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    a, b = await upstream("a"), await upstream("b")
    plane = await make_plane()
    port = free_port()
    backends = [Backend("a", (a.endpoint,)), Backend("b", (b.endpoint,))]
    await plane.set_route(route("svc", port, backends, {"a": 100, "b": 0}))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url) as client:
        slow = asyncio.create_task(client.get("/", params={"sleep": "1"}))
        await inflight_until(plane, lambda inflight: inflight == {"a": 1, "b": 0})
        assert (await slow).text == "a"
        await inflight_until(plane, lambda inflight: inflight == {"a": 0, "b": 0})

    async with aiohttp.ClientSession() as session, session.ws_connect(url + "/ws") as socket:
        await socket.send_str("hi")
        assert json.loads(await socket.receive_str())["backend"] == "a"
        await inflight_until(plane, lambda inflight: inflight["a"] == 1)
        await plane.set_route(route("svc", port, backends, {"a": 0, "b": 100}))
        # The socket opened before the switch stays with its backend, and counts as in flight there.
        await socket.send_str("still there")
        assert json.loads(await socket.receive_str()) == {"backend": "a", "echo": "still there"}
        assert (await plane.routes())["svc"].inflight["a"] == 1
        async with session.ws_connect(url + "/ws") as newer:
            await newer.send_str("new")
            assert json.loads(await newer.receive_str())["backend"] == "b"
    await inflight_until(plane, lambda inflight: inflight == {"a": 0, "b": 0})

    # A process that cannot be read makes the whole observation fail: never "idle" by omission.
    os.kill(plane.processes()[1].pid, signal.SIGKILL)
    with pytest.raises(DataPlaneError):
        await plane.routes()
