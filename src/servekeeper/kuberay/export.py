"""Pure: servekeeper's spec -> a KubeRay `ray.io/v1` `RayService` manifest.

What KubeRay has no field for is kept in the `servekeeper.io/extensions` annotation (KubeRay
ignores it; servekeeper's import reads it back, so export -> import gives the same spec) and
listed in a comment block at the top of the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

from servekeeper.kuberay.fields import EXTENSIONS_ANNOTATION, INITIALIZING_TIMEOUT_ANNOTATION
from servekeeper.kuberay.notes import SecretRef
from servekeeper.kuberay.quantity import format_duration, format_memory
from servekeeper.kuberay.versions import image_tag
from servekeeper.model.cluster_spec import HeadGroupSpec, RayClusterConfigSpec
from servekeeper.model.spec import IngressSpec, ReadinessSpec, ServiceSpec, ServiceSpecBody
from servekeeper.model.start_params import StartParamValue

RAY_IMAGE = "rayproject/ray"


# A stored secret value this long is looked for inside any text of the manifest; a shorter one
# ("1", "true") would match ordinary settings, so it is matched only as a whole env value.
MIN_SECRET_SEARCHED = 8


class SecretInExport(ValueError):
    """The manifest would hold a stored secret's value where no secretKeyRef can stand for it
    (inside a longer env value, in the Serve config): refused, never printed."""


Secrets = Mapping[str, Mapping[str, str]]  # secret name -> key -> value, as `servekeeper secret` stores them


def export_manifest(
    spec: ServiceSpec, ray_version: str, secret_refs: Sequence[SecretRef] = (), secrets: Secrets | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The manifest, and the lines of the comment block (what has no KubeRay equivalent).

    An env value is written as a secretKeyRef when `secret_refs` names it (how it was imported)
    or when it equals the current value of one of `secrets` (a safety net: the refs of a
    revision may be lost); SecretInExport when a secret's value would still be in the text."""
    manifest, comments, serve_config = _manifest(spec, ray_version, secret_refs, secrets or {})
    _refuse_secret_values(secrets or {}, [manifest, serve_config, comments])
    return manifest, comments


def _manifest(
    spec: ServiceSpec, ray_version: str, secret_refs: Sequence[SecretRef], secrets: Secrets
) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    body = spec.spec
    comments: list[str] = []
    serve_config = _serve_config(body, comments)
    extensions = _extensions(body)
    comments += _differences(body, extensions)
    annotations = {INITIALIZING_TIMEOUT_ANNOTATION: format_duration(body.readinessTimeoutSeconds)}
    if extensions:
        annotations[EXTENSIONS_ANNOTATION] = json.dumps(extensions, sort_keys=True, separators=(",", ":"))
    cluster = _cluster_config(body.rayClusterConfig, ray_version, secret_refs, secrets)
    manifest_spec: dict[str, Any] = {
        "upgradeStrategy": _upgrade_strategy(body, comments),
        "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
        "rayClusterConfig": cluster,
    }
    delay = body.rayClusterDeletionDelaySeconds
    if delay == int(delay):
        manifest_spec["rayClusterDeletionDelaySeconds"] = int(delay)
    manifest = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": spec.name, "annotations": annotations},
        "spec": manifest_spec,
    }
    return manifest, comments, serve_config


def _refs_by_value(secrets: Secrets) -> dict[str, tuple[str, str]]:
    """A stored secret value -> the first (secret, key) that holds it (any gives the same value)."""
    by_value: dict[str, tuple[str, str]] = {}
    for secret in sorted(secrets):
        for key in sorted(secrets[secret]):
            if secrets[secret][key]:
                by_value.setdefault(secrets[secret][key], (secret, key))
    return by_value


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _secret_within(text: str, secrets: Secrets) -> tuple[str, str] | None:
    """The (secret, key) of a stored value long enough to search for that `text` holds, if any."""
    for secret in sorted(secrets):
        for key, value in sorted(secrets[secret].items()):
            if len(value) >= MIN_SECRET_SEARCHED and value in text:
                return secret, key
    return None


