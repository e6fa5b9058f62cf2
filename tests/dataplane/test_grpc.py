"""gRPC through the second listener, speaking HTTP/2 to the backends' gRPC endpoints."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from servekeeper.dataplane import Backend, Endpoint
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, route

GrpcFactory = Callable[[str], Awaitable[Endpoint]]


@pytest.fixture
async def grpc_server() -> AsyncIterator[GrpcFactory]:
    servers: list[grpc.aio.Server] = []

    async def make(name: str) -> Endpoint:
        async def say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return name.encode() + b":" + request

        # A generic handler without serializers: raw bytes in and out, no generated code.
        handler = grpc.method_handlers_generic_handler("echo.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
        return Endpoint("127.0.0.1", port)

    yield make
    for server in servers:
        await server.stop(None)


async def test_grpc_before_and_after_switch(
    make_plane: PlaneFactory, upstream: UpstreamFactory, grpc_server: GrpcFactory
) -> None:
    http_a, http_b = await upstream("a"), await upstream("b")
    a = Backend("a", (http_a.endpoint,), (await grpc_server("a"),))
    b = Backend("b", (http_b.endpoint,), (await grpc_server("b"),))
    plane = await make_plane()
    port, grpc_port = free_port(), free_port()
    await plane.set_route(route("svc", port, [a], {"a": 100}, grpc_port=grpc_port))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        say = channel.unary_unary("/echo.Echo/Say")
        assert await say(b"one", timeout=5) == b"a:one"
        await plane.set_route(route("svc", port, [a, b], {"a": 0, "b": 100}, grpc_port=grpc_port))
        assert [await say(b"two", timeout=5) for _ in range(3)] == [b"b:two"] * 3
    assert (await plane.backend_stats())["b"].rq_2xx >= 3
