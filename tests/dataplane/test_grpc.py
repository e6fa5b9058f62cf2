"""gRPC through the second listener, speaking HTTP/2 to the backends' gRPC endpoints."""

from __future__ import annotations

import grpc

from servekeeper.dataplane import Backend
from tests.dataplane.conftest import GrpcFactory, PlaneFactory, UpstreamFactory, free_port, route


async def test_grpc_before_and_after_switch(
    make_plane: PlaneFactory, upstream: UpstreamFactory, grpc_server: GrpcFactory
) -> None:
    http_a, http_b = await upstream("a"), await upstream("b")
    a = Backend("a", (http_a.endpoint,), ((await grpc_server("a")).endpoint,))
    b = Backend("b", (http_b.endpoint,), ((await grpc_server("b")).endpoint,))
    plane = await make_plane()
    port, grpc_port = free_port(), free_port()
    await plane.set_route(route("svc", port, [a], {"a": 100}, grpc_port=grpc_port))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        say = channel.unary_unary("/echo.Echo/Say")
        assert await say(b"one", timeout=5) == b"a:one"
        await plane.set_route(route("svc", port, [a, b], {"a": 0, "b": 100}, grpc_port=grpc_port))
        assert [await say(b"two", timeout=5) for _ in range(3)] == [b"b:two"] * 3
    assert (await plane.backend_stats())["b"].rq_2xx >= 3
