"""Fuzz the daemon's API from its own OpenAPI document (issue 19, "Beyond the list"), the
dashboard's login-code route included. With the token: no request causes a 5xx, and every answer
matches the document (a documented status, its content type, its schema). Without the token, or
with a wrong one: every operation answers 401 (only /openapi.json is open), and nothing changes.
Examples are bounded so that both runs stay well under a minute."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from servekeeper.api.app import build_app
from servekeeper.api.errors import ErrorAnswer
from servekeeper.store.store import Store
from servekeeper.web.pages import Dashboard
from tests.unit.test_api import TOKEN, FakeController


async def _no_shutdown(stop_clusters: bool) -> None:
    return None


def _fuzzed_schema(store: Store) -> schemathesis.schemas.BaseSchema:
    app = build_app(FakeController(), store, TOKEN, _no_shutdown, dashboard=Dashboard())  # type: ignore[arg-type]
    return schemathesis.openapi.from_asgi("/openapi.json", app)


# The stores live in pytest's temporary dirs and open when a test needs them, not at import
# (collection made two /tmp dirs that nothing removed); the schemas are loaded from fixtures.
@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    store = Store(tmp_path_factory.mktemp("skfuzz") / "store.db")
    yield store
    store.close()


@pytest.fixture(scope="module")
def locked_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    store = Store(tmp_path_factory.mktemp("skfuzz-locked") / "store.db")
    yield store
    store.close()


@pytest.fixture(scope="module")
def fuzzed_api(fuzz_store: Store) -> schemathesis.schemas.BaseSchema:
    return _fuzzed_schema(fuzz_store)


@pytest.fixture(scope="module")
def locked_api(locked_store: Store) -> schemathesis.schemas.BaseSchema:
    return _fuzzed_schema(locked_store)


schema = schemathesis.pytest.from_fixture("fuzzed_api")
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_causes_a_server_error_and_every_answer_matches_the_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, checks=CONFORMANCE)


LOCKED = schemathesis.pytest.from_fixture("locked_api")


# Each case without a token and with a wrong one (a lazily loaded schema's tests take no
# parametrized arguments of their own).
WITHOUT_THE_TOKEN = [{}, {"Authorization": "Bearer not-the-token"}]


@LOCKED.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_the_token_every_operation_is_401_and_changes_nothing(
    case: schemathesis.Case, locked_store: Store
) -> None:
    for headers in WITHOUT_THE_TOKEN:
        response = case.call(headers=headers)
        assert response.status_code == 401, (headers, case.method, case.formatted_path, response.text[:200])
        assert response.json() == {"detail": "missing or wrong bearer token"}
        assert locked_store.list_services() == [] and locked_store.list_host_pools() == []


def test_the_fuzzed_schema_covers_every_operation(fuzzed_api: schemathesis.schemas.BaseSchema) -> None:
    """The runs above reach every route of the API, the dashboard's login codes included."""
    operations = {(result.ok().method.upper(), result.ok().path) for result in fuzzed_api.get_all_operations()}
    assert ("POST", "/api/v1/dashboard/login-codes") in operations
    assert ("POST", "/api/v1/shutdown") in operations and ("DELETE", "/api/v1/hostpools/{name}") in operations
    assert len(operations) >= 16


def test_every_operation_documents_its_refusals_as_they_are_answered(fuzz_store: Store) -> None:
    """The fuzz run's first finding: refusals (404, 409, 400, a spec's 422 with `problems`) were
    not in the document, and its 422 said `detail` is a list only. Each is now declared for every
    operation, and real refusals of each kind read as the declared body."""
    app = build_app(FakeController(), fuzz_store, TOKEN, _no_shutdown, dashboard=Dashboard())  # type: ignore[arg-type]
    document = app.openapi()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            for status in ("400", "401", "404", "409", "422"):
                declared = operation["responses"][status]["content"]["application/json"]["schema"]
                assert declared == {"$ref": "#/components/schemas/ErrorAnswer"}, (method, path, status)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app) as client:
        refusals = [
            client.get("/api/v1/services/nope", headers=auth),  # 404, a sentence
            client.post("/api/v1/services", json={"spec": {"kind": "Nope"}}, headers=auth),  # 422, problems
            client.post("/api/v1/services/x/undo", json={"toRevision": "x"}, headers=auth),  # 422, FastAPI's list
            client.post("/api/v1/shutdown", content=b"\xff", headers={**auth, "Content-Type": "application/json"}),
            client.get("/api/v1/services"),  # 401
        ]
    assert [r.status_code for r in refusals][:3] == [404, 422, 422] and refusals[4].status_code == 401
    for answer in refusals:
        assert answer.status_code in (400, 401, 404, 409, 422)
        ErrorAnswer.model_validate(answer.json())
    assert "problems" in refusals[1].json()["detail"]


@pytest.mark.parametrize("body", [b"\xff", b"\xc3\x28{}", "\u2603".encode()])
@pytest.mark.parametrize(
    "path", ["/api/v1/shutdown", "/api/v1/services", "/api/v1/hostpools", "/api/v1/services/x/undo"]
)
def test_a_body_that_is_not_json_nor_utf8_is_422_not_500(path: str, body: bytes, fuzz_store: Store) -> None:
    """Found beside the fuzz run (which always declares JSON): a body without a JSON content type
    is validated as raw bytes, and FastAPI's own handler then failed to encode bytes that are not
    UTF-8 into its answer (UnicodeDecodeError, a 500)."""
    app = build_app(FakeController(), fuzz_store, TOKEN, _no_shutdown)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post(path, content=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body"]


def test_collecting_this_module_leaves_no_temporary_dir(tmp_path: Path) -> None:
    """Its stores were made by `mkdtemp` at import time: two /tmp/skfuzz-* dirs left behind by
    every collection, run or not."""
    environment = {**os.environ, "TMPDIR": str(tmp_path)}
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", __file__],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert [path.name for path in tmp_path.iterdir() if not path.name.startswith("pytest-of-")] == []
