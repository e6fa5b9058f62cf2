"""Secrets compared with non-ASCII input (issue 19, defect 14): a login code, a session cookie, a
CSRF header or a bearer token with a character outside ASCII is a wrong secret (401/403), never a
500. `hmac.compare_digest` raises TypeError on a str that is not ASCII, so every comparison is
of bytes. Each request below really carries the non-ASCII value: headers are sent as latin-1
bytes (httpx would refuse or escape a str), the login code as a percent-encoded query."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.store.store import Store
from servekeeper.web.auth import CSRF_HEADER, SESSION_COOKIE, DashboardAuth, same_secret
from servekeeper.web.pages import Dashboard
from tests.unit.test_client import TOKEN, FakeController, document
from tests.unit.test_client_rollouts import pending_cluster
from tests.unit.test_dashboard_commands import AUTH, BUTTONS, ORIGIN, base_path, login, promotes

NON_ASCII = ["é", "ü" * 43, "\u2603", "abc\u00ff"]


@pytest.fixture
def browser(store: Store) -> Iterator[TestClient]:
    """The dashboard on the real API app with service hello; a route's exception is a 500 here,
    not a raise in the test."""

    async def shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(FakeController(), store, TOKEN, shutdown, dashboard=Dashboard(auth=DashboardAuth()))  # type: ignore[arg-type]
    with TestClient(app, base_url=ORIGIN, raise_server_exceptions=False) as client:
        assert client.post("/api/v1/services", json={"spec": document()}, headers=AUTH).status_code == 200
        yield client


@pytest.mark.parametrize("value", NON_ASCII)
def test_the_dashboard_auth_refuses_non_ascii_secrets(value: str) -> None:
    auth = DashboardAuth()
    code = auth.new_code()
    assert auth.exchange(value) is None
    session = auth.exchange(code)  # the real code was not spent by the wrong one
    assert session is not None
    assert auth.valid(value) is False
    assert auth.csrf_valid(session, value) is False
    assert auth.csrf_valid(value, auth.csrf_token(value)) is False  # a token for a session that is none


def test_same_secret_takes_any_text() -> None:
    assert same_secret("abc", "abc") and same_secret("é", "é")
    assert not same_secret("abc", "ab\u00e9") and not same_secret("abc", "\udc80")  # a lone surrogate too


@pytest.mark.parametrize("value", NON_ASCII)
def test_a_non_ascii_login_code_is_401(browser: TestClient, value: str) -> None:
    path = browser.post("/api/v1/dashboard/login-codes", headers=AUTH).json()["path"]  # a code waits
    response = browser.get(f"{base_path(browser)}/login", params={"code": value}, follow_redirects=False)
    assert response.status_code == 401
    assert browser.get(path, follow_redirects=False).status_code == 303  # the waiting code still works


@pytest.mark.parametrize("value", ["é", "\u00ff" * 43])
def test_a_non_ascii_session_cookie_is_401(browser: TestClient, value: str) -> None:
    base = login(browser).base  # a session exists, so the cookie is compared with it
    cookie = f"{SESSION_COOKIE}={value}".encode("latin-1")
    for path in (base, f"{base}/services/hello"):
        assert browser.get(path, headers={"Cookie": cookie}).status_code == 401
    assert browser.post(f"{base}/services/hello/abort", headers={"Cookie": cookie}).status_code == 401


def test_a_utf8_session_cookie_is_401(browser: TestClient) -> None:
    base = login(browser).base
    cookie = f"{SESSION_COOKIE}=\u2603".encode()  # UTF-8 bytes, read back as latin-1 text
    assert browser.get(base, headers={"Cookie": cookie}).status_code == 401


@pytest.mark.parametrize("value", ["é", "\u00ff" * 64])
def test_a_non_ascii_csrf_header_is_403_and_changes_nothing(browser: TestClient, store: Store, value: str) -> None:
    store.put_cluster(pending_cluster())
    base = login(browser).base
    headers = {"Origin": ORIGIN, CSRF_HEADER: value.encode("latin-1")}
    for path in BUTTONS:
        assert browser.post(base + path, headers=headers).status_code == 403
    assert promotes(store) == (0, False, False)


@pytest.mark.parametrize("header", ["Bearer é", "Bearer " + "\u00ff" * 20, "é"])
def test_a_non_ascii_bearer_token_is_401(browser: TestClient, store: Store, header: str) -> None:
    """The API's check already compared bytes; this keeps it so."""
    response = browser.get("/api/v1/services", headers={"Authorization": header.encode("latin-1")})
    assert response.status_code == 401
    response = browser.delete("/api/v1/services/hello", headers={"Authorization": header.encode("latin-1")})
    assert response.status_code == 401
    assert [service.name for service in store.list_services()] == ["hello"]
