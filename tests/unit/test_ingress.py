"""The ingress against real HTTP upstreams on loopback (no Ray needed to test the proxy itself)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from servekeeper.ingress.proxy import Ingress
from servekeeper.ports import PortAllocator
from tests.unit.http_stub import serve_everything


async def start_upstream(name: str, gate: asyncio.Event | None = None) -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path == "/slow" and gate is not None:
            await gate.wait()
        if request.path == "/big":
            return web.Response(body=b"x" * (1024 * 1024))
        body = await request.read()
        return web.json_response(
            {
                "upstream": name,
                "path": request.path_qs,
                "method": request.method,
                "body": body.decode(),
                "xff": request.headers.get("X-Forwarded-For"),
                "custom": request.headers.get("X-Custom"),
            }
        )

    return await serve_everything(answer)


@pytest.fixture
async def ingress(tmp_path: Path) -> AsyncIterator[Ingress]:
    proxy = Ingress(tmp_path, token="secret")
    await proxy.start()
    yield proxy
    await proxy.close()


async def get(port: int, path: str = "/", **kwargs: object) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}{path}", **kwargs) as r:
        return r.status, await r.text()


async def test_forwards_to_the_active_upstream_and_switches_atomically(ingress: Ingress) -> None:
    a, a_url = await start_upstream("a")
    b, b_url = await start_upstream("b")
    port = PortAllocator().one()
    await ingress.set_route("svc", port, "a", {"a": a_url})
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{port}/x/y?q=1", data=b"payload", headers={"X-Custom": "kept"}
        ) as response:
            data = await response.json()
    assert data == {
        "upstream": "a",
        "path": "/x/y?q=1",
        "method": "POST",
        "body": "payload",
        "xff": "127.0.0.1",
        "custom": "kept",
    }
    await ingress.set_route("svc", port, "b", {"b": b_url, "a": a_url})
    status, text = await get(port)
    assert status == 200 and '"upstream": "b"' in text
    assert ingress.routes["svc"].upstreams["a"].total == 1
    await a.cleanup()
    await b.cleanup()


async def test_large_responses_are_streamed_through(ingress: Ingress) -> None:
    a, a_url = await start_upstream("a")
    port = PortAllocator().one()
    await ingress.set_route("svc", port, "a", {"a": a_url})
    status, text = await get(port, "/big")
    assert status == 200 and len(text) == 1024 * 1024
    await a.cleanup()


async def test_in_flight_requests_are_counted_per_upstream(ingress: Ingress) -> None:
    gate = asyncio.Event()
    a, a_url = await start_upstream("a", gate)
    b, b_url = await start_upstream("b")
    port = PortAllocator().one()
    await ingress.set_route("svc", port, "a", {"a": a_url})
    slow = asyncio.create_task(get(port, "/slow"))
    for _ in range(100):
        if ingress.routes["svc"].upstreams["a"].inflight == 1:
            break
        await asyncio.sleep(0.01)
    assert ingress.routes["svc"].upstreams["a"].inflight == 1
    # Switch while the request is in flight: it is still counted against the old upstream.
    await ingress.set_route("svc", port, "b", {"b": b_url, "a": a_url})
    assert ingress.routes["svc"].upstreams["a"].inflight == 1
    assert (await get(port))[1].count('"b"') == 1
    gate.set()
    assert (await slow)[0] == 200
    assert ingress.routes["svc"].upstreams["a"].inflight == 0
    await a.cleanup()
    await b.cleanup()


async def test_connection_refused_is_retried_once_on_the_other_upstream(ingress: Ingress) -> None:
    b, b_url = await start_upstream("b")
    dead_url = f"http://127.0.0.1:{PortAllocator().one()}"
    port = PortAllocator().one()
    await ingress.set_route("svc", port, "dead", {"dead": dead_url, "b": b_url})
    status, text = await get(port)
    assert status == 200 and '"upstream": "b"' in text
    assert ingress.routes["svc"].upstreams["dead"].failed_connects == 1
    await b.cleanup()


async def test_no_ready_cluster_answers_503_at_once(ingress: Ingress) -> None:
    port = PortAllocator().one()
    dead_url = f"http://127.0.0.1:{PortAllocator().one()}"
    await ingress.set_route("svc", port, "dead", {"dead": dead_url})
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _ = await get(port)
    assert status == 503
    assert loop.time() - started < 2
    await ingress.set_route("svc", port, None, {})
    assert (await get(port))[0] == 503


async def test_oversized_request_is_rejected_and_others_still_served(ingress: Ingress) -> None:
    a, a_url = await start_upstream("a")
    port = PortAllocator().one()
    await ingress.set_route("svc", port, "a", {"a": a_url})
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{port}/", data=b"x" * 10, headers={"Content-Length": str(10**10)}
        ) as response:
            assert response.status == 413
    assert (await get(port))[0] == 200
    await a.cleanup()


async def test_control_api_requires_the_token(ingress: Ingress) -> None:
    runner = web.AppRunner(ingress.control_app())
    await runner.setup()
    port = PortAllocator().one()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/routes") as response:
            assert response.status == 401
        async with session.put(
            f"http://127.0.0.1:{port}/routes/x",
            json={"port": 1, "upstreams": {}},
            headers={"Authorization": "Bearer wrong"},
        ) as response:
            assert response.status == 401
        async with session.get(
            f"http://127.0.0.1:{port}/routes", headers={"Authorization": "Bearer secret"}
        ) as response:
            assert response.status == 200 and (await response.json())["services"] == {}
    assert ingress.routes == {}
    await runner.cleanup()


async def test_a_restarted_ingress_serves_its_saved_routes_at_once(tmp_path: Path) -> None:
    a, a_url = await start_upstream("a")
    port = PortAllocator().one()
    first = Ingress(tmp_path, token="t")
    await first.start()
    await first.set_route("svc", port, "a", {"a": a_url})
    await first.close()
    second = Ingress(tmp_path, token="t")
    await second.start()
    assert (await get(port))[0] == 200
    await second.close()
    await a.cleanup()
