"""servekeeper spec -> KubeRay RayService: valid against KubeRay's CRD schema, and export -> import
gives the same spec (every example service); status in KubeRay's shape."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from servekeeper.kuberay.export import export_manifest, render_manifest
from servekeeper.kuberay.notes import SecretRef
from servekeeper.kuberay.status import kuberay_service, kuberay_status
from servekeeper.kuberay.translate import import_documents
from servekeeper.model.cluster_spec import GcsFaultToleranceSpec, RedisSpec
from servekeeper.model.spec import ServiceSpec, StandbySpec, load_spec_file, parse_spec

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
EXAMPLES = sorted(p for p in (REPO / "examples").glob("**/*.yaml") if "kuberay" not in p.parts)
RAY = "2.60.0"


@functools.cache
def rayservice_schema() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return dict(v1["schema"]["openAPIV3Schema"])


def roundtrip(spec: ServiceSpec, refs: list[SecretRef] | None = None, secrets: Any = None) -> tuple[str, ServiceSpec]:
    manifest, comments = export_manifest(spec, RAY, refs or [])
    text = render_manifest(manifest, comments)
    documents = list(yaml.safe_load_all(text))
    jsonschema.validate(documents[0], rayservice_schema())
    return text, import_documents(documents, RAY, secrets or {}).spec


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(REPO))) for p in EXAMPLES])
def test_every_example_exports_a_valid_manifest_that_imports_back_the_same(path: Path) -> None:
    spec = load_spec_file(path)
    text, back = roundtrip(spec)
    assert back == spec
    assert text.startswith("# Exported by servekeeper")
    assert "must become a remote URI" in text  # every example has a local workingDir


def test_schema_rejects_what_kuberay_rejects() -> None:
    manifest, _ = export_manifest(load_spec_file(EXAMPLES[0]), RAY)
    del manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, rayservice_schema())


def _spec(**body: Any) -> ServiceSpec:
    document: dict[str, Any] = {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": "full"},
        "spec": {
            "ingress": {"port": 8300, "grpcPort": 8301, "requestTimeoutSeconds": 30},
            "rayClusterConfig": {
                "workingDir": "/srv/app",
                "excludes": ["*.ckpt"],
                "head": {
                    "numCpus": 0,
                    "memory": 3 * 2**30,
                    "env": {"A": "1", "TOKEN": "t"},
                    "rayStartParams": {"object-store-memory": 100000000, "include-log-monitor": False},
                },
                "workerGroups": [
                    {"name": "gpu", "replicas": 2, "numCpus": 2, "numGpus": 1, "memory": 1000},
                    {"name": "cpu", "replicas": 0, "numCpus": 3, "numGpus": 0},
                ],
            },
            "serveConfig": {
                "applications": [
                    {"name": "a", "import_path": "m:app", "route_prefix": "/a"},
                    {
                        "name": "b",
                        "import_path": "m:b",
                        "route_prefix": "/b",
                        "runtime_env": {"working_dir": "https://example.com/b.zip"},
                    },
                ],
                "http_options": {"request_timeout_s": 9},
            },
            "upgradeStrategy": {"type": "None"},
            "serveConfigUpdate": "NewCluster",
            "readiness": {"applications": "all", "probes": [{"path": "/ready", "successThreshold": 2}]},
            "rayClusterDeletionDelaySeconds": 7.5,
            "readinessTimeoutSeconds": 90,
            "serviceUnhealthySecondThreshold": 45,
            **body,
        },
    }
    return parse_spec(document)


def test_every_field_round_trips_and_secrets_stay_references() -> None:
    spec = _spec()
    refs = [SecretRef(group="head", env="TOKEN", secret="api", key="token")]
    text, back = roundtrip(spec, refs, secrets={"api": {"token": "t"}})
    assert back == spec
    assert "secretKeyRef" in text and "name: TOKEN\n" in text and "value: t\n" not in text
    for expected in ("readiness probes", "serveConfigUpdate: NewCluster", "ingress options", "excludes"):
        assert expected in text


def test_a_pool_service_with_gcs_fault_tolerance_and_a_standby_round_trips() -> None:
    spec = _spec()
    config = spec.spec.rayClusterConfig.model_copy(
        update={
            "hostPool": "fleet",
            "gcsFaultTolerance": GcsFaultToleranceSpec(),
            "head": spec.spec.rayClusterConfig.head.model_copy(update={"host": "host-1"}),
        }
    )
    body = spec.spec.model_copy(update={"rayClusterConfig": config, "standby": StandbySpec()})
    spec = spec.model_copy(update={"spec": body})
    text, back = roundtrip(spec)
    assert back == spec
    manifest = yaml.safe_load(text)
    assert manifest["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {"backend": "rocksdb"}
    assert "hostPool fleet" in text


def test_a_head_that_moves_host_round_trips_in_the_extensions() -> None:
    spec = _spec()
    fault_tolerance = GcsFaultToleranceSpec(backend="redis", redis=RedisSpec(), headMoveAfterSeconds=12)
    config = spec.spec.rayClusterConfig.model_copy(update={"hostPool": "fleet", "gcsFaultTolerance": fault_tolerance})
    spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"rayClusterConfig": config})})
    text, back = roundtrip(spec)
    assert back == spec
    manifest = yaml.safe_load(text)
    assert manifest["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {"backend": "redis"}
    extensions = json.loads(manifest["metadata"]["annotations"]["servekeeper.io/extensions"])
    assert extensions["headMoveAfterSeconds"] == 12


def test_a_cluster_of_its_own_ray_python_and_packages_round_trips() -> None:
    """rayVersion and pythonVersion in KubeRay's rayVersion and image tags, pip in the extensions."""
    spec = _spec()
    own = {"rayVersion": "2.52.0", "pythonVersion": "3.10", "pip": ["numpy==2.1.0"]}
    config = spec.spec.rayClusterConfig.model_copy(update=own)
    spec = spec.model_copy(update={"spec": spec.spec.model_copy(update={"rayClusterConfig": config})})
    text, back = roundtrip(spec)
    assert back == spec
    manifest = yaml.safe_load(text)
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.52.0"
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "rayproject/ray:2.52.0-py310"
    extensions = json.loads(manifest["metadata"]["annotations"]["servekeeper.io/extensions"])
    assert extensions["pip"] == ["numpy==2.1.0"]


