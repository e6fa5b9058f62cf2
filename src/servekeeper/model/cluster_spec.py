"""The declared shape of a Ray cluster: its head and worker groups, their resources, env and
`ray start` parameters, and the host pool they run on."""

from __future__ import annotations

import math
import re
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import Field, field_validator, model_validator

from servekeeper.model.base import DNS_LABEL, StrictModel
from servekeeper.model.start_params import StartParamValue, check_start_params

RAY_VERSION = re.compile(r"^\d+\.\d+\.\d+$")  # a Ray release, as `pip install ray==` takes it
PYTHON_VERSION = re.compile(r"^3\.\d{1,2}$")  # a Python minor version: an interpreter on the host
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# Set on the nodes by servekeeper when gcsFaultTolerance is on.
GCS_FT_ENV = frozenset(
    {
        "RAY_gcs_storage",
        "RAY_gcs_storage_path",
        "RAY_gcs_rpc_server_reconnect_timeout_s",
        "RAY_REDIS_ADDRESS",
        "RAY_external_storage_namespace",
    }
)


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not ENV_KEY.match(key):
            raise ValueError(f"env key {key!r} is not a valid environment variable name")
        if "\x00" in value:
            raise ValueError(f"env value of {key!r} contains a NUL byte")
    return env


class HeadGroupSpec(StrictModel):
    numCpus: float = Field(default=1, ge=0, le=1024)
    # `ray start --num-gpus` / `--memory` (bytes: Ray's logical memory resource). None: not passed,
    # Ray detects the GPUs and takes the memory it sees.
    numGpus: float | None = Field(default=None, ge=0, le=1024)
    memory: int | None = Field(default=None, ge=0, le=2**50)
    env: dict[str, str] = Field(default_factory=dict)
    rayStartParams: dict[str, StartParamValue] = Field(default_factory=dict)
    # With a hostPool: the pool's host this group's nodes run on (None: placed, spread).
    host: str | None = None

    _env = field_validator("env")(_check_env)
    _params = field_validator("rayStartParams")(check_start_params)


def _with_starting_count(group: dict[str, object]) -> dict[str, object]:
    """Bounds without a starting count start at minReplicas, as KubeRay does (at most maxReplicas,
    and 1, the default count, when only maxReplicas is given)."""
    low, high = group.get("minReplicas"), group.get("maxReplicas")
    if "replicas" in group or not (isinstance(low, int) or isinstance(high, int)):
        return group
    start = low if isinstance(low, int) else 1
    return {**group, "replicas": min(start, high) if isinstance(high, int) else start}


class WorkerGroupSpec(HeadGroupSpec):
    name: str
    # The node count a cluster starts with; with enableInTreeAutoscaling, Ray's autoscaler then
    # moves it between minReplicas and maxReplicas (unset: replicas, KubeRay's names and defaults).
    replicas: int = Field(default=1, ge=0, le=64)
    minReplicas: int | None = Field(default=None, ge=0, le=64)
    maxReplicas: int | None = Field(default=None, ge=0, le=64)

    def min_nodes(self) -> int:
        return self.replicas if self.minReplicas is None else self.minReplicas

    def max_nodes(self) -> int:
        return self.replicas if self.maxReplicas is None else self.maxReplicas

    @model_validator(mode="before")
    @classmethod
    def _start_within_the_bounds(cls, data: object) -> object:
        return _with_starting_count(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _replicas_within_bounds(self) -> WorkerGroupSpec:
        if self.min_nodes() > self.max_nodes():
            raise ValueError(f"minReplicas ({self.min_nodes()}) exceeds maxReplicas ({self.max_nodes()})")
        if not self.min_nodes() <= self.replicas <= self.max_nodes():
            raise ValueError(
                f"replicas ({self.replicas}) must lie within minReplicas ({self.min_nodes()}) "
                f"and maxReplicas ({self.max_nodes()})"
            )
        return self

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, name: str) -> str:
        if not DNS_LABEL.match(name):
            raise ValueError(f"{name!r} is not a DNS label (lowercase letters, digits, '-')")
        return name


REDIS_ADDRESS = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$")


class SecretKeySelector(StrictModel):
    """A key of a `servekeeper secret`: its value is read when a node starts, never stored in the spec."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class RedisSpec(StrictModel):
    """The Redis that keeps the GCS tables. `address` (host:port) is the user's own Redis, which
    every head host must reach; unset, servekeeper runs one on this machine (Debian's
    redis-server, AOF on, a generated password) bound to the address the pool's hosts reach it on."""

    address: str | None = None
    passwordSecret: SecretKeySelector | None = None

    @field_validator("address")
    @classmethod
    def _host_and_port(cls, address: str | None) -> str | None:
        if address is not None and not REDIS_ADDRESS.match(address):
            raise ValueError(f"{address!r} is not host:port (e.g. 10.0.0.5:6379)")
        if address is not None and not 0 < int(address.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"{address!r}: the port must be 1-65535")
        return address

    @model_validator(mode="after")
    def _password_only_for_the_users_redis(self) -> RedisSpec:
        if self.passwordSecret is not None and self.address is None:
            raise ValueError("passwordSecret is for a Redis at `address`; the one servekeeper runs has its own")
        return self


