"""Pure: a RayService's `spec.rayClusterConfig` -> servekeeper's rayClusterConfig: the head and
worker groups, their env (secrets resolved), resources and rayStartParams, the Ray and Python
they ask for (`versions`), and the local working_dir the Serve config names (servekeeper packages it)."""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from servekeeper.kuberay.autoscaling import autoscaling_fields, worker_nodes
from servekeeper.kuberay.fields import (
    CONTAINER_FIELD_REASONS,
    GCS_FT_OPTIONS,
    IGNORED_CLUSTER_FIELDS,
    IGNORED_HEAD_FIELDS,
    IGNORED_WORKER_FIELDS,
    POD_FIELD_REASONS,
    REFUSED_CLUSTER_FIELDS,
    as_list,
    as_mapping,
)
from servekeeper.kuberay.notes import Findings, NoteKind, SecretRef
from servekeeper.kuberay.quantity import QuantityError, parse_quantity, quantity_value
from servekeeper.kuberay.versions import DeclaredVersions
from servekeeper.model.start_params import OWNED_START_PARAMS


def is_gpu_resource(name: str) -> bool:
    """KubeRay's IsGPUResourceKey: 'nvidia.com/gpu', 'amd.com/gpu', 'nvidia.com/mig-2g.32gb'."""
    return name.endswith("gpu") or re.search(r"nvidia\.com/mig-\d+g\.\d+gb$", name) is not None


