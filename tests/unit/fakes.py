"""Fakes of the controller's outside world: the cluster provider, Ray's Serve API, the data plane
and the clock. Each keeps a record of the calls it got and has controls to steer it; none
starts a process or opens a socket."""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from servekeeper.core.health import parse_applications
from servekeeper.dataplane import DataPlaneError, Endpoint, RouteObservation, ServiceRoute
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.observation import AppState
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import launch_here
from servekeeper.providers.base import ClusterRecords, Liveness, RecordChanges
from servekeeper.providers.local import process_liveness, store_with_local_ports
from servekeeper.rayapi.package import Package
from servekeeper.rayapi.serve_api import RetryableServeError


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeProvider:
    """The `ClusterProvider` protocol over a dict of pretend processes, as the local provider
    (its ports allocated and its liveness judged by the local provider's own functions).

    Controls: `set_alive()`, `start_head_error`, `start_workers_error`, `move_head_error`,
    `update_autoscaler_error`, `workers_gate` (a start of workers waits for it), `stop_error`,
    `leftovers` (pids a stop leaves alive), and `before_start_head` (called with the record the
    start got, before anything starts)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (method, cluster name)
        self.alive: dict[str, bool] = {}
        self.dead: set[int] = set()
        self.start_head_error: Exception | None = None
        self.start_workers_error: BaseException | None = None
        self.workers_gate: asyncio.Event | None = None
        self.stop_error: BaseException | None = None
        self.move_head_error: Exception | None = None
        self.update_autoscaler_error: Exception | None = None
        self.leftovers: dict[str, list[int]] = {}
        self.before_start_head: Callable[[ClusterRecord], None] | None = None
        self.pruned: list[list[str]] = []  # the keys kept at each prune_environments
        self._pids = itertools.count(4000)

    def set_alive(self, cluster: str, alive: bool = True) -> None:
        self.alive[cluster] = alive

    async def create(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        return store_with_local_ports(draft, config, records)

    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        self.calls.append(("start_head", cluster.name))
        if self.before_start_head is not None:
            self.before_start_head(cluster)
        if self.start_head_error is not None:
            raise self.start_head_error
        self.alive[cluster.name] = True
        return cluster.with_changes(head_pid=next(self._pids))

    def needs_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> bool:
        return len(cluster.worker_pids) < config.worker_count()

    async def start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        self.calls.append(("start_nodes", cluster.name))
        if self.workers_gate is not None:
            await self.workers_gate.wait()
        if self.start_workers_error is not None:
            raise self.start_workers_error
        pids = list(cluster.worker_pids)
        while len(pids) < config.worker_count():
            pids.append(next(self._pids))
            record(worker_pids=tuple(pids))

    def restarted(self, cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
        return cluster.with_changes(worker_pids=tuple(pid for pid in cluster.worker_pids if pid not in pids))

    async def move_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        self.calls.append(("move_head", cluster.name))
        if self.move_head_error is not None:
            raise self.move_head_error
        return cluster.with_changes(head_pid=None, worker_pids=())

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        return process_liveness(self, cluster)

    def endpoints(self, cluster: ClusterRecord, grpc: bool) -> tuple[Endpoint, ...]:
        return (Endpoint("127.0.0.1", cluster.ports.serve_grpc if grpc else cluster.ports.serve_http),)

    def headers(self, cluster: ClusterRecord) -> dict[str, str]:
        return {}

    async def close(self) -> None:
        return None

    async def prune_environments(self, keep: Collection[str], read_at: float) -> None:
        self.pruned.append(sorted(keep))

    def processes_alive(self, cluster: ClusterRecord) -> bool:
        return cluster.head_pid is not None and self.alive.get(cluster.name, False)

    def dead_workers(self, cluster: ClusterRecord) -> list[int]:
        return [pid for pid in cluster.worker_pids if pid in self.dead]

    def exit_reason(self, cluster: ClusterRecord, worker_pid: int | None = None) -> str:
        return f"pid {worker_pid or cluster.head_pid} exited with status 1"

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        self.calls.append(("launch_nodes", cluster.name))
        return launch_here(cluster, config, group, count, records)

    async def update_autoscaler(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        self.calls.append(("update_autoscaler", cluster.name))
        if self.update_autoscaler_error is not None:
            raise self.update_autoscaler_error

    async def stop_node(self, cluster: ClusterRecord, index: int) -> None:
        self.calls.append(("stop_node", f"{cluster.name}/{index}"))

    async def stop(self, cluster: ClusterRecord, record: RecordChanges | None = None) -> list[int]:
        self.calls.append(("stop", cluster.name))
        if self.stop_error is not None:
            raise self.stop_error
        left = list(self.leftovers.get(cluster.name, []))
        if not left:
            self.alive[cluster.name] = False
        return left

    def release_workers(self) -> None:
        if self.workers_gate is not None:
            self.workers_gate.set()


class FakeServe:
    """Ray's Serve API as the controller sees it through `ServeClient`.

    `applications()` answers like Ray: one entry per app of the last document PUT to that
    dashboard, `source: declarative`, its `deployed_app_config` being that app's entry of the
    document. A new document starts as `status_after_put` (DEPLOYING, as Ray does).
    Controls: `set_status()`, `put_errors` (raised by the next PUTs, in order), `defer` (PUTs are
    acknowledged but Ray shows them only after `deploy_deferred()`), `unreachable`, `on_put`
    and `on_applications` (called first, to observe or change the world mid-tick)."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, dict[str, Any]]] = []  # every PUT that Ray accepted
        self.deployed: dict[str, dict[str, Any]] = {}  # dashboard url -> the document Ray runs
        self.status: dict[str, tuple[str, str]] = {}  # dashboard url -> (app status, message)
        self.status_after_put = "DEPLOYING"
        self.put_errors: list[Exception] = []
        self.defer = False
        self._deferred: dict[str, dict[str, Any]] = {}
        self.unreachable: set[str] = set()
        self.proxy_ok = True
        self.package_error: Exception | None = None
        self.packages: list[tuple[str, str]] = []  # (dashboard url, package hash) uploaded
        self.on_put: Callable[[str, dict[str, Any]], None] | None = None
        self.on_applications: Callable[[str], None] | None = None

    # -- controls -------------------------------------------------------------------------

    def set_status(self, status: str, message: str = "", dashboard_url: str | None = None) -> None:
        for url in [dashboard_url] if dashboard_url else list(self.deployed):
            self.status[url] = (status, message)

    def deploy_deferred(self, status: str | None = None) -> None:
        for url, document in self._deferred.items():
            self.deployed[url] = document
            self.status[url] = (status or self.status_after_put, "")
        self._deferred.clear()

    # -- the ServeClient surface ----------------------------------------------------------

    async def applications(self, dashboard_url: str, headers: Any = None) -> dict[str, AppState]:
        if self.on_applications is not None:
            self.on_applications(dashboard_url)
        if dashboard_url in self.unreachable:
            raise RetryableServeError(f"GET {dashboard_url} failed: connection refused")
        apps: dict[str, Any] = {}
        document = self.deployed.get(dashboard_url)
        status, message = self.status.get(dashboard_url, (self.status_after_put, ""))
        # One replica per app while it runs, none at target_capacity 0 (a warm standby).
        replicas = (
            [{"state": "RUNNING"}] if status == "RUNNING" and (document or {}).get("target_capacity") != 0 else []
        )
        for app in (document or {}).get("applications", []):
            apps[app.get("name", "default")] = {
                "status": status,
                "source": "declarative",
                "message": message,
                "route_prefix": app.get("route_prefix", "/"),
                "deployed_app_config": copy.deepcopy(app),
                "deployments": {"D": {"status": "HEALTHY", "replicas": replicas}},
            }
        return parse_applications({"applications": apps})

    async def applications_with_capacity(
        self, dashboard_url: str, headers: Any = None
    ) -> tuple[dict[str, AppState], float | None]:
        """Like Ray: the apps, and the target_capacity of the document it runs (None: unset)."""
        apps = await self.applications(dashboard_url, headers)
        capacity = (self.deployed.get(dashboard_url) or {}).get("target_capacity")
        return apps, float(capacity) if capacity is not None else None

    async def put_config(self, dashboard_url: str, document: dict[str, Any], headers: Any = None) -> None:
        if self.on_put is not None:
            self.on_put(dashboard_url, document)
        if self.put_errors:
            raise self.put_errors.pop(0)
        self.puts.append((dashboard_url, copy.deepcopy(document)))
        if self.defer:
            self._deferred[dashboard_url] = copy.deepcopy(document)
            return
        self.deployed[dashboard_url] = copy.deepcopy(document)
        self.status[dashboard_url] = (self.status_after_put, "")

    async def proxy_healthy(self, serve_url: str) -> bool:
        return self.proxy_ok

    async def proxy_routes(self, serve_url: str) -> frozenset[str]:
        """The route prefixes of the RUNNING apps of the cluster whose Serve port this is."""
        routes: set[str] = set()
        for url, document in self.deployed.items():
            port = (document.get("http_options") or {}).get("port")
            if serve_url.endswith(f":{port}") and self.status.get(url, ("",))[0] == "RUNNING":
                routes.update(app.get("route_prefix", "/") for app in document["applications"])
        return frozenset(routes)

    async def ensure_package(self, dashboard_url: str, package: Package, headers: Any = None) -> bool:
        if self.package_error is not None:
            raise self.package_error
        self.packages.append((dashboard_url, package.hash))
        return True


