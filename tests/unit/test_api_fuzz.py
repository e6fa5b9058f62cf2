"""Fuzz the daemon's API from its own OpenAPI document: no request may cause a 5xx."""

from __future__ import annotations

import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from servekeeper.api.app import build_app
from servekeeper.store.store import Store
from tests.unit.test_api import TOKEN, FakeController


async def _no_shutdown(stop_clusters: bool) -> None:
    return None


STORE = Store(Path(tempfile.mkdtemp(prefix="skfuzz-")) / "store.db")
APP = build_app(FakeController(), STORE, TOKEN, _no_shutdown)  # type: ignore[arg-type]
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_causes_a_server_error(case: schemathesis.Case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, checks=[not_a_server_error])


LOCKED_STORE = Store(Path(tempfile.mkdtemp(prefix="skfuzz-")) / "store.db")
LOCKED = schemathesis.openapi.from_asgi(
    "/openapi.json",
    build_app(FakeController(), LOCKED_STORE, TOKEN, _no_shutdown),  # type: ignore[arg-type]
)


@LOCKED.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_without_the_token_gets_in_or_changes_anything(case: schemathesis.Case) -> None:
    response = case.call(headers={"Authorization": "Bearer not-the-token"})
    # 405: a method the path does not have is refused before anything else; never 2xx.
    assert response.status_code in (401, 405)
    assert LOCKED_STORE.list_services() == []