def _refuse_secret_values(secrets: Secrets, parts: Sequence[Any]) -> None:
    """SecretInExport naming the secret and key (never the value) found in any text of `parts`."""
    for text in _strings(list(parts)):
        found = _secret_within(text, secrets)
        if found is not None:
            raise SecretInExport(
                f"the manifest would hold the value of secret {found[0]!r} key {found[1]!r} where no "
                "secretKeyRef can stand for it; not exported"
            )


def _serve_config(body: ServiceSpecBody, comments: list[str]) -> dict[str, Any]:
    """serveConfigV2 with the ingress port as Serve's port and the cluster's working dir in
    each app's runtime_env (KubeRay has no cluster-wide one)."""
    config = body.rayClusterConfig
    serve_config = body.serveConfig.model_dump(mode="json", exclude_none=False)
    if serve_config.get("http_options") is None:
        serve_config.pop("http_options", None)
    serve_config["http_options"] = {**(serve_config.get("http_options") or {}), "port": body.ingress.port}
    if config.workingDir:
        for app in serve_config["applications"]:
            runtime_env = dict(app.get("runtime_env") or {})
            runtime_env.setdefault("working_dir", config.workingDir)
            app["runtime_env"] = runtime_env
        if "://" not in config.workingDir:
            comments.append(
                f"runtime_env.working_dir {config.workingDir} is a local folder that servekeeper packages and "
                "uploads; on Kubernetes it must become a remote URI (an https:// zip, s3://, gs://) that the pods "
                "can fetch: replace it before applying this manifest."
            )
    return serve_config


def _differences(body: ServiceSpecBody, extensions: dict[str, Any]) -> list[str]:
    """The comment lines for servekeeper settings KubeRay would not honour."""
    comments: list[str] = []
    if body.readiness.probes:
        comments.append(
            "readiness probes (spec.readiness.probes): KubeRay has none; traffic there moves once every "
            "declared app is RUNNING."
        )
    if body.readiness.applications != "declarative":
        comments.append("readiness.applications: all (run-time apps gate readiness): KubeRay has no such option.")
    if body.serveConfigUpdate != "InPlace":
        comments.append("serveConfigUpdate: NewCluster: KubeRay applies a Serve-config-only change in place.")
    if body.ingress != IngressSpec(port=body.ingress.port):
        comments.append("ingress options (grpcPort, request size and timeouts): set them on your Kubernetes ingress.")
    if body.rayClusterConfig.excludes:
        comments.append("rayClusterConfig.excludes: applies to servekeeper's code package only.")
    if body.rayClusterConfig.hostPool is not None:
        comments.append(
            f"hostPool {body.rayClusterConfig.hostPool}: the nodes run on that pool's machines over SSH; KubeRay "
            "schedules pods instead."
        )
    comments.append(
        "servekeeper drains the old cluster by in-flight requests; KubeRay deletes it after "
        "rayClusterDeletionDelaySeconds regardless."
    )
    if extensions:
        comments.append(
            f"The {EXTENSIONS_ANNOTATION} annotation keeps these servekeeper settings for a round trip; "
            "KubeRay ignores it."
        )
    return comments


def _cluster_config(
    config: RayClusterConfigSpec, ray_version: str, secret_refs: Sequence[SecretRef], secrets: Secrets
) -> dict[str, Any]:
    # A cluster of its own Ray says so; the image tag carries its Python too, as KubeRay's images do.
    image = image_tag(config.rayVersion or ray_version, config.pythonVersion)
    ray_version = config.rayVersion or ray_version
    cluster: dict[str, Any] = {
        "rayVersion": ray_version,
        "headGroupSpec": {
            "rayStartParams": _start_params(config.head),
            "template": _pod_template("ray-head", config.head, image, _refs(secret_refs, "head", config.head, secrets)),
        },
    }
    if config.workerGroups:
        cluster["workerGroupSpecs"] = [
            {
                "groupName": group.name,
                "replicas": group.replicas,
                "minReplicas": group.min_nodes(),
                "maxReplicas": group.max_nodes(),
                "rayStartParams": _start_params(group),
                "template": _pod_template("ray-worker", group, image, _refs(secret_refs, group.name, group, secrets)),
            }
            for group in config.workerGroups
        ]
    if config.enableInTreeAutoscaling:
        cluster["enableInTreeAutoscaling"] = True
        if config.autoscalerOptions is not None:
            cluster["autoscalerOptions"] = config.autoscalerOptions.model_dump(mode="json")
    if config.gcsFaultTolerance is not None:
        cluster["gcsFaultToleranceOptions"] = _fault_tolerance_options(config)
    return cluster


