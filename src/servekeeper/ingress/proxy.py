"""The ingress's data plane: one reverse proxy worker.

One listening port per service (SO_REUSEPORT, so several workers share it) forwards every
request to the service's active cluster. It counts in-flight requests per upstream, switches
atomically, retries a refused connection once on the other upstream, and answers 503 at once
when nothing is reachable. A small control API (loopback, token) sets its routes.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger("servekeeper.ingress")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
SMALL_BODY = 256 * 1024  # read responses this small whole: cheaper than chunked streaming
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=None)
MAX_REQUEST_BYTES = 64 * 1024 * 1024
SHUTDOWN_GRACE_SECONDS = 10.0


def token_middleware(token: str):  # type: ignore[no-untyped-def]
    """Every control call must carry the bearer token, compared in constant time."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def require_token(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    return require_token


@dataclass
class Upstream:
    name: str
    url: str
    inflight: int = 0
    total: int = 0
    failed_connects: int = 0


@dataclass
class ServiceRoute:
    service: str
    port: int
    active: str | None
    upstreams: dict[str, Upstream] = field(default_factory=dict)

    def order(self) -> list[Upstream]:
        """Active first, then the others (draining clusters) as the one-time fallback."""
        first = [self.upstreams[self.active]] if self.active in self.upstreams else []
        return first + [u for name, u in self.upstreams.items() if name != self.active]

    def to_json(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "active": self.active,
            "upstreams": {
                name: {"url": u.url, "inflight": u.inflight, "total": u.total, "failedConnects": u.failed_connects}
                for name, u in self.upstreams.items()
            },
        }


