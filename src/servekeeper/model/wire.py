"""The JSON shapes of the daemon's API, declared once.

`views/` builds them from records (mypy checks the producer side), the API serves them, and
`client/` returns them to its callers (mypy checks the consumer side). A key that is always
present is required; `NotRequired` marks the few that a view leaves out in some cases.
Changing a shape here is changing the API: `tests/unit/test_wire.py` holds both sides to it.
"""

# No `from __future__ import annotations` here: `NotRequired` in a string annotation is not seen
# at run time, and tests/unit/test_wire.py reads `__required_keys__`.
from typing import Literal

from typing_extensions import NotRequired, TypedDict

# -- a service, as `get` and `list` show it ------------------------------------------------------


class ConditionView(TypedDict):
    type: str  # Ready | UpgradeInProgress | RolloutFailed | ClusterSpecOutdated
    status: Literal["True", "False"]
    reason: str
    message: str
    lastTransitionTime: float


class AppView(TypedDict):
    status: str  # NOT_STARTED | DEPLOYING | DEPLOY_FAILED | RUNNING | UNHEALTHY | DELETING
    source: str  # declarative | imperative | unknown
    message: str


class ProbeView(TypedDict):
    """The latest results of one readiness probe against one cluster."""

    path: str
    passing: bool  # at least successThreshold consecutive passes
    consecutiveSuccesses: int
    successThreshold: int
    lastOk: bool | None  # None: not run yet
    lastMessage: str
    lastTime: float | None


class AnalysisView(TypedDict):
    """One analysis interval: the canary's figures, and the stable cluster's beside them."""

    started_at: float
    ended_at: float
    requests: int
    success_rate: float | None  # None: no requests
    p99_ms: float | None
    stable_requests: int
    stable_success_rate: float | None
    stable_p99_ms: float | None
    verdict: str  # passed | failed | inconclusive
    message: str


class CanaryView(TypedDict):
    weight: int  # the canary's share of traffic (percent) in force
    step: int  # index of the current step (0-based); == steps once every step is done
    stepStartedAt: float
    passedIntervals: int
    failedIntervals: int
    inconclusiveIntervals: int
    lastAnalysis: AnalysisView | None
    # The next three only when the stored spec still reads as a canary strategy.
    steps: NotRequired[int]
    stepDescription: NotRequired[str]  # "step 2/4: pause 30s"
    pauseRemainingSeconds: NotRequired[float | None]  # None: not in a timed pause
    headerRoute: NotRequired[str | None]  # "x-canary: always": its requests go to the canary, whatever the weight
    mirror: NotRequired[str | None]  # "100% of GET, HEAD copied" during a shadow step


class WorkerGroupView(TypedDict):
    """A worker group's nodes (issue 22): running, recorded (asked for, running or starting),
    and Ray's autoscaler's bounds (min = max = the fixed count without autoscaling)."""

    name: str
    nodes: int
    desired: int
    minNodes: int
    maxNodes: int
    autoscaled: bool


class ClusterView(TypedDict):
    name: str
    generation: int
    role: str  # pending | active | standby | draining | deleting
    address: str
    dashboardUrl: str
    hostPool: str | None  # None: on the controller's machine
    headHost: str | None
    # Its own environment (issue 21); None and []: the controller's Ray and Python
    rayVersion: str | None
    pythonVersion: str | None
    pip: list[str]
    serveUrl: str
    trafficPercent: int
    headPid: int | None
    workerPids: list[int]
    workersExpected: int | None  # None: a record stored by an older version
    workerGroups: list[WorkerGroupView]  # []: a record stored by an older version
    appliedConfigHash: str | None
    goodConfigHash: str | None
    packageHash: str | None
    createdAt: float
    submittedConfigHash: str | None
    configSubmittedAt: float | None
    readyAt: float | None
    drainStartedAt: float | None
    failureReason: str | None
    headAlive: bool | None  # None: not observed yet
    dashboardOk: bool | None
    deployedConfigHash: str | None
    inflightRequests: int | None  # at the ingress; None: not routed there, or not read
    applications: dict[str, AppView]
    probes: list[ProbeView]
    canary: NotRequired[CanaryView]  # only on a pending cluster rolled out with `upgradeStrategy.type: Canary`


class IngressView(TypedDict):
    url: str
    port: int
    routedTo: str | None


class ImportNoteView(TypedDict):
    """What of an imported KubeRay manifest does not apply here."""

    kind: str
    path: str
    message: str


