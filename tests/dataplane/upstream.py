"""A small aiohttp server standing in for a Ray Serve HTTP proxy: it names itself in every answer."""

from __future__ import annotations

import asyncio
import json

from aiohttp import WSMsgType, web

from servekeeper.dataplane import Endpoint
from servekeeper.providers.ports import PortAllocator


class Upstream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.port = PortAllocator().one()
        self.healthy = True
        self.requests = 0
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint("127.0.0.1", self.port)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_get("/-/healthz", self._health)
        app.router.add_get("/ws", self._websocket)
        app.router.add_get("/stream", self._stream)
        app.router.add_get("/cookies", self._cookies)
        app.router.add_get("/headers", self._headers)
        app.router.add_post("/echo", self._echo)
        app.router.add_post("/slow-reader", self._slow_reader)
        app.router.add_route("*", "/{tail:.*}", self._hello)
        return app

    async def start(self) -> Upstream:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="success" if self.healthy else "draining", status=200 if self.healthy else 503)

    async def _hello(self, request: web.Request) -> web.Response:
        self.requests += 1
        delay = float(request.query.get("sleep", "0"))
        if delay:
            await asyncio.sleep(delay)
        return web.Response(text=self.name, status=int(request.query.get("status", "200")))

    async def _slow_reader(self, request: web.Request) -> web.Response:
        """Reads the body only after `stall` seconds, as a proxy holding an upload while it waits
        for a replica: once the socket buffers fill, the sender sees a shut window."""
        await asyncio.sleep(float(request.query["stall"]))
        return web.Response(text=str(len(await request.read())))

    async def _headers(self, request: web.Request) -> web.Response:
        return web.json_response({"backend": self.name, "headers": dict(request.headers)})

    async def _cookies(self, request: web.Request) -> web.Response:
        response = web.Response(text=self.name)
        for index in range(3):
            response.headers.add("Set-Cookie", f"c{index}=v{index}; Path=/")
        return response

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        async for chunk in request.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {self.name} first\n\n".encode())
        await asyncio.sleep(float(request.query.get("pause", "1")))
        for index in range(3):
            await response.write(f"data: {index}\n\n".encode())
        await response.write_eof()
        return response

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        async for message in socket:
            if message.type == WSMsgType.TEXT:
                await socket.send_str(json.dumps({"backend": self.name, "echo": message.data}))
        return socket
