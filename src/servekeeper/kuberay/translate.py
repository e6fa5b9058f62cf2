"""Pure: a KubeRay `RayService` manifest (`ray.io/v1` or `v1alpha1`) -> servekeeper's spec.

Every field of the manifest ends in one of four places: mapped to the spec, listed as a note
(ignored on this provider, overridden by servekeeper, or changed), or refused with its path and
what to do instead. Refusals are collected and raised together as one SpecError.

The caller passes in what would need I/O: the installed Ray version, the secrets that exist,
and the manifest file's folder (to resolve a relative `working_dir`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from servekeeper.kuberay.cluster import ClusterTranslation
from servekeeper.kuberay.fields import (
    DEFAULT_SERVE_PORT,
    EXTENSION_KEYS,
    EXTENSIONS_ANNOTATION,
    FT_ENABLED_ANNOTATION,
    FT_ENABLED_REASON,
    GCS_FT_OPTIONS,
    GCS_NEEDS_POOL_REASON,
    IGNORED_SPEC_FIELDS,
    INGRESS_PORT_ANNOTATION,
    INITIALIZING_TIMEOUT_ANNOTATION,
    REFUSED_CLUSTER_FIELDS,
    as_mapping,
)
from servekeeper.kuberay.notes import Findings, Note, NoteKind, SecretRef
from servekeeper.kuberay.quantity import QuantityError, parse_duration_seconds
from servekeeper.model.documents import KUBERAY_API_VERSIONS
from servekeeper.model.spec import ServiceSpec, SpecError, parse_spec


@dataclass(frozen=True)
class ImportResult:
    spec: ServiceSpec
    notes: tuple[Note, ...]
    secret_refs: tuple[SecretRef, ...]
    source: str  # e.g. "ray.io/v1 RayService"


def import_documents(
    documents: list[Any],
    ray_version: str,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    base_dir: str | None = None,
    python_version: str | None = None,
) -> ImportResult:
    """Translate the RayService of a (multi-document) KubeRay file. Raises SpecError listing
    every refusal and every problem, each by field path. `ray_version` and `python_version` are
    the controller's: a cluster asking for another gets an environment of its own (None: any
    Python a tag names is the cluster's own)."""
    notes: list[Note] = []
    services: list[tuple[int, dict[str, Any]]] = []
    for index, document in enumerate(documents):
        if document is None:
            continue
        if (
            isinstance(document, dict)
            and document.get("kind") == "RayService"
            and document.get("apiVersion") in KUBERAY_API_VERSIONS
        ):
            services.append((index, document))
            continue
        kind = document.get("kind", "?") if isinstance(document, dict) else type(document).__name__
        api_version = document.get("apiVersion", "?") if isinstance(document, dict) else "?"
        name = (document.get("metadata") or {}).get("name", "?") if isinstance(document, dict) else "?"
        notes.append(
            Note(
                NoteKind.SKIPPED, f"(document {index + 1})", f"{kind}/{name} ({api_version}) skipped: not a RayService"
            )
        )
    if len(services) != 1:
        found = ", ".join(f"document {i + 1}" for i, _ in services) or "none"
        raise SpecError([f"(file): expected exactly one ray.io RayService, found {len(services)} ({found})"])
    index, document = services[0]
    translation = _ServiceTranslation(ray_version, secrets or {}, base_dir, python_version)
    spec_document = translation.translate(document)
    findings = translation.findings
    if findings.problems:
        raise SpecError(findings.problems)
    try:
        spec = parse_spec(spec_document)
    except SpecError as exc:
        raise SpecError([kuberay_path(problem) for problem in exc.problems]) from exc
    return ImportResult(
        spec=spec,
        notes=tuple(notes + findings.notes),
        secret_refs=tuple(findings.secret_refs),
        source=f"{document['apiVersion']} RayService",
    )