class FakeDataPlane:
    """The data plane as the controller sees it (`controller.DataPlanePort`): routes(),
    set_route(), remove_route(), desired_route(). Kept small so that it follows that port.
    `fail(method, error)` makes a method raise (DataPlaneError unless told otherwise)."""

    def __init__(self) -> None:
        self.table: dict[str, ServiceRoute] = {}  # what every Envoy acknowledged
        self.desired: dict[str, ServiceRoute] = {}  # what was last asked for
        self.set_calls: list[ServiceRoute] = []
        self.removed: list[str] = []
        self.inflight: dict[str, int] = {}  # backend -> requests in flight
        self.errors: dict[str, Exception] = {}
        self.on_routes: Callable[[], Awaitable[Any]] | None = None  # called first (to change the world mid-tick)

    def fail(self, method: str, error: Exception | None = None) -> None:
        self.errors[method] = error or DataPlaneError(f"data plane {method} failed: envoy not answering")

    def recover(self) -> None:
        self.errors.clear()

    def _check(self, method: str) -> None:
        if method in self.errors:
            raise self.errors[method]

    async def routes(self) -> dict[str, RouteObservation]:
        if self.on_routes is not None:
            await self.on_routes()
        self._check("routes")
        return {
            service: RouteObservation(
                service=service,
                weights=dict(route.weights),
                in_sync=True,
                inflight={name: self.inflight.get(name, 0) for name in route.weights},
                failover=route.standby is not None,
            )
            for service, route in self.table.items()
        }

    async def set_route(self, route: ServiceRoute) -> None:
        self.desired[route.service] = route
        self._check("set_route")
        self.set_calls.append(route)
        self.table[route.service] = route

    async def remove_route(self, service: str) -> None:
        self._check("remove_route")
        self.removed.append(service)
        self.table.pop(service, None)
        self.desired.pop(service, None)

    def desired_route(self, service: str) -> ServiceRoute | None:
        return self.desired.get(service)
