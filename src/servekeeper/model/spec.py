"""The declared service: pydantic models, YAML loading and validation errors.

User-facing config is strict (`extra="forbid"`): a typo must be an error, not a silently
ignored field. Every problem is reported at once, by field path. The cluster's shape is
declared in cluster_spec.py; the Serve config, ingress, upgrade strategy and readiness here.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servekeeper.model.base import DNS_LABEL, StrictModel
from servekeeper.model.canary_spec import CanarySpec
from servekeeper.model.cluster_spec import (
    RayClusterConfigSpec,
    fractional_resource_problems,
    gcs_problems,
)

MAX_SPEC_BYTES = 1_000_000


class SpecError(ValueError):
    """A spec that cannot be accepted. `problems` lists every one as 'field.path: message'."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid service spec:\n" + "\n".join(f"  - {p}" for p in problems))


class IngressSpec(StrictModel):
    """The service's stable entry point: an Envoy listener on 127.0.0.1."""

    port: int = Field(ge=1, le=65535)
    grpcPort: int | None = Field(default=None, ge=1, le=65535)  # Serve's gRPC proxy, switched the same way
    maxRequestBytes: int = Field(default=64 * 1024 * 1024, ge=1, le=4 * 1024**3)  # 413 above, chunked too
    requestTimeoutSeconds: float = Field(default=0, ge=0, le=86400)  # 0: none, so long streams work
    idleTimeoutSeconds: float = Field(default=300, gt=0, le=86400)
    # How long a request's upstream may leave bytes unacknowledged, or keep its window shut (an app
    # not reading an upload), before the request fails: a silent host's requests end then, not at
    # their client's timeout. The kernel cannot tell the two apart. 0: off (a silent host's
    # requests then end after the kernel's retransmissions, ~15 minutes). At least 1 s otherwise.
    silentUpstreamSeconds: float = Field(default=4, ge=0, le=3600)
    # While a pending (canary) cluster exists, this port sends all its requests there; else 503.
    previewPort: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("silentUpstreamSeconds")
    @classmethod
    def _whole_second_or_off(cls, value: float) -> float:
        if 0 < value < 1:
            raise ValueError("must be 0 (off) or at least 1: below a second it cuts connections to healthy hosts")
        return value

    def ports(self) -> list[int]:
        """Every port this ingress listens on (HTTP, then gRPC and preview where declared)."""
        return [p for p in (self.port, self.grpcPort, self.previewPort) if p is not None]

    @model_validator(mode="after")
    def _distinct_ports(self) -> IngressSpec:
        ports = self.ports()
        if len(set(ports)) != len(ports):
            raise ValueError("port, grpcPort and previewPort must differ")
        return self


class UpgradeStrategySpec(StrictModel):
    # Canary: every change (cluster or Serve config) rolls a new cluster and moves traffic to it in steps.
    type: Literal["NewCluster", "Canary", "None"] = "NewCluster"
    canary: CanarySpec | None = None

    @model_validator(mode="after")
    def _canary_iff_canary(self) -> UpgradeStrategySpec:
        if self.type == "Canary" and self.canary is None:
            raise ValueError("type Canary needs a canary: {steps: [...]} section")
        if self.type != "Canary" and self.canary is not None:
            raise ValueError(f"canary is only read with type Canary, not {self.type}")
        return self