class _ServiceTranslation:
    """The document's own fields (metadata, annotations, serveConfigV2, upgradeStrategy); the
    cluster's shape goes to a ClusterTranslation reporting into the same findings."""

    def __init__(
        self,
        ray_version: str,
        secrets: Mapping[str, Mapping[str, str]],
        base_dir: str | None,
        python_version: str | None,
    ) -> None:
        self.findings = Findings()
        self.cluster = ClusterTranslation(self.findings, ray_version, secrets, base_dir, python_version)

    def translate(self, document: dict[str, Any]) -> dict[str, Any]:
        metadata = as_mapping(document.get("metadata"))
        spec = as_mapping(document.get("spec"))
        annotations = as_mapping(metadata.get("annotations"))
        for key in sorted(set(metadata) - {"name", "annotations"}):
            self.findings.note(NoteKind.IGNORED, f"metadata.{key}", "Kubernetes metadata does not apply")
        for key in sorted(set(document) - {"apiVersion", "kind", "metadata", "spec", "status"}):
            self.findings.note(NoteKind.IGNORED, key, "not a field of a RayService")

        body: dict[str, Any] = {}
        serve_config, serve_port = self.serve_config(spec)
        body["serveConfig"] = serve_config
        cluster_config = self.cluster.translate(as_mapping(spec.get("rayClusterConfig")), serve_config)
        body["rayClusterConfig"] = cluster_config
        body["ingress"] = {"port": self.ingress_port(annotations, serve_port)}
        body["upgradeStrategy"] = self.upgrade_strategy(as_mapping(spec.get("upgradeStrategy")))
        if "rayClusterDeletionDelaySeconds" in spec:
            body["rayClusterDeletionDelaySeconds"] = spec["rayClusterDeletionDelaySeconds"]
        self.spec_fields(spec)
        self.annotations(annotations, body)
        self.fault_tolerance(annotations, as_mapping(spec.get("rayClusterConfig")), cluster_config)
        return {
            "apiVersion": "servekeeper/v1alpha1",
            "kind": "RayService",
            "metadata": {"name": metadata.get("name")},
            "spec": body,
        }

    def spec_fields(self, spec: dict[str, Any]) -> None:
        for key, reason in IGNORED_SPEC_FIELDS.items():
            if key in spec:
                self.findings.note(NoteKind.IGNORED, f"spec.{key}", reason)
        if spec.get("managedBy") is not None:
            self.findings.refuse("spec.managedBy", REFUSED_CLUSTER_FIELDS["managedBy"])
        if spec.get("suspend"):
            self.findings.refuse(
                "spec.suspend", "suspending is not available; remove it, or run: servekeeper delete NAME"
            )
        if "serveConfig" in spec:
            self.findings.refuse(
                "spec.serveConfig", "the single-application serveConfig is gone from KubeRay; use serveConfigV2"
            )
        known = {
            "serveConfigV2",
            "rayClusterConfig",
            "upgradeStrategy",
            "rayClusterDeletionDelaySeconds",
            "managedBy",
            "suspend",
            "serveConfig",
            *IGNORED_SPEC_FIELDS,
        }
        for key in sorted(set(spec) - known):
            self.findings.note(NoteKind.IGNORED, f"spec.{key}", "not known to servekeeper")

    def annotations(self, annotations: dict[str, Any], body: dict[str, Any]) -> None:
        path = "metadata.annotations"
        timeout = annotations.get(INITIALIZING_TIMEOUT_ANNOTATION)
        if timeout is not None:
            try:
                body["readinessTimeoutSeconds"] = parse_duration_seconds(timeout)
            except QuantityError as exc:
                self.findings.refuse(f'{path}["{INITIALIZING_TIMEOUT_ANNOTATION}"]', str(exc))
        extensions = annotations.get(EXTENSIONS_ANNOTATION)
        if extensions is not None:
            self.extensions(f'{path}["{EXTENSIONS_ANNOTATION}"]', extensions, body)
        for key in sorted(annotations):
            known = (INITIALIZING_TIMEOUT_ANNOTATION, EXTENSIONS_ANNOTATION, INGRESS_PORT_ANNOTATION)
            if key not in (*known, FT_ENABLED_ANNOTATION):
                self.findings.note(NoteKind.IGNORED, f'{path}["{key}"]', "annotation not known to servekeeper")

    def extensions(self, path: str, text: Any, body: dict[str, Any]) -> None:
        """servekeeper's fields that KubeRay has no place for, kept by `export` as JSON."""
        try:
            extensions = json.loads(text) if isinstance(text, str) else None
        except json.JSONDecodeError as exc:
            self.findings.refuse(path, f"not valid JSON: {exc}")
            return
        if not isinstance(extensions, dict):
            self.findings.refuse(path, "must be a JSON object")
            return
        for key in sorted(set(extensions) - EXTENSION_KEYS):
            self.findings.refuse(f"{path}.{key}", f"unknown; allowed: {sorted(EXTENSION_KEYS)}")
        for key, value in extensions.items():
            if key == "ingress" and isinstance(value, dict):
                body["ingress"] = {**body["ingress"], **value}
            elif key in ("excludes", "hostPool", "pip"):
                body["rayClusterConfig"][key] = value
            elif key == "hostPins":
                self.host_pins(f"{path}.hostPins", value, body["rayClusterConfig"])
            elif key == "headMoveAfterSeconds":
                fault_tolerance = body["rayClusterConfig"].get("gcsFaultTolerance")
                if fault_tolerance is None:
                    self.findings.refuse(f"{path}.{key}", f"for a head whose GCS is in Redis: set {GCS_FT_OPTIONS}")
                else:
                    fault_tolerance[key] = value
            elif key in EXTENSION_KEYS:
                body[key] = value

    def host_pins(self, path: str, pins: Any, config: dict[str, Any]) -> None:
        """`{"head": host, "<group name>": host}`: the pool host each group's nodes run on."""
        if not isinstance(pins, dict):
            self.findings.refuse(path, 'must be a JSON object: {"head": "host-1", "<group name>": "host-2"}')
            return
        groups = {"head": config["head"], **{str(group["name"]): group for group in config.get("workerGroups", [])}}
        for name, host in pins.items():
            if name not in groups:
                self.findings.refuse(f"{path}.{name}", f"no such group; groups: {sorted(groups)}")
            else:
                groups[name]["host"] = host

    def fault_tolerance(self, annotations: dict[str, Any], cluster: dict[str, Any], config: dict[str, Any]) -> None:
        """KubeRay's older `ray.io/ft-enabled` switch means Redis; and a Redis-backed head restarts in
        place on a host pool only (named in the extensions annotation, which KubeRay has no field
        for); a RocksDB one on this machine too."""
        path = f'metadata.annotations["{FT_ENABLED_ANNOTATION}"]'
        if str(annotations.get(FT_ENABLED_ANNOTATION, "")).lower() == "true" and GCS_FT_OPTIONS not in cluster:
            self.findings.refuse(path, FT_ENABLED_REASON)
        backend = dict(config.get("gcsFaultTolerance") or {}).get("backend")
        if backend == "redis" and config.get("hostPool") is None:
            self.findings.refuse(f"spec.rayClusterConfig.{GCS_FT_OPTIONS}", GCS_NEEDS_POOL_REASON)

    def ingress_port(self, annotations: dict[str, Any], serve_port: Any) -> Any:
        override = annotations.get(INGRESS_PORT_ANNOTATION)
        if override is None:
            return DEFAULT_SERVE_PORT if serve_port is None else serve_port
        try:
            return int(str(override))
        except ValueError:
            self.findings.refuse(
                f'metadata.annotations["{INGRESS_PORT_ANNOTATION}"]', f"{override!r} is not a port number"
            )
            return DEFAULT_SERVE_PORT

    def upgrade_strategy(self, strategy: dict[str, Any]) -> dict[str, Any]:
        path = "spec.upgradeStrategy"
        upgrade_type = strategy.get("type") or "NewCluster"
        options = as_mapping(strategy.get("clusterUpgradeOptions"))
        if "gatewayClassName" in options:
            self.findings.note(
                NoteKind.IGNORED, f"{path}.clusterUpgradeOptions.gatewayClassName", "there is no Gateway API here"
            )
        if upgrade_type == "NewClusterWithIncrementalUpgrade":
            return self.incremental_upgrade(f"{path}.clusterUpgradeOptions", options)
        if upgrade_type not in ("NewCluster", "None"):
            self.findings.refuse(
                f"{path}.type", f"{upgrade_type!r} is not NewCluster, NewClusterWithIncrementalUpgrade or None"
            )
        elif options:
            self.findings.note(NoteKind.IGNORED, f"{path}.clusterUpgradeOptions", "used only by incremental upgrades")
        return {"type": str(upgrade_type)}

    def incremental_upgrade(self, path: str, options: dict[str, Any]) -> dict[str, Any]:
        """KubeRay's incremental upgrade as a canary: `stepSizePercent` more traffic every
        `intervalSeconds`, the new cluster's capacity following its traffic."""
        step = self.whole_number(f"{path}.stepSizePercent", options.get("stepSizePercent"), 1, 100)
        interval = self.whole_number(f"{path}.intervalSeconds", options.get("intervalSeconds"), 1, 86400)
        steps: list[dict[str, Any]] = []
        for weight in range(step, 100, step):
            steps += [{"setWeight": weight}, {"pause": {"duration": interval}}]
        if not steps:
            steps = [{"setWeight": 100}]
        surge = options.get("maxSurgePercent")
        self.findings.note(
            NoteKind.CHANGED,
            "spec.upgradeStrategy.type",
            f"rolled out as a servekeeper Canary: {step}% more traffic every {interval}s at the ingress, the new "
            "cluster's target_capacity following its traffic (capacityFollowsTraffic)"
            + (f"; maxSurgePercent {surge} unused: capacity grows with each step" if surge is not None else ""),
        )
        return {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}

    def whole_number(self, path: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.findings.refuse(
                path, f"needs a whole number from {low} to {high} for an incremental upgrade, got {value!r}"
            )
            return high
        return value

    # -- serveConfigV2 ------------------------------------------------------------------

    def serve_config(self, spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        path = "spec.serveConfigV2"
        text = spec.get("serveConfigV2")
        if not isinstance(text, str) or not text.strip():
            self.findings.refuse(path, "required: the Serve config (a YAML string), as `serve build` writes it")
            return {"applications": []}, None
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            self.findings.refuse(path, f"not valid YAML: {exc}")
            return {"applications": []}, None
        if not isinstance(config, dict):
            self.findings.refuse(path, "must be a YAML mapping with `applications`")
            return {"applications": []}, None
        serve_port = None
        http_options = dict(as_mapping(config.get("http_options")))
        if "port" in http_options:
            serve_port = http_options.pop("port")
        if "host" in http_options:
            http_options.pop("host")
            self.findings.note(
                NoteKind.OVERRIDDEN, f"{path}.http_options.host", "each cluster's Serve proxy binds 127.0.0.1"
            )
        if http_options:
            config["http_options"] = http_options
        else:
            config.pop("http_options", None)
        location = config.pop("proxy_location", None)
        if location is not None and location != "HeadOnly":
            self.findings.note(
                NoteKind.OVERRIDDEN,
                f"{path}.proxy_location",
                f"{location}: servekeeper runs Serve's proxy on the head only (HeadOnly), behind its ingress",
            )
        grpc_options = config.get("grpc_options")
        if isinstance(grpc_options, dict) and "port" in grpc_options:
            config["grpc_options"] = {k: v for k, v in grpc_options.items() if k != "port"}
            self.findings.note(
                NoteKind.OVERRIDDEN,
                f"{path}.grpc_options.port",
                "servekeeper allocates each cluster's gRPC port (a stable one: the extensions' ingress.grpcPort)",
            )
        return config, serve_port


_PATH_MAP = [
    (
        re.compile(r"^spec\.rayClusterConfig\.workerGroups\.(\d+)\.name"),
        r"spec.rayClusterConfig.workerGroupSpecs[\1].groupName",
    ),
    (re.compile(r"^spec\.rayClusterConfig\.workerGroups\.(\d+)"), r"spec.rayClusterConfig.workerGroupSpecs[\1]"),
    (re.compile(r"^spec\.rayClusterConfig\.head"), "spec.rayClusterConfig.headGroupSpec"),
    (re.compile(r"^spec\.serveConfig\.applications\.(\d+)"), r"spec.serveConfigV2.applications[\1]"),
    (re.compile(r"^spec\.serveConfig"), "spec.serveConfigV2"),
    (re.compile(r"^spec\.ingress\.port"), "spec.serveConfigV2.http_options.port"),
]


def kuberay_path(problem: str) -> str:
    """A problem found in the translated spec, named by the manifest's path where there is one."""
    for pattern, replacement in _PATH_MAP:
        if pattern.match(problem):
            return pattern.sub(replacement, problem, count=1)
    return problem
