"""The async client of the servekeeper daemon: `Client`'s methods as coroutines.

async with AsyncClient() as client:
    await client.apply("examples/hello/service.yaml")
    view = await client.wait("hello", timeout=300)
"""

from __future__ import annotations

import asyncio
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
    OkView,
    PoolCheckView,
    PromoteResult,
    ServiceView,
    UndoResult,
)


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
        self._endpoint = Endpoint(state_dir, url, token)
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
        return decoded_answer(response)

    async def healthz(self) -> bool:
        answer: OkView = await self._call("GET", "/healthz")
        return bool(answer.get("ok"))

    async def apply(self, spec: SpecSource) -> ApplyResult:
        path, body = apply_request(spec)
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
        answer: ExportView = await self._call("GET", f"/api/v1/services/{name}/export", params={"format": format})
        return str(answer["manifest"])

    async def events(self, name: str | None = None, limit: int = 50) -> EventViews:
        events: EventViews = await self._call("GET", "/api/v1/events", params=events_params(name, limit))
        return events

    async def wait(self, name: str, timeout: float = 900, poll_interval: float = WAIT_POLL_S) -> ServiceView:
        deadline = time.monotonic() + timeout
        while True:
            view = await self.get(name)
            if wait_verdict(view):
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
            pool: HostPoolView = await self._call("GET", f"/api/v1/hostpools/{name}")
            return [pool]
        pools: HostPoolViews = await self._call("GET", "/api/v1/hostpools")
        return list(pools)

    async def check_hosts(self, pool: str) -> PoolCheckView:
        path = f"/api/v1/hostpools/{pool}/check"
        answer: PoolCheckView = await self._call("POST", path, timeout=HOST_CHECK_TIMEOUT_S)
        return answer

    async def delete_host_pool(self, name: str) -> None:
        await self._call("DELETE", f"/api/v1/hostpools/{name}")
