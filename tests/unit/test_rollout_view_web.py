"""The web dashboard without a daemon: login codes and sessions, the stats history and its
rates, the SVG charts, and the /ui routes on a FastAPI app with fake views."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from servekeeper.dataplane import BackendStats
from servekeeper.web.auth import SESSION_COOKIE, DashboardAuth
from servekeeper.web.charts import line_chart
from servekeeper.web.pages import Dashboard, ViewSource, dashboard_router
from servekeeper.web.stats import Sample, StatsHistory, series, service_backends
from tests.unit.test_rollout_view import OLD, cluster, pending, view


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_login_code_works_once_and_expires() -> None:
    clock = FakeClock()
    auth = DashboardAuth(clock=clock, code_seconds=60, session_seconds=600)
    code = auth.new_code()
    session = auth.exchange(code)
    assert session is not None and auth.valid(session)
    assert auth.exchange(code) is None  # spent
    late = auth.new_code()
    clock.now += 61
    assert auth.exchange(late) is None  # expired
    assert auth.valid(session)
    clock.now += 600
    assert not auth.valid(session)
    assert not auth.valid(None) and not auth.valid("") and not auth.valid("guess")


def stats(total: int, errors: int = 0, buckets: dict[float, int] | None = None) -> BackendStats:
    return BackendStats(backend="x", rq_total=total, rq_5xx=errors, latency_ms_buckets=buckets or {})


def test_series_turns_counters_into_rates_and_p99() -> None:
    samples = [
        Sample(0.0, {"a": stats(0, 0, {5.0: 0, 10.0: 0, 100.0: 0})}),
        Sample(2.0, {"a": stats(200, 2, {5.0: 150, 10.0: 197, 100.0: 200})}),
        Sample(4.0, {"a": stats(200, 2, {5.0: 150, 10.0: 197, 100.0: 200}), "b": stats(10)}),
        Sample(6.0, {"a": stats(50), "b": stats(30)}),  # a's Envoy restarted: counters back near 0
    ]
    result = series(samples)
    assert result["a"].rate == [(2.0, 100.0), (4.0, 0.0), (6.0, 0.0)]
    assert result["a"].errors == [(2.0, 1.0), (4.0, 0.0), (6.0, 0.0)]
    assert result["a"].p99_ms == [(2.0, 100.0), (4.0, None), (6.0, None)]
    assert result["b"].rate == [(4.0, 5.0), (6.0, 10.0)]


def test_history_is_a_ring_buffer() -> None:
    history = StatsHistory(sample_seconds=2, history_seconds=10)
    for second in range(0, 40, 2):
        history.add(float(second), {})
    assert [s.time for s in history.samples()] == [28.0, 30.0, 32.0, 34.0, 36.0, 38.0]


def test_service_backends_by_cluster_name() -> None:
    samples = [Sample(0, {"hello-g1-abc123": stats(1), "hello2-g1-abc123": stats(1), "hello-gx": stats(1)})]
    assert service_backends(samples, "hello", ["hello-g2-def456"]) == ["hello-g1-abc123", "hello-g2-def456"]


def test_chart_is_svg_with_escaped_names_and_gaps() -> None:
    svg = line_chart("requests", "req/s", {"<b>": [(0.0, 1.0), (1.0, 2.0), (2.0, None), (3.0, 4.0)]}, 0.0, 4.0)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "&lt;b&gt;" in svg and "<b>" not in svg
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1  # the None broke the line
    assert ">4.40<" in svg  # the y axis tops out 10% above the peak


SERVICE = view(active=OLD, pending=pending())


@pytest.fixture
def dashboard() -> Dashboard:
    return Dashboard(auth=DashboardAuth())


@pytest.fixture
def client(dashboard: Dashboard) -> TestClient:
    views = {"hello": SERVICE}
    source = ViewSource(
        services=lambda: list(views.values()),
        service=views.get,
        events=lambda name, limit: [
            {"service": name, "time": 1.0, "type": "Normal", "reason": "ClusterCreating", "message": "creating"}
        ],
    )
    app = FastAPI()
    app.include_router(dashboard_router(dashboard, source, clock=lambda: 1000.0))
    return TestClient(app, base_url="http://127.0.0.1")


def login(client: TestClient) -> str:
    """Log in as `servekeeper dashboard` does; the dashboard's (secret) base path."""
    path = client.post("/api/v1/dashboard/login-codes").json()["path"]
    base = path.split("/login?")[0]
    response = client.get(path, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == base
    cookie = response.headers["set-cookie"]
    for attribute in ("HttpOnly", "SameSite=strict", f"Path={base};", "Max-Age=3600"):
        assert attribute.lower() in cookie.lower()
    return base


def test_the_session_cookie_is_bound_to_a_secret_path_of_this_daemon(client: TestClient) -> None:
    """Issue 19, defect 8: browsers send a cookie to every port of 127.0.0.1, so with `Path=/ui`
    a server on another port got the session. The dashboard and its cookie's Path are under a
    path key of this daemon's, unguessable and different for every daemon."""
    path = client.post("/api/v1/dashboard/login-codes").json()["path"]
    found = re.fullmatch(r"/ui/([A-Za-z0-9_-]{22,})/login\?code=[A-Za-z0-9_-]+", path)
    assert found is not None, path
    key = found.group(1)
    assert DashboardAuth().base_path != f"/ui/{key}" and DashboardAuth().base_path.startswith("/ui/")
    response = client.get(path, follow_redirects=False)
    assert response.headers["location"] == f"/ui/{key}"
    assert f"Path=/ui/{key};" in response.headers["set-cookie"]
    assert client.get(f"/ui/{key}").status_code == 200
    # The cookie goes with requests under the key only (the jar keeps its Path, as a browser does).
    session = client.cookies.get(SESSION_COOKIE)
    assert session
    for elsewhere in ("/ui", f"/ui/{key[:-1]}", "/ui/services/hello"):
        sent = client.build_request("GET", elsewhere)
        assert SESSION_COOKIE not in sent.headers.get("cookie", ""), elsewhere
    # With the session but another key (a guess, or an old daemon's link): 401, and a code is not spent.
    cookies = {"Cookie": f"{SESSION_COOKIE}={session}"}
    other = key[:-1] + ("a" if key[-1] != "a" else "b")
    assert client.get(f"/ui/{other}", headers=cookies).status_code == 401
    assert client.get(f"/ui/{other}/services/hello", headers=cookies).status_code == 401
    waiting = client.post("/api/v1/dashboard/login-codes").json()["path"]
    assert client.get(waiting.replace(key, "not-the-key"), follow_redirects=False).status_code == 401
    assert client.get(waiting, follow_redirects=False).status_code == 303


@pytest.mark.parametrize(
    "path", ["", "/services/hello", "/services/hello/live", "/fragments/services", "/static/htmx.min.js"]
)
def test_every_page_needs_the_session(client: TestClient, dashboard: Dashboard, path: str) -> None:
    assert client.get(dashboard.auth.base_path + path).status_code == 401
    client.cookies.set(SESSION_COOKIE, "forged")
    assert client.get(dashboard.auth.base_path + path).status_code == 401
    assert client.get("/ui").status_code == 401  # the old address says how to log in


def test_a_spent_code_gets_401(client: TestClient) -> None:
    path = client.post("/api/v1/dashboard/login-codes").json()["path"]
    assert client.get(path, follow_redirects=False).status_code == 303
    client.cookies.clear()
    assert client.get(path, follow_redirects=False).status_code == 401
    assert client.get(path.split("?")[0] + "?code=nonsense").status_code == 401


def test_pages_after_login(client: TestClient, dashboard: Dashboard) -> None:
    base = login(client)
    listing = client.get(base)
    assert listing.status_code == 200 and listing.headers["cache-control"] == "no-store"
    assert listing.headers["referrer-policy"] == "same-origin"
    assert 'data-service="hello"' in listing.text and "hello-g1-aaaaaa" in listing.text
    assert f'href="{base}/services/hello"' in listing.text and f'hx-get="{base}/fragments/services"' in listing.text
    assert f'<script src="{base}/static/htmx.min.js">' in listing.text
    page = client.get(f"{base}/services/hello")
    assert 'data-cluster="hello-g2-bbbbbb" data-role="pending"' in page.text
    assert 'data-percent="100"' in page.text and "switching traffic" in page.text
    assert "ClusterCreating" in page.text and f'hx-get="{base}/services/hello/live"' in page.text
    assert f'hx-get="{base}/services/hello/charts"' in page.text
    assert client.get(f"{base}/services/nope").status_code == 404
    dashboard.history.add(996.0, {"hello-g1-aaaaaa": stats(0)})
    dashboard.history.add(998.0, {"hello-g1-aaaaaa": stats(100, buckets={5.0: 99, 25.0: 100})})
    charts = client.get(f"{base}/services/hello/charts")
    assert charts.text.count("<svg") == 3 and "<polyline" not in charts.text and "<circle" in charts.text
    script = client.get(f"{base}/static/htmx.min.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")


def test_unknown_service_page_is_404_not_500(client: TestClient) -> None:
    base = login(client)
    assert client.get(f"{base}/services/nope/live").status_code == 404


def test_running_cluster_without_probes_renders() -> None:
    # a cluster dict as the API gives it for a just-created cluster (nothing observed yet)
    bare: dict[str, Any] = cluster("hello-g3-cccccc", "pending", headAlive=None, inflightRequests=None)
    bare["workersExpected"] = None
    source = ViewSource(services=list, service=lambda n: view(active=OLD, pending=bare), events=lambda n, k: [])
    app = FastAPI()
    board = Dashboard()
    app.include_router(dashboard_router(board, source))
    client = TestClient(app, base_url="http://127.0.0.1")
    base = login(client)
    page = client.get(f"{base}/services/hello")
    assert page.status_code == 200 and "0/?" in page.text