class ServeApplicationSpec(BaseModel):
    """One application of Ray Serve's own config schema.

    Only the fields servekeeper relies on are typed; the rest pass through to Ray untouched,
    because Ray validates them and its schema grows with every release.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = "default"
    route_prefix: str | None = "/"
    import_path: str

    @field_validator("import_path")
    @classmethod
    def _import_path_shape(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$", value):
            raise ValueError(f"{value!r} is not an import path like 'module:attribute'")
        return value

    @field_validator("route_prefix")
    @classmethod
    def _route_prefix_shape(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"route_prefix {value!r} must start with '/'")
        return value


class ServeConfigSpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    applications: list[ServeApplicationSpec] = Field(min_length=1)
    http_options: dict[str, Any] | None = None

    @field_validator("http_options")
    @classmethod
    def _port_is_owned(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and ("port" in value or "host" in value):
            raise ValueError(
                "http_options.port and http_options.host belong to servekeeper "
                "(each cluster gets its own port on 127.0.0.1); remove them"
            )
        return value

    @model_validator(mode="after")
    def _unique_apps(self) -> ServeConfigSpec:
        names = [app.name for app in self.applications]
        prefixes = [app.route_prefix for app in self.applications if app.route_prefix is not None]
        for label, values in (("names", names), ("route_prefix values", prefixes)):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"application {label} must be unique; repeated: {repeated}")
        return self


class ProbeSpec(StrictModel):
    """An HTTP check against a cluster's own Serve endpoint (not through the ingress)."""

    path: str
    expectStatus: int = Field(default=200, ge=100, le=599)
    bodyContains: str | None = None
    periodSeconds: float = Field(default=1, gt=0, le=3600)
    timeoutSeconds: float = Field(default=2, gt=0, le=600)
    successThreshold: int = Field(default=1, ge=1, le=1000)

    @field_validator("path")
    @classmethod
    def _path_shape(cls, value: str) -> str:
        if not value.startswith("/") or any(ch in value for ch in " \r\n\t#"):
            raise ValueError(f"probe path {value!r} must start with '/' and hold no whitespace or '#'")
        return value


class ReadinessSpec(StrictModel):
    applications: Literal["declarative", "all"] = "declarative"
    probes: list[ProbeSpec] = Field(default_factory=list, max_length=20)


class StandbySpec(StrictModel):
    """`hot`: a second cluster of the active spec with the apps deployed and ready, taking no
    traffic; the ingress fails over to it the moment the active refuses connections, and the
    controller then makes it the active and builds a new standby. It costs a second cluster.
    `warm`: the same cluster with the apps deployed at no replicas (Serve's target_capacity 0);
    when the active dies it is scaled up and takes the traffic once its replicas run. It costs
    about a head's memory, and the time to start the replicas."""

    mode: Literal["hot", "warm"] = "hot"


class ServiceSpecBody(StrictModel):
    ingress: IngressSpec
    rayClusterConfig: RayClusterConfigSpec = Field(default_factory=RayClusterConfigSpec)
    serveConfig: ServeConfigSpec
    upgradeStrategy: UpgradeStrategySpec = Field(default_factory=UpgradeStrategySpec)
    serveConfigUpdate: Literal["InPlace", "NewCluster"] = "InPlace"
    readiness: ReadinessSpec = Field(default_factory=ReadinessSpec)
    rayClusterDeletionDelaySeconds: float = Field(default=60, ge=0, le=86400)
    readinessTimeoutSeconds: float = Field(default=600, gt=0, le=86400)
    serviceUnhealthySecondThreshold: float = Field(default=300, ge=0, le=86400)
    # After a full switch the old cluster is kept (no traffic) this long: `undo` within it moves
    # traffic back at once, without starting a cluster.
    rollbackWindowSeconds: float = Field(default=0, ge=0, le=7 * 86400)
    revisionHistoryLimit: int = Field(default=10, ge=1, le=1000)
    standby: StandbySpec | None = None  # None: a dead active is replaced (or restarted in place)

    @property
    def rolls_config_changes_on_new_cluster(self) -> bool:
        """A canary needs a cluster beside the active one: with upgradeStrategy Canary every Serve
        config change rolls out on a new cluster, whatever serveConfigUpdate says."""
        return self.serveConfigUpdate == "NewCluster" or self.upgradeStrategy.type == "Canary"


class Metadata(StrictModel):
    name: str

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, name: str) -> str:
        if not DNS_LABEL.match(name) or len(name) > 40:
            raise ValueError(f"{name!r} is not a DNS label of at most 40 characters")
        return name