class ClusterTranslation:
    """Reports what it refuses or notes into the findings it shares with the rest of the import."""

    def __init__(
        self,
        findings: Findings,
        ray_version: str,
        secrets: Mapping[str, Mapping[str, str]],
        base_dir: str | None,
        python_version: str | None = None,
    ) -> None:
        self.findings = findings
        # the controller's: a cluster asking for another gets its own
        self.ray_version = ray_version
        self.python_version = python_version
        self.versions = DeclaredVersions(findings)
        self.secrets = secrets
        self.base_dir = base_dir

    # -- rayClusterConfig ---------------------------------------------------------------

    def translate(self, cluster: dict[str, Any], serve_config: dict[str, Any]) -> dict[str, Any]:
        path = "spec.rayClusterConfig"
        for key, reason in REFUSED_CLUSTER_FIELDS.items():
            value = cluster.get(key)
            if value is None or value is False:
                continue
            self.findings.refuse(f"{path}.{key}", reason)
        for key, reason in IGNORED_CLUSTER_FIELDS.items():
            if key in cluster:
                self.findings.note(NoteKind.IGNORED, f"{path}.{key}", reason)
        if cluster.get("suspend"):
            self.findings.refuse(
                f"{path}.suspend", "suspending is not available; remove it, or run: servekeeper delete NAME"
            )
        known = {"rayVersion", "headGroupSpec", "workerGroupSpecs", "suspend", GCS_FT_OPTIONS}
        known |= {"enableInTreeAutoscaling", "autoscalerOptions"}
        known |= set(REFUSED_CLUSTER_FIELDS) | set(IGNORED_CLUSTER_FIELDS)
        for key in sorted(set(cluster) - known):
            self.findings.note(NoteKind.IGNORED, f"{path}.{key}", "not known to servekeeper")
        self.versions = DeclaredVersions(self.findings)
        if "rayVersion" in cluster:
            self.versions.read_ray_version(f"{path}.rayVersion", str(cluster["rayVersion"]))

        config: dict[str, Any] = {}
        working_dir = self.working_dir(serve_config)
        if working_dir is not None:
            config["workingDir"] = working_dir
        head = as_mapping(cluster.get("headGroupSpec"))
        if "headGroupSpec" not in cluster:
            self.findings.refuse(f"{path}.headGroupSpec", "required")
        config["head"] = self.group(f"{path}.headGroupSpec", "head", head, IGNORED_HEAD_FIELDS)
        autoscaling = autoscaling_fields(self.findings, path, cluster)
        config.update(autoscaling)
        workers = []
        for index, worker in enumerate(as_list(cluster.get("workerGroupSpecs"))):
            worker_path = f"{path}.workerGroupSpecs[{index}]"
            worker = as_mapping(worker)
            name = worker.get("groupName")
            group = self.group(worker_path, str(name), worker, IGNORED_WORKER_FIELDS)
            group["name"] = name
            group.update(worker_nodes(self.findings, worker_path, worker, bool(autoscaling)))
            workers.append(group)
        if workers:
            config["workerGroups"] = workers
        if cluster.get(GCS_FT_OPTIONS) is not None:
            fault_tolerance = self.gcs_fault_tolerance(f"{path}.{GCS_FT_OPTIONS}", as_mapping(cluster[GCS_FT_OPTIONS]))
            if fault_tolerance is not None:
                config["gcsFaultTolerance"] = fault_tolerance
        config.update(self.versions.fields(self.ray_version, self.python_version))
        return config

    def gcs_fault_tolerance(self, path: str, options: dict[str, Any]) -> dict[str, Any] | None:
        """KubeRay's backends, both servekeeper's: the embedded RocksDB, and Redis (KubeRay's
        default; `redisAddress` the user's Redis, its password from a servekeeper secret)."""
        backend = options.get("backend", "redis")
        if backend == "rocksdb":
            if "storage" in options:
                self.findings.note(
                    NoteKind.IGNORED,
                    f"{path}.storage",
                    "no volume to claim: the store is a directory beside the head's temp dir on its pool host, "
                    "removed with the cluster",
                )
            for key in sorted(set(options) - {"backend", "storage"}):
                self.findings.note(NoteKind.IGNORED, f"{path}.{key}", "a Redis setting: not used by backend rocksdb")
            return {"backend": "rocksdb"}
        if backend != "redis":
            self.findings.refuse(f"{path}.backend", f"{backend!r} is not a backend: rocksdb or redis")
            return None
        return {"backend": "redis", "redis": self.redis_options(path, options)}

    def redis_options(self, path: str, options: dict[str, Any]) -> dict[str, Any]:
        redis: dict[str, Any] = {}
        if options.get("redisAddress") is not None:
            redis["address"] = str(options["redisAddress"])
        else:
            self.findings.note(NoteKind.CHANGED, f"{path}.redisAddress", "unset: servekeeper runs a Redis for it")
        username = options.get("redisUsername")  # KubeRay's RedisCredential: {value} or {valueFrom}
        if (username.get("value") if isinstance(username, dict) else username) not in (None, "", "default"):
            self.findings.refuse(f"{path}.redisUsername", "Ray's default Redis user only ('default')")
        if "externalStorageNamespace" in options:
            why = "each cluster's tables go in a namespace of its own (its name), removed with it"
            self.findings.note(NoteKind.IGNORED, f"{path}.externalStorageNamespace", why)
        password = options.get("redisPassword")
        if password is not None and (not isinstance(password, dict) or "value" in password):
            self.findings.refuse(
                f"{path}.redisPassword.value",
                "a literal password would be stored with the spec: put it in a servekeeper secret "
                "(servekeeper secret set NAME KEY=-) and use valueFrom.secretKeyRef",
            )
        source = as_mapping(as_mapping(password).get("valueFrom"))
        ref = as_mapping(source.get("secretKeyRef"))
        if source and not ref:
            self.findings.refuse(f"{path}.redisPassword.valueFrom", "only a secretKeyRef to a servekeeper secret")
        if ref:
            secret, key = str(ref.get("name")), str(ref.get("key"))
            if key not in self.secrets.get(secret, {}):
                self.findings.refuse(f"{path}.redisPassword.valueFrom.secretKeyRef", missing_secret(secret, key))
            redis["passwordSecret"] = {"name": secret, "key": key}
        return redis

    def working_dir(self, serve_config: dict[str, Any]) -> str | None:
        """Remote working_dir and py_modules URIs stay in the app's runtime_env (Ray fetches
        them); a local working_dir becomes the cluster's workingDir, which servekeeper packages."""
        local: set[str] = set()
        for index, app in enumerate(as_list(serve_config.get("applications"))):
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
            for module_index, module in enumerate(as_list(runtime_env.get("py_modules"))):
                if isinstance(module, str) and "://" not in module:
                    self.findings.refuse(
                        f"{path}.py_modules[{module_index}]",
                        "a local module is not packaged by servekeeper; put it inside the working_dir, or use a "
                        "remote URI",
                    )
            if runtime_env:
                app["runtime_env"] = runtime_env
            else:
                del app["runtime_env"]
        if len(local) > 1:
            self.findings.refuse(
                "spec.serveConfigV2.applications",
                f"local working_dir values differ ({sorted(local)}); servekeeper packages one per service: use one "
                "folder, or remote URIs",
            )
        return next(iter(local)) if len(local) == 1 else None

    def local_path(self, path: str, directory: str) -> str | None:
        if posixpath.isabs(directory):
            return posixpath.normpath(directory)
        if self.base_dir is None:
            self.findings.refuse(
                path, f"the relative path {directory!r} needs the manifest's folder: apply the file with the CLI"
            )
            return None
        return posixpath.normpath(posixpath.join(self.base_dir, directory))

    # -- groups -------------------------------------------------------------------------

    def group(self, path: str, name: str, group: dict[str, Any], ignored: Mapping[str, str]) -> dict[str, Any]:
        for key, reason in ignored.items():
            if key in group:
                self.findings.note(NoteKind.IGNORED, f"{path}.{key}", reason)
        known = {"rayStartParams", "template", "resources", "groupName", "replicas", "minReplicas", "maxReplicas"}
        known |= {"numOfHosts", "suspend", *ignored}
        for key in sorted(set(group) - known):
            self.findings.note(NoteKind.IGNORED, f"{path}.{key}", "not known to servekeeper")
        template = as_mapping(group.get("template"))
        if "metadata" in template:
            self.findings.note(NoteKind.IGNORED, f"{path}.template.metadata", "pod labels and annotations do not apply")
        pod = as_mapping(template.get("spec"))
        for key in sorted(set(pod) - {"containers"}):
            reason = POD_FIELD_REASONS.get(key, "a Kubernetes pod field: no effect on local processes")
            self.findings.note(NoteKind.IGNORED, f"{path}.template.spec.{key}", reason)
        containers = as_list(pod.get("containers"))
        if not containers:
            self.findings.refuse(f"{path}.template.spec.containers", "required: the Ray container is the first one")
            container: dict[str, Any] = {}
        else:
            container = as_mapping(containers[0])
        for index in range(1, len(containers)):
            self.findings.note(
                NoteKind.IGNORED, f"{path}.template.spec.containers[{index}]", "only the Ray container (the first) runs"
            )
        container_path = f"{path}.template.spec.containers[0]"
        for key in sorted(set(container) - {"image", "resources", "env", "envFrom"}):
            container_reason = CONTAINER_FIELD_REASONS.get(key, "a Kubernetes container field: no effect here")
            if container_reason is not None:
                self.findings.note(NoteKind.IGNORED, f"{container_path}.{key}", container_reason)
        if "image" in container:
            self.versions.read_image(f"{container_path}.image", str(container["image"]))
        if "envFrom" in container:
            self.findings.refuse(
                f"{container_path}.envFrom", "list each variable under env (a literal value or a secretKeyRef)"
            )
        result: dict[str, Any] = {"env": self.env(f"{container_path}.env", name, container.get("env"))}
        result.update(self.resources(path, group, as_mapping(container.get("resources"))))
        return result

    def env(self, path: str, group: str, entries: Any) -> dict[str, str]:
        env: dict[str, str] = {}
        for index, entry in enumerate(as_list(entries)):
            entry = as_mapping(entry)
            name = str(entry.get("name"))
            entry_path = f"{path}[{index}]"
            if "valueFrom" not in entry:
                env[name] = str(entry.get("value", ""))
                continue
            source = as_mapping(entry["valueFrom"])
            ref = source.get("secretKeyRef")
            if not isinstance(ref, dict):
                kinds = ", ".join(sorted(source)) or "nothing"
                self.findings.refuse(
                    f"{entry_path}.valueFrom",
                    f"{kinds} cannot be read here; use a literal value, or a secretKeyRef to a servekeeper secret",
                )
                continue
            secret, key = str(ref.get("name")), str(ref.get("key"))
            value = self.secrets.get(secret, {}).get(key)
            if value is None:
                if ref.get("optional"):
                    self.findings.note(
                        NoteKind.IGNORED,
                        f"{entry_path}.valueFrom.secretKeyRef",
                        f"optional secret {secret!r} key {key!r} does not exist: {name} is not set",
                    )
                    continue
                self.findings.refuse(f"{entry_path}.valueFrom.secretKeyRef", missing_secret(secret, key))
                continue
            env[name] = value
            self.findings.secret_refs.append(SecretRef(group=group, env=name, secret=secret, key=key))
        return env

    def resources(self, path: str, group: dict[str, Any], resources: dict[str, Any]) -> dict[str, Any]:
        """num-cpus, memory and num-gpus the way KubeRay derives them (controllers/ray/common/pod.go):
        the group's `resources` win, then rayStartParams, then the container's limits (for CPUs
        the request when there is no limit), each rounded up to an integer like Quantity.Value().
        A fraction of a CPU or GPU given as a Ray parameter is rounded up too (with a note):
        `ray start` takes whole CPUs and GPUs, and would refuse it."""
        params_path = f"{path}.rayStartParams"
        params: dict[str, Any] = dict(as_mapping(group.get("rayStartParams")))
        sources = {key: f"{params_path}.{key}" for key in params}  # where each parameter was set
        for name, quantity in as_mapping(group.get("resources")).items():
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
                self.findings.refuse(
                    f"{path}.resources.{name}", "custom Ray resources: set them with rayStartParams.resources"
                )
                continue
            params[target] = quantity
            sources[target] = f"{path}.resources.{name}"
        limits = as_mapping(resources.get("limits"))
        requests = as_mapping(resources.get("requests"))
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
            self.findings.refuse(container_path, str(exc))
        result["rayStartParams"] = self.start_params(params_path, params)
        return result

    def start_params(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        """The rayStartParams left once resources are taken out, less those servekeeper sets."""
        passed: dict[str, Any] = {}
        for key, value in sorted(params.items()):
            if key in OWNED_START_PARAMS:
                self.findings.note(NoteKind.OVERRIDDEN, f"{path}.{key}", "set by servekeeper (ports, addresses, dirs)")
                continue
            passed[key] = _start_param_value(key, value)
        return passed

    def whole(self, path: str, quantity: Any, flag: str) -> float:
        """A CPU or GPU count for `ray start --{flag}`, rounded up to a whole number as Ray's
        own container limits are; a fraction rounded is noted."""
        exact = parse_quantity(quantity)
        rounded = math.ceil(exact)
        if rounded != exact:
            self.findings.note(
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


def missing_secret(secret: str, key: str) -> str:
    return (
        f"secret {secret!r} with key {key!r} does not exist here; create it with: "
        f"servekeeper secret set {secret} {key}=- (the value on standard input)"
    )
