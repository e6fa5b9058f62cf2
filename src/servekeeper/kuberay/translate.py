"""Pure: a KubeRay `RayService` manifest (`ray.io/v1` or `v1alpha1`) -> servekeeper's spec.

Every field of the manifest ends in one of four places: mapped to the spec, listed as a note
(ignored on this provider, overridden by servekeeper, or changed), or refused with its path and
what to do instead. Refusals are collected and raised together as one SpecError.

The caller passes in what would need I/O: the installed Ray version, the secrets that exist,
and the manifest file's folder (to resolve a relative `working_dir`).
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from servekeeper.kuberay.notes import Note, NoteKind, SecretRef
from servekeeper.kuberay.quantity import QuantityError, parse_duration_seconds, parse_quantity, quantity_value
from servekeeper.model.spec import OWNED_START_PARAMS, ServiceSpec, SpecError, parse_spec

KUBERAY_API_VERSIONS = ("ray.io/v1", "ray.io/v1alpha1")
INGRESS_PORT_ANNOTATION = "servekeeper.io/ingress-port"
EXTENSIONS_ANNOTATION = "servekeeper.io/extensions"
INITIALIZING_TIMEOUT_ANNOTATION = "ray.io/initializing-timeout"
DEFAULT_SERVE_PORT = 8000  # Serve's default http_options.port, which KubeRay's serve service targets
EXTENSION_KEYS = frozenset(
    {
        "ingress",
        "readiness",
        "serveConfigUpdate",
        "serviceUnhealthySecondThreshold",
        "excludes",
        "rayClusterDeletionDelaySeconds",
        "readinessTimeoutSeconds",
        "upgradeStrategy",  # a canary's steps and analysis (KubeRay's incremental upgrade has neither)
        "rollbackWindowSeconds",
        "revisionHistoryLimit",
    }
)

_SCHEDULING = "pod scheduling does not apply: every node is a process on this machine"
_POD_FIELD_REASONS = {
    "tolerations": _SCHEDULING,
    "affinity": _SCHEDULING,
    "nodeSelector": _SCHEDULING,
    "nodeName": _SCHEDULING,
    "topologySpreadConstraints": _SCHEDULING,
    "priorityClassName": _SCHEDULING,
    "schedulerName": _SCHEDULING,
    "volumes": "volumes do not apply: the nodes share this machine's filesystem",
    "initContainers": "init containers do not run on this provider",
    "serviceAccountName": "Kubernetes service accounts do not apply",
}
_CONTAINER_FIELD_REASONS = {
    "lifecycle": "container lifecycle hooks do not apply: servekeeper stops its nodes itself",
    "readinessProbe": "Kubernetes probes do not apply: servekeeper checks the nodes, the Serve proxy and the apps",
    "livenessProbe": "Kubernetes probes do not apply: servekeeper checks the nodes, the Serve proxy and the apps",
    "startupProbe": "Kubernetes probes do not apply: servekeeper checks the nodes, the Serve proxy and the apps",
    "volumeMounts": "volumes do not apply: the nodes share this machine's filesystem",
    "ports": "servekeeper allocates every port of a cluster",
    "name": None,  # a container's name means nothing off Kubernetes; not worth a note
}
_IGNORED_SPEC_FIELDS = {
    "serviceUnhealthySecondThreshold": "deprecated in KubeRay and unused there; servekeeper's own threshold "
    "is set with the servekeeper.io/extensions annotation",
    "deploymentUnhealthySecondThreshold": "deprecated in KubeRay and unused there",
    "serveService": "the Serve endpoint is servekeeper's ingress on 127.0.0.1",
    "excludeHeadPodFromServeSvc": "the Serve endpoint is servekeeper's ingress on 127.0.0.1",
}
_IGNORED_CLUSTER_FIELDS = {
    "headServiceAnnotations": "there is no Kubernetes head service",
    "historyServerOptions": "not available on this provider",
    "upgradeStrategy": "RayCluster upgrades are driven by the RayService's upgradeStrategy here",
}
_REFUSED_CLUSTER_FIELDS = {
    "enableInTreeAutoscaling": "autoscaling is not available on this provider; remove it and size the "
    "worker groups with replicas",
    "autoscalerOptions": "autoscaling is not available on this provider; remove it and size the worker "
    "groups with replicas",
    "gcsFaultToleranceOptions": "GCS fault tolerance (external Redis) is not available on this provider; "
    "remove it: servekeeper replaces a cluster whose head dies",
    "authOptions": "authentication of managed clusters is servekeeper's (they bind to 127.0.0.1); remove it",
    "networkPolicy": "there are no Kubernetes network policies here: managed clusters bind to 127.0.0.1; remove it",
    "managedBy": "servekeeper manages this service; remove managedBy",
    "tlsOptions": "TLS between Ray nodes is not set up by this provider; remove it",
}
_IGNORED_HEAD_FIELDS = {
    "serviceType": "there is no Kubernetes head service",
    "enableIngress": "there is no Kubernetes ingress: servekeeper's ingress serves 127.0.0.1",
    "ingressOptions": "there is no Kubernetes ingress: servekeeper's ingress serves 127.0.0.1",
    "headService": "there is no Kubernetes head service",
    "labels": "Ray node labels are not set by this provider",
}
_IGNORED_WORKER_FIELDS = {
    "idleTimeoutSeconds": "no autoscaling on this provider",
    "scaleStrategy": "no autoscaling on this provider",
    "priority": "no scheduling priorities on this provider",
    "labels": "Ray node labels are not set by this provider",
    "workersToDelete": "no autoscaling on this provider",
}
_VERSION = re.compile(r"^(\d+\.\d+\.\d+)")


@dataclass(frozen=True)
class ImportResult:
    spec: ServiceSpec
    notes: tuple[Note, ...]
    secret_refs: tuple[SecretRef, ...]
    source: str  # e.g. "ray.io/v1 RayService"


def is_kuberay(documents: list[Any]) -> bool:
    """Is this (multi-document) file a KubeRay manifest rather than a servekeeper spec?"""
    return any(isinstance(d, dict) and d.get("apiVersion") in KUBERAY_API_VERSIONS for d in documents)


def is_gpu_resource(name: str) -> bool:
    """KubeRay's IsGPUResourceKey: 'nvidia.com/gpu', 'amd.com/gpu', 'nvidia.com/mig-2g.32gb'."""
    return name.endswith("gpu") or re.search(r"nvidia\.com/mig-\d+g\.\d+gb$", name) is not None