class Ingress:
    def __init__(self, state_dir: Path, token: str, persist: bool = True) -> None:
        self.state_dir = state_dir
        self.token = token
        self.persist = persist  # workers under a supervisor only read the file; it writes it
        self.routes: dict[str, ServiceRoute] = {}
        self.runners: dict[str, tuple[int, web.AppRunner]] = {}
        self.session: aiohttp.ClientSession | None = None
        self.routes_file = state_dir / "ingress-routes.json"

    # -- data plane ----------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=UPSTREAM_TIMEOUT, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        for service, data in self._load_routes().items():
            with contextlib.suppress(OSError):
                await self.set_route(service, data["port"], data["active"], data["upstreams"], persist=False)

    def _handler_for(self, service: str):  # type: ignore[no-untyped-def]
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.forward(service, request)

        return handle

    async def forward(self, service: str, request: web.Request) -> web.StreamResponse:
        route = self.routes.get(service)
        if route is None or route.active is None:
            return web.Response(status=503, text="servekeeper: no ready cluster for this service\n")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = request.host
        peer = request.remote or ""
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
        body = request.content if request.body_exists else None
        if request.content_length is not None and request.content_length > MAX_REQUEST_BYTES:
            return web.Response(status=413, text="servekeeper: request body too large\n")
        last_error: Exception | None = None
        for attempt, upstream in enumerate(route.order()[:2]):
            if attempt > 0 and body is not None and body.total_bytes > 0:
                break  # the body was already partly sent: never replay it
            upstream.inflight += 1
            upstream.total += 1
            try:
                return await self._exchange(request, upstream, headers, body)
            except aiohttp.ClientConnectorError as exc:
                # Refused before anything was sent: safe to try the other cluster once.
                upstream.failed_connects += 1
                last_error = exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("[%s] upstream %s failed mid-request: %r", service, upstream.name, exc)
                return web.Response(status=502, text="servekeeper: upstream failed\n")
            finally:
                upstream.inflight -= 1
        logger.warning("[%s] no upstream reachable: %r", service, last_error)
        return web.Response(status=503, text="servekeeper: no cluster reachable\n")

    async def _exchange(
        self, request: web.Request, upstream: Upstream, headers: dict[str, str], body: Any
    ) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.request(
            request.method,
            upstream.url + request.raw_path,
            headers=headers,
            data=body,
            allow_redirects=False,
        ) as answer:
            out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
            length = answer.content_length
            if length is not None and length <= SMALL_BODY:
                payload = await answer.read()
                return web.Response(status=answer.status, reason=answer.reason, headers=out_headers, body=payload)
            response = web.StreamResponse(status=answer.status, reason=answer.reason, headers=out_headers)
            if length is not None:
                response.content_length = length
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    # -- routes --------------------------------------------------------------------------

    async def set_route(
        self, service: str, port: int, active: str | None, upstreams: dict[str, str], persist: bool = True
    ) -> None:
        current = self.routes.get(service)
        bound = self.runners.get(service)
        if bound is not None and bound[0] != port:
            await self._unbind(service)
            bound = None
        if bound is None:
            await self._bind(service, port)
        previous = current.upstreams if current else {}
        merged = {
            name: previous[name] if name in previous and previous[name].url == url else Upstream(name, url)
            for name, url in upstreams.items()
        }
        # One assignment: a request sees either the old route or the new one, never a mix.
        self.routes[service] = ServiceRoute(service=service, port=port, active=active, upstreams=merged)
        if persist and self.persist:
            self._save_routes()

    async def remove_route(self, service: str) -> None:
        self.routes.pop(service, None)
        await self._unbind(service)
        if self.persist:
            self._save_routes()

    async def _bind(self, service: str, port: int) -> None:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handler_for(service))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host="127.0.0.1", port=port, reuse_address=True, reuse_port=True, backlog=1024)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self.runners[service] = (port, runner)
        logger.info("[%s] listening on 127.0.0.1:%d", service, port)

    async def _unbind(self, service: str) -> None:
        bound = self.runners.pop(service, None)
        if bound is not None:
            await bound[1].cleanup()

    def _load_routes(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.routes_file.read_text()))
        except (OSError, ValueError):
            return {}

    def _save_routes(self) -> None:
        data = {
            name: {
                "port": route.port,
                "active": route.active,
                "upstreams": {n: u.url for n, u in route.upstreams.items()},
            }
            for name, route in self.routes.items()
        }
        tmp = self.routes_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.routes_file)

    # -- control API ---------------------------------------------------------------------

    def control_app(self) -> web.Application:
        app = web.Application(middlewares=[token_middleware(self.token)])
        app.router.add_get("/healthz", self._control_health)
        app.router.add_get("/routes", self._control_routes)
        app.router.add_put("/routes/{service}", self._control_put)
        app.router.add_delete("/routes/{service}", self._control_delete)
        return app

    async def _control_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "pid": os.getpid()})

    async def _control_routes(self, request: web.Request) -> web.Response:
        return web.json_response({"pid": os.getpid(), "services": {n: r.to_json() for n, r in self.routes.items()}})

    async def _control_put(self, request: web.Request) -> web.Response:
        service = request.match_info["service"]
        try:
            data = await request.json()
            port = int(data["port"])
            active = data.get("active")
            upstreams = {str(k): str(v) for k, v in dict(data["upstreams"]).items()}
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"bad route: {exc!r}"}, status=400)
        if active is not None and active not in upstreams:
            return web.json_response({"error": "active must be one of upstreams"}, status=400)
        try:
            await self.set_route(service, port, active, upstreams)
        except OSError as exc:
            return web.json_response({"error": f"cannot listen on port {port}: {exc.strerror}"}, status=409)
        return web.json_response(self.routes[service].to_json())

    async def _control_delete(self, request: web.Request) -> web.Response:
        await self.remove_route(request.match_info["service"])
        return web.json_response({"ok": True})

    async def close(self) -> None:
        for service in list(self.runners):
            await self._unbind(service)
        if self.session is not None:
            await self.session.close()

    def inflight_total(self) -> int:
        return sum(u.inflight for r in self.routes.values() for u in r.upstreams.values())
