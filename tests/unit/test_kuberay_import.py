"""KubeRay RayService -> servekeeper spec: every mapping, every ignored or refused field by path,
KubeRay's own samples as shipped, multi-document files, the Ray version check."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from servekeeper.kuberay.fields import FT_ENABLED_REASON, GCS_NEEDS_POOL_REASON
from servekeeper.kuberay.notes import NoteKind
from servekeeper.kuberay.quantity import parse_duration_seconds, quantity_value
from servekeeper.kuberay.translate import ImportResult, import_documents
from servekeeper.model.documents import is_kuberay
from servekeeper.model.spec import SpecError

DATA = Path(__file__).resolve().parents[1] / "data" / "kuberay"
SAMPLES = DATA / "samples"
APP_DIR = str(DATA / "apps" / "test_dag")
RAY = "2.60.0"


def sample_documents(name: str, ray_version: str | None = RAY) -> list[Any]:
    """A sample's documents; with `ray_version`, its rayVersion and image tags set to it."""
    text = (SAMPLES / name).read_text()
    if ray_version is not None:
        text = re.sub(r"(rayVersion: \")[0-9.]+", rf"\g<1>{ray_version}", text)
        text = re.sub(r"(image: rayproject/ray[-a-z]*:)[0-9.]+[0-9a-z.-]*", rf"\g<1>{ray_version}", text)
    return [d for d in yaml.safe_load_all(text) if d is not None]


def run_import(documents: list[Any], secrets: dict[str, dict[str, str]] | None = None) -> ImportResult:
    return import_documents(documents, RAY, secrets or {}, base_dir=str(SAMPLES))


def notes(result: ImportResult) -> set[tuple[str, str]]:
    return {(note.kind.value, note.path) for note in result.notes}


def problems(documents: list[Any], **kwargs: Any) -> list[str]:
    with pytest.raises(SpecError) as caught:
        import_documents(documents, RAY, kwargs.get("secrets", {}), base_dir=str(SAMPLES))
    return caught.value.problems


def minimal(**spec_overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "svc"},
        "spec": {
            "serveConfigV2": "applications:\n- name: app\n  import_path: fruit.deployment_graph\n  route_prefix: /\n",
            "rayClusterConfig": {
                "rayVersion": RAY,
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [{"name": "ray-head", "image": f"rayproject/ray:{RAY}"}]}},
                },
            },
        },
    }
    document["spec"].update(spec_overrides)
    return document


def head(document: dict[str, Any]) -> dict[str, Any]:
    return dict(document["spec"]["rayClusterConfig"]["headGroupSpec"])


def head_container(document: dict[str, Any]) -> dict[str, Any]:
    return dict(head(document)["template"]["spec"]["containers"][0])


HEAD_PATH = "spec.rayClusterConfig.headGroupSpec"
CONTAINER_PATH = f"{HEAD_PATH}.template.spec.containers[0]"


# -- KubeRay's samples ------------------------------------------------------------------------


def test_sample_as_shipped_runs_on_the_ray_it_declares() -> None:
    """Issue 21: KubeRay's samples ask for Ray 2.52.0 (rayVersion and the image tags): the
    cluster gets that Ray in an environment of its own, on the controller's Python (no -pyXY)."""
    config = run_import(sample_documents("ray-service.sample.yaml", ray_version=None)).spec.spec.rayClusterConfig
    assert (config.rayVersion, config.pythonVersion, config.pip) == ("2.52.0", None, [])
    on_ours = run_import(sample_documents("ray-service.sample.yaml")).spec.spec.rayClusterConfig
    assert (on_ours.rayVersion, on_ours.pythonVersion) == (None, None), "the controller's own: unset, as before"


