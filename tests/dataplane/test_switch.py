"""Route switches: acknowledged by every process, make before break, connections kept."""

from __future__ import annotations

import asyncio

import httpx

from servekeeper.dataplane import Backend
from servekeeper.dataplane.admin import AdminClient
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, route


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

    admin = AdminClient(plane._admin()._session)  # noqa: SLF001
    for info in plane.processes():
        config = await admin.config(info.admin_port)
        assert config.route_weights["http-svc"] == {"http-a": 0, "http-b": 100}
        assert {"http-a", "http-b"} <= config.active_clusters

    # Draining done: the old backend leaves the route, and its cluster leaves every process.
    await plane.set_route(route("svc", port, [backend_b], {"b": 100}))
    for info in plane.processes():
        config = await admin.config(info.admin_port)
        assert config.active_clusters == {"http-b"}
    await asyncio.sleep(0)