def _fault_tolerance_options(config: RayClusterConfigSpec) -> dict[str, Any]:
    """KubeRay's names; a Redis servekeeper runs (no address) has none: `backend: redis` alone."""
    assert config.gcsFaultTolerance is not None
    options: dict[str, Any] = {"backend": config.gcsFaultTolerance.backend}
    redis = config.gcsFaultTolerance.redis
    if redis is not None and redis.address is not None:
        options["redisAddress"] = redis.address
    if redis is not None and redis.passwordSecret is not None:
        ref = {"name": redis.passwordSecret.name, "key": redis.passwordSecret.key}
        options["redisPassword"] = {"valueFrom": {"secretKeyRef": ref}}
    return options


def render_manifest(manifest: dict[str, Any], comments: list[str]) -> str:
    header = [
        "# Exported by servekeeper: a KubeRay RayService (ray.io/v1).",
        "# No KubeRay equivalent:",
        *(f"#  - {line}" for line in comments),
    ]
    return "\n".join(header) + "\n" + yaml.dump(manifest, Dumper=_BlockDumper, sort_keys=False)


class _BlockDumper(yaml.SafeDumper):
    """serveConfigV2 as a `|` block, the way KubeRay's samples write it."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


def _extensions(body: ServiceSpecBody) -> dict[str, Any]:
    """servekeeper fields that differ from their defaults and have no KubeRay field."""
    defaults = ServiceSpecBody(ingress=body.ingress, serveConfig=body.serveConfig)
    extensions: dict[str, Any] = {}
    ingress = body.ingress.model_dump(mode="json", exclude={"port"})
    default_ingress = IngressSpec(port=body.ingress.port).model_dump(mode="json", exclude={"port"})
    changed_ingress = {k: v for k, v in ingress.items() if v != default_ingress[k]}
    if changed_ingress:
        extensions["ingress"] = changed_ingress
    if body.readiness != ReadinessSpec():
        extensions["readiness"] = body.readiness.model_dump(mode="json")
    for key in (
        "serveConfigUpdate",
        "serviceUnhealthySecondThreshold",
        "rollbackWindowSeconds",
        "revisionHistoryLimit",
    ):
        if getattr(body, key) != getattr(defaults, key):
            extensions[key] = getattr(body, key)
    if body.standby is not None:
        extensions["standby"] = body.standby.model_dump(mode="json")
    if body.upgradeStrategy.type == "Canary" and _incremental(body) is None:
        extensions["upgradeStrategy"] = body.upgradeStrategy.model_dump(mode="json", exclude_none=True)
    config = body.rayClusterConfig
    if config.excludes:
        extensions["excludes"] = list(config.excludes)
    if config.hostPool is not None:
        extensions["hostPool"] = config.hostPool
    if config.pip:
        extensions["pip"] = list(config.pip)
    if config.gcsFaultTolerance is not None and config.gcsFaultTolerance.headMoveAfterSeconds is not None:
        extensions["headMoveAfterSeconds"] = config.gcsFaultTolerance.headMoveAfterSeconds
    pins = {"head": config.head.host} | {group.name: group.host for group in config.workerGroups}
    if any(host is not None for host in pins.values()):
        extensions["hostPins"] = {name: host for name, host in pins.items() if host is not None}
    delay = body.rayClusterDeletionDelaySeconds
    if delay != int(delay):
        extensions["rayClusterDeletionDelaySeconds"] = delay
    return extensions


def _incremental(body: ServiceSpecBody) -> tuple[int, float] | None:
    """(stepSizePercent, intervalSeconds) when the canary is exactly what KubeRay's incremental
    upgrade does: equal steps each followed by an equal timed pause, capacity following traffic,
    no analysis."""
    canary = body.upgradeStrategy.canary
    if canary is None or canary.analysis is not None or canary.headerRoute is not None:
        return None
    if not canary.capacityFollowsTraffic or any(step.mirror or step.setHeaderRoute for step in canary.steps):
        return None  # KubeRay's incremental upgrade has no header route or shadow traffic
    weights = [step.setWeight for step in canary.steps[0::2]]
    pauses = [step.pause.duration if step.pause else None for step in canary.steps[1::2]]
    if not weights or weights[0] is None or len(weights) != len(pauses):
        return None
    size = weights[0]
    interval = pauses[0]
    if weights != list(range(size, 100, size)) or interval is None or any(p != interval for p in pauses):
        return None
    return size, interval


def _upgrade_strategy(body: ServiceSpecBody, comments: list[str]) -> dict[str, Any]:
    if body.upgradeStrategy.type != "Canary":
        return {"type": body.upgradeStrategy.type}
    incremental = _incremental(body)
    if incremental is not None:
        size, interval = incremental
        comments.append(
            "upgradeStrategy Canary became KubeRay's incremental upgrade, which routes through the Gateway API: "
            "set clusterUpgradeOptions.gatewayClassName to your gateway class."
        )
        options = {
            "gatewayClassName": "SET-ME",
            "stepSizePercent": size,
            "intervalSeconds": int(interval),
            "maxSurgePercent": size,
        }
        return {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": options}
    comments.append(
        "upgradeStrategy Canary (steps, pauses, analysis, promote/abort): KubeRay has no equivalent; exported as "
        f"NewCluster, the canary kept in the {EXTENSIONS_ANNOTATION} annotation."
    )
    return {"type": "NewCluster"}


def _refs(
    secret_refs: Sequence[SecretRef], group_name: str, group: HeadGroupSpec, secrets: Secrets
) -> dict[str, SecretRef]:
    """Env name -> the secret it is written as: as imported, else the stored secret holding its
    value; SecretInExport for a value that holds a secret's value within more text."""
    by_value = _refs_by_value(secrets)
    refs = {ref.env: ref for ref in secret_refs if ref.group == group_name}
    for name, value in group.env.items():
        if name in refs:
            continue
        if value in by_value:
            refs[name] = SecretRef(group_name, name, *by_value[value])
        elif (found := _secret_within(value, secrets)) is not None:
            raise SecretInExport(
                f"env {name} of group {group_name} holds the value of secret {found[0]!r} key {found[1]!r} "
                "within other text, which a secretKeyRef cannot express; not exported (set it from the secret "
                "whole, or export after removing it)"
            )
    return refs


