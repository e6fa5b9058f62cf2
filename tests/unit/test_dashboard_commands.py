"""The dashboard's rollout buttons on the real API app and a real store: promote, promote --full,
abort and undo need the session (401), a same-origin request with the session's CSRF token (403
otherwise, and nothing changes), and act through the same commands as the API; the canary block
and the history table on the service page."""

from __future__ import annotations

import re
from collections.abc import Iterator

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


def login(browser: TestClient) -> str:
    """Log in as `servekeeper dashboard` does; the CSRF token the service page hands to htmx."""
    path = browser.post("/api/v1/dashboard/login-codes", headers=AUTH).json()["path"]
    assert browser.get(path, follow_redirects=False).status_code == 303
    page = browser.get("/ui/services/hello")
    found = re.search(r"hx-headers='\{\"X-Servekeeper-CSRF\": \"([0-9a-f]{64})\"\}'", page.text)
    assert found is not None, page.text[:500]
    return found.group(1)


def promotes(store: Store) -> tuple[int, bool, bool]:
    cluster = store.get_cluster(PENDING)
    assert cluster is not None
    return cluster.promote_requests, cluster.promote_full, cluster.abort_requested


@pytest.mark.parametrize(
    "path", ["/ui/services/hello/promote", "/ui/services/hello/abort", "/ui/services/hello/undo?toRevision=1"]
)
def test_without_the_session_401(browser: TestClient, store: Store, path: str) -> None:
    store.put_cluster(pending_cluster())
    assert browser.post(path).status_code == 401
    assert browser.post(path, headers=AUTH).status_code == 401  # the API token is no session
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
    ],
)
def test_a_cross_origin_post_is_403_even_with_the_token(
    browser: TestClient, store: Store, headers: dict[str, str]
) -> None:
    store.put_cluster(pending_cluster())
    token = login(browser)
    for path in ("/ui/services/hello/promote", "/ui/services/hello/abort", "/ui/services/hello/undo"):
        assert browser.post(path, headers={**headers, CSRF_HEADER: token}).status_code == 403
    assert promotes(store) == (0, False, False)
    assert store.get_service("hello").generation == 2  # type: ignore[union-attr]


def test_without_the_csrf_token_403(browser: TestClient, store: Store) -> None:
    store.put_cluster(pending_cluster())
    token = login(browser)
    assert browser.post("/ui/services/hello/promote", headers={"Origin": ORIGIN}).status_code == 403
    altered = token[:-1] + ("1" if token[-1] == "0" else "0")
    assert browser.post("/ui/services/hello/promote", headers={CSRF_HEADER: altered}).status_code == 403
    assert browser.post("/ui/services/hello/promote", headers={CSRF_HEADER: "x"}).status_code == 403
    another = DashboardAuth()  # a token of another daemon (another key) is worthless here
    assert browser.post("/ui/services/hello/abort", headers={CSRF_HEADER: another.csrf_token("s")}).status_code == 403
    assert promotes(store)[2] is False


def test_promote_abort_and_undo_with_the_session(browser: TestClient, store: Store) -> None:
    token = login(browser)
    same_origin = {"Origin": ORIGIN, "Sec-Fetch-Site": "same-origin", CSRF_HEADER: token}
    refused = browser.post("/ui/services/hello/promote", headers=same_origin)
    assert refused.status_code == 409 and "no rollout in progress to promote" in refused.text
    store.put_cluster(pending_cluster())
    promoted = browser.post("/ui/services/hello/promote", headers=same_origin)
    assert promoted.status_code == 200 and f"promoting {PENDING} (promote #1)" in promoted.text
    assert promotes(store) == (1, False, False)
    assert browser.post("/ui/services/hello/promote", headers={CSRF_HEADER: token}).status_code == 200  # no Origin
    assert promotes(store) == (2, False, False)
    full = browser.post("/ui/services/hello/promote?full=true", headers=same_origin)
    assert full.status_code == 200 and "every remaining step skipped" in full.text
    aborted = browser.post("/ui/services/hello/abort", headers=same_origin)
    assert aborted.status_code == 200 and f"aborting the rollout of {PENDING}" in aborted.text
    assert promotes(store) == (2, True, True)
    undone = browser.post("/ui/services/hello/undo", headers=same_origin)
    assert undone.status_code == 200 and "rolling back to revision 1 (generation 3)" in undone.text
    service = store.get_service("hello")
    assert service is not None and service.generation == 3
    missing = browser.post("/ui/services/hello/undo?toRevision=9", headers=same_origin)
    assert missing.status_code == 404 and "revision 9 is not in the history" in missing.text
    assert browser.post("/ui/services/nope/abort", headers=same_origin).status_code == 404


def test_the_service_page_shows_buttons_canary_and_history(browser: TestClient, store: Store) -> None:
    login(browser)
    page = browser.get("/ui/services/hello").text
    assert 'id="action-result"' in page and 'hx-post="/ui/services/hello/undo"' in page
    # The buttons sit inside #live, whose hx-swap="outerHTML" they would inherit (and so replace
    # the result line itself): their containers set the target and the swap.
    assert page.count('hx-target="#action-result" hx-swap="innerHTML"') == 2
    assert "/promote" not in page and "/abort" not in page  # no rollout pending
    assert '<tr data-revision="2" class="current">' in page and "(current)" in page
    assert 'hx-post="/ui/services/hello/undo?toRevision=1"' in page and "toRevision=2" not in page
    assert "Succeeded" in page and "Progressing" in page
    figures = AnalysisFigures(100.0, 110.0, 120, 0.9916, 45.2, 1080, 1.0, 40.0, "failed", "p99 45.2 ms > 40 ms")
    state = CanaryState(step=1, step_started_at=100.0, weight=10, failed_intervals=1, last_analysis=figures)
    store.put_cluster(pending_cluster().with_changes(canary=state))
    live = browser.get("/ui/services/hello/live").text
    assert 'hx-post="/ui/services/hello/promote"' in live and 'hx-post="/ui/services/hello/abort"' in live
    assert 'hx-post="/ui/services/hello/promote?full=true"' in live
    assert 'id="canary"' in live and 'data-weight="10"' in live and "1 failed" in live and "step 2" in live
    assert "99.2%" in live and "1080" in live and "45 ms" in live and "failed: p99 45.2 ms &gt; 40 ms" in live
