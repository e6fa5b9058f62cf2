"""The daemon's HTTP API (loopback, bearer token), used by the CLI. FastAPI gives the OpenAPI
document for free, which is also what the API fuzz run reads. Routes only parse, call one
command (commands/) and return its answer; a command's refusal becomes a status in errors.py.

Every handler is `async def`, so it runs on the event loop that uvicorn shares with the
controller (see daemon.py), never in a worker thread: `controller.wake()` sets an
`asyncio.Event`, which is only safe on its own loop, and a handler's reads and writes cannot
interleave with another handler's or with a controller tick (none of them awaits in between).
The store calls are short SQLite transactions, so running them on the loop is fine."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from servekeeper.api.errors import ERROR_RESPONSES, add_error_handler
from servekeeper.api.hosts import host_routes
from servekeeper.api.nodes import node_route_cluster, node_routes
from servekeeper.api.rollouts import rollout_routes
from servekeeper.api.services import event_routes, service_routes
from servekeeper.commands.apply import ApplyCommand
from servekeeper.commands.context import CommandContext
from servekeeper.commands.hosts import HostPoolCommands
from servekeeper.commands.nodes import NodeCommands, node_token
from servekeeper.commands.rollouts import RolloutCommands
from servekeeper.commands.services import ServiceCommands
from servekeeper.controller.loop import Controller
from servekeeper.store.store import Store
from servekeeper.web.pages import Dashboard, ViewSource, dashboard_router


class ShutdownRequest(BaseModel):
    stopClusters: bool = True


def build_app(
    controller: Controller,
    store: Store,
    token: str,
    request_shutdown: Callable[[bool], Awaitable[None]],
    packages_dir: Path | None = None,
    secrets_dir: Path | None = None,
    dashboard: Dashboard | None = None,
) -> FastAPI:
    """`packages_dir`: where code packages go (the daemon's state dir); without it, a local
    workingDir is handed to Ray as a live `local://` path (unit tests of the API only).
    `secrets_dir`: `servekeeper secret`s for KubeRay's secretKeyRef (default: beside packages_dir)."""
    if secrets_dir is None and packages_dir is not None:
        secrets_dir = packages_dir.parent / "secrets"
    context = CommandContext(store, controller, packages_dir, secrets_dir)
    services, rollouts = ServiceCommands(context), RolloutCommands(context)
    app = FastAPI(title="servekeeper", version="v1alpha1", docs_url=None, redoc_url=None, responses=ERROR_RESPONSES)
    _require_token(app, token, dashboard_open=dashboard is not None)
    add_error_handler(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    app.include_router(service_routes(services, ApplyCommand(context)))
    app.include_router(rollout_routes(rollouts))
    app.include_router(event_routes(services))

    @app.post("/api/v1/shutdown")
    async def shutdown(body: ShutdownRequest) -> dict[str, Any]:
        await request_shutdown(body.stopClusters)
        return {"ok": True}

    app.include_router(host_routes(HostPoolCommands(store)))  # host pools for multi-host clusters (issue 10)
    app.include_router(node_routes(NodeCommands(context)))  # Ray's autoscaler, from a cluster's head (issue 22)
    if dashboard is not None:
        source = ViewSource(services=services.views, service=services.find, events=services.events, commands=rollouts)
        app.include_router(dashboard_router(dashboard, source))
    return app


def _require_token(app: FastAPI, token: str, *, dashboard_open: bool) -> None:
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def authorized(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # Before routing and body validation: a caller without the token learns nothing and
        # changes nothing. Only the OpenAPI document (public knowledge) is open. The dashboard
        # (/ui) takes no token: its own router requires its session cookie (web/auth.py).
        path = request.url.path
        if path != "/openapi.json" and not (dashboard_open and (path == "/ui" or path.startswith("/ui/"))):
            given = request.headers.get("authorization", "").encode()
            if not (hmac.compare_digest(given, expected) or _node_token_fits(path, given, token)):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)


def _node_token_fits(path: str, given: bytes, token: str) -> bool:
    """A cluster's node token opens that cluster's node routes, and nothing else."""
    cluster = node_route_cluster(path)
    if cluster is None:
        return False
    return hmac.compare_digest(given, f"Bearer {node_token(token, cluster)}".encode())