def test_manifest_shape() -> None:
    manifest, _ = export_manifest(_spec(), RAY)
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert cluster["rayVersion"] == RAY
    assert head["rayStartParams"] == {
        "object-store-memory": "100000000",
        "include-log-monitor": "false",
        "num-cpus": "0",
    }
    container = head["template"]["spec"]["containers"][0]
    assert container["image"] == f"rayproject/ray:{RAY}"
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "3Gi"}
    gpu = cluster["workerGroupSpecs"][0]
    assert (gpu["groupName"], gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == ("gpu", 2, 2, 2)
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "cpu": "2",
        "memory": "1000",
        "nvidia.com/gpu": "1",
    }
    assert manifest["spec"]["upgradeStrategy"] == {"type": "None"}
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config["http_options"] == {"request_timeout_s": 9, "port": 8300}
    assert serve_config["applications"][0]["runtime_env"] == {"working_dir": "/srv/app"}
    assert serve_config["applications"][1]["runtime_env"] == {"working_dir": "https://example.com/b.zip"}
    assert manifest["metadata"]["annotations"]["ray.io/initializing-timeout"] == "90s"


# -- status in KubeRay's shape ------------------------------------------------------------------


def _cluster(name: str, traffic: int, apps: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "trafficPercent": traffic, "applications": apps}


def _view(ready: bool, active: Any, pending: Any, failure: str | None = None) -> dict[str, Any]:
    return {
        "name": "svc",
        "generation": 3,
        "observedGeneration": 2,
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "AllAppsReady" if ready else "X",
                "message": "",
                "lastTransitionTime": 0.0,
            },
            {
                "type": "UpgradeInProgress",
                "status": "True" if pending else "False",
                "reason": "PendingClusterNotReady",
                "message": "m",
                "lastTransitionTime": None,
            },
        ],
        "activeCluster": active,
        "pendingCluster": pending,
        "failureReason": failure,
    }