# A silent host may be a short network blip: the head moves only after this, well before the
# default unhealthy threshold (300 s) would replace the whole cluster.
HEAD_MOVE_AFTER_SECONDS = 30.0


class GcsFaultToleranceSpec(StrictModel):
    """Where the head's GCS keeps its tables, so that a head started again finds them: workers
    reconnect, Serve's controller recovers its apps, and the cluster is not replaced.

    `rocksdb`: Ray's embedded store, in a directory beside the head (kept with the cluster);
    the head restarts on the host it ran on. `redis`: the tables live in a Redis (`redis`; a
    namespace per cluster, removed with it), outside the head's host, so a head whose host stays
    silent (`headMoveAfterSeconds`) is started on another host of the pool with them."""

    backend: Literal["rocksdb", "redis"] = "rocksdb"
    redis: RedisSpec | None = None
    # Redis only: once the head's host has been silent this long, the head is started on another
    # host of the pool with the same tables (None: HEAD_MOVE_AFTER_SECONDS).
    headMoveAfterSeconds: float | None = Field(default=None, ge=1, le=86400)

    @model_validator(mode="after")
    def _redis_settings_need_redis(self) -> GcsFaultToleranceSpec:
        if self.redis is not None and self.backend != "redis":
            raise ValueError("redis settings are for backend: redis")
        if self.headMoveAfterSeconds is not None and self.backend != "redis":
            raise ValueError(
                "headMoveAfterSeconds is for backend: redis (RocksDB tables stay on the head's host: it never moves)"
            )
        return self

    def head_move_after(self) -> float | None:
        """How long a head's host may be silent before the head moves; None: it never moves."""
        if self.backend != "redis":
            return None
        return self.headMoveAfterSeconds if self.headMoveAfterSeconds is not None else HEAD_MOVE_AFTER_SECONDS

    def hash_shape(self) -> dict[str, object]:
        """Its part of the cluster spec hash: a rocksdb spec hashes as before `redis` existed."""
        shape = self.model_dump(mode="json", exclude_none=True)
        if not shape.get("redis"):  # `redis: {}` is the same Redis as none given
            shape.pop("redis", None)
        return shape


class AutoscalerOptionsSpec(StrictModel):
    """Ray's autoscaler for the cluster, under KubeRay's names."""

    # A worker node idle this long is removed (down to its group's minReplicas).
    idleTimeoutSeconds: int = Field(default=60, ge=0, le=86400)  # an int32 in KubeRay
    # Conservative: at most as many nodes pending as the cluster has; Default and Aggressive: no limit.
    upscalingMode: Literal["Default", "Aggressive", "Conservative"] = "Default"


