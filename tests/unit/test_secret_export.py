"""Issue 19 item 3, for revisions stored before the per-revision secret references existed: the
migration gives every stored revision the references of the names its env holds, and export
never prints the value of a stored secret, whatever the facts say (a secretKeyRef instead, or a
refusal naming the env var and the secret)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.commands import apply as apply_module
from servekeeper.commands.apply import store_spec
from servekeeper.commands.services import ray_version
from servekeeper.core.placement import Capacity
from servekeeper.kuberay.export import SecretInExport, export_manifest
from servekeeper.kuberay.notes import SecretRef
from servekeeper.kuberay.translate import import_documents
from servekeeper.model.spec import ServiceSpec, parse_spec
from servekeeper.store.secrets import set_secret
from servekeeper.store.store import Store
from tests.unit.test_api import AUTH, TOKEN, FakeController
from tests.unit.test_kuberay_import import SAMPLES, sample_documents
from tests.unit.test_planner import make_spec as planner_spec

RAY = ray_version()
NAME = "rayservice-sample"
SECRET_VALUE = "value-of-the-secret"


def make_client(store_path: Path, secrets_dir: Path) -> TestClient:
    async def shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(FakeController(), Store(store_path), TOKEN, shutdown, secrets_dir=secrets_dir)  # type: ignore[arg-type]
    return TestClient(app)


@pytest.fixture(autouse=True)
def enough_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apply_module, "machine_capacity", lambda: Capacity(gpus=0, memory_bytes=64 * 2**30))


def documents_with_head_env(env: list[dict[str, Any]]) -> list[Any]:
    documents = sample_documents("ray-service.sample.yaml", ray_version=RAY)
    container = documents[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["env"] = env
    return documents


def apply(client: TestClient, documents: list[Any]) -> Any:
    answer = client.post("/api/v1/services", json={"documents": documents, "baseDir": str(SAMPLES)}, headers=AUTH)
    assert answer.status_code == 200, answer.text
    return answer.json()


def head_env(manifest: str) -> list[dict[str, Any]]:
    head = yaml.safe_load(manifest)["spec"]["rayClusterConfig"]["headGroupSpec"]
    return list(head["template"]["spec"]["containers"][0].get("env", []))


def as_before_migration_8(path: Path) -> None:
    """The store as servekeeper left it before migration 8: no per-revision import facts (only
    the service's `import:NAME`, of its current generation), schema version 7 (so without the
    columns of migrations 9 and 10 either)."""
    db = sqlite3.connect(path)
    db.execute("DELETE FROM facts WHERE key LIKE 'import:%@%'")
    db.execute("DROP INDEX submissions_by_cluster")
    dropped = (("clusters", "takeover_started_at"), ("services", "standby_failures"))  # migration 9
    for table, column in (*dropped, ("clusters", "left_behind_json")):  # and 10
        db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.execute("ALTER TABLE services DROP COLUMN standby_retry_at")
    db.execute("PRAGMA user_version = 7")
    db.commit()
    db.close()


def test_undo_after_the_upgrade_to_a_revision_imported_before_it_exports_no_value(tmp_path: Path) -> None:
    path, secrets_dir = tmp_path / "store.db", tmp_path / "secrets"
    set_secret(secrets_dir, "api", {"key": SECRET_VALUE})
    secret_env = {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}
    client = make_client(path, secrets_dir)
    assert apply(client, documents_with_head_env([secret_env]))["generation"] == 1
    assert apply(client, documents_with_head_env([secret_env, {"name": "MODE", "value": "b"}]))["generation"] == 2
    as_before_migration_8(path)

    # The secret changes after the upgrade: the old revision's env holds a value no secret has now.
    set_secret(secrets_dir, "api", {"key": "the-new-value"})
    upgraded = make_client(path, secrets_dir)
    undone = upgraded.post(f"/api/v1/services/{NAME}/undo", json={"toRevision": 1}, headers=AUTH)
    assert undone.status_code == 200, undone.text
    exported = upgraded.get(f"/api/v1/services/{NAME}/export", headers=AUTH)
    assert exported.status_code == 200, exported.text
    manifest = exported.json()["manifest"]
    assert SECRET_VALUE not in manifest
    assert head_env(manifest) == [secret_env]


def test_the_migration_gives_each_revision_the_references_its_env_names(tmp_path: Path) -> None:
    path, secrets_dir = tmp_path / "store.db", tmp_path / "secrets"
    set_secret(secrets_dir, "api", {"key": SECRET_VALUE, "other": "another-secret-value"})
    api_key = {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}
    other = {"name": "OTHER", "valueFrom": {"secretKeyRef": {"name": "api", "key": "other"}}}
    client = make_client(path, secrets_dir)
    apply(client, documents_with_head_env([{"name": "MODE", "value": "plain"}]))  # 1: no secret
    apply(client, documents_with_head_env([api_key]))  # 2: API_KEY only
    apply(client, documents_with_head_env([api_key, other]))  # 3: both (the current import fact)
    as_before_migration_8(path)

    store = Store(path)
    refs = {
        n: [r["env"] for r in (store.get_fact(f"import:{NAME}@{n}") or {}).get("secretRefs", [])] for n in (1, 2, 3)
    }
    assert refs == {1: [], 2: ["API_KEY"], 3: ["API_KEY", "OTHER"]}
    store.close()


def test_export_writes_a_stored_secrets_value_as_a_reference_without_any_import_fact(tmp_path: Path) -> None:
    """The safety net alone: a spec applied as servekeeper YAML (no import fact) whose env holds
    the value of a stored secret."""
    path, secrets_dir = tmp_path / "store.db", tmp_path / "secrets"
    set_secret(secrets_dir, "api", {"key": SECRET_VALUE})
    client = make_client(path, secrets_dir)
    apply(
        client,
        documents_with_head_env([{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}]),
    )
    store = Store(path)
    service = store.get_service(NAME)
    assert service is not None
    store_spec(store, NAME, service.spec_json, service.package_hash, None, history_limit=10)  # the refs forgotten
    store.close()
    manifest = client.get(f"/api/v1/services/{NAME}/export", headers=AUTH).json()["manifest"]
    assert SECRET_VALUE not in manifest
    assert head_env(manifest) == [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}]


def spec_with_head_env(env: dict[str, str]) -> ServiceSpec:
    documents = sample_documents("ray-service.sample.yaml", ray_version=RAY)
    spec = import_documents(documents, RAY, {}, base_dir=str(SAMPLES)).spec
    body = spec.spec.model_copy(
        update={
            "rayClusterConfig": spec.spec.rayClusterConfig.model_copy(
                update={"head": spec.spec.rayClusterConfig.head.model_copy(update={"env": env})}
            )
        }
    )
    return spec.model_copy(update={"spec": body})


def test_export_refuses_an_env_value_that_holds_a_secret_it_cannot_reference() -> None:
    spec = spec_with_head_env({"DATABASE_URL": f"postgres://me:{SECRET_VALUE}@db/x"})
    with pytest.raises(SecretInExport) as refused:
        export_manifest(spec, RAY, (), {"api": {"key": SECRET_VALUE}})
    assert "DATABASE_URL" in str(refused.value) and "api" in str(refused.value)
    assert SECRET_VALUE not in str(refused.value)


def test_export_keeps_a_known_reference_and_maps_an_equal_value() -> None:
    spec = spec_with_head_env({"A": SECRET_VALUE, "B": "x", "C": "plain"})
    manifest, _ = export_manifest(
        spec, RAY, [SecretRef("head", "B", "named", "b")], {"api": {"key": SECRET_VALUE, "short": "x"}}
    )
    env = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [
        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}},
        {"name": "B", "valueFrom": {"secretKeyRef": {"name": "named", "key": "b"}}},
        {"name": "C", "value": "plain"},
    ]


def test_export_refuses_a_secret_value_in_the_serve_config_and_the_api_says_409(tmp_path: Path) -> None:
    """No secretKeyRef can stand in an app's runtime_env: the whole manifest is searched."""
    document = json.loads(planner_spec().to_json())
    document["spec"]["serveConfig"]["applications"][0]["runtime_env"] = {"env_vars": {"TOKEN": SECRET_VALUE}}
    spec = parse_spec(document)
    with pytest.raises(SecretInExport, match="secret 'api' key 'key'") as refused:
        export_manifest(spec, RAY, (), {"api": {"key": SECRET_VALUE}})
    assert SECRET_VALUE not in str(refused.value)

    path, secrets_dir = tmp_path / "store.db", tmp_path / "secrets"
    set_secret(secrets_dir, "api", {"key": SECRET_VALUE})
    store = Store(path)
    store_spec(store, spec.name, spec.to_json(), None, None, history_limit=10)
    store.close()
    answer = make_client(path, secrets_dir).get(f"/api/v1/services/{spec.name}/export", headers=AUTH)
    assert answer.status_code == 409 and "secret 'api' key 'key'" in answer.text
    assert SECRET_VALUE not in answer.text
