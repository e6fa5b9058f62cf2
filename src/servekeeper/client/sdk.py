"""The Python client of the servekeeper daemon; the CLI is built on it.

    from servekeeper import Client

    with Client() as client:                      # finds the daemon from the state dir
        client.apply("examples/hello/service.yaml")
        view = client.wait("hello", timeout=300)  # raises RolloutFailed / WaitTimeout
        print(view["activeCluster"]["name"])

`AsyncClient` has the same methods as coroutines. Both speak HTTP (httpx) to the daemon's API
with its bearer token. Without `url` and `token` they read the state dir (`--state-dir`,
`SERVEKEEPER_STATE_DIR`, or `~/.servekeeper`) on every call: `api.json` (where the running daemon
listens) and `token`, so a client made before `servekeeper up`, or one that outlives a restart
of the daemon on another port, finds it.

This module stands alone (HTTP, the spec models, nothing of the daemon): importing it starts no
Ray, no event loop, no server.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypedDict

import httpx
import yaml
from typing_extensions import NotRequired

from servekeeper.kuberay.translate import is_kuberay
from servekeeper.model.hostpool import is_host_pool, parse_host_pool, read_single_document
from servekeeper.model.spec import MAX_SPEC_BYTES, ServiceSpec, SpecError, load_spec_file

DEFAULT_TIMEOUT_S = 30.0
WAIT_POLL_S = 0.5

# -- what the API answers ------------------------------------------------------------------------


class ConditionView(TypedDict):
    type: str  # Ready | UpgradeInProgress | RolloutFailed | ClusterSpecOutdated
    status: Literal["True", "False"]
    reason: str
    message: str
    lastTransitionTime: float | None


class AppView(TypedDict):
    status: str
    source: str
    message: str


class ClusterView(TypedDict, total=False):
    name: str
    generation: int
    role: str  # pending | active | draining | deleting
    address: str
    dashboardUrl: str
    serveUrl: str
    trafficPercent: int
    headPid: int | None
    workerPids: list[int]
    appliedConfigHash: str | None
    goodConfigHash: str | None
    packageHash: str | None
    createdAt: float
    headAlive: bool | None
    applications: dict[str, AppView]
    probes: list[dict[str, Any]]
    canary: CanaryView  # only on a pending cluster rolled out with `upgradeStrategy.type: Canary`


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


class CanaryView(TypedDict, total=False):
    weight: int  # the canary's share of traffic (percent) in force
    step: int  # index of the current step (0-based); == steps once every step is done
    steps: int
    stepDescription: str  # "step 2/4: pause 30s"
    pauseRemainingSeconds: float | None  # None: not in a timed pause
    stepStartedAt: float
    passedIntervals: int
    failedIntervals: int
    inconclusiveIntervals: int
    lastAnalysis: AnalysisView | None


class IngressView(TypedDict):
    url: str
    port: int
    routedTo: str | None


class ServiceView(TypedDict, total=False):
    name: str
    generation: int
    observedGeneration: int
    deleting: bool
    conditions: list[ConditionView]
    ingress: IngressView
    activeCluster: ClusterView | None
    pendingCluster: ClusterView | None
    otherClusters: list[ClusterView]
    failureReason: str | None
    importedFrom: str | None  # "ray.io/v1 RayService" for a KubeRay manifest, else None
    importNotes: list[dict[str, str]]  # kind, path, message: what of that manifest does not apply here


class EventView(TypedDict):
    service: str
    time: float
    type: str  # Normal | Warning
    reason: str
    message: str


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


# Aliases: inside the client classes `list` names a method.
ServiceViews = list[ServiceView]
EventViews = list[EventView]
RevisionViews = list[RevisionView]
SpecSource = str | os.PathLike[str] | Mapping[str, Any] | ServiceSpec


def condition(view: ServiceView, condition_type: str) -> ConditionView | None:
    for found in view.get("conditions", []):
        if found["type"] == condition_type:
            return found
    return None


def is_true(view: ServiceView, condition_type: str) -> bool:
    found = condition(view, condition_type)
    return found is not None and found["status"] == "True"


# -- errors ----------------------------------------------------------------------------------------


class ServekeeperError(Exception):
    """Every error this client raises."""


class DaemonNotRunning(ServekeeperError):
    """No daemon answers for the state dir (or at the given URL)."""

    def __init__(self, where: str, cause: str = "") -> None:
        self.where = where
        self.cause = cause
        super().__init__(f"servekeeper is not running for {where}; start it with: servekeeper up --detach")


class ApiError(ServekeeperError):
    """The daemon refused a call. `status` is the HTTP status, `detail` its decoded answer."""

    def __init__(self, status: int, detail: Any, text: str, message: str | None = None) -> None:
        self.status = status
        self.detail = detail
        self.text = text
        super().__init__(message or f"API error {status}: {text}")


class Unauthorized(ApiError):
    """Missing or wrong bearer token (the `token` file of the state dir)."""


class ServiceNotFound(ApiError):
    """No service of that name (the message is the daemon's: "service 'x' not found")."""


class RevisionNotFound(ApiError):
    """`undo --to-revision N` named a revision the history does not keep."""


class Conflict(ApiError):
    """The call does not fit the service's state (409): promote or abort with no rollout in
    progress, undo with nothing to undo to, to the current revision, or to a deleted package."""


class SpecInvalid(ServekeeperError):
    """The spec was refused; `problems` lists each as "field.path: message". `source` is the file
    it came from, when it was rejected before reaching the daemon."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" {source}" if source else ""
        super().__init__(f"invalid service spec{where}:\n" + "\n".join(f"  - {p}" for p in problems))


class WaitTimeout(ServekeeperError):
    def __init__(self, view: ServiceView) -> None:
        self.view = view
        ready = condition(view, "Ready")
        status, reason, message = (ready["status"], ready["reason"], ready["message"]) if ready else (None, None, None)
        super().__init__(f"timed out waiting for service/{view.get('name')}: Ready={status} ({reason}: {message})")


class RolloutFailed(ServekeeperError):
    """The latest generation will not roll out: it failed (`RolloutFailed`), or its cluster change
    is not rolled out by design (`ClusterSpecOutdated`, `upgradeStrategy: None`)."""

    def __init__(self, view: ServiceView, failed: ConditionView) -> None:
        self.view = view
        self.generation = view.get("generation")
        self.reason = failed["reason"]
        self.message = failed["message"]
        super().__init__(
            f"service/{view.get('name')} generation {self.generation} not rolled out: {self.reason}: {self.message}"
        )


# -- the parts both clients share --------------------------------------------------------------


def default_state_dir() -> Path:
    configured = os.environ.get("SERVEKEEPER_STATE_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".servekeeper"


def read_api_info(state_dir: Path) -> dict[str, Any] | None:
    """What the running daemon wrote in `api.json` (`url`, `pid`), or None."""
    try:
        return dict(json.loads((state_dir / "api.json").read_text()))
    except (OSError, ValueError):
        return None


class _Endpoint:
    """Where the daemon is and how to authenticate: given, or read from the state dir."""

    def __init__(self, state_dir: str | os.PathLike[str] | None, url: str | None, token: str | None) -> None:
        if (url is None) != (token is None):
            raise ValueError("give both url and token, or neither (then they are read from the state dir)")
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().resolve()
        self._url = url.rstrip("/") if url else None
        self._token = token

    @property
    def where(self) -> str:
        return self._url or str(self.state_dir)

    def resolve(self) -> tuple[str, dict[str, str]]:
        if self._url is not None and self._token is not None:
            return self._url, {"Authorization": f"Bearer {self._token}"}
        info = read_api_info(self.state_dir)
        try:
            token = (self.state_dir / "token").read_text().strip()
        except OSError:
            token = None
        if info is None or token is None or "url" not in info:
            raise DaemonNotRunning(self.where)
        return str(info["url"]), {"Authorization": f"Bearer {token}"}

    def daemon_pid(self) -> int | None:
        info = read_api_info(self.state_dir) if self._url is None else None
        return int(info["pid"]) if info and "pid" in info else None


def _answer(response: httpx.Response) -> Any:
    """The decoded answer, or the matching error."""
    if response.status_code < 400:
        return response.json()
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    if response.status_code == 401:
        raise Unauthorized(401, detail, response.text)
    if response.status_code == 404:
        if isinstance(detail, str) and detail.startswith("revision "):
            raise RevisionNotFound(404, detail, response.text, message=detail)
        raise ServiceNotFound(404, detail, response.text, message=str(detail))
    if response.status_code == 409:
        raise Conflict(409, detail, response.text, message=str(detail))
    if response.status_code == 422:
        problems = detail.get("problems") if isinstance(detail, dict) else None
        if not isinstance(problems, list):
            problems = [json.dumps(detail)]
        raise SpecInvalid([str(p) for p in problems])
    raise ApiError(response.status_code, detail, response.text)


def _apply_body(spec: SpecSource) -> dict[str, Any]:
    """What `apply` POSTs. A KubeRay manifest file goes as it is, every document of it, with its
    folder: the daemon translates it (and keeps the notes), so the CLI and this client agree."""
    if not isinstance(spec, (ServiceSpec, Mapping)):
        path = Path(spec)
        documents = _kuberay_documents(path)
        if documents is not None:
            return {"documents": documents, "baseDir": str(path.parent.resolve())}
    return {"spec": _spec_document(spec)}


def _kuberay_documents(path: Path) -> list[Any] | None:
    try:
        text = path.read_text()
    except OSError:
        return None  # load_spec_file reports it
    if len(text.encode()) > MAX_SPEC_BYTES:
        return None
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return None
    return documents if is_kuberay(documents) else None


def _spec_document(spec: SpecSource) -> dict[str, Any]:
    """A file is read and checked here (a relative workingDir is resolved against its folder),
    so a bad file is refused before the daemon is even looked for; a mapping is sent as it is
    (its workingDir should be absolute) and checked by the daemon."""
    if isinstance(spec, ServiceSpec):
        return spec.model_dump(mode="json")
    if isinstance(spec, Mapping):
        return dict(spec)
    path = Path(spec)
    try:
        return load_spec_file(path).model_dump(mode="json")
    except SpecError as exc:
        raise SpecInvalid(exc.problems, source=str(path)) from exc


def _host_pool_document(spec: SpecSource) -> dict[str, Any] | None:
    """A HostPool (a file or a mapping whose kind says so) as `apply` posts it, else None. A file
    is checked here, like a service spec, so a bad one never reaches the daemon."""
    if isinstance(spec, ServiceSpec):
        return None
    if isinstance(spec, Mapping):
        return dict(spec) if is_host_pool(dict(spec)) else None
    path = Path(spec)
    try:
        document = read_single_document(path)
    except SpecError:
        return None  # reported as the service spec it then is taken for
    if not is_host_pool(document):
        return None
    try:
        return parse_host_pool(document).model_dump(mode="json")
    except SpecError as exc:
        raise SpecInvalid(exc.problems, source=str(path)) from exc


HOST_CHECK_TIMEOUT_S = 120.0  # every host at once, each with its connect timeout and a retry
HostPoolViews = list[dict[str, Any]]  # an alias: inside the client classes `list` names a method


def _wait_verdict(view: ServiceView) -> bool:
    """True once the latest generation is rolled out and Ready; raises if it will not be."""
    current = view.get("observedGeneration") == view.get("generation")
    if current:
        for failed_type in ("RolloutFailed", "ClusterSpecOutdated"):
            failed = condition(view, failed_type)
            if failed is not None and failed["status"] == "True":
                raise RolloutFailed(view, failed)
    return current and is_true(view, "Ready") and not is_true(view, "UpgradeInProgress")


def _events_params(name: str | None, limit: int) -> dict[str, Any]:
    return {"limit": limit, **({"service": name} if name else {})}


# -- the clients ---------------------------------------------------------------------------------


class Client:
    """Blocking client. Thread-safe as httpx.Client is; close it (or use `with`)."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._endpoint = _Endpoint(state_dir, url, token)
        self._http = httpx.Client(timeout=timeout, transport=transport, trust_env=False)

    @property
    def state_dir(self) -> Path:
        return self._endpoint.state_dir

    @property
    def daemon_pid(self) -> int | None:
        """The pid in `api.json` (None with an explicit url, or when no daemon runs)."""
        return self._endpoint.daemon_pid()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        base, headers = self._endpoint.resolve()
        try:
            response = self._http.request(method, base + path, headers=headers, **kwargs)
        except httpx.TransportError as exc:
            raise DaemonNotRunning(self._endpoint.where, repr(exc)) from exc
        return _answer(response)

    def healthz(self) -> bool:
        return bool(self._call("GET", "/healthz").get("ok"))

    def apply(self, spec: SpecSource) -> ApplyResult:
        """Create or update a service from a spec file path, a mapping, or a `ServiceSpec`
        (or a host pool: `kind: HostPool`)."""
        pool = _host_pool_document(spec)
        path = "/api/v1/services" if pool is None else "/api/v1/hostpools"
        result: ApplyResult = self._call("POST", path, json=_apply_body(spec) if pool is None else {"spec": pool})
        return result

    def get(self, name: str) -> ServiceView:
        view: ServiceView = self._call("GET", f"/api/v1/services/{name}")
        return view

    def list(self) -> ServiceViews:
        views: ServiceViews = self._call("GET", "/api/v1/services")
        return views

    def delete(self, name: str) -> DeleteResult:
        result: DeleteResult = self._call("DELETE", f"/api/v1/services/{name}")
        return result

    def export(self, name: str, format: str = "kuberay") -> str:
        """The service as a KubeRay `RayService` manifest (YAML text, with a comment block)."""
        return str(self._call("GET", f"/api/v1/services/{name}/export", params={"format": format})["manifest"])

    def events(self, name: str | None = None, limit: int = 50) -> EventViews:
        """The latest `limit` events (oldest first), of one service or of all."""
        events: EventViews = self._call("GET", "/api/v1/events", params=_events_params(name, limit))
        return events

    def wait(self, name: str, timeout: float = 900, poll_interval: float = WAIT_POLL_S) -> ServiceView:
        """Until the latest generation is rolled out and Ready; returns its view. Raises
        RolloutFailed if it will not roll out, WaitTimeout after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            view = self.get(name)
            if _wait_verdict(view):
                return view
            if time.monotonic() >= deadline:
                raise WaitTimeout(view)
            time.sleep(poll_interval)

    def shutdown(self, stop_clusters: bool = True) -> None:
        """Ask the daemon to exit (`servekeeper down`); with `stop_clusters`, every cluster stops too."""
        self._call("POST", "/api/v1/shutdown", json={"stopClusters": stop_clusters})

    def promote(self, name: str, full: bool = False) -> PromoteResult:
        """Let the canary go on past its current pause (`full`: skip every remaining step and
        analysis, all traffic at once). Conflict when no rollout is in progress."""
        result: PromoteResult = self._call("POST", f"/api/v1/services/{name}/promote", json={"full": full})
        return result

    def abort(self, name: str) -> AbortResult:
        """Stop the rollout in progress: the new cluster loses its traffic at once and is removed."""
        result: AbortResult = self._call("POST", f"/api/v1/services/{name}/abort")
        return result

    def undo(self, name: str, to_revision: int | None = None) -> UndoResult:
        """Roll out an earlier revision's spec and code as a new generation (default: the last
        one that rolled out before the current one)."""
        body = {"toRevision": to_revision}
        result: UndoResult = self._call("POST", f"/api/v1/services/{name}/undo", json=body)
        return result

    def history(self, name: str) -> RevisionViews:
        """The service's revisions, oldest first (at most `spec.revisionHistoryLimit`)."""
        answer: HistoryView = self._call("GET", f"/api/v1/services/{name}/history")
        return answer["revisions"]

    def dashboard_login_url(self) -> str:
        """A URL that logs a browser in to the web dashboard: a one-time code, valid about a
        minute, that the daemon exchanges for a session cookie (`servekeeper dashboard`)."""
        base, _ = self._endpoint.resolve()
        answer = self._call("POST", "/api/v1/dashboard/login-codes")
        return f"{base}{answer['path']}"

    def host_pools(self, name: str | None = None) -> HostPoolViews:
        """Every stored host pool (or the one named), with its hosts."""
        if name is not None:
            return [self._call("GET", f"/api/v1/hostpools/{name}")]
        return list(self._call("GET", "/api/v1/hostpools"))

    def check_hosts(self, pool: str) -> dict[str, Any]:
        """The daemon connects to every host of `pool` (host keys checked) and compares each
        one's Python and Ray with its own: `ok`, and per host `state` and `problem`."""
        return dict(self._call("POST", f"/api/v1/hostpools/{pool}/check", timeout=HOST_CHECK_TIMEOUT_S))

    def delete_host_pool(self, name: str) -> None:
        self._call("DELETE", f"/api/v1/hostpools/{name}")


