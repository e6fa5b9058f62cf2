"""A KubeRay manifest through the daemon's API and the CLI's client: translated there, notes
stored and shown, secrets injected, export, capacity refusals; `servekeeper secret` files."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.client.common import apply_body
from servekeeper.commands import apply as apply_module
from servekeeper.commands.services import ray_version
from servekeeper.core.placement import Capacity
from servekeeper.store.secrets import SecretError, delete_secret, list_secrets, read_secrets, read_values, set_secret
from servekeeper.store.store import Store
from tests.unit.test_api import AUTH, TOKEN, FakeController
from tests.unit.test_kuberay_import import SAMPLES, sample_documents

RAY = ray_version()


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    return tmp_path / "secrets"


@pytest.fixture
def client(tmp_path: Path, secrets_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setattr(apply_module, "machine_capacity", lambda: Capacity(gpus=0, memory_bytes=64 * 2**30))

    async def shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(FakeController(), Store(tmp_path / "store.db"), TOKEN, shutdown, secrets_dir=secrets_dir)  # type: ignore[arg-type]
    return TestClient(app)


def apply(client: TestClient, documents: list[Any]) -> Any:
    return client.post("/api/v1/services", json={"documents": documents, "baseDir": str(SAMPLES)}, headers=AUTH)


def test_sample_is_applied_with_notes_in_the_view_and_exported(client: TestClient) -> None:
    documents = sample_documents("ray-service.different-port.yaml", ray_version=RAY)
    assert apply(client, documents).json() == {"name": "rayservice-sample", "generation": 1, "changed": True}
    view = client.get("/api/v1/services/rayservice-sample", headers=AUTH).json()
    assert view["importedFrom"] == "ray.io/v1 RayService"
    assert {(n["kind"], n["path"]) for n in view["importNotes"]} == {
        ("ignored", "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].ports"),
        ("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].ports"),
        ("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas"),
    }
    assert view["ingress"]["port"] == 9000
    exported = client.get("/api/v1/services/rayservice-sample/export", headers=AUTH).json()["manifest"]
    assert yaml.safe_load(exported)["apiVersion"] == "ray.io/v1"


def test_a_sample_on_another_ray_is_applied_and_exported_on_that_ray(client: TestClient) -> None:
    response = apply(client, sample_documents("ray-service.sample.yaml", ray_version=None))
    assert response.status_code < 300, response.text
    exported = client.get("/api/v1/services/rayservice-sample/export", headers=AUTH).json()["manifest"]
    cluster = yaml.safe_load(exported)["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.52.0" != RAY
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "rayproject/ray:2.52.0"


def test_gpu_sample_is_refused_with_insufficient_capacity_naming_gpu(client: TestClient) -> None:
    response = apply(client, sample_documents("ray-service.stable-diffusion.yaml", ray_version=RAY))
    assert response.status_code == 422
    assert response.json()["detail"]["problems"] == [
        "spec.rayClusterConfig.workerGroupSpecs[0].numGpus: InsufficientCapacity: the cluster needs 1 GPU in all, "
        "this machine has 0 GPU"
    ]


def test_secret_key_ref_reads_servekeeper_secrets(client: TestClient, secrets_dir: Path) -> None:
    documents = sample_documents("ray-service.sample.yaml", ray_version=RAY)
    container = documents[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}]
    refused = apply(client, documents)
    assert refused.status_code == 422
    assert "servekeeper secret set api key=-" in refused.json()["detail"]["problems"][0]
    set_secret(secrets_dir, "api", {"key": "value-of-the-secret"})
    assert apply(client, documents).status_code == 200
    exported = client.get("/api/v1/services/rayservice-sample/export", headers=AUTH).json()["manifest"]
    assert "secretKeyRef" in exported and "value-of-the-secret" not in exported


def test_client_sends_a_kuberay_file_as_documents_with_its_folder() -> None:
    body = apply_body(str(SAMPLES / "ray-service.high-availability.yaml"))
    assert body["baseDir"] == str(SAMPLES) and len(body["documents"]) == 7


def test_secret_files(secrets_dir: Path) -> None:
    set_secret(secrets_dir, "db", read_values(["password=-"], [], lambda: "a=b\n") | {"user": "me"})
    path = secrets_dir / "db.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    assert read_secrets(secrets_dir) == {"db": {"user": "me", "password": "a=b"}}
    assert list_secrets(secrets_dir) == {"db": ["password", "user"]}
    assert delete_secret(secrets_dir, "db") and not delete_secret(secrets_dir, "db")
    with pytest.raises(SecretError):
        read_values(["novalue"], [], lambda: "")
    with pytest.raises(SecretError):
        set_secret(secrets_dir, "../evil", {})


def test_undo_to_an_imported_revision_exports_its_secret_references_not_values(
    client: TestClient, secrets_dir: Path, tmp_path: Path
) -> None:
    """Issue 19 item 3: the secret references are kept per revision and come back with `undo`;
    the secret's value appears in no answer of the API (export, get, history, events)."""
    set_secret(secrets_dir, "api", {"key": "value-of-the-secret"})
    documents = sample_documents("ray-service.sample.yaml", ray_version=RAY)
    container = documents[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}]
    assert apply(client, documents).json()["generation"] == 1
    container["env"] = [{"name": "MODE", "value": "plain"}]  # revision 2: no secret at all
    assert apply(client, documents).json()["generation"] == 2
    undone = client.post("/api/v1/services/rayservice-sample/undo", json={"toRevision": 1}, headers=AUTH)
    assert undone.status_code == 200 and undone.json()["generation"] == 3
    exported = client.get("/api/v1/services/rayservice-sample/export", headers=AUTH).json()["manifest"]
    head_env = yaml.safe_load(exported)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}} in (
        head_env["containers"][0]["env"]
    )
    answers = [
        exported,
        client.get("/api/v1/services/rayservice-sample", headers=AUTH).text,
        client.get("/api/v1/services", headers=AUTH).text,
        client.get("/api/v1/services/rayservice-sample/history", headers=AUTH).text,
        client.get("/api/v1/events", headers=AUTH).text,
        client.get("/api/v1/events?service=rayservice-sample", headers=AUTH).text,
    ]
    assert all("value-of-the-secret" not in answer for answer in answers)
