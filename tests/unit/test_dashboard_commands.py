"""The dashboard's rollout buttons on the real API app and a real store: promote, promote --full,
abort and undo need the session (401), a request that says it comes from this origin (Origin or
Sec-Fetch-Site) with the session's CSRF token (403 otherwise, and nothing changes), and act
through the same commands as the API; the canary block and the history table on the service
page. Every dashboard path is under the daemon's secret base path, which login() returns."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

import pytest
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.model.records import AnalysisFigures, CanaryState
from servekeeper.store.store import Store
from servekeeper.web.auth import CSRF_HEADER, DashboardAuth
from servekeeper.web.pages import Dashboard
from tests.unit.test_client import TOKEN, FakeController, document
from tests.unit.test_client_rollouts import pending_cluster

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PENDING = "hello-g2-bbbbbb"
ORIGIN = "http://127.0.0.1"


@pytest.fixture
def browser(store: Store) -> Iterator[TestClient]:
    """A browser on the dashboard: hello at generation 2 (1 rolled out), not logged in yet."""

    async def shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(FakeController(), store, TOKEN, shutdown, dashboard=Dashboard(auth=DashboardAuth()))  # type: ignore[arg-type]
    with TestClient(app, base_url=ORIGIN) as client:
        assert client.post("/api/v1/services", json={"spec": document(msg="v1")}, headers=AUTH).status_code == 200
        store.end_revision("hello", 1, "Succeeded", "controller", "rolled out", now=10.0)
        assert client.post("/api/v1/services", json={"spec": document(msg="v2")}, headers=AUTH).status_code == 200
        yield client


class Login(NamedTuple):
    base: str  # the dashboard's secret base path, `/ui/<path key>`
    csrf: str  # the CSRF token the service page hands to htmx


def login(browser: TestClient) -> Login:
    """Log in as `servekeeper dashboard` does."""
    path = browser.post("/api/v1/dashboard/login-codes", headers=AUTH).json()["path"]
    landed = browser.get(path, follow_redirects=False)
    assert landed.status_code == 303
    base = landed.headers["location"]
    page = browser.get(f"{base}/services/hello")
    found = re.search(r"hx-headers='\{\"X-Servekeeper-CSRF\": \"([0-9a-f]{64})\"\}'", page.text)
    assert found is not None, page.text[:500]
    return Login(base, found.group(1))


def promotes(store: Store) -> tuple[int, bool, bool]:
    cluster = store.get_cluster(PENDING)
    assert cluster is not None
    return cluster.promote_requests, cluster.promote_full, cluster.abort_requested


def base_path(browser: TestClient) -> str:
    """The dashboard's base path, as a login path names it (the code is left unspent)."""
    path: str = browser.post("/api/v1/dashboard/login-codes", headers=AUTH).json()["path"]
    return path.split("/login?")[0]


BUTTONS = ["/services/hello/promote", "/services/hello/abort", "/services/hello/undo"]


@pytest.mark.parametrize(
    "path", ["/services/hello/promote", "/services/hello/abort", "/services/hello/undo?toRevision=1"]
)
def test_without_the_session_401(browser: TestClient, store: Store, path: str) -> None:
    store.put_cluster(pending_cluster())
    base = base_path(browser)
    assert browser.post(base + path).status_code == 401
    assert browser.post(base + path, headers=AUTH).status_code == 401  # the API token is no session
    assert promotes(store) == (0, False, False)
    assert store.get_service("hello").generation == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"Origin": "http://evil.example"}, id="cross-origin"),
        pytest.param({"Origin": "http://127.0.0.1:9999"}, id="another-port-same-site"),
        pytest.param({"Origin": "null"}, id="opaque-origin"),
        pytest.param({"Sec-Fetch-Site": "same-site"}, id="sec-fetch-same-site"),
        pytest.param({"Sec-Fetch-Site": "cross-site"}, id="sec-fetch-cross-site"),
        pytest.param({"Origin": ORIGIN, "Sec-Fetch-Site": "same-site"}, id="origin-ours-but-fetch-same-site"),
        pytest.param({}, id="neither-origin-nor-sec-fetch-site"),
    ],
)
def test_a_post_not_from_this_origin_is_403_even_with_the_token(
    browser: TestClient, store: Store, headers: dict[str, str]
) -> None:
    store.put_cluster(pending_cluster())
    session = login(browser)
    for path in BUTTONS:
        assert browser.post(session.base + path, headers={**headers, CSRF_HEADER: session.csrf}).status_code == 403
    assert promotes(store) == (0, False, False)
    assert store.get_service("hello").generation == 2  # type: ignore[union-attr]