class ServiceView(TypedDict):
    name: str
    generation: int
    observedGeneration: int
    deleting: bool
    conditions: list[ConditionView]
    ingress: IngressView
    activeCluster: ClusterView | None
    pendingCluster: ClusterView | None
    standbyCluster: ClusterView | None
    standby: str  # ready | building | none (spec.standby: a hot standby the ingress fails over to)
    otherClusters: list[ClusterView]
    failureReason: str | None
    declaredApplications: list[str]
    # Set by the API from what it stored at apply (the view of records alone has no import).
    importedFrom: NotRequired[str | None]  # "ray.io/v1 RayService" for a KubeRay manifest, else None
    importNotes: NotRequired[list[ImportNoteView]]


class EventView(TypedDict):
    service: str
    time: float
    type: str  # Normal | Warning
    reason: str
    message: str


class ExportView(TypedDict):
    format: str  # kuberay
    manifest: str  # YAML text, with a comment block


# -- what the commands answer -----------------------------------------------------------------


class ApplyResult(TypedDict):
    name: str
    generation: int
    changed: bool  # False: the same spec (and code) was already stored
    kind: NotRequired[str]  # "HostPool" for a host pool (then generation is 0); absent for a service


class DeleteResult(TypedDict):
    name: str
    deleting: bool


class PromoteResult(TypedDict):
    name: str
    cluster: str  # the canary (pending) cluster
    full: bool
    promoteRequests: int  # `promote`s counted on that cluster so far


class AbortResult(TypedDict):
    name: str
    cluster: str
    aborting: bool


class UndoResult(TypedDict):
    name: str
    generation: int  # the new generation that rolls the earlier revision out
    changed: bool
    toRevision: int


class RevisionView(TypedDict):
    revision: int  # the generation it was applied as
    current: bool
    createdAt: float
    specHash: str
    packageHash: str | None
    cause: str  # "apply", "undo to revision 3", ...
    outcome: str  # Progressing | Succeeded | Failed | Aborted | Superseded
    endedAt: float | None
    endedBy: str | None
    message: str | None


class HistoryView(TypedDict):
    name: str
    revisions: list[RevisionView]  # oldest first


class OkView(TypedDict):
    ok: bool  # `/healthz`, `shutdown`


class LoginCodeView(TypedDict):
    path: str  # "/ui/<secret path key>/login?code=..."
    expiresInSeconds: float


# -- host pools ----------------------------------------------------------------------------------


class HostUseView(TypedDict):
    """What one node of a cluster takes of a host."""

    cluster: str
    service: str
    role: str  # head | worker
    cpus: float
    gpus: float
    memoryBytes: int


class HostResourcesView(TypedDict):
    """The host's capacity, as its spec declares it."""

    cpus: float
    gpus: float
    memoryGiB: float


class HostView(TypedDict):
    name: str
    address: str
    sshUser: str
    sshPort: int
    python: str  # the interpreter's path on the host
    resources: HostResourcesView
    used: list[HostUseView]


class HostPoolView(TypedDict):
    name: str
    createdAt: float
    updatedAt: float
    hosts: list[HostView]


class HostCheckView(TypedDict):
    """One host of a pool check: the host's view, with what the connection found."""

    name: str
    address: str
    sshUser: str
    sshPort: int
    python: str | None  # the host's Python version (None: not reached)
    resources: HostResourcesView
    used: list[HostUseView]
    ray: str | None
    pythonPath: str
    interpreters: dict[str, str]  # minor version -> path: for clusters with their own pythonVersion
    state: str  # ok | mismatch | refused | unreachable | error
    reachable: bool
    ok: bool
    problem: str | None


class VersionsView(TypedDict):
    python: str
    ray: str | None  # None: Ray is not importable by the daemon's Python


class PoolCheckView(TypedDict):
    name: str
    controller: VersionsView  # what every host must match
    ok: bool
    hosts: list[HostCheckView]


class HostPoolDeleteResult(TypedDict):
    name: str
    deleted: bool


# -- reading a service view ----------------------------------------------------------------------


def condition(view: ServiceView, condition_type: str) -> ConditionView | None:
    for found in view.get("conditions", []):
        if found["type"] == condition_type:
            return found
    return None


def is_true(view: ServiceView, condition_type: str) -> bool:
    found = condition(view, condition_type)
    return found is not None and found["status"] == "True"