def test_status_during_an_upgrade() -> None:
    active = _cluster("svc-1", 100, {"app": {"status": "RUNNING", "source": "declarative", "message": ""}})
    pending = _cluster("svc-2", 0, {"app": {"status": "DEPLOYING", "source": "declarative", "message": "wait"}})
    status = kuberay_status(_view(True, active, pending))
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "True", "NonZeroServeEndpoints"),
        ("UpgradeInProgress", "True", "BothActivePendingClustersExist"),
    ]
    assert status["conditions"][0]["lastTransitionTime"] == "1970-01-01T00:00:00Z"
    assert status["conditions"][1]["message"] == "PendingClusterNotReady: m"
    assert status["activeServiceStatus"] == {
        "rayClusterName": "svc-1",
        "trafficRoutedPercent": 100,
        "applicationStatuses": {"app": {"status": "RUNNING"}},
    }
    assert status["pendingServiceStatus"]["applicationStatuses"] == {"app": {"status": "DEPLOYING", "message": "wait"}}
    assert (status["numServeEndpoints"], status["observedGeneration"], status["serviceStatus"]) == (1, 2, "Running")


@pytest.mark.parametrize(
    ("view", "ready_reason", "upgrade_reason"),
    [
        pytest.param(_view(False, None, None), "Initializing", "NoActiveCluster", id="first-apply"),
        pytest.param(
            _view(False, None, None, failure="ReadinessTimeout: not ready"),
            "InitializingTimeout",
            "NoActiveCluster",
            id="timeout",
        ),
        pytest.param(_view(False, _cluster("c", 100, {}), None), "ZeroServeEndpoints", "NoPendingCluster", id="down"),
    ],
)
def test_status_reasons(view: dict[str, Any], ready_reason: str, upgrade_reason: str) -> None:
    status = kuberay_service(view)["status"]
    assert [c["reason"] for c in status["conditions"]] == [ready_reason, upgrade_reason]
    assert status["numServeEndpoints"] == 0 and "serviceStatus" not in status
    if view["activeCluster"] is None:
        assert status["activeServiceStatus"] == {} and status["pendingServiceStatus"] == {}


def test_a_canary_exports_as_kuberay_incremental_upgrade_when_it_is_one_and_round_trips() -> None:
    steps = [{"setWeight": 25}, {"pause": {"duration": 30}}, {"setWeight": 50}, {"pause": {"duration": 30}}]
    steps += [{"setWeight": 75}, {"pause": {"duration": 30}}]
    incremental = _spec(upgradeStrategy={"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}})
    manifest, comments = export_manifest(incremental, RAY)
    options = manifest["spec"]["upgradeStrategy"]["clusterUpgradeOptions"]
    assert manifest["spec"]["upgradeStrategy"]["type"] == "NewClusterWithIncrementalUpgrade"
    assert (options["stepSizePercent"], options["intervalSeconds"]) == (25, 30)
    assert any("gatewayClassName" in comment for comment in comments)
    _, back = roundtrip(incremental, [], secrets={})
    assert back.spec.upgradeStrategy == incremental.spec.upgradeStrategy


def test_a_canary_with_analysis_exports_as_new_cluster_and_comes_back_from_the_annotation() -> None:
    canary = {
        "steps": [{"setWeight": 10}, {"pause": {}}],
        "analysis": {"interval": 5, "successRate": {"min": 0.99}},
    }
    spec = _spec(upgradeStrategy={"type": "Canary", "canary": canary}, rollbackWindowSeconds=60)
    text, back = roundtrip(spec, [], secrets={})
    assert "type: NewCluster" in text and "KubeRay has no equivalent" in text
    assert back == spec


def test_header_routes_keep_a_canary_out_of_incremental_and_come_back_from_the_annotation() -> None:
    steps = [{"setWeight": 50}, {"pause": {"duration": 30}}]
    for canary in (
        {"steps": steps, "capacityFollowsTraffic": True, "headerRoute": {"header": "x-canary", "value": "always"}},
        {"steps": [*steps, {"setHeaderRoute": {"header": "x-qa", "regex": "qa-.*"}}], "capacityFollowsTraffic": True},
    ):
        spec = _spec(upgradeStrategy={"type": "Canary", "canary": canary})
        manifest, _ = export_manifest(spec, RAY)
        assert manifest["spec"]["upgradeStrategy"]["type"] == "NewCluster", "KubeRay's incremental upgrade has none"
        _, back = roundtrip(spec, [], secrets={})
        assert back == spec
