"""HTTP through the Envoy listener: streaming, upgrades, headers, bodies, protocol versions."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest

from servekeeper.dataplane import Backend, DataPlane
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, route
from tests.dataplane.upstream import Upstream


@pytest.fixture
async def served(make_plane: PlaneFactory, upstream: UpstreamFactory) -> tuple[DataPlane, Upstream, int]:
    a = await upstream("a")
    plane = await make_plane()
    port = free_port()
    await plane.set_route(route("svc", port, [Backend("a", (a.endpoint,))], {"a": 100}, max_request_bytes=4 << 20))
    return plane, a, port


async def _first_chunk_seconds(url: str) -> float:
    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        async with client.stream("GET", url, params={"pause": "1"}) as response:
            async for _ in response.aiter_raw():
                return time.perf_counter() - started
    raise AssertionError("no chunk")


async def test_streamed_response_is_not_buffered(served: tuple[DataPlane, Upstream, int]) -> None:
    _, a, port = served
    direct = await _first_chunk_seconds(f"http://127.0.0.1:{a.port}/stream")
    proxied = await _first_chunk_seconds(f"http://127.0.0.1:{port}/stream")
    assert direct < 0.5 and proxied - direct < 0.05, (direct, proxied)


async def test_headers_bodies_and_limits(served: tuple[DataPlane, Upstream, int]) -> None:
    _, _, port = served
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        cookies = (await client.get("/cookies")).headers.get_list("set-cookie")
        assert cookies == ["c0=v0; Path=/", "c1=v1; Path=/", "c2=v2; Path=/"]

        seen = (await client.get("/headers")).json()["headers"]
        lowered = {k.lower(): v for k, v in seen.items()}
        # Envoy writes the peer's address; for a loopback peer it writes this host's own address.
        ipaddress.ip_address(lowered["x-forwarded-for"])
        assert lowered["x-forwarded-proto"] == "http"
        assert len(lowered["x-request-id"]) >= 32

        body = os.urandom(3 << 20)  # under the 4 MiB limit of this route
        assert (await client.post("/echo", content=body)).content == body

        async def chunked(total: int) -> AsyncIterator[bytes]:
            for _ in range(total // 65536):
                yield b"x" * 65536

        assert (await client.post("/echo", content=chunked(5 << 20))).status_code == 413
        assert (await client.post("/echo", content=b"x" * (5 << 20))).status_code == 413


async def test_default_limit_passes_ten_mebibytes(make_plane: PlaneFactory, upstream: UpstreamFactory) -> None:
    a = await upstream("a")
    plane = await make_plane(processes=1)
    port = free_port()
    await plane.set_route(route("svc", port, [Backend("a", (a.endpoint,))], {"a": 100}))
    body = os.urandom(10 << 20)
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"http://127.0.0.1:{port}/echo", content=body)
    assert answer.status_code == 200 and answer.content == body


async def test_http10_and_h2c_clients(served: tuple[DataPlane, Upstream, int]) -> None:
    _, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)  # HTTP/1.0: the server closes after the answer
    writer.close()
    assert raw.split(b"\r\n", 1)[0].endswith(b"200 OK") and raw.endswith(b"a")

    async with httpx.AsyncClient(http1=False, http2=True) as client:
        answer = await client.get(f"http://127.0.0.1:{port}/")
    assert answer.http_version == "HTTP/2" and answer.text == "a"


async def test_websocket_before_and_after_switch(make_plane: PlaneFactory, upstream: UpstreamFactory) -> None:
    a, b = await upstream("a"), await upstream("b")
    plane = await make_plane()
    port = free_port()
    backends = [Backend("a", (a.endpoint,)), Backend("b", (b.endpoint,))]
    await plane.set_route(route("svc", port, backends, {"a": 100, "b": 0}))
    url = f"http://127.0.0.1:{port}/ws"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as before:
        await before.send_str("one")
        assert json.loads(await before.receive_str()) == {"backend": "a", "echo": "one"}
        await plane.set_route(route("svc", port, backends, {"a": 0, "b": 100}))
        for text in ("two", "three"):
            await before.send_str(text)
            assert json.loads(await before.receive_str()) == {"backend": "a", "echo": text}
        async with session.ws_connect(url) as after:
            await after.send_str("four")
            assert json.loads(await after.receive_str()) == {"backend": "b", "echo": "four"}