class ServiceSpec(StrictModel):
    apiVersion: Literal["servekeeper/v1alpha1"]
    kind: Literal["RayService"]
    metadata: Metadata
    spec: ServiceSpecBody

    @property
    def name(self) -> str:
        return self.metadata.name

    def cluster_spec_hash(self) -> str:
        """What a cluster is made of; a change here needs a new cluster."""
        shape = self.spec.rayClusterConfig.model_dump(mode="json")
        # What is packaged is the code's business: its hash is part of the Serve config's.
        shape.pop("excludes", None)
        # Fields added later hash as if absent while unset: a stored spec keeps its hash, so an
        # upgrade of servekeeper never replaces a running cluster.
        for group in [shape["head"], *shape["workerGroups"]]:
            for key in ("numGpus", "memory", "host", "minReplicas", "maxReplicas"):
                if group.get(key) is None:
                    group.pop(key, None)
        keys = ("hostPool", "gcsFaultTolerance", "rayVersion", "pythonVersion", "pip")
        for key in (*keys, "enableInTreeAutoscaling", "autoscalerOptions"):
            if not shape.get(key):
                shape.pop(key, None)
        if self.spec.rayClusterConfig.gcsFaultTolerance is not None:
            shape["gcsFaultTolerance"] = self.spec.rayClusterConfig.gcsFaultTolerance.hash_shape()
        return _digest(shape)

    def serve_config_hash(self) -> str:
        """What is submitted to Serve; a change here can be applied in place."""
        return _digest(
            {
                "serveConfig": self.spec.serveConfig.model_dump(mode="json", exclude_none=False),
                "workingDir": self.spec.rayClusterConfig.workingDir,
            }
        )

    @property
    def judges_imperative_apps(self) -> bool:
        return self.spec.readiness.applications == "all"

    def declared_apps(self) -> dict[str, str | None]:
        """Declared application name -> route prefix."""
        return {app.name: app.route_prefix for app in self.spec.serveConfig.applications}

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def format_errors(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(document)"
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{path}: {message}")
    return problems


def parse_spec(document: Any) -> ServiceSpec:
    """Validate a decoded document; raise SpecError listing every problem."""
    if not isinstance(document, dict):
        raise SpecError([f"(document): expected a mapping, got {type(document).__name__}"])
    try:
        spec = ServiceSpec.model_validate(document)
    except ValidationError as exc:
        raise SpecError(format_errors(exc)) from exc
    config = spec.spec.rayClusterConfig
    problems = fractional_resource_problems(config) + gcs_problems(config)
    if problems:
        raise SpecError(problems)
    return spec


def single_document(text: str) -> Any:
    """The one YAML document of `text`, or SpecError (too large, not YAML, several)."""
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise SpecError([f"(document): larger than {MAX_SPEC_BYTES} bytes"])
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise SpecError([f"(document): not valid YAML: {exc}"]) from exc
    if len(documents) != 1:
        raise SpecError([f"(document): expected exactly one YAML document, found {len(documents)}"])
    return documents[0]


def load_spec_text(text: str, base_dir: Path | None = None) -> ServiceSpec:
    """Parse YAML text. A relative workingDir is resolved against base_dir (the file's folder)."""
    spec = parse_spec(single_document(text))
    working_dir = spec.spec.rayClusterConfig.workingDir
    if working_dir is not None and base_dir is not None and "://" not in working_dir:
        resolved = (base_dir / working_dir).resolve()
        if not resolved.is_dir():
            raise SpecError([f"spec.rayClusterConfig.workingDir: {resolved} is not a directory"])
        cluster_config = spec.spec.rayClusterConfig.model_copy(update={"workingDir": str(resolved)})
        body = spec.spec.model_copy(update={"rayClusterConfig": cluster_config})
        spec = spec.model_copy(update={"spec": body})
    return spec


def load_spec_file(path: Path) -> ServiceSpec:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError([f"(file): cannot read {path}: {exc.strerror}"]) from exc
    return load_spec_text(text, base_dir=path.parent.resolve())