class RayClusterConfigSpec(StrictModel):
    # The HostPool whose machines run the nodes, over SSH (None: this machine, the embedded default).
    hostPool: str | None = None
    workingDir: str | None = None
    # Gitignore-style patterns left out of the workingDir package, like a .servekeeperignore file.
    excludes: list[str] = Field(default_factory=list, max_length=1000)
    head: HeadGroupSpec = Field(default_factory=HeadGroupSpec)
    workerGroups: list[WorkerGroupSpec] = Field(default_factory=list)
    # None: a head that dies takes the cluster's state with it (replaced after the threshold).
    gcsFaultTolerance: GcsFaultToleranceSpec | None = None
    # What an image would hold: the Ray release and Python of every node, and extra packages
    # (requirement specifiers, resolved once and locked). None and []: the controller's own.
    rayVersion: str | None = Field(default=None, pattern=RAY_VERSION.pattern)
    pythonVersion: str | None = Field(default=None, pattern=PYTHON_VERSION.pattern)
    pip: list[str] = Field(default_factory=list, max_length=200)
    # Ray's own autoscaler adds and removes worker nodes between each group's bounds.
    enableInTreeAutoscaling: bool = False

    @model_validator(mode="before")
    @classmethod
    def _autoscaled_bounds_as_values(cls, data: object) -> object:
        # With Ray's autoscaler each group's bounds are stored as values: the KubeRay manifest
        # `export` writes (it must carry them) then imports back as the same spec, the same hash.
        if not isinstance(data, dict) or data.get("enableInTreeAutoscaling") is not True:
            return data
        groups = data.get("workerGroups")
        if not isinstance(groups, list):
            return data
        filled: list[object] = []
        for group in groups:
            if isinstance(group, dict):
                group = _with_starting_count(group)
                count = group.get("replicas", 1)
                group = {**group, **{key: count for key in ("minReplicas", "maxReplicas") if group.get(key) is None}}
            filled.append(group)
        return {**data, "workerGroups": filled}

    autoscalerOptions: AutoscalerOptionsSpec | None = None

    def worker_count(self) -> int:
        return sum(group.replicas for group in self.workerGroups)

    def max_worker_count(self) -> int:
        """The most worker nodes the cluster may have (Ray's autoscaler's bound)."""
        return sum(group.max_nodes() for group in self.workerGroups)

    @field_validator("excludes")
    @classmethod
    def _excludes_are_single_lines(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if any(ch in pattern for ch in "\x00\n\r"):
                raise ValueError(f"excludes pattern {pattern!r} contains a NUL or line break")
        return patterns

    @field_validator("pip")
    @classmethod
    def _pip_holds_requirements(cls, requirements: list[str]) -> list[str]:
        """Requirement specifiers only: an option (`--index-url`, `-e`) would reach uv's command line."""
        for requirement in requirements:
            if requirement.lstrip().startswith("-"):
                raise ValueError(f"pip entry {requirement!r} is an option, not a requirement")
            try:
                parsed = Requirement(requirement)
            except InvalidRequirement as exc:
                raise ValueError(f"pip entry {requirement!r} is not a requirement: {exc}") from None
            if parsed.url:
                raise ValueError(f"pip entry {requirement!r} names a URL: only packages of the index are resolved")
        return requirements

    def has_own_environment(self) -> bool:
        return self.rayVersion is not None or self.pythonVersion is not None or bool(self.pip)

    @model_validator(mode="after")
    def _hosts_need_a_pool(self) -> RayClusterConfigSpec:
        pinned = [g for g in [self.head, *self.workerGroups] if g.host is not None]
        if pinned and self.hostPool is None:
            raise ValueError("a group's host names a machine of a hostPool: set hostPool too")
        return self

    @model_validator(mode="after")
    def _gcs_storage_is_ours(self) -> RayClusterConfigSpec:
        if self.gcsFaultTolerance is None:
            return self
        for group in [self.head, *self.workerGroups]:
            owned = sorted(key for key in group.env if key in GCS_FT_ENV)
            if owned:
                raise ValueError(f"env {owned} is set by servekeeper when gcsFaultTolerance is on")
        return self

    @model_validator(mode="after")
    def _bounds_need_the_autoscaler(self) -> RayClusterConfigSpec:
        if self.enableInTreeAutoscaling:
            return self
        if self.autoscalerOptions is not None:
            raise ValueError("autoscalerOptions needs enableInTreeAutoscaling: true")
        for group in self.workerGroups:
            if group.min_nodes() != group.max_nodes():
                raise ValueError(
                    f"workerGroup {group.name!r}: minReplicas and maxReplicas differ, which needs "
                    "enableInTreeAutoscaling: true (without it a group has replicas nodes)"
                )
        return self

    @model_validator(mode="after")
    def _unique_worker_groups(self) -> RayClusterConfigSpec:
        names = [group.name for group in self.workerGroups]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"workerGroups names must be unique; repeated: {duplicates}")
        return self


def fractional_resource_problems(config: RayClusterConfigSpec) -> list[str]:
    """`ray start --num-cpus` and `--num-gpus` take whole numbers: a fraction would fail every
    node's start. Checked when a spec is applied, not when a stored one is read (the model
    allows fractions), so that a spec stored before this check still loads and can be replaced."""
    groups: list[tuple[str, HeadGroupSpec]] = [("spec.rayClusterConfig.head", config.head)]
    groups += [(f"spec.rayClusterConfig.workerGroups.{i}", group) for i, group in enumerate(config.workerGroups)]
    problems = []
    for path, group in groups:
        for field, value, flag in (("numCpus", group.numCpus, "num-cpus"), ("numGpus", group.numGpus, "num-gpus")):
            if value is not None and value != int(value):
                problems.append(
                    f"{path}.{field}: {value:g} is not a whole number: `ray start --{flag}` takes an integer; "
                    f"use {math.ceil(value)} (a deployment's share of a node goes in its ray_actor_options)"
                )
    return problems


def gcs_problems(config: RayClusterConfigSpec) -> list[str]:
    """GCS fault tolerance restarts a head in place where it ran: on a pool host with either
    backend, on this machine with RocksDB (Redis is for heads that may move host, and a head on
    this machine never does)."""
    fault_tolerance = config.gcsFaultTolerance
    if fault_tolerance is not None and fault_tolerance.backend == "redis" and config.hostPool is None:
        return [
            "spec.rayClusterConfig.gcsFaultTolerance.backend: redis needs a hostPool (a head on this machine is "
            "started again in place with its tables in RocksDB: use backend: rocksdb)"
        ]
    return []
