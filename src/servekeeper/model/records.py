"""The frozen records of stored state: services, clusters (ports, nodes, canary progress), conditions,
events and revisions, with their JSON forms for the store."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from servekeeper.model.enums import ClusterRole, ConditionType
from servekeeper.model.observation import BackendCounters


@dataclass(frozen=True)
class ClusterPorts:
    gcs: int
    dashboard: int
    client_server: int
    serve_http: int
    serve_grpc: int
    # Per node (head first, then each worker raylet): ports each raylet needs for itself.
    node_ports: tuple[NodePorts, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "gcs": self.gcs,
            "dashboard": self.dashboard,
            "client_server": self.client_server,
            "serve_http": self.serve_http,
            "serve_grpc": self.serve_grpc,
            "node_ports": [node.__dict__ for node in self.node_ports],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterPorts:
        nodes = tuple(NodePorts(**node) for node in data["node_ports"])
        return cls(
            gcs=data["gcs"],
            dashboard=data["dashboard"],
            client_server=data["client_server"],
            serve_http=data["serve_http"],
            serve_grpc=data["serve_grpc"],
            node_ports=nodes,
        )

    def all_ports(self) -> list[int]:
        ports = [self.gcs, self.dashboard, self.client_server, self.serve_http, self.serve_grpc]
        for node in self.node_ports:
            ports.extend(node.all_ports())
        return ports


@dataclass(frozen=True)
class NodePorts:
    node_manager: int
    object_manager: int
    metrics_export: int
    agent_listen: int
    agent_grpc: int
    runtime_env_agent: int
    min_worker: int
    max_worker: int

    def all_ports(self) -> list[int]:
        singles = [
            self.node_manager,
            self.object_manager,
            self.metrics_export,
            self.agent_listen,
            self.agent_grpc,
            self.runtime_env_agent,
        ]
        return singles + list(range(self.min_worker, self.max_worker + 1))


@dataclass(frozen=True)
class AnalysisFigures:
    """What one analysis interval measured, for the canary and (beside it) the stable cluster."""

    started_at: float
    ended_at: float
    requests: int
    success_rate: float | None  # None: no requests
    p99_ms: float | None
    stable_requests: int
    stable_success_rate: float | None
    stable_p99_ms: float | None
    verdict: str  # "passed" | "failed" | "inconclusive"
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AnalysisFigures:
        return cls(**data)


@dataclass(frozen=True)
class CanaryState:
    """A canary's progress, stored on its cluster: a restarted controller resumes the same step
    with the same remaining pause, and the analysis interval where it was."""

    step: int  # index of the current step; len(steps) means every step is done
    step_started_at: float
    weight: int  # the canary's share of traffic (percent) in force
    promotes_seen: int = 0  # `promote` requests acted upon (the API counts them on the cluster)
    interval_started_at: float | None = None
    baseline: dict[str, BackendCounters] = field(default_factory=dict)  # counters at the interval start
    passed_intervals: int = 0
    failed_intervals: int = 0
    inconclusive_intervals: int = 0
    last_analysis: AnalysisFigures | None = None
    held_since: float | None = None  # steps held (canary not ready, or its capacity not reached) since

    def with_changes(self, **changes: Any) -> CanaryState:
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "stepStartedAt": self.step_started_at,
                "weight": self.weight,
                "promotesSeen": self.promotes_seen,
                "intervalStartedAt": self.interval_started_at,
                "baseline": {name: counters.to_json() for name, counters in self.baseline.items()},
                "passedIntervals": self.passed_intervals,
                "failedIntervals": self.failed_intervals,
                "inconclusiveIntervals": self.inconclusive_intervals,
                "lastAnalysis": self.last_analysis.to_json() if self.last_analysis else None,
                "heldSince": self.held_since,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> CanaryState:
        data = json.loads(text)
        last = data.get("lastAnalysis")
        return cls(
            step=data["step"],
            step_started_at=data["stepStartedAt"],
            weight=data["weight"],
            promotes_seen=data.get("promotesSeen", 0),
            interval_started_at=data.get("intervalStartedAt"),
            baseline={name: BackendCounters.from_json(c) for name, c in data.get("baseline", {}).items()},
            passed_intervals=data.get("passedIntervals", 0),
            failed_intervals=data.get("failedIntervals", 0),
            inconclusive_intervals=data.get("inconclusiveIntervals", 0),
            last_analysis=AnalysisFigures.from_json(last) if last else None,
            held_since=data.get("heldSince"),
        )


@dataclass(frozen=True)
class NodePlacement:
    """One node of a cluster, on a pool's host or on this machine (`localhost`): where it goes
    (written before it starts), the `ray start` process once it runs (its pid is also its
    session id on that host), and whether a deletion stopped it for sure (it takes no room on
    its host any more)."""

    host: str
    address: str
    role: str  # "head" | "worker"
    ports: NodePorts
    temp_dir: str
    pid: int | None = None
    session_id: int | None = None
    stopped: bool = False  # absent from rows written before it: False
    restarts: int = 0  # times it was started again after its process exited
    # The worker group it belongs to (None: the head, or a row written before groups were kept)
    # and its id for Ray's autoscaler (the NODE_ID_AS_RESOURCE it starts with; the head's is 0).
    group: str | None = None
    node_id: int | None = None
    # A local node's log file in the cluster's log dir, also its process tag: named once, when it
    # is placed, so that a node never changes name under its processes (None: a row written
    # before names were kept, named by its place).
    log: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "ports": self.ports.__dict__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodePlacement:
        return cls(**{**data, "ports": NodePorts(**data["ports"])})


@dataclass(frozen=True)
class ClusterRecord:
    """One Ray cluster as servekeeper stored it. Written before anything is started."""

    name: str
    service: str
    generation: int  # the service generation this cluster was created for
    cluster_spec_hash: str
    cluster_spec_json: str
    role: ClusterRole
    ports: ClusterPorts
    temp_dir: str
    log_dir: str
    created_at: float
    head_pid: int | None = None  # also the process session id of every process of the head
    worker_pids: tuple[int, ...] = ()
    submitted_config_hash: str | None = None  # intent: written before the PUT
    # What Ray was last SEEN running (its deployed_app_config matched this config), never
    # merely what was sent: a PUT that failed or never happened leaves it unchanged.
    applied_config_hash: str | None = None
    config_submitted_at: float | None = None  # when Ray acknowledged the last PUT (None: not acknowledged)
    good_config_hash: str | None = None  # the last config seen with every judged app RUNNING
    ready_at: float | None = None
    drain_started_at: float | None = None
    failure_reason: str | None = None
    package_hash: str | None = None
    canary: CanaryState | None = None  # set once traffic started moving to this pending cluster
    # Operator commands, written by the API only (counters and flags: one given while a tick
    # runs is seen by the next tick, never overwritten).
    promote_requests: int = 0
    promote_full: bool = False
    abort_requested: bool = False
    # Serve's target_capacity servekeeper wants on this cluster (None: not managed, Ray's 100);
    # set when a canary's capacity follows its traffic.
    target_capacity: float | None = None
    pool: str | None = None  # the HostPool it runs on (None: this machine)
    # Head first, then the workers (empty in records of local clusters stored before they had them)
    nodes: tuple[NodePlacement, ...] = ()
    takeover_started_at: float | None = None  # a warm standby began scaling up to replace a dead active
    # Nodes a head move left on a silent host (they may still run there): stopped once it answers
    left_behind: tuple[NodePlacement, ...] = ()

    def with_changes(self, **changes: Any) -> ClusterRecord:
        return replace(self, **changes)

    @property
    def session_ids(self) -> tuple[int, ...]:
        head = (self.head_pid,) if self.head_pid is not None else ()
        return head + self.worker_pids

    @property
    def head_address(self) -> str:
        return self.nodes[0].address if self.nodes else "127.0.0.1"

    @property
    def gcs_address(self) -> str:
        return f"{self.head_address}:{self.ports.gcs}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head_address}:{self.ports.dashboard}"

    @property
    def serve_url(self) -> str:
        return f"http://{self.head_address}:{self.ports.serve_http}"


@dataclass(frozen=True)
class Condition:
    type: ConditionType
    status: bool
    reason: str
    message: str
    last_transition_time: float

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type.value,
            "status": "True" if self.status else "False",
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Condition:
        return cls(
            type=ConditionType(data["type"]),
            status=data["status"] == "True",
            reason=data["reason"],
            message=data["message"],
            last_transition_time=data["lastTransitionTime"],
        )


@dataclass(frozen=True)
class ServiceRecord:
    name: str
    spec_json: str
    generation: int
    observed_generation: int = 0
    deleting: bool = False
    unhealthy_since: float | None = None
    failed_generation: int | None = None  # rollout of this generation failed; not retried
    failure_reason: str | None = None
    conditions: tuple[Condition, ...] = ()
    created_at: float = 0.0
    package_hash: str | None = None
    # Standby builds started since the last standby was ready, and when the next may start (a
    # standby that cannot start, or dies, is built again after 5 s, 10 s, ... up to 300 s).
    standby_failures: int = 0
    standby_retry_at: float | None = None

    def with_changes(self, **changes: Any) -> ServiceRecord:
        return replace(self, **changes)

    def condition(self, condition_type: ConditionType) -> Condition | None:
        for condition in self.conditions:
            if condition.type == condition_type:
                return condition
        return None

    def conditions_json(self) -> str:
        return json.dumps([c.to_json() for c in self.conditions])


@dataclass(frozen=True)
class Event:
    service: str
    time: float
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class Revision:
    """One generation of a service as it was applied, and how its rollout ended."""

    service: str
    revision: int  # the generation
    spec_json: str
    spec_hash: str
    package_hash: str | None
    created_at: float
    cause: str  # "apply", "undo to revision 3", ...
    outcome: str  # Progressing | Succeeded | Failed | Aborted | Superseded
    ended_at: float | None = None
    ended_by: str | None = None
    message: str | None = None
