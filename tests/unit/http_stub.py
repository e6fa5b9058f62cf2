"""A real HTTP server on loopback that answers every path with one handler (for adapter tests)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from servekeeper.providers.ports import PortAllocator


async def serve_everything(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = PortAllocator().one()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