@pytest.mark.parametrize(
    ("image", "ray", "python"),
    [
        ("rayproject/ray:2.52.0-py310", "2.52.0", "3.10"),
        ("rayproject/ray:2.52.0-py39-gpu", "2.52.0", "3.9"),
        ("rayproject/ray-ml:2.46.0.0e19ea-py312-cu121", "2.46.0", "3.12"),
        ("registry.example/team/ray:2.50.1@sha256:abc", "2.50.1", None),
    ],
)
def test_an_image_tag_gives_the_ray_and_python_of_the_cluster(image: str, ray: str, python: str | None) -> None:
    documents = sample_documents("ray-service.sample.yaml", ray_version=None)
    cluster = documents[0]["spec"]["rayClusterConfig"]
    cluster["rayVersion"] = ray
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        group["template"]["spec"]["containers"][0]["image"] = image
    config = run_import(documents).spec.spec.rayClusterConfig
    assert (config.rayVersion, config.pythonVersion) == (ray, python)


def test_nodes_asking_for_different_rays_are_refused_naming_each() -> None:
    documents = sample_documents("ray-service.sample.yaml", ray_version=None)
    worker = documents[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["image"] = "rayproject/ray:2.51.0"
    (found,) = problems(documents)
    assert found.startswith("spec.rayClusterConfig.rayVersion: the nodes of one cluster run one rayVersion;")
    worker_image = "workerGroupSpecs[0].template.spec.containers[0].image: 2.51.0"
    assert f"{CONTAINER_PATH}.image: 2.52.0" in found and worker_image in found


def test_an_image_without_a_release_leaves_the_ray_to_rayversion() -> None:
    documents = sample_documents("ray-service.sample.yaml", ray_version=None)
    documents[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = (
        "registry.example/team/model:latest"
    )
    result = run_import(documents)
    assert result.spec.spec.rayClusterConfig.rayVersion == "2.52.0"
    assert ("ignored", f"{CONTAINER_PATH}.image") in notes(result)


def test_sample_maps_every_field() -> None:
    result = run_import(sample_documents("ray-service.sample.yaml"))
    spec = result.spec
    assert spec.name == "rayservice-sample"
    assert spec.spec.ingress.port == 8000  # Serve's default port, which KubeRay's serve service targets
    config = spec.spec.rayClusterConfig
    assert config.workingDir == APP_DIR  # the local working_dir, packaged by servekeeper
    assert (config.head.numCpus, config.head.memory, config.head.numGpus) == (2, 5 * 2**30, None)
    (worker,) = config.workerGroups
    # cpu limit "1" (the request "500m" is not used when there is a limit); memory from the limit
    assert (worker.name, worker.replicas, worker.numCpus, worker.memory) == ("small-group", 1, 1, 2 * 2**30)
    apps = spec.spec.serveConfig.applications
    assert [(a.name, a.import_path, a.route_prefix) for a in apps] == [
        ("fruit_app", "fruit.deployment_graph", "/fruit"),
        ("math_app", "conditional_dag.serve_dag", "/calc"),
    ]
    assert all("runtime_env" not in (a.model_extra or {}) for a in apps)  # working_dir moved to the cluster
    assert apps[0].model_extra is not None and apps[0].model_extra["deployments"][0]["num_replicas"] == 2
    assert spec.spec.upgradeStrategy.type == "NewCluster"
    assert notes(result) == {("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas")}


def test_different_port_sample_takes_its_port_from_serve_config() -> None:
    result = run_import(sample_documents("ray-service.different-port.yaml"))
    assert result.spec.spec.ingress.port == 9000
    assert result.spec.spec.serveConfig.http_options is None  # the port moved to the ingress
    assert notes(result) == {
        ("ignored", f"{CONTAINER_PATH}.ports"),
        ("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].ports"),
        ("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas"),
    }


def test_ingress_port_annotation_wins_over_serve_config() -> None:
    documents = sample_documents("ray-service.different-port.yaml")
    documents[0]["metadata"]["annotations"] = {"servekeeper.io/ingress-port": "9123"}
    assert run_import(documents).spec.spec.ingress.port == 9123


HA_SECRET = {"redis-password-secret": {"password": "5241590000000000"}}
HA_GCS = "spec.rayClusterConfig.gcsFaultToleranceOptions"


def test_the_high_availability_sample_maps_its_redis_once_the_secret_and_a_pool_exist() -> None:
    documents = sample_documents("ray-service.high-availability.yaml")
    assert problems(documents) == [
        f"{HA_GCS}.redisPassword.valueFrom.secretKeyRef: secret 'redis-password-secret' with key 'password' does "
        "not exist here; create it with: servekeeper secret set redis-password-secret password=- (the value on "
        "standard input)",
        f"{HA_GCS}: {GCS_NEEDS_POOL_REASON}",
    ]
    documents[0]["metadata"].setdefault("annotations", {}).update(pool_extensions())
    result = run_import(documents, secrets=HA_SECRET)
    fault_tolerance = result.spec.spec.rayClusterConfig.gcsFaultTolerance
    assert fault_tolerance is not None and fault_tolerance.backend == "redis" and fault_tolerance.redis is not None
    assert fault_tolerance.redis.address == "redis:6379"
    assert fault_tolerance.redis.passwordSecret is not None
    assert (fault_tolerance.redis.passwordSecret.name, fault_tolerance.redis.passwordSecret.key) == (
        "redis-password-secret",
        "password",
    )
    assert "5241590000000000" not in result.spec.to_json(), "the password stays in the secret"


def pool_extensions(**more: Any) -> dict[str, str]:
    return {"servekeeper.io/extensions": json.dumps({"hostPool": "fleet", **more})}


def test_rocksdb_gcs_fault_tolerance_maps_to_the_field_on_a_pool_named_in_the_extensions() -> None:
    document = minimal()
    worker = copy.deepcopy(head(document))
    worker.update({"groupName": "cpu", "replicas": 2, "minReplicas": 2, "maxReplicas": 2})
    cluster(document)["workerGroupSpecs"] = [worker]
    cluster(document)["gcsFaultToleranceOptions"] = {"backend": "rocksdb", "storage": {"size": "1Gi"}}
    document["metadata"]["annotations"] = pool_extensions(hostPins={"head": "host-1", "cpu": "host-2"})
    result = run_import([document])
    config = result.spec.spec.rayClusterConfig
    assert config.gcsFaultTolerance is not None and config.gcsFaultTolerance.backend == "rocksdb"
    assert config.hostPool == "fleet"
    assert (config.head.host, config.workerGroups[0].host) == ("host-1", "host-2")
    assert ("ignored", "spec.rayClusterConfig.gcsFaultToleranceOptions.storage") in notes(result)


def test_rocksdb_without_a_pool_restarts_the_head_on_this_machine_and_redis_is_refused_there() -> None:
    document = minimal()
    cluster(document)["gcsFaultToleranceOptions"] = {"backend": "rocksdb"}
    config = run_import([document]).spec.spec.rayClusterConfig
    assert config.gcsFaultTolerance is not None and config.gcsFaultTolerance.backend == "rocksdb"
    assert config.hostPool is None
    cluster(document)["gcsFaultToleranceOptions"] = {"backend": "redis", "redisAddress": "redis:6379"}
    (problem,) = problems([document])
    assert problem.startswith("spec.rayClusterConfig.gcsFaultToleranceOptions: ") and '"hostPool"' in problem


def test_redis_options_a_literal_password_another_user_and_the_ft_enabled_annotation() -> None:
    document = minimal()
    document["metadata"]["annotations"] = pool_extensions()
    cluster(document)["gcsFaultToleranceOptions"] = {"backend": "redis", "externalStorageNamespace": "mine"}
    result = run_import([document])
    fault_tolerance = result.spec.spec.rayClusterConfig.gcsFaultTolerance
    assert fault_tolerance is not None and fault_tolerance.redis is not None
    assert fault_tolerance.redis.address is None, "no redisAddress: the Redis servekeeper runs"
    assert {("changed", f"{HA_GCS}.redisAddress"), ("ignored", f"{HA_GCS}.externalStorageNamespace")} <= notes(result)
    literal = (
        f"{HA_GCS}.redisPassword.value: a literal password would be stored with the spec: put it in a servekeeper "
        "secret (servekeeper secret set NAME KEY=-) and use valueFrom.secretKeyRef"
    )
    cluster(document)["gcsFaultToleranceOptions"] = {
        "redisAddress": "redis:6379",
        "redisUsername": {"value": "ray"},  # KubeRay's RedisCredential
        "redisPassword": {"value": "hunter2"},
    }
    assert problems([document]) == [f"{HA_GCS}.redisUsername: Ray's default Redis user only ('default')", literal]
    cluster(document)["gcsFaultToleranceOptions"] = {"redisUsername": {"value": "default"}, "redisPassword": "hunter2"}
    assert problems([document]) == [literal]
    config_map = {"valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    cluster(document)["gcsFaultToleranceOptions"] = {"redisPassword": config_map}
    assert problems([document]) == [f"{HA_GCS}.redisPassword.valueFrom: only a secretKeyRef to a servekeeper secret"]
    document = minimal()
    document["metadata"]["annotations"] = {"ray.io/ft-enabled": "true"}
    assert problems([document]) == [f'metadata.annotations["ray.io/ft-enabled"]: {FT_ENABLED_REASON}']


def test_host_pins_name_existing_groups() -> None:
    document = minimal()
    document["metadata"]["annotations"] = pool_extensions(hostPins={"gpu": "host-1"})
    (problem,) = problems([document])
    assert problem.startswith('metadata.annotations["servekeeper.io/extensions"].hostPins.gpu: no such group')


def test_multi_document_file_skips_other_kinds_with_a_warning_naming_them() -> None:
    documents = sample_documents("ray-service.high-availability.yaml")
    del documents[0]["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    result = run_import(documents)
    skipped = [note.message for note in result.notes if note.kind == NoteKind.SKIPPED]
    assert skipped == [
        "ConfigMap/query-config (v1) skipped: not a RayService",
        "Pod/ray-pod (v1) skipped: not a RayService",
        "ConfigMap/redis-config (v1) skipped: not a RayService",
        "Service/redis (v1) skipped: not a RayService",
        "Deployment/redis (apps/v1) skipped: not a RayService",
        "Secret/redis-password-secret (v1) skipped: not a RayService",
    ]
    assert result.spec.spec.rayClusterConfig.head.numCpus == 0  # rayStartParams num-cpus "0" wins
    assert result.spec.spec.rayClusterConfig.workerGroups[0].replicas == 2


def test_gpu_sample_maps_the_gpu_and_keeps_remote_working_dir_and_pip() -> None:
    result = run_import(sample_documents("ray-service.stable-diffusion.yaml"))
    config = result.spec.spec.rayClusterConfig
    assert config.workingDir is None
    (worker,) = config.workerGroups
    assert (worker.name, worker.numCpus, worker.memory, worker.numGpus) == ("gpu-group", 4, 16 * 2**30, 1)
    runtime_env = (result.spec.spec.serveConfig.applications[0].model_extra or {})["runtime_env"]
    assert runtime_env["working_dir"].startswith("https://github.com/ray-project/serve_config_examples/")
    assert runtime_env["pip"] == ["diffusers==0.32.2", "transformers==4.48.2"]
    assert notes(result) == {
        ("ignored", f"{CONTAINER_PATH}.volumeMounts"),
        ("ignored", f"{HEAD_PATH}.template.spec.volumes"),
        ("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas"),
        ("ignored", "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.tolerations"),
    }


def test_is_kuberay() -> None:
    assert is_kuberay(sample_documents("ray-service.high-availability.yaml"))
    assert not is_kuberay([{"apiVersion": "servekeeper/v1alpha1", "kind": "RayService"}])


# -- mappings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resources", "params", "expected"),
    [
        pytest.param({"limits": {"cpu": "500m"}}, {}, (1, None, None), id="cpu-limit-rounded-up"),
        pytest.param({"requests": {"cpu": "2"}}, {}, (2, None, None), id="cpu-request-without-limit"),
        pytest.param({"limits": {"cpu": "3"}, "requests": {"cpu": "1"}}, {}, (3, None, None), id="limit-over-request"),
        pytest.param({"limits": {"cpu": "2"}}, {"num-cpus": "3"}, (3, None, None), id="start-param-wins"),
        pytest.param({"limits": {"cpu": "2"}}, {"num-cpus": "0.5"}, (1, None, None), id="fraction-rounded"),
        pytest.param({"limits": {"memory": "1Gi"}, "requests": {"memory": "2Gi"}}, {}, (1, 2**30, None), id="memory"),
        pytest.param({"requests": {"memory": "1Gi"}}, {}, (1, None, None), id="memory-request-unused"),
        pytest.param({"limits": {"nvidia.com/gpu": "2"}}, {}, (1, None, 2), id="gpu"),
        pytest.param({"limits": {"nvidia.com/mig-2g.32gb": "1"}}, {}, (1, None, 1), id="mig-gpu"),
        pytest.param({"limits": {"nvidia.com/gpu": "2"}}, {"num-gpus": "1"}, (1, None, 1), id="gpu-start-param"),
        pytest.param({}, {"memory": "1000"}, (1, 1000, None), id="memory-start-param"),
    ],
)
def test_resources_map_as_kuberay_does(
    resources: dict[str, Any], params: dict[str, str], expected: tuple[float, int | None, float | None]
) -> None:
    document = minimal()
    head(document)  # shape check
    document["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"] = params
    document["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"] = resources
    group = run_import([document]).spec.spec.rayClusterConfig.head
    assert (group.numCpus, group.memory, group.numGpus) == expected


@pytest.mark.parametrize(
    ("where", "path"),
    [
        pytest.param("rayStartParams", f"{HEAD_PATH}.rayStartParams.num-cpus", id="start-param"),
        pytest.param("resources", f"{HEAD_PATH}.resources.cpu", id="group-resources"),
    ],
)
def test_a_fraction_of_a_cpu_is_rounded_up_with_a_note(where: str, path: str) -> None:
    """`ray start --num-cpus` takes whole CPUs: KubeRay would pass 0.5 and the node would not
    start; servekeeper's import starts it with 1 (what Ray makes of a container limit of 500m)."""
    document = minimal()
    key = "num-cpus" if where == "rayStartParams" else "cpu"
    document["spec"]["rayClusterConfig"]["headGroupSpec"][where] = {key: "500m"}
    result = run_import([document])
    assert result.spec.spec.rayClusterConfig.head.numCpus == 1
    [note] = [n for n in result.notes if n.path == path]
    assert note.kind == NoteKind.CHANGED and note.message.startswith("0.5 rounded up to 1")


def test_quantities_and_durations() -> None:
    assert [quantity_value(v) for v in ("500m", "1", 2, "1.5", "1Ki", "1G")] == [1, 1, 2, 2, 1024, 10**9]
    assert [parse_duration_seconds(v) for v in ("30m", "1h30m", "90s", "600", "1.5h", "500ms")] == [
        1800,
        5400,
        90,
        600,
        5400,
        0.5,
    ]


def test_start_params_pass_through_typed_and_owned_ones_are_overridden() -> None:
    document = minimal()
    document["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"] = {
        "object-store-memory": "100000000",
        "dashboard-host": "0.0.0.0",
        "port": "6379",
        "include-dashboard": "true",
        "resources": "'{\"custom\": 1}'",
    }
    result = run_import([document])
    assert result.spec.spec.rayClusterConfig.head.rayStartParams == {
        "object-store-memory": 100000000,
        "resources": '{"custom": 1}',
    }
    assert notes(result) == {
        ("overridden", f"{HEAD_PATH}.rayStartParams.dashboard-host"),
        ("overridden", f"{HEAD_PATH}.rayStartParams.include-dashboard"),
        ("overridden", f"{HEAD_PATH}.rayStartParams.port"),
    }


def test_literal_env_and_secret_env() -> None:
    document = minimal()
    head_container(document)
    document["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "MODE", "value": "fast"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "api", "key": "token"}}},
    ]
    result = run_import([document], secrets={"api": {"token": "s3cret"}})
    assert result.spec.spec.rayClusterConfig.head.env == {"MODE": "fast", "TOKEN": "s3cret"}
    assert [ref.to_json() for ref in result.secret_refs] == [
        {"group": "head", "env": "TOKEN", "secret": "api", "key": "token"}
    ]
    assert problems([document]) == [
        f"{CONTAINER_PATH}.env[1].valueFrom.secretKeyRef: secret 'api' with key 'token' does not exist here; "
        "create it with: servekeeper secret set api token=- (the value on standard input)"
    ]


def test_worker_count_group_name_and_upgrade_settings() -> None:
    document = minimal(
        upgradeStrategy={"type": "None"},
        rayClusterDeletionDelaySeconds=15,
    )
    document["metadata"]["annotations"] = {"ray.io/initializing-timeout": "5m"}
    worker = copy.deepcopy(head(document))
    worker.update({"groupName": "cpu-pool", "replicas": 1, "minReplicas": 3, "maxReplicas": 3})
    document["spec"]["rayClusterConfig"]["workerGroupSpecs"] = [worker]
    spec = run_import([document]).spec
    assert [(g.name, g.replicas) for g in spec.spec.rayClusterConfig.workerGroups] == [("cpu-pool", 3)]
    assert spec.spec.upgradeStrategy.type == "None"
    assert spec.spec.rayClusterDeletionDelaySeconds == 15
    assert spec.spec.readinessTimeoutSeconds == 300


def test_incremental_upgrade_becomes_a_canary_whose_capacity_follows_traffic() -> None:
    document = minimal(
        upgradeStrategy={
            "type": "NewClusterWithIncrementalUpgrade",
            "clusterUpgradeOptions": {
                "gatewayClassName": "istio",
                "stepSizePercent": 30,
                "intervalSeconds": 20,
                "maxSurgePercent": 10,
            },
        }
    )
    result = run_import([document])
    strategy = result.spec.spec.upgradeStrategy
    assert strategy.type == "Canary" and strategy.canary is not None and strategy.canary.capacityFollowsTraffic
    steps = [(step.setWeight, step.pause.duration if step.pause else None) for step in strategy.canary.steps]
    assert steps == [(30, None), (None, 20), (60, None), (None, 20), (90, None), (None, 20)]
    by_path = {note.path: note for note in result.notes}
    assert "30% more traffic every 20s" in by_path["spec.upgradeStrategy.type"].message
    assert "maxSurgePercent 10 unused" in by_path["spec.upgradeStrategy.type"].message
    assert by_path["spec.upgradeStrategy.clusterUpgradeOptions.gatewayClassName"].kind == NoteKind.IGNORED


def test_incremental_upgrade_without_its_step_size_is_refused_naming_the_field() -> None:
    document = minimal(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {}})
    with pytest.raises(SpecError) as raised:
        run_import([document])
    assert any("clusterUpgradeOptions.stepSizePercent" in problem for problem in raised.value.problems)


def test_serve_config_http_host_and_proxy_location_are_read_not_refused() -> None:
    document = minimal(
        serveConfigV2=(
            "proxy_location: EveryNode\nhttp_options: {host: 0.0.0.0, port: 8100, request_timeout_s: 5}\n"
            "applications:\n- name: app\n  import_path: fruit.deployment_graph\n"
        )
    )
    result = run_import([document])
    assert result.spec.spec.ingress.port == 8100
    assert result.spec.spec.serveConfig.http_options == {"request_timeout_s": 5}
    assert notes(result) == {
        ("overridden", "spec.serveConfigV2.http_options.host"),
        ("overridden", "spec.serveConfigV2.proxy_location"),
    }


def test_remote_uris_are_kept_and_local_py_modules_refused() -> None:
    document = minimal(
        serveConfigV2=(
            "applications:\n- name: a\n  import_path: m.app\n  route_prefix: /a\n"
            "  runtime_env: {working_dir: 's3://bucket/code.zip', py_modules: ['https://x/y.whl', './local_mod']}\n"
        )
    )
    assert problems([document]) == [
        "spec.serveConfigV2.applications[0].runtime_env.py_modules[1]: a local module is not packaged by "
        "servekeeper; put it inside the working_dir, or use a remote URI"
    ]
    document["spec"]["serveConfigV2"] = document["spec"]["serveConfigV2"].replace(", './local_mod'", "")
    runtime_env = (run_import([document]).spec.spec.serveConfig.applications[0].model_extra or {})["runtime_env"]
    assert runtime_env == {"working_dir": "s3://bucket/code.zip", "py_modules": ["https://x/y.whl"]}


def test_differing_local_working_dirs_are_refused() -> None:
    document = minimal(
        serveConfigV2=(
            "applications:\n- {name: a, import_path: m.app, route_prefix: /a, runtime_env: {working_dir: ./a}}\n"
            "- {name: b, import_path: m.app, route_prefix: /b, runtime_env: {working_dir: ./b}}\n"
        )
    )
    (problem,) = problems([document])
    assert problem.startswith("spec.serveConfigV2.applications: local working_dir values differ")


# -- ignored and refused fields, each by its path -----------------------------------------------

IGNORED = [
    ("spec.serviceUnhealthySecondThreshold", lambda d: d["spec"].update(serviceUnhealthySecondThreshold=900)),
    ("spec.deploymentUnhealthySecondThreshold", lambda d: d["spec"].update(deploymentUnhealthySecondThreshold=9)),
    ("spec.serveService", lambda d: d["spec"].update(serveService={"spec": {"type": "LoadBalancer"}})),
    (
        "spec.rayClusterConfig.headServiceAnnotations",
        lambda d: d["spec"]["rayClusterConfig"].update(headServiceAnnotations={"a": "b"}),
    ),
    ("spec.rayClusterConfig.autoscalerOptions", lambda d: cluster(d).update(autoscalerOptions={"upscalingMode": "x"})),
    (f"{HEAD_PATH}.serviceType", lambda d: head_group(d).update(serviceType="NodePort")),
    (f"{HEAD_PATH}.enableIngress", lambda d: head_group(d).update(enableIngress=True)),
    (f"{HEAD_PATH}.template.spec.tolerations", lambda d: pod(d).update(tolerations=[{"key": "k"}])),
    (f"{HEAD_PATH}.template.spec.affinity", lambda d: pod(d).update(affinity={})),
    (f"{HEAD_PATH}.template.spec.nodeSelector", lambda d: pod(d).update(nodeSelector={"gpu": "a100"})),
    (f"{HEAD_PATH}.template.spec.volumes", lambda d: pod(d).update(volumes=[])),
    (f"{CONTAINER_PATH}.lifecycle", lambda d: container(d).update(lifecycle={"preStop": {}})),
    (f"{CONTAINER_PATH}.readinessProbe", lambda d: container(d).update(readinessProbe={})),
    (f"{CONTAINER_PATH}.livenessProbe", lambda d: container(d).update(livenessProbe={})),
    (f"{CONTAINER_PATH}.volumeMounts", lambda d: container(d).update(volumeMounts=[])),
]
REFUSED = [
    (
        "spec.rayClusterConfig.gcsFaultToleranceOptions",
        lambda d: cluster(d).update(gcsFaultToleranceOptions={"redisAddress": "redis:6379"}),
    ),
    ("spec.rayClusterConfig.authOptions", lambda d: cluster(d).update(authOptions={"mode": "token"})),
    ("spec.rayClusterConfig.networkPolicy", lambda d: cluster(d).update(networkPolicy={"mode": "Deny"})),
    ("spec.managedBy", lambda d: d["spec"].update(managedBy="kueue.x-k8s.io/multikueue")),
    ("spec.rayClusterConfig.managedBy", lambda d: cluster(d).update(managedBy="x")),
    (
        f"{CONTAINER_PATH}.env[0].valueFrom",
        lambda d: container(d).update(env=[{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]),
    ),
    (f"{CONTAINER_PATH}.envFrom", lambda d: container(d).update(envFrom=[{"secretRef": {"name": "s"}}])),
]


def cluster(document: dict[str, Any]) -> dict[str, Any]:
    return document["spec"]["rayClusterConfig"]  # type: ignore[no-any-return]


def head_group(document: dict[str, Any]) -> dict[str, Any]:
    return cluster(document)["headGroupSpec"]  # type: ignore[no-any-return]


def pod(document: dict[str, Any]) -> dict[str, Any]:
    return head_group(document)["template"]["spec"]  # type: ignore[no-any-return]


def container(document: dict[str, Any]) -> dict[str, Any]:
    return pod(document)["containers"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("path", "change"), [pytest.param(p, c, id=p) for p, c in IGNORED])
def test_ignored_field_is_accepted_and_noted_by_path(path: str, change: Any) -> None:
    document = minimal()
    change(document)
    result = run_import([document])
    assert ("ignored", path) in notes(result)


@pytest.mark.parametrize(("path", "change"), [pytest.param(p, c, id=p) for p, c in REFUSED])
def test_refused_field_names_its_path_and_what_to_do(path: str, change: Any) -> None:
    document = minimal()
    change(document)
    found = problems([document])
    assert len(found) == 1 and found[0].startswith(f"{path}: "), found
    assert len(found[0]) > len(path) + 20  # says what to do instead


def test_problems_of_the_translated_spec_name_kuberay_paths() -> None:
    document = minimal()
    worker = copy.deepcopy(head(document))
    worker.update({"groupName": "Not_A_Label", "replicas": 1, "minReplicas": 1, "maxReplicas": 1})
    cluster(document)["workerGroupSpecs"] = [worker]
    (problem,) = problems([document])
    assert problem.startswith("spec.rayClusterConfig.workerGroupSpecs[0].groupName: ")


def test_extensions_annotation_sets_servekeeper_only_fields() -> None:
    document = minimal()
    document["metadata"]["annotations"] = {
        "servekeeper.io/extensions": json.dumps(
            {"readiness": {"probes": [{"path": "/ready"}]}, "ingress": {"grpcPort": 9001}, "excludes": ["*.bin"]}
        )
    }
    spec = run_import([document]).spec
    assert spec.spec.readiness.probes[0].path == "/ready"
    assert spec.spec.ingress.grpcPort == 9001
    assert spec.spec.rayClusterConfig.excludes == ["*.bin"]


def test_one_ray_service_per_file() -> None:
    with pytest.raises(SpecError) as caught:
        run_import([minimal(), minimal()])
    assert caught.value.problems == ["(file): expected exactly one ray.io RayService, found 2 (document 1, document 2)"]


def test_v1alpha1_is_accepted() -> None:
    document = minimal()
    document["apiVersion"] = "ray.io/v1alpha1"
    assert run_import([document]).source == "ray.io/v1alpha1 RayService"
