"""The web dashboard, served by the daemon on the API's port under `/ui/<path key>`.

Pages are rendered on the server with Jinja2 from the same service views the CLI prints
(`views/service.py`) and the same rollout phase as `rollout status` (`views/rollout.py`); the
live parts are fragments that htmx (vendored under `static/`, no build step) polls every
second. Every dashboard path, the login included, starts with this daemon's secret path key,
which is also the session cookie's `Path` (see `auth.py`); every one but the login needs the
session cookie; the API's bearer token is never accepted or needed here. Templates build every
link from `ui`, the dashboard's base path.

The rollout buttons (promote, abort, undo) POST to `<base>/services/NAME/...` and run the same
commands as the API (`commands.rollouts.RolloutCommands`); a refusal answers with the API's
status for it (`api/errors.py`). Besides the session, a POST must carry the session's CSRF token
in a header (htmx adds it from the page) and say that it comes from this origin: an `Origin`
equal to ours or `Sec-Fetch-Site: same-origin` (every current browser sends both on a fetch);
one that says nothing is refused. The session cookie is `SameSite=Strict`, but another port of
127.0.0.1 is the same *site*, so that alone is not enough.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, select_autoescape

from servekeeper.commands.errors import CommandError, detail_of, status_of
from servekeeper.views.rollout import rollout_status
from servekeeper.web.auth import CSRF_HEADER, SESSION_COOKIE, DashboardAuth
from servekeeper.web.charts import legend_color, line_chart
from servekeeper.web.stats import StatsHistory, series, service_backends

CHART_SECONDS = 300.0
# `same-origin`, not `no-referrer`: the secret path stays out of any other site's Referer, and
# a same-origin POST keeps its real `Origin` (under `no-referrer` browsers send `Origin: null`).
PAGE_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "same-origin"}
LOGIN_HINT = "log in with the URL that `servekeeper dashboard` prints"

View = dict[str, Any]


@dataclass
class Dashboard:
    """What the daemon keeps for the dashboard: logins and the ingress stats history."""

    auth: DashboardAuth = field(default_factory=DashboardAuth)
    history: StatsHistory = field(default_factory=StatsHistory)


class Commands(Protocol):
    """The rollout commands (`commands.rollouts.RolloutCommands`); a refusal is a CommandError."""

    async def promote(self, name: str, full: bool) -> dict[str, Any]: ...

    async def abort(self, name: str) -> dict[str, Any]: ...

    async def undo(self, name: str, to_revision: int | None) -> dict[str, Any]: ...

    def history(self, name: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ViewSource:
    """How the dashboard reads state, and acts on it: the API's own view functions and commands."""

    services: Callable[[], list[View]]
    service: Callable[[str], View | None]
    events: Callable[[str, int], list[View]]
    commands: Commands | None = None  # None: no buttons, no history