def test_a_post_without_origin_or_sec_fetch_site_is_403(browser: TestClient, store: Store) -> None:
    """Issue 19, defect 8: a script that holds the session and its CSRF token (a server on another
    port of 127.0.0.1 that got the cookie) but sends no Origin was let through; either header from
    this origin is enough for a browser's own POST."""
    store.put_cluster(pending_cluster())
    session = login(browser)
    promote = f"{session.base}/services/hello/promote"
    refused = browser.post(promote, headers={CSRF_HEADER: session.csrf})
    assert refused.status_code == 403 and "Origin or Sec-Fetch-Site" in refused.text
    assert promotes(store) == (0, False, False)
    assert browser.post(promote, headers={CSRF_HEADER: session.csrf, "Origin": ORIGIN}).status_code == 200
    fetched = {CSRF_HEADER: session.csrf, "Sec-Fetch-Site": "same-origin"}
    assert browser.post(promote, headers=fetched).status_code == 200
    assert promotes(store) == (2, False, False)


def test_without_the_csrf_token_403(browser: TestClient, store: Store) -> None:
    store.put_cluster(pending_cluster())
    session = login(browser)
    promote, abort = f"{session.base}/services/hello/promote", f"{session.base}/services/hello/abort"
    assert browser.post(promote, headers={"Origin": ORIGIN}).status_code == 403
    altered = session.csrf[:-1] + ("1" if session.csrf[-1] == "0" else "0")
    assert browser.post(promote, headers={"Origin": ORIGIN, CSRF_HEADER: altered}).status_code == 403
    assert browser.post(promote, headers={"Origin": ORIGIN, CSRF_HEADER: "x"}).status_code == 403
    another = DashboardAuth()  # a token of another daemon (another key) is worthless here
    assert browser.post(abort, headers={"Origin": ORIGIN, CSRF_HEADER: another.csrf_token("s")}).status_code == 403
    assert promotes(store)[2] is False


def test_promote_abort_and_undo_with_the_session(browser: TestClient, store: Store) -> None:
    session = login(browser)
    service = f"{session.base}/services/hello"
    same_origin = {"Origin": ORIGIN, "Sec-Fetch-Site": "same-origin", CSRF_HEADER: session.csrf}
    refused = browser.post(f"{service}/promote", headers=same_origin)
    assert refused.status_code == 409 and "no rollout in progress to promote" in refused.text
    store.put_cluster(pending_cluster())
    promoted = browser.post(f"{service}/promote", headers=same_origin)
    assert promoted.status_code == 200 and f"promoting {PENDING} (promote #1)" in promoted.text
    assert promotes(store) == (1, False, False)
    full = browser.post(f"{service}/promote?full=true", headers=same_origin)
    assert full.status_code == 200 and "every remaining step skipped" in full.text
    aborted = browser.post(f"{service}/abort", headers=same_origin)
    assert aborted.status_code == 200 and f"aborting the rollout of {PENDING}" in aborted.text
    assert promotes(store) == (1, True, True)
    undone = browser.post(f"{service}/undo", headers=same_origin)
    assert undone.status_code == 200 and "rolling back to revision 1 (generation 3)" in undone.text
    stored = store.get_service("hello")
    assert stored is not None and stored.generation == 3
    missing = browser.post(f"{service}/undo?toRevision=9", headers=same_origin)
    assert missing.status_code == 404 and "revision 9 is not in the history" in missing.text
    assert browser.post(f"{session.base}/services/nope/abort", headers=same_origin).status_code == 404


def test_the_service_page_shows_buttons_canary_and_history(browser: TestClient, store: Store) -> None:
    base = login(browser).base
    page = browser.get(f"{base}/services/hello").text
    assert 'id="action-result"' in page and f'hx-post="{base}/services/hello/undo"' in page
    # The buttons sit inside #live, whose hx-swap="outerHTML" they would inherit (and so replace
    # the result line itself): their containers set the target and the swap.
    assert page.count('hx-target="#action-result" hx-swap="innerHTML"') == 2
    assert "/promote" not in page and "/abort" not in page  # no rollout pending
    assert '<tr data-revision="2" class="current">' in page and "(current)" in page
    assert f'hx-post="{base}/services/hello/undo?toRevision=1"' in page and "toRevision=2" not in page
    assert "Succeeded" in page and "Progressing" in page
    figures = AnalysisFigures(100.0, 110.0, 120, 0.9916, 45.2, 1080, 1.0, 40.0, "failed", "p99 45.2 ms > 40 ms")
    state = CanaryState(step=1, step_started_at=100.0, weight=10, failed_intervals=1, last_analysis=figures)
    store.put_cluster(pending_cluster().with_changes(canary=state))
    live = browser.get(f"{base}/services/hello/live").text
    assert f'hx-post="{base}/services/hello/promote"' in live and f'hx-post="{base}/services/hello/abort"' in live
    assert f'hx-post="{base}/services/hello/promote?full=true"' in live
    assert 'id="canary"' in live and 'data-weight="10"' in live and "1 failed" in live and "step 2" in live
    assert "99.2%" in live and "1080" in live and "45 ms" in live and "failed: p99 45.2 ms &gt; 40 ms" in live
