"""The daemon's API: authentication, validation, and that a refused call changes nothing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.store.store import Store

TOKEN = "s3cret-token"
SPEC: dict[str, Any] = {
    "apiVersion": "servekeeper/v1alpha1",
    "kind": "RayService",
    "metadata": {"name": "hello"},
    "spec": {
        "ingress": {"port": 8000},
        "serveConfig": {"applications": [{"name": "hello", "import_path": "hello:app"}]},
    },
}


class FakeController:
    """Only what the API touches: no Ray, no loop."""

    def __init__(self) -> None:
        self.woken: list[str] = []

    def wake(self, name: str) -> None:
        self.woken.append(name)

    def status_snapshot(self, name: str) -> None:
        return None


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store.db")


@pytest.fixture
def client(store: Store) -> TestClient:
    async def shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(FakeController(), store, TOKEN, shutdown)  # type: ignore[arg-type]
    return TestClient(app)


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}], ids=str)
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/v1/services", {"spec": SPEC}),
        ("DELETE", "/api/v1/services/hello", None),
        ("GET", "/api/v1/services", None),
        ("POST", "/api/v1/shutdown", {"stopClusters": True}),
    ],
)
def test_every_call_without_the_right_token_gets_401_and_changes_nothing(
    client: TestClient, store: Store, headers: dict[str, str], method: str, path: str, body: Any
) -> None:
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert store.list_services() == []


def test_apply_get_and_delete(client: TestClient, store: Store) -> None:
    created = client.post("/api/v1/services", json={"spec": SPEC}, headers=AUTH).json()
    assert created == {"name": "hello", "generation": 1, "changed": True}
    again = client.post("/api/v1/services", json={"spec": SPEC}, headers=AUTH).json()
    assert again["changed"] is False and again["generation"] == 1
    view = client.get("/api/v1/services/hello", headers=AUTH).json()
    assert view["name"] == "hello" and view["activeCluster"] is None and view["ingress"]["port"] == 8000
    assert client.delete("/api/v1/services/hello", headers=AUTH).json()["deleting"] is True
    assert store.get_service("hello").deleting  # type: ignore[union-attr]
    assert client.get("/api/v1/services/nope", headers=AUTH).status_code == 404


def test_an_invalid_spec_is_refused_with_every_problem_and_nothing_is_stored(client: TestClient, store: Store) -> None:
    client.post("/api/v1/services", json={"spec": SPEC}, headers=AUTH)
    before = store.get_service("hello")
    bad = copy.deepcopy(SPEC)
    bad["spec"]["ingress"]["port"] = "eighty"
    bad["spec"]["serveConfig"]["http_options"] = {"port": 9000}
    response = client.post("/api/v1/services", json={"spec": bad}, headers=AUTH)
    assert response.status_code == 422
    problems = response.json()["detail"]["problems"]
    assert any(p.startswith("spec.ingress.port") for p in problems)
    assert any("http_options" in p for p in problems)
    assert store.get_service("hello") == before


def test_two_services_cannot_share_an_ingress_port(client: TestClient, store: Store) -> None:
    client.post("/api/v1/services", json={"spec": SPEC}, headers=AUTH)
    other = copy.deepcopy(SPEC)
    other["metadata"]["name"] = "other"
    response = client.post("/api/v1/services", json={"spec": other}, headers=AUTH)
    assert response.status_code == 422
    assert "used by service 'hello'" in response.json()["detail"]["problems"][0]
    assert store.get_service("other") is None


@pytest.mark.parametrize(
    "body",
    [None, {"spec": None}, {"spec": []}, {"spec": {"apiVersion": 1}}, {"nope": 1}, {"spec": {"metadata": "x"}}],
    ids=str,
)
def test_malformed_bodies_are_4xx_never_5xx(client: TestClient, store: Store, body: Any) -> None:
    response = client.post("/api/v1/services", json=body, headers=AUTH)
    assert 400 <= response.status_code < 500
    assert store.list_services() == []


def test_delete_sets_only_the_flag_and_is_idempotent(client: TestClient, store: Store) -> None:
    client.post("/api/v1/services", json={"spec": SPEC}, headers=AUTH)
    assert store.persist_status("hello", 1, False, observed_generation=1, failure_reason="kept")
    before = store.get_service("hello")
    for _ in range(2):
        response = client.delete("/api/v1/services/hello", headers=AUTH)
        assert response.status_code == 200 and response.json() == {"name": "hello", "deleting": True}
    assert store.get_service("hello") == before.with_changes(deleting=True)  # type: ignore[union-attr]
    assert client.delete("/api/v1/services/nope", headers=AUTH).status_code == 404