def undo_possible(view: Mapping[str, Any], revisions: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a plain `undo` has somewhere to go: an earlier revision that rolled out."""
    generation = int(view.get("generation", 0))
    return any(r["revision"] < generation and r["outcome"] == "Succeeded" for r in revisions)


def _templates(base_path: str) -> Jinja2Templates:
    env = Environment(loader=PackageLoader("servekeeper.web", "templates"), autoescape=select_autoescape(["html"]))
    env.globals["ui"] = base_path
    env.filters["when"] = lambda t: time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"
    env.globals["legend_color"] = legend_color
    return Jinja2Templates(env=env)


def _clusters(view: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    found: list[tuple[str, Mapping[str, Any]]] = []
    if view.get("activeCluster"):
        found.append(("active", view["activeCluster"]))
    if view.get("pendingCluster"):
        found.append(("pending", view["pendingCluster"]))
    if view.get("standbyCluster"):
        found.append((f"standby ({view.get('standby', 'building')})", view["standbyCluster"]))
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


def _service_context(source: ViewSource, auth: DashboardAuth, request: Request, name: str) -> dict[str, Any]:
    view = source.service(name)
    if view is None:
        raise HTTPException(status_code=404, detail=f"service {name!r} not found")
    events = source.events(name, 40)
    clusters = _clusters(view)
    revisions = source.commands.history(name)["revisions"] if source.commands is not None else []
    session_id = request.cookies.get(SESSION_COOKIE) or ""
    return {
        "view": view,
        "clusters": clusters,
        "status": rollout_status(view, events),
        "events": list(reversed(events)),
        "canary": (view.get("pendingCluster") or {}).get("canary"),
        "commands": source.commands is not None,
        "revisions": list(reversed(revisions)),  # newest first
        "can_undo": undo_possible(view, revisions),
        "csrf_token": auth.csrf_token(session_id) if source.commands is not None else None,
    }


def dashboard_router(dashboard: Dashboard, source: ViewSource, clock: Callable[[], float] = time.time) -> APIRouter:
    auth = dashboard.auth
    templates = _templates(auth.base_path)

    def session(request: Request, key: str) -> None:
        # A wrong path key answers as a missing session does: whether a path exists says nothing.
        if not auth.path_key_valid(key) or not auth.valid(request.cookies.get(SESSION_COOKIE)):
            raise HTTPException(status_code=401, detail=LOGIN_HINT)

    router = APIRouter()
    pages = APIRouter(prefix="/ui/{key}", dependencies=[Depends(session)], default_response_class=HTMLResponse)

    _login_routes(router, auth)

    def service_context(request: Request, name: str) -> dict[str, Any]:
        return _service_context(source, auth, request, name)

    @pages.get("", include_in_schema=False)
    async def services_page(request: Request) -> Response:
        return templates.TemplateResponse(request, "services.html", {"views": source.services()}, headers=PAGE_HEADERS)

    @pages.get("/fragments/services", include_in_schema=False)
    async def services_fragment(request: Request) -> Response:
        return templates.TemplateResponse(request, "_services.html", {"views": source.services()}, headers=PAGE_HEADERS)

    @pages.get("/services/{name}", include_in_schema=False)
    async def service_page(request: Request, name: str) -> Response:
        return templates.TemplateResponse(request, "service.html", service_context(request, name), headers=PAGE_HEADERS)

    @pages.get("/services/{name}/live", include_in_schema=False)
    async def service_fragment(request: Request, name: str) -> Response:
        context = service_context(request, name)
        return templates.TemplateResponse(request, "_service.html", context, headers=PAGE_HEADERS)

    @pages.get("/services/{name}/charts", include_in_schema=False)
    async def charts_fragment(request: Request, name: str) -> Response:
        view = source.service(name)
        known = [c["name"] for _, c in _clusters(view)] if view else []
        backends, svgs = charts(dashboard.history, name, known, clock())
        context = {"name": name, "charts": svgs, "backends": backends}
        return templates.TemplateResponse(request, "_charts.html", context, headers=PAGE_HEADERS)

    @pages.get("/static/htmx.min.js", include_in_schema=False)
    async def htmx() -> Response:
        script = resources.files("servekeeper.web").joinpath("static/htmx.min.js").read_bytes()
        return Response(script, media_type="text/javascript", headers={"Cache-Control": "private, max-age=3600"})

    if source.commands is not None:
        _command_routes(pages, templates, auth, source.commands)
    router.include_router(pages)
    return router


def _login_routes(router: APIRouter, auth: DashboardAuth) -> None:
    """The one-time login code (behind the API token) and its exchange for a session cookie."""

    @router.post("/api/v1/dashboard/login-codes")
    async def login_code() -> dict[str, Any]:
        """A one-time login path, secret path key and code (behind the API's bearer token like
        every /api path)."""
        return {"path": f"{auth.base_path}/login?code={auth.new_code()}", "expiresInSeconds": auth.code_seconds}

    @router.get("/ui", include_in_schema=False)
    async def no_path_key() -> Response:
        return HTMLResponse(f"<h1>401</h1><p>{LOGIN_HINT}.</p>", status_code=401, headers=PAGE_HEADERS)

    @router.get("/ui/{key}/login", include_in_schema=False)
    async def login(key: str, code: str = "") -> Response:
        # A wrong path key (another daemon's link) does not spend the code.
        session_id = auth.exchange(code) if auth.path_key_valid(key) else None
        if session_id is None:
            return HTMLResponse(
                "<h1>401</h1><p>This login link is spent or expired: run <code>servekeeper dashboard</code> again.</p>",
                status_code=401,
                headers=PAGE_HEADERS,
            )
        response = RedirectResponse(auth.base_path, status_code=303, headers=PAGE_HEADERS)
        response.set_cookie(
            SESSION_COOKIE,
            session_id,
            max_age=int(auth.session_seconds),
            path=auth.base_path,  # sent to this dashboard only, not to /ui/ of another port
            httponly=True,
            samesite="strict",
        )
        return response


def _command_routes(pages: APIRouter, templates: Jinja2Templates, auth: DashboardAuth, commands: Commands) -> None:
    """POST routes of the rollout buttons; each answers a fragment saying what was done (or why not)."""

    def same_origin(request: Request) -> None:
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        origin = request.headers.get("origin")
        fetch_site = request.headers.get("sec-fetch-site")
        if origin is not None and origin != own:
            raise HTTPException(status_code=403, detail=f"cross-origin request from {origin} refused")
        if fetch_site is not None and fetch_site != "same-origin":
            raise HTTPException(status_code=403, detail="cross-site request refused")
        if origin is None and fetch_site is None:  # a browser says; a request that does not is no page of ours
            raise HTTPException(status_code=403, detail="a POST must say where it comes from: Origin or Sec-Fetch-Site")
        if not auth.csrf_valid(request.cookies.get(SESSION_COOKIE), request.headers.get(CSRF_HEADER)):
            raise HTTPException(status_code=403, detail="missing or wrong CSRF token: reload the page")

    async def run(
        request: Request, command: Awaitable[dict[str, Any]], done: Callable[[dict[str, Any]], str]
    ) -> Response:
        try:
            result = await command
        except CommandError as exc:  # refused (409 nothing to promote, ...): say why, change nothing
            context = {"ok": False, "message": str(detail_of(exc))}
            return templates.TemplateResponse(
                request, "_action.html", context, status_code=status_of(exc), headers=PAGE_HEADERS
            )
        return templates.TemplateResponse(
            request, "_action.html", {"ok": True, "message": done(result)}, headers=PAGE_HEADERS
        )

    checked = [Depends(same_origin)]

    @pages.post("/services/{name}/promote", dependencies=checked, include_in_schema=False)
    async def promote(request: Request, name: str, full: bool = False) -> Response:
        def done(result: dict[str, Any]) -> str:
            if result["full"]:
                return f"promoting {result['cluster']} fully: every remaining step skipped"
            return f"promoting {result['cluster']} (promote #{result['promoteRequests']})"

        return await run(request, commands.promote(name, full), done)

    @pages.post("/services/{name}/abort", dependencies=checked, include_in_schema=False)
    async def abort(request: Request, name: str) -> Response:
        return await run(request, commands.abort(name), lambda r: f"aborting the rollout of {r['cluster']}")

    @pages.post("/services/{name}/undo", dependencies=checked, include_in_schema=False)
    async def undo(request: Request, name: str, toRevision: int | None = None) -> Response:
        def done(result: dict[str, Any]) -> str:
            if not result["changed"]:
                return f"unchanged: revision {result['toRevision']}'s spec is already the current one"
            return f"rolling back to revision {result['toRevision']} (generation {result['generation']})"

        return await run(request, commands.undo(name, toRevision), done)