def import_documents(
    documents: list[Any],
    ray_version: str,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    base_dir: str | None = None,
) -> ImportResult:
    """Translate the RayService of a (multi-document) KubeRay file. Raises SpecError listing
    every refusal and every problem, each by field path."""
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
    importer = _Importer(ray_version, secrets or {}, base_dir)
    spec_document = importer.translate(document)
    if importer.problems:
        raise SpecError(importer.problems)
    try:
        spec = parse_spec(spec_document)
    except SpecError as exc:
        raise SpecError([kuberay_path(problem) for problem in exc.problems]) from exc
    return ImportResult(
        spec=spec,
        notes=tuple(notes + importer.notes),
        secret_refs=tuple(importer.secret_refs),
        source=f"{document['apiVersion']} RayService",
    )


class _Importer:
    def __init__(self, ray_version: str, secrets: Mapping[str, Mapping[str, str]], base_dir: str | None) -> None:
        self.ray_version = ray_version
        self.secrets = secrets
        self.base_dir = base_dir
        self.problems: list[str] = []
        self.notes: list[Note] = []
        self.secret_refs: list[SecretRef] = []

    def refuse(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def note(self, kind: NoteKind, path: str, message: str) -> None:
        self.notes.append(Note(kind, path, message))

    # -- the document -------------------------------------------------------------------

    def translate(self, document: dict[str, Any]) -> dict[str, Any]:
        metadata = _mapping(document.get("metadata"))
        spec = _mapping(document.get("spec"))
        annotations = _mapping(metadata.get("annotations"))
        for key in sorted(set(metadata) - {"name", "annotations"}):
            self.note(NoteKind.IGNORED, f"metadata.{key}", "Kubernetes metadata does not apply")
        for key in sorted(set(document) - {"apiVersion", "kind", "metadata", "spec", "status"}):
            self.note(NoteKind.IGNORED, key, "not a field of a RayService")

        body: dict[str, Any] = {}
        serve_config, serve_port = self.serve_config(spec)
        body["serveConfig"] = serve_config
        cluster_config = self.cluster_config(_mapping(spec.get("rayClusterConfig")), serve_config)
        body["rayClusterConfig"] = cluster_config
        body["ingress"] = {"port": self.ingress_port(annotations, serve_port)}
        body["upgradeStrategy"] = self.upgrade_strategy(_mapping(spec.get("upgradeStrategy")))
        if "rayClusterDeletionDelaySeconds" in spec:
            body["rayClusterDeletionDelaySeconds"] = spec["rayClusterDeletionDelaySeconds"]
        self.spec_fields(spec)
        self.annotations(annotations, body)
        return {
            "apiVersion": "servekeeper/v1alpha1",
            "kind": "RayService",
            "metadata": {"name": metadata.get("name")},
            "spec": body,
        }

    def spec_fields(self, spec: dict[str, Any]) -> None:
        for key, reason in _IGNORED_SPEC_FIELDS.items():
            if key in spec:
                self.note(NoteKind.IGNORED, f"spec.{key}", reason)
        if spec.get("managedBy") is not None:
            self.refuse("spec.managedBy", _REFUSED_CLUSTER_FIELDS["managedBy"])
        if spec.get("suspend"):
            self.refuse("spec.suspend", "suspending is not available; remove it, or run: servekeeper delete NAME")
        if "serveConfig" in spec:
            self.refuse(
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
            *_IGNORED_SPEC_FIELDS,
        }
        for key in sorted(set(spec) - known):
            self.note(NoteKind.IGNORED, f"spec.{key}", "not known to servekeeper")

    def annotations(self, annotations: dict[str, Any], body: dict[str, Any]) -> None:
        path = "metadata.annotations"
        timeout = annotations.get(INITIALIZING_TIMEOUT_ANNOTATION)
        if timeout is not None:
            try:
                body["readinessTimeoutSeconds"] = parse_duration_seconds(timeout)
            except QuantityError as exc:
                self.refuse(f'{path}["{INITIALIZING_TIMEOUT_ANNOTATION}"]', str(exc))
        extensions = annotations.get(EXTENSIONS_ANNOTATION)
        if extensions is not None:
            self.extensions(f'{path}["{EXTENSIONS_ANNOTATION}"]', extensions, body)
        for key in sorted(annotations):
            if key not in (INITIALIZING_TIMEOUT_ANNOTATION, EXTENSIONS_ANNOTATION, INGRESS_PORT_ANNOTATION):
                self.note(NoteKind.IGNORED, f'{path}["{key}"]', "annotation not known to servekeeper")

    def extensions(self, path: str, text: Any, body: dict[str, Any]) -> None:
        """servekeeper's fields that KubeRay has no place for, kept by `export` as JSON."""
        try:
            extensions = json.loads(text) if isinstance(text, str) else None
        except json.JSONDecodeError as exc:
            self.refuse(path, f"not valid JSON: {exc}")
            return
        if not isinstance(extensions, dict):
            self.refuse(path, "must be a JSON object")
            return
        for key in sorted(set(extensions) - EXTENSION_KEYS):
            self.refuse(f"{path}.{key}", f"unknown; allowed: {sorted(EXTENSION_KEYS)}")
        for key, value in extensions.items():
            if key == "ingress" and isinstance(value, dict):
                body["ingress"] = {**body["ingress"], **value}
            elif key == "excludes":
                body["rayClusterConfig"]["excludes"] = value
            elif key in EXTENSION_KEYS:
                body[key] = value

    def ingress_port(self, annotations: dict[str, Any], serve_port: Any) -> Any:
        override = annotations.get(INGRESS_PORT_ANNOTATION)
        if override is None:
            return DEFAULT_SERVE_PORT if serve_port is None else serve_port
        try:
            return int(str(override))
        except ValueError:
            self.refuse(f'metadata.annotations["{INGRESS_PORT_ANNOTATION}"]', f"{override!r} is not a port number")
            return DEFAULT_SERVE_PORT

    def upgrade_strategy(self, strategy: dict[str, Any]) -> dict[str, Any]:
        path = "spec.upgradeStrategy"
        upgrade_type = strategy.get("type") or "NewCluster"
        options = _mapping(strategy.get("clusterUpgradeOptions"))
        if "gatewayClassName" in options:
            self.note(
                NoteKind.IGNORED, f"{path}.clusterUpgradeOptions.gatewayClassName", "there is no Gateway API here"
            )
        if upgrade_type == "NewClusterWithIncrementalUpgrade":
            return self.incremental_upgrade(f"{path}.clusterUpgradeOptions", options)
        if upgrade_type not in ("NewCluster", "None"):
            self.refuse(f"{path}.type", f"{upgrade_type!r} is not NewCluster, NewClusterWithIncrementalUpgrade or None")
        elif options:
            self.note(NoteKind.IGNORED, f"{path}.clusterUpgradeOptions", "used only by incremental upgrades")
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
        self.note(
            NoteKind.CHANGED,
            "spec.upgradeStrategy.type",
            f"rolled out as a servekeeper Canary: {step}% more traffic every {interval}s at the ingress, the new "
            "cluster's target_capacity following its traffic (capacityFollowsTraffic)"
            + (f"; maxSurgePercent {surge} unused: capacity grows with each step" if surge is not None else ""),
        )
        return {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}

    def whole_number(self, path: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.refuse(path, f"needs a whole number from {low} to {high} for an incremental upgrade, got {value!r}")
            return high
        return value

    # -- serveConfigV2 ------------------------------------------------------------------

    def serve_config(self, spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        path = "spec.serveConfigV2"
        text = spec.get("serveConfigV2")
        if not isinstance(text, str) or not text.strip():
            self.refuse(path, "required: the Serve config (a YAML string), as `serve build` writes it")
            return {"applications": []}, None
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            self.refuse(path, f"not valid YAML: {exc}")
            return {"applications": []}, None
        if not isinstance(config, dict):
            self.refuse(path, "must be a YAML mapping with `applications`")
            return {"applications": []}, None
        serve_port = None
        http_options = dict(_mapping(config.get("http_options")))
        if "port" in http_options:
            serve_port = http_options.pop("port")
        if "host" in http_options:
            http_options.pop("host")
            self.note(NoteKind.OVERRIDDEN, f"{path}.http_options.host", "each cluster's Serve proxy binds 127.0.0.1")
        if http_options:
            config["http_options"] = http_options
        else:
            config.pop("http_options", None)
        location = config.pop("proxy_location", None)
        if location is not None and location != "HeadOnly":
            self.note(
                NoteKind.OVERRIDDEN,
                f"{path}.proxy_location",
                f"{location}: servekeeper runs Serve's proxy on the head only (HeadOnly), behind its ingress",
            )
        grpc_options = config.get("grpc_options")
        if isinstance(grpc_options, dict) and "port" in grpc_options:
            config["grpc_options"] = {k: v for k, v in grpc_options.items() if k != "port"}
            self.note(
                NoteKind.OVERRIDDEN,
                f"{path}.grpc_options.port",
                "servekeeper allocates each cluster's gRPC port (a stable one: the extensions' ingress.grpcPort)",
            )
        return config, serve_port

    # -- rayClusterConfig ---------------------------------------------------------------

    def cluster_config(self, cluster: dict[str, Any], serve_config: dict[str, Any]) -> dict[str, Any]:
        path = "spec.rayClusterConfig"
        for key, reason in _REFUSED_CLUSTER_FIELDS.items():
            value = cluster.get(key)
            if value is None or value is False:
                continue
            self.refuse(f"{path}.{key}", reason)
        for key, reason in _IGNORED_CLUSTER_FIELDS.items():
            if key in cluster:
                self.note(NoteKind.IGNORED, f"{path}.{key}", reason)
        if cluster.get("suspend"):
            self.refuse(f"{path}.suspend", "suspending is not available; remove it, or run: servekeeper delete NAME")
        known = {"rayVersion", "headGroupSpec", "workerGroupSpecs", "suspend"}
        known |= set(_REFUSED_CLUSTER_FIELDS) | set(_IGNORED_CLUSTER_FIELDS)
        for key in sorted(set(cluster) - known):
            self.note(NoteKind.IGNORED, f"{path}.{key}", "not known to servekeeper")
        if "rayVersion" in cluster:
            self.check_version(f"{path}.rayVersion", str(cluster["rayVersion"]), "rayVersion")

        config: dict[str, Any] = {}
        working_dir = self.working_dir(serve_config)
        if working_dir is not None:
            config["workingDir"] = working_dir
        head = _mapping(cluster.get("headGroupSpec"))
        if "headGroupSpec" not in cluster:
            self.refuse(f"{path}.headGroupSpec", "required")
        config["head"] = self.group(f"{path}.headGroupSpec", "head", head, _IGNORED_HEAD_FIELDS)
        workers = []
        for index, worker in enumerate(_sequence(cluster.get("workerGroupSpecs"))):
            worker_path = f"{path}.workerGroupSpecs[{index}]"
            worker = _mapping(worker)
            name = worker.get("groupName")
            group = self.group(worker_path, str(name), worker, _IGNORED_WORKER_FIELDS)
            group["name"] = name
            group["replicas"] = self.worker_count(worker_path, worker)
            workers.append(group)
        if workers:
            config["workerGroups"] = workers
        return config

    def check_version(self, path: str, text: str, what: str) -> None:
        match = _VERSION.match(text)
        if match is None:
            self.note(NoteKind.IGNORED, path, f"{what} {text!r} names no Ray version; not checked")
            return
        if match.group(1) != self.ray_version:
            self.refuse(
                path,
                f"asks for Ray {match.group(1)}, but servekeeper runs Ray {self.ray_version} (one cluster, one Ray "
                f"version): set it to {self.ray_version}, or run servekeeper with Ray {match.group(1)} installed",
            )

    def working_dir(self, serve_config: dict[str, Any]) -> str | None:
        """Remote working_dir and py_modules URIs stay in the app's runtime_env (Ray fetches
        them); a local working_dir becomes the cluster's workingDir, which servekeeper packages."""
        local: set[str] = set()
        for index, app in enumerate(_sequence(serve_config.get("applications"))):
            if not isinstance(app, dict) or not isinstance(app.get("runtime_env"), dict):
                continue
            path = f"spec.serveConfigV2.applications[{index}].runtime_env"
            runtime_env = dict(app["runtime_env"])
            directory = runtime_env.get("working_dir")
            if isinstance(directory, str) and "://" not in directory:
                resolved = self.local_path(f"{path}.working_dir", directory)
                if resolved is not None:
                    local.add(resolved)
                    del runtime_env["working_dir"]
            for module_index, module in enumerate(_sequence(runtime_env.get("py_modules"))):
                if isinstance(module, str) and "://" not in module:
                    self.refuse(
                        f"{path}.py_modules[{module_index}]",
                        "a local module is not packaged by servekeeper; put it inside the working_dir, or use a "
                        "remote URI",
                    )
            if runtime_env:
                app["runtime_env"] = runtime_env
            else:
                del app["runtime_env"]
        if len(local) > 1:
            self.refuse(
                "spec.serveConfigV2.applications",
                f"local working_dir values differ ({sorted(local)}); servekeeper packages one per service: use one "
                "folder, or remote URIs",
            )
        return next(iter(local)) if len(local) == 1 else None

    def local_path(self, path: str, directory: str) -> str | None:
        if posixpath.isabs(directory):
            return posixpath.normpath(directory)
        if self.base_dir is None:
            self.refuse(
                path, f"the relative path {directory!r} needs the manifest's folder: apply the file with the CLI"
            )
            return None
        return posixpath.normpath(posixpath.join(self.base_dir, directory))

    def worker_count(self, path: str, worker: dict[str, Any]) -> Any:
        replicas = worker.get("replicas")
        minimum = worker.get("minReplicas")
        if not all(isinstance(v, int) or v is None for v in (replicas, minimum)):
            self.refuse(f"{path}.replicas", "replicas and minReplicas must be integers")
            return 0
        count = max(replicas or 0, minimum or 0)
        hosts = worker.get("numOfHosts")
        if isinstance(hosts, int) and hosts > 1:
            self.note(NoteKind.CHANGED, f"{path}.numOfHosts", f"{hosts} hosts per replica: {count * hosts} nodes")
            count *= hosts
        maximum = worker.get("maxReplicas")
        if maximum is not None and maximum != count:
            self.note(NoteKind.IGNORED, f"{path}.maxReplicas", f"no autoscaling on this provider: {count} node(s)")
        if worker.get("suspend"):
            self.refuse(f"{path}.suspend", "suspending a worker group is not available; set replicas: 0")
        return count

    # -- groups -------------------------------------------------------------------------

    def group(self, path: str, name: str, group: dict[str, Any], ignored: Mapping[str, str]) -> dict[str, Any]:
        for key, reason in ignored.items():
            if key in group:
                self.note(NoteKind.IGNORED, f"{path}.{key}", reason)
        known = {"rayStartParams", "template", "resources", "groupName", "replicas", "minReplicas", "maxReplicas"}
        known |= {"numOfHosts", "suspend", *ignored}
        for key in sorted(set(group) - known):
            self.note(NoteKind.IGNORED, f"{path}.{key}", "not known to servekeeper")
        template = _mapping(group.get("template"))
        if "metadata" in template:
            self.note(NoteKind.IGNORED, f"{path}.template.metadata", "pod labels and annotations do not apply")
        pod = _mapping(template.get("spec"))
        for key in sorted(set(pod) - {"containers"}):
            reason = _POD_FIELD_REASONS.get(key, "a Kubernetes pod field: no effect on local processes")
            self.note(NoteKind.IGNORED, f"{path}.template.spec.{key}", reason)
        containers = _sequence(pod.get("containers"))
        if not containers:
            self.refuse(f"{path}.template.spec.containers", "required: the Ray container is the first one")
            container: dict[str, Any] = {}
        else:
            container = _mapping(containers[0])
        for index in range(1, len(containers)):
            self.note(
                NoteKind.IGNORED, f"{path}.template.spec.containers[{index}]", "only the Ray container (the first) runs"
            )
        container_path = f"{path}.template.spec.containers[0]"
        for key in sorted(set(container) - {"image", "resources", "env", "envFrom"}):
            container_reason = _CONTAINER_FIELD_REASONS.get(key, "a Kubernetes container field: no effect here")
            if container_reason is not None:
                self.note(NoteKind.IGNORED, f"{container_path}.{key}", container_reason)
        if "image" in container:
            tag = str(container["image"]).rsplit("/", 1)[-1].partition("@")[0]
            image_name, _, version = tag.partition(":")
            self.check_version(f"{container_path}.image", version, f"image tag of {image_name}")
        if "envFrom" in container:
            self.refuse(f"{container_path}.envFrom", "list each variable under env (a literal value or a secretKeyRef)")
        result: dict[str, Any] = {"env": self.env(f"{container_path}.env", name, container.get("env"))}
        result.update(self.resources(path, group, _mapping(container.get("resources"))))
        return result

    def env(self, path: str, group: str, entries: Any) -> dict[str, str]:
        env: dict[str, str] = {}
        for index, entry in enumerate(_sequence(entries)):
            entry = _mapping(entry)
            name = str(entry.get("name"))
            entry_path = f"{path}[{index}]"
            if "valueFrom" not in entry:
                env[name] = str(entry.get("value", ""))
                continue
            source = _mapping(entry["valueFrom"])
            ref = source.get("secretKeyRef")
            if not isinstance(ref, dict):
                kinds = ", ".join(sorted(source)) or "nothing"
                self.refuse(
                    f"{entry_path}.valueFrom",
                    f"{kinds} cannot be read here; use a literal value, or a secretKeyRef to a servekeeper secret",
                )
                continue
            secret, key = str(ref.get("name")), str(ref.get("key"))
            value = self.secrets.get(secret, {}).get(key)
            if value is None:
                if ref.get("optional"):
                    self.note(
                        NoteKind.IGNORED,
                        f"{entry_path}.valueFrom.secretKeyRef",
                        f"optional secret {secret!r} key {key!r} does not exist: {name} is not set",
                    )
                    continue
                self.refuse(
                    f"{entry_path}.valueFrom.secretKeyRef",
                    f"secret {secret!r} with key {key!r} does not exist here; create it with: "
                    f"servekeeper secret set {secret} {key}=VALUE",
                )
                continue
            env[name] = value
            self.secret_refs.append(SecretRef(group=group, env=name, secret=secret, key=key))
        return env

    def resources(self, path: str, group: dict[str, Any], resources: dict[str, Any]) -> dict[str, Any]:
        """num-cpus, memory and num-gpus the way KubeRay derives them (controllers/ray/common/pod.go):
        the group's `resources` win, then rayStartParams, then the container's limits (for CPUs
        the request when there is no limit), each rounded up to an integer like Quantity.Value().
        A fraction of a CPU or GPU given as a Ray parameter is rounded up too (with a note):
        `ray start` takes whole CPUs and GPUs, and would refuse it."""
        params_path = f"{path}.rayStartParams"
        params: dict[str, Any] = dict(_mapping(group.get("rayStartParams")))
        sources = {key: f"{params_path}.{key}" for key in params}  # where each parameter was set
        for name, quantity in _mapping(group.get("resources")).items():
            key = str(name).lower()
            target = (
                "num-cpus"
                if key == "cpu"
                else "memory"
                if key == "memory"
                else "num-gpus"
                if is_gpu_resource(key)
                else None
            )
            if target is None:
                self.refuse(f"{path}.resources.{name}", "custom Ray resources: set them with rayStartParams.resources")
                continue
            params[target] = quantity
            sources[target] = f"{path}.resources.{name}"
        limits = _mapping(resources.get("limits"))
        requests = _mapping(resources.get("requests"))
        result: dict[str, Any] = {}
        container_path = f"{path}.template.spec.containers[0].resources"
        try:
            if "num-cpus" in params:
                result["numCpus"] = self.whole(sources["num-cpus"], params.pop("num-cpus"), "num-cpus")
            elif limits.get("cpu") is not None:
                result["numCpus"] = quantity_value(limits["cpu"])
            elif requests.get("cpu") is not None:
                result["numCpus"] = quantity_value(requests["cpu"])
            if "memory" in params:
                result["memory"] = quantity_value(params.pop("memory"))
            elif limits.get("memory") is not None:
                result["memory"] = quantity_value(limits["memory"])
            if "num-gpus" in params:
                result["numGpus"] = self.whole(sources["num-gpus"], params.pop("num-gpus"), "num-gpus")
            else:
                for name in sorted(limits):
                    if is_gpu_resource(name) and quantity_value(limits[name]) > 0:
                        result["numGpus"] = quantity_value(limits[name])
                        break
        except QuantityError as exc:
            self.refuse(container_path, str(exc))
        passed: dict[str, Any] = {}
        for key, value in sorted(params.items()):
            if key in OWNED_START_PARAMS:
                self.note(NoteKind.OVERRIDDEN, f"{params_path}.{key}", "set by servekeeper (ports, addresses, dirs)")
                continue
            passed[key] = _start_param_value(key, value)
        result["rayStartParams"] = passed
        return result

    def whole(self, path: str, quantity: Any, flag: str) -> float:
        """A CPU or GPU count for `ray start --{flag}`, rounded up to a whole number as Ray's
        own container limits are; a fraction rounded is noted."""
        exact = parse_quantity(quantity)
        rounded = math.ceil(exact)
        if rounded != exact:
            self.note(
                NoteKind.CHANGED,
                path,
                f"{float(exact):g} rounded up to {rounded}: `ray start --{flag}` takes a whole number "
                "(a deployment's share of a node goes in its ray_actor_options)",
            )
        return float(rounded)


def _start_param_value(key: str, value: Any) -> Any:
    """KubeRay's rayStartParams are strings; servekeeper's are typed like the flags they become."""
    if not isinstance(value, str):
        return value
    if key == "resources":
        return value.strip("'\"` ")  # KubeRay quotes it for a shell; no shell here
    if value in ("true", "false"):
        return value == "true"
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            continue
    return value


def _mapping(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def _sequence(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


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
