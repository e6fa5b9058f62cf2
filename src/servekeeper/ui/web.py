"""The web dashboard at `/ui`, served by the daemon on the API's port.

Pages are rendered on the server with Jinja2 from the same service views the CLI prints
(`core/views.py`) and the same rollout phase as `rollout status` (`core/rollout_view.py`); the
live parts are fragments that htmx (vendored under `static/`, no build step) polls every
second. Every `/ui` path but the login needs the session cookie (see `auth.py`); the API's
bearer token is never accepted or needed here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, select_autoescape

from servekeeper.core.rollout_view import rollout_status
from servekeeper.ui.auth import SESSION_COOKIE, DashboardAuth
from servekeeper.ui.charts import legend_color, line_chart
from servekeeper.ui.stats import StatsHistory, series, service_backends

CHART_SECONDS = 300.0
NO_STORE = {"Cache-Control": "no-store"}

View = dict[str, Any]


@dataclass
class Dashboard:
    """What the daemon keeps for the dashboard: logins and the ingress stats history."""

    auth: DashboardAuth = field(default_factory=DashboardAuth)
    history: StatsHistory = field(default_factory=StatsHistory)


@dataclass(frozen=True)
class ViewSource:
    """How the dashboard reads state: the API's own view functions."""

    services: Callable[[], list[View]]
    service: Callable[[str], View | None]
    events: Callable[[str, int], list[View]]


def _templates() -> Jinja2Templates:
    env = Environment(loader=PackageLoader("servekeeper.ui", "templates"), autoescape=select_autoescape(["html"]))
    env.filters["when"] = lambda t: time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"
    env.globals["legend_color"] = legend_color
    return Jinja2Templates(env=env)


def _clusters(view: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    found: list[tuple[str, Mapping[str, Any]]] = []
    if view.get("activeCluster"):
        found.append(("active", view["activeCluster"]))
    if view.get("pendingCluster"):
        found.append(("pending", view["pendingCluster"]))
    found += [(c["role"], c) for c in view.get("otherClusters", [])]
    return found


def charts(history: StatsHistory, service: str, known: Sequence[str], now: float) -> tuple[list[str], list[str]]:
    """(the service's backends, in legend order; the request, error and p99 charts)."""
    samples = [s for s in history.samples() if s.time >= now - CHART_SECONDS - history.sample_seconds]
    backends = service_backends(samples, service, known)
    per_backend = series(samples, backends)
    start = now - CHART_SECONDS
    return backends, [
        line_chart("requests", "req/s", {n: s.rate for n, s in per_backend.items()}, start, now),
        line_chart("errors", "5xx/s", {n: s.errors for n, s in per_backend.items()}, start, now),
        line_chart("p99 latency", "ms", {n: s.p99_ms for n, s in per_backend.items()}, start, now),
    ]


def dashboard_router(dashboard: Dashboard, source: ViewSource, clock: Callable[[], float] = time.time) -> APIRouter:
    templates = _templates()
    auth = dashboard.auth

    def session(request: Request) -> None:
        if not auth.valid(request.cookies.get(SESSION_COOKIE)):
            raise HTTPException(status_code=401, detail="log in with the URL that `servekeeper dashboard` prints")

    router = APIRouter()
    pages = APIRouter(prefix="/ui", dependencies=[Depends(session)], default_response_class=HTMLResponse)

    @router.post("/api/v1/dashboard/login-codes")
    async def login_code() -> dict[str, Any]:
        """A one-time code for `/ui/login` (behind the API's bearer token like every /api path)."""
        return {"path": f"/ui/login?code={auth.new_code()}", "expiresInSeconds": auth.code_seconds}

    @router.get("/ui/login", include_in_schema=False)
    async def login(code: str = "") -> Response:
        session_id = auth.exchange(code)
        if session_id is None:
            return HTMLResponse(
                "<h1>401</h1><p>This login link is spent or expired: run <code>servekeeper dashboard</code> again.</p>",
                status_code=401,
                headers=NO_STORE,
            )
        response = RedirectResponse("/ui", status_code=303, headers=NO_STORE)
        response.set_cookie(
            SESSION_COOKIE,
            session_id,
            max_age=int(auth.session_seconds),
            path="/ui",
            httponly=True,
            samesite="strict",
        )
        return response

    def service_context(name: str) -> dict[str, Any]:
        view = source.service(name)
        if view is None:
            raise HTTPException(status_code=404, detail=f"service {name!r} not found")
        events = source.events(name, 40)
        clusters = _clusters(view)
        return {
            "view": view,
            "clusters": clusters,
            "status": rollout_status(view, events),
            "events": list(reversed(events)),
        }

    @pages.get("", include_in_schema=False)
    async def services_page(request: Request) -> Response:
        return templates.TemplateResponse(request, "services.html", {"views": source.services()}, headers=NO_STORE)

    @pages.get("/fragments/services", include_in_schema=False)
    async def services_fragment(request: Request) -> Response:
        return templates.TemplateResponse(request, "_services.html", {"views": source.services()}, headers=NO_STORE)

    @pages.get("/services/{name}", include_in_schema=False)
    async def service_page(request: Request, name: str) -> Response:
        return templates.TemplateResponse(request, "service.html", service_context(name), headers=NO_STORE)

    @pages.get("/services/{name}/live", include_in_schema=False)
    async def service_fragment(request: Request, name: str) -> Response:
        return templates.TemplateResponse(request, "_service.html", service_context(name), headers=NO_STORE)

    @pages.get("/services/{name}/charts", include_in_schema=False)
    async def charts_fragment(request: Request, name: str) -> Response:
        view = source.service(name)
        known = [c["name"] for _, c in _clusters(view)] if view else []
        backends, svgs = charts(dashboard.history, name, known, clock())
        context = {"name": name, "charts": svgs, "backends": backends}
        return templates.TemplateResponse(request, "_charts.html", context, headers=NO_STORE)

    @pages.get("/static/htmx.min.js", include_in_schema=False)
    async def htmx() -> Response:
        script = resources.files("servekeeper.ui").joinpath("static/htmx.min.js").read_bytes()
        return Response(script, media_type="text/javascript", headers={"Cache-Control": "private, max-age=3600"})

    router.include_router(pages)
    return router