def _start_params(group: HeadGroupSpec) -> dict[str, str]:
    params = {key: _param_text(value) for key, value in group.rayStartParams.items()}
    # Container resources carry whole numbers; KubeRay takes rayStartParams first, so an exact
    # share of a CPU or GPU (or none at all) goes there.
    if group.numCpus != int(group.numCpus) or group.numCpus == 0:
        params["num-cpus"] = f"{group.numCpus:g}"
    if group.numGpus is not None and (group.numGpus != int(group.numGpus) or group.numGpus == 0):
        params["num-gpus"] = f"{group.numGpus:g}"
    return params


def _param_text(value: StartParamValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _pod_template(container_name: str, group: HeadGroupSpec, image: str, refs: dict[str, SecretRef]) -> dict[str, Any]:
    resources: dict[str, str] = {"cpu": str(max(1, math.ceil(group.numCpus)))}
    if group.memory is not None:
        resources["memory"] = format_memory(group.memory)
    if group.numGpus:
        resources["nvidia.com/gpu"] = str(math.ceil(group.numGpus))
    container: dict[str, Any] = {
        "name": container_name,
        "image": f"{RAY_IMAGE}:{image}",
        "resources": {"limits": dict(resources), "requests": dict(resources)},
    }
    env = []
    for name, value in group.env.items():
        ref = refs.get(name)
        if ref is not None:
            env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}})
        else:
            env.append({"name": name, "value": value})
    if env:
        container["env"] = env
    return {"spec": {"containers": [container]}}
