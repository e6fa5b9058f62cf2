"""The blocking client of the servekeeper daemon; the CLI is built on it.

    from servekeeper import Client

    with Client() as client:                      # finds the daemon from the state dir
        client.apply("examples/hello/service.yaml")
        view = client.wait("hello", timeout=300)  # raises RolloutFailed / WaitTimeout
        print(view["activeCluster"]["name"])

It speaks HTTP (httpx) to the daemon's API with its bearer token, and returns the API's JSON as
the wire types of `model/wire.py`. Importing it starts no Ray, no event loop, no server.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from servekeeper.client.common import (
    DEFAULT_TIMEOUT_S,
    HOST_CHECK_TIMEOUT_S,
    WAIT_POLL_S,
    Endpoint,
    EventViews,
    HostPoolViews,
    RevisionViews,
    ServiceViews,
    SpecSource,
    apply_request,
    decoded_answer,
    events_params,
    wait_verdict,
)
from servekeeper.client.errors import DaemonNotRunning, WaitTimeout
from servekeeper.model.wire import (
    AbortResult,
    ApplyResult,
    DeleteResult,
    ExportView,
    HistoryView,
    HostPoolView,
    LoginCodeView,
    OkView,
    PoolCheckView,
    PromoteResult,
    ServiceView,
    UndoResult,
)


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
        self._endpoint = Endpoint(state_dir, url, token)
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
        return decoded_answer(response)

    def healthz(self) -> bool:
        answer: OkView = self._call("GET", "/healthz")
        return bool(answer.get("ok"))

    def apply(self, spec: SpecSource) -> ApplyResult:
        """Create or update a service from a spec file path, a mapping, or a `ServiceSpec`
        (or a host pool: `kind: HostPool`)."""
        path, body = apply_request(spec)
        result: ApplyResult = self._call("POST", path, json=body)
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
        answer: ExportView = self._call("GET", f"/api/v1/services/{name}/export", params={"format": format})
        return str(answer["manifest"])

    def events(self, name: str | None = None, limit: int = 50) -> EventViews:
        """The latest `limit` events (oldest first), of one service or of all."""
        events: EventViews = self._call("GET", "/api/v1/events", params=events_params(name, limit))
        return events

    def wait(self, name: str, timeout: float = 900, poll_interval: float = WAIT_POLL_S) -> ServiceView:
        """Until the latest generation is rolled out and Ready; returns its view. Raises
        RolloutFailed if it will not roll out, WaitTimeout after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            view = self.get(name)
            if wait_verdict(view):
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
        answer: LoginCodeView = self._call("POST", "/api/v1/dashboard/login-codes")
        return f"{base}{answer['path']}"

    def host_pools(self, name: str | None = None) -> HostPoolViews:
        """Every stored host pool (or the one named), with its hosts."""
        if name is not None:
            pool: HostPoolView = self._call("GET", f"/api/v1/hostpools/{name}")
            return [pool]
        pools: HostPoolViews = self._call("GET", "/api/v1/hostpools")
        return list(pools)

    def check_hosts(self, pool: str) -> PoolCheckView:
        """The daemon connects to every host of `pool` (host keys checked) and compares each
        one's Python and Ray with its own: `ok`, and per host `state` and `problem`."""
        answer: PoolCheckView = self._call("POST", f"/api/v1/hostpools/{pool}/check", timeout=HOST_CHECK_TIMEOUT_S)
        return answer

    def delete_host_pool(self, name: str) -> None:
        self._call("DELETE", f"/api/v1/hostpools/{name}")