class AsyncClient:
    """The same as `Client`, with coroutines (`async with AsyncClient() as client: ...`)."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._endpoint = _Endpoint(state_dir, url, token)
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False)

    @property
    def state_dir(self) -> Path:
        return self._endpoint.state_dir

    @property
    def daemon_pid(self) -> int | None:
        return self._endpoint.daemon_pid()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        base, headers = self._endpoint.resolve()
        try:
            response = await self._http.request(method, base + path, headers=headers, **kwargs)
        except httpx.TransportError as exc:
            raise DaemonNotRunning(self._endpoint.where, repr(exc)) from exc
        return _answer(response)

    async def healthz(self) -> bool:
        return bool((await self._call("GET", "/healthz")).get("ok"))

    async def apply(self, spec: SpecSource) -> ApplyResult:
        pool = _host_pool_document(spec)
        path = "/api/v1/services" if pool is None else "/api/v1/hostpools"
        body = _apply_body(spec) if pool is None else {"spec": pool}
        result: ApplyResult = await self._call("POST", path, json=body)
        return result

    async def get(self, name: str) -> ServiceView:
        view: ServiceView = await self._call("GET", f"/api/v1/services/{name}")
        return view

    async def list(self) -> ServiceViews:
        views: ServiceViews = await self._call("GET", "/api/v1/services")
        return views

    async def delete(self, name: str) -> DeleteResult:
        result: DeleteResult = await self._call("DELETE", f"/api/v1/services/{name}")
        return result

    async def export(self, name: str, format: str = "kuberay") -> str:
        answer = await self._call("GET", f"/api/v1/services/{name}/export", params={"format": format})
        return str(answer["manifest"])

    async def events(self, name: str | None = None, limit: int = 50) -> EventViews:
        events: EventViews = await self._call("GET", "/api/v1/events", params=_events_params(name, limit))
        return events

    async def wait(self, name: str, timeout: float = 900, poll_interval: float = WAIT_POLL_S) -> ServiceView:
        deadline = time.monotonic() + timeout
        while True:
            view = await self.get(name)
            if _wait_verdict(view):
                return view
            if time.monotonic() >= deadline:
                raise WaitTimeout(view)
            await asyncio.sleep(poll_interval)

    async def shutdown(self, stop_clusters: bool = True) -> None:
        await self._call("POST", "/api/v1/shutdown", json={"stopClusters": stop_clusters})

    async def promote(self, name: str, full: bool = False) -> PromoteResult:
        result: PromoteResult = await self._call("POST", f"/api/v1/services/{name}/promote", json={"full": full})
        return result

    async def abort(self, name: str) -> AbortResult:
        result: AbortResult = await self._call("POST", f"/api/v1/services/{name}/abort")
        return result

    async def undo(self, name: str, to_revision: int | None = None) -> UndoResult:
        result: UndoResult = await self._call("POST", f"/api/v1/services/{name}/undo", json={"toRevision": to_revision})
        return result

    async def history(self, name: str) -> RevisionViews:
        answer: HistoryView = await self._call("GET", f"/api/v1/services/{name}/history")
        return answer["revisions"]

    async def host_pools(self, name: str | None = None) -> HostPoolViews:
        if name is not None:
            return [await self._call("GET", f"/api/v1/hostpools/{name}")]
        return list(await self._call("GET", "/api/v1/hostpools"))

    async def check_hosts(self, pool: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/api/v1/hostpools/{pool}/check", timeout=HOST_CHECK_TIMEOUT_S))

    async def delete_host_pool(self, name: str) -> None:
        await self._call("DELETE", f"/api/v1/hostpools/{name}")


__all__ = [
    "AbortResult",
    "AnalysisView",
    "ApiError",
    "ApplyResult",
    "AsyncClient",
    "CanaryView",
    "Client",
    "ClusterView",
    "ConditionView",
    "Conflict",
    "DaemonNotRunning",
    "DeleteResult",
    "EventView",
    "HistoryView",
    "PromoteResult",
    "RevisionNotFound",
    "RevisionView",
    "RolloutFailed",
    "ServekeeperError",
    "ServiceNotFound",
    "ServiceView",
    "SpecInvalid",
    "Unauthorized",
    "UndoResult",
    "WaitTimeout",
    "condition",
    "is_true",
]
