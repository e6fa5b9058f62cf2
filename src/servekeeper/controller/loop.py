"""The reconcile loop: observe -> plan -> execute -> persist, one task per service.

A tick never blocks on a long operation: cluster starts and deletions run as background tasks
whose progress is recorded in the store, and later ticks observe where they got to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from servekeeper.controller.hooks import Hooks
from servekeeper.controller.metrics import ControllerMetrics
from servekeeper.controller.probes import ProbeRunner
from servekeeper.core import actions as act
from servekeeper.core.planner import plan
from servekeeper.core.serve_config import build_serve_config, config_deployed, desired_config_hash, package_hash_of
from servekeeper.dataplane import Backend, BackendStats, DataPlaneError, Endpoint, RouteObservation, ServiceRoute
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.spec import ServiceSpec
from servekeeper.model.status import (
    BackendCounters,
    ClusterObservation,
    ClusterRecord,
    ClusterRole,
    ConditionType,
    Event,
    IngressRouteObservation,
    Observation,
    ServiceRecord,
    SwitchGate,
)
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.providers.pool import HostRefused, PoolClusters, Shortfall
from servekeeper.providers.ports import PortAllocator
from servekeeper.rayapi.package import Package
from servekeeper.rayapi.serve_api import PermanentServeError, RetryableServeError, ServeClient
from servekeeper.store.store import PROGRESSING, Store

logger = logging.getLogger(__name__)

PENDING_TICK_SECONDS = 0.25  # a cluster is coming up: each poll saved is latency off the switch
FAST_TICK_SECONDS = 0.5  # something else is changing (draining, deleting, not ready)
STEADY_TICK_SECONDS = 2.0  # the reference polls every 2 s, always
SERVICE_SCAN_SECONDS = 1.0
MAX_PUTS_PER_CONFIG = 5  # PUTs of one config to one cluster that Ray acknowledged but never showed


class DataPlanePort(Protocol):
    """What the controller needs of the data plane (`servekeeper.dataplane.DataPlane`)."""

    async def routes(self) -> dict[str, RouteObservation]: ...

    async def set_route(self, route: ServiceRoute) -> None: ...

    async def remove_route(self, service: str) -> None: ...

    def desired_route(self, service: str) -> ServiceRoute | None: ...

    async def backend_stats(self) -> dict[str, BackendStats]: ...


@dataclass
class _Tick:
    """What one tick's actions found out, beyond the plan: events, and a rollout Ray rejected."""

    events: list[Event] = field(default_factory=list)
    rejected: str | None = None


class Controller:
    def __init__(
        self,
        store: Store,
        provider: ClusterProvider,
        dataplane: DataPlanePort,
        session: aiohttp.ClientSession,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        gate: SwitchGate = SwitchGate.READY,
        hooks: Hooks | None = None,
        serve: ServeClient | None = None,
        metrics: ControllerMetrics | None = None,
        pools: PoolClusters | None = None,
    ) -> None:
        self.store = store
        self.pools = pools or PoolClusters(store, state_dir)  # clusters on host pools, over SSH
        self._shortfalls: dict[str, str] = {}  # service -> why its next cluster cannot be placed now
        self.metrics = metrics or ControllerMetrics()  # rollouts, config PUTs, tick durations
        self.provider = provider
        self.dataplane = dataplane
        self.serve = serve or ServeClient(session)
        self.probes = ProbeRunner(session, clock)
        self.state_dir = state_dir
        self.packages_dir = state_dir / "packages"
        self.clock = clock
        self.gate = gate
        self.hooks = hooks or Hooks()
        self.observations: dict[str, Observation] = {}
        self._service_tasks: dict[str, asyncio.Task[None]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._background: dict[str, asyncio.Task[None]] = {}  # cluster name -> its start or stop task
        self._documents: dict[tuple[str, str], dict[str, Any]] = {}  # (cluster, config hash) -> what was PUT
        self._unacknowledged_routes: set[str] = set()  # services whose last route push failed
        self._stopping = False

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for service in self.store.list_services():
                task = self._service_tasks.get(service.name)
                if task is None or task.done():
                    self._service_tasks[service.name] = asyncio.create_task(
                        self._guarded_service_loop(service.name), name=f"service-{service.name}"
                    )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SERVICE_SCAN_SECONDS)

    def wake(self, name: str) -> None:
        """Run the service's next tick now. Call it on the controller's event loop only."""
        event = self._wakeups.get(name)
        if event is not None:
            event.set()

    async def _guarded_service_loop(self, name: str) -> None:
        wakeup = self._wakeups.setdefault(name, asyncio.Event())
        while not self._stopping:
            wakeup.clear()  # before the tick: a wake() that comes during it runs the next one at once
            started = time.perf_counter()
            try:
                delay = await self.tick(name)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("[%s] tick failed; retrying", name)
                delay = STEADY_TICK_SECONDS
            self.metrics.tick_finished(name, time.perf_counter() - started)
            if delay is None:
                self._wakeups.pop(name, None)
                return  # the service is gone
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wakeup.wait(), delay)

    async def tick(self, name: str) -> float | None:
        """One reconcile pass for one service; returns the delay before the next, or None."""
        service = self.store.get_service(name)
        if service is None:
            return None
        spec = ServiceSpec.model_validate_json(service.spec_json)
        clusters = self.store.list_clusters(name)
        observation = await self.observe(service, clusters, spec)
        self.observations[name] = observation
        decision = plan(spec, service, clusters, observation, self.clock(), self.gate)
        if not any(isinstance(action, act.CreateCluster) for action in decision.actions):
            self._shortfalls.pop(name, None)  # nothing waits for room now: no stale InsufficientCapacity
        failed = decision.service.failed_generation != service.failed_generation
        if failed:
            # A rollout failure is a decision, not a reading: stored before the actions that
            # follow from it (a restore PUT), so a crash after them cannot re-send the failed config.
            self._persist_status(service, service.with_changes(**_failure_fields(decision.service)), only_failure=True)
        tick = _Tick()
        completed = False
        try:
            for action in decision.actions:
                await self._execute(action, service, spec, tick)
            completed = True
        except _StopTick:
            pass  # logged where raised; the next tick re-plans from what is stored
        finally:
            # The plan's status and events describe the world after ALL its actions: when one
            # failed, neither is true, so only what this tick learned is kept (the next tick
            # re-plans from the store and says it again once it is so).
            after = decision.service if completed else service.with_changes(**_failure_fields(decision.service))
            failure_events = [e for e in decision.events if failed and e.reason in ("RolloutFailed", "RolloutAborted")]
            tick.events[:0] = decision.events if completed else failure_events
            if tick.rejected is not None and after.failed_generation != service.generation:
                after = after.with_changes(failed_generation=service.generation, failure_reason=tick.rejected)
            self._persist_status(service, after)
            self._record_revision_outcome(service, after)
            self.store.add_events(tick.events)
            self.metrics.tick_persisted(self.store, service, after, tick.events, self.clock())
            for event in tick.events:
                log = logger.warning if event.type == "Warning" else logger.info
                # `extra`: the fields of a structured (--log-format json) log line
                extra = {"service": name, "event_type": event.type, "reason": event.reason, "event_time": event.time}
                log("[%s] %s: %s", name, event.reason, event.message, extra=extra)
        self.hooks.after_tick(self.store.list_clusters(name), decision.actions)
        if any(isinstance(action, act.ForgetService) for action in decision.actions):
            self.observations.pop(name, None)
            return None
        if any(c.role == ClusterRole.PENDING for c in clusters) or any(
            isinstance(a, act.CreateCluster) for a in decision.actions
        ):
            return PENDING_TICK_SECONDS
        busy = decision.actions or any(c.role != ClusterRole.ACTIVE for c in clusters)
        return FAST_TICK_SECONDS if busy or not _is_ready(decision.service) else STEADY_TICK_SECONDS

    def _record_revision_outcome(self, before: ServiceRecord, after: ServiceRecord) -> None:
        """The history's answer to "how did revision N end" (the first ending stands)."""
        generation = before.generation
        failed = after.failed_generation == generation
        if not failed and after.observed_generation != generation:
            return
        # Level-triggered (a crash between the status and this must not leave it Progressing):
        # one read per tick, a write only when it ends.
        revision = self.store.get_revision(before.name, generation)
        if revision is None or revision.outcome != PROGRESSING:
            return
        if failed:
            reason = after.failure_reason or "RolloutFailed"
            if reason.startswith("Aborted"):
                outcome, ended_by = "Aborted", "servekeeper abort"
            elif reason.startswith("AnalysisFailed"):
                outcome, ended_by = "Aborted", "canary analysis"
            else:
                outcome, ended_by = "Failed", "servekeeper"
            self.store.end_revision(before.name, generation, outcome, ended_by, reason, self.clock())
        else:
            outdated = after.condition(ConditionType.CLUSTER_SPEC_OUTDATED)
            if outdated is not None and outdated.status:  # observed, but by design not rolled out
                message = "the cluster spec changed but upgradeStrategy.type is None"
                self.store.end_revision(before.name, generation, "NotRolledOut", "servekeeper", message, self.clock())
            else:
                self.store.end_revision(before.name, generation, "Succeeded", "servekeeper", "", self.clock())

    def _persist_status(self, before: ServiceRecord, after: ServiceRecord, only_failure: bool = False) -> None:
        # The API may have stored a new spec or marked the service deleted while this tick ran:
        # the store writes the controller-owned fields only if neither happened (one atomic
        # compare-and-set), and the next tick acts on the newer state.
        if only_failure:
            self.store.persist_status(
                before.name,
                expected_generation=before.generation,
                expected_deleting=before.deleting,
                failed_generation=after.failed_generation,
                failure_reason=after.failure_reason,
            )
            return
        self.store.persist_status(
            before.name,
            expected_generation=before.generation,
            expected_deleting=before.deleting,
            observed_generation=after.observed_generation,
            unhealthy_since=after.unhealthy_since,
            failed_generation=after.failed_generation,
            failure_reason=after.failure_reason,
            conditions=after.conditions,
        )

    # -- observe -------------------------------------------------------------------------

    async def observe(self, service: ServiceRecord, clusters: list[ClusterRecord], spec: ServiceSpec) -> Observation:
        live = [c for c in clusters if c.role != ClusterRole.DELETING]
        observed = await asyncio.gather(*(self._observe_cluster(c, service, spec) for c in live))
        route: IngressRouteObservation | None = None
        ingress_ok = True
        counters: dict[str, BackendCounters] | None = None
        try:
            observed_route = (await self.dataplane.routes()).get(service.name)
            route = observed_route.to_ingress() if observed_route is not None else None
            if route is not None:
                desired = self.dataplane.desired_route(service.name)
                route = replace(route, preview=desired.preview_backend if desired is not None else None)
            if route is not None and (
                not observed_route.in_sync  # type: ignore[union-attr]
                or service.name in self._unacknowledged_routes
                or _listener_settings_changed(self.dataplane.desired_route(service.name), spec)
            ):
                # Envoy processes disagree, the last push was not acknowledged, or the spec moved
                # or re-limited the listener: the route is set again (to every process).
                route = None
        except DataPlaneError as exc:
            ingress_ok = False  # every backend counts as busy: nothing is deleted on this look
            logger.warning("[%s] data plane not readable: %s", service.name, exc)
        if any(c.role == ClusterRole.PENDING and c.canary is not None for c in live):
            try:
                counters = _counters(await self.dataplane.backend_stats())
            except DataPlaneError as exc:  # no analysis verdict on this look; nothing else changes
                logger.info("[%s] ingress counters not readable: %s", service.name, exc)
        return Observation(
            clusters={o.name: o for o in observed},
            route=route,
            ingress_ok=ingress_ok,
            backend_counters=counters,
            placement_problem=self._shortfalls.get(service.name),
        )

    def _liveness(self, cluster: ClusterRecord) -> tuple[bool, list[int], str | None]:
        """Process checks and log reads: blocking, so they run in a worker thread."""
        if not self.provider.processes_alive(cluster):
            reason = self.provider.exit_reason(cluster) if cluster.head_pid is not None else None
            return False, [], reason
        dead = self.provider.dead_workers(cluster)
        if dead:
            return True, dead, f"worker pid {dead[0]} exited: {self.provider.exit_reason(cluster, dead[0])}"
        return True, [], None

    async def _observe_cluster(
        self, cluster: ClusterRecord, service: ServiceRecord, spec: ServiceSpec
    ) -> ClusterObservation:
        exited: tuple[int, ...] = ()  # of the dead workers, those known gone (restartable in place)
        if cluster.pool is not None:
            alive, dead_workers, reason, exited = await self.pools.liveness(cluster)
        else:
            alive, dead_workers, reason = await asyncio.to_thread(self._liveness, cluster)
        if not alive:
            return ClusterObservation(name=cluster.name, processes_alive=False, error=reason)
        if cluster.role == ClusterRole.ACTIVE and not dead_workers:
            # A serving cluster's worker being started again (or whose start failed) is missing:
            # unhealthy until it runs, so a worker that keeps dying cannot look healthy between tries.
            missing = [n for n in cluster.nodes[1:] if n.pid is None and not n.stopped]
            if missing:
                return ClusterObservation(
                    name=cluster.name,
                    processes_alive=True,
                    dead_workers=len(missing),
                    error=f"worker node on host {missing[0].host} is not running (being started again)",
                )
        if dead_workers:
            return ClusterObservation(
                name=cluster.name,
                processes_alive=True,
                dead_workers=len(dead_workers),
                exited_workers=exited,
                error=reason,
            )
        auth = self._auth(cluster)  # only now: a pool cluster that never started has no token
        capacity = None
        try:
            if cluster.target_capacity is not None:  # managed: what Ray scales to is part of the look
                apps, capacity = await self.serve.applications_with_capacity(cluster.dashboard_url, **auth)
            else:
                apps = await self.serve.applications(cluster.dashboard_url, **auth)
        except (RetryableServeError, PermanentServeError) as exc:
            return ClusterObservation(name=cluster.name, processes_alive=True, error=str(exc))
        healthy, routes = await asyncio.gather(
            self.serve.proxy_healthy(cluster.serve_url), self.serve.proxy_routes(cluster.serve_url)
        )
        return ClusterObservation(
            probes=self.probes.states(cluster.name, cluster.serve_url, spec.spec.readiness.probes),
            name=cluster.name,
            processes_alive=True,
            dashboard_ok=True,
            apps=apps,
            proxy_healthy=healthy,
            routes=routes,
            deployed_config_hash=self._deployed_config_hash(cluster, service, spec, apps),
            target_capacity=capacity,
        )

    def _deployed_config_hash(
        self, cluster: ClusterRecord, service: ServiceRecord, spec: ServiceSpec, apps: dict[str, Any]
    ) -> str | None:
        """Which config servekeeper sent does Ray run now? Compared app by app with Ray's
        deployed_app_config: the desired one first, then the ones this cluster was given before."""
        desired = desired_config_hash(spec, service.package_hash)
        candidates = {desired: build_serve_config(spec, cluster, self._package_uri(service))}
        for known in (cluster.applied_config_hash, cluster.good_config_hash, cluster.submitted_config_hash):
            if known is not None and known not in candidates:
                document = self._submitted_document(cluster.name, known)
                if document is not None:
                    candidates[known] = document
        for config_hash, document in candidates.items():
            if config_deployed(document, apps):
                return config_hash
        return None

    def _submitted_document(self, cluster: str, config_hash: str) -> dict[str, Any] | None:
        key = (cluster, config_hash)
        if key not in self._documents:
            document = self.store.submitted_document(cluster, config_hash)
            if document is None:
                return None
            self._documents[key] = document
        return self._documents[key]

    def _package(self, service: ServiceRecord) -> Package | None:
        return self._package_by_hash(service.package_hash) if service.package_hash is not None else None

    def _package_by_hash(self, package_hash: str) -> Package:
        path = self.packages_dir / f"{package_hash}.zip"
        return Package(hash=package_hash, path=path, size=path.stat().st_size if path.exists() else 0)

    def _package_uri(self, service: ServiceRecord) -> str | None:
        package = self._package(service)
        return package.uri if package else None

    # -- execute -------------------------------------------------------------------------

    async def _execute(self, action: act.Action, service: ServiceRecord, spec: ServiceSpec, tick: _Tick) -> None:
        if isinstance(action, act.CreateCluster):
            await self._create_cluster(service, spec, action.role)
        elif isinstance(action, act.StartCluster):
            cluster = self.store.get_cluster(action.cluster)
            if cluster is not None:
                self._start_cluster(cluster)
        elif isinstance(action, act.RestartWorkers):
            self._restart_workers(action)
        elif isinstance(action, act.SubmitConfig):
            await self._submit_config(action, service, spec, tick)
        elif isinstance(action, act.UpdateCluster):
            changes = dict(action.changes)
            applied = changes.get("applied_config_hash")
            if applied is not None:
                document = self._submitted_document(action.cluster, applied)
                if document is not None:
                    changes["package_hash"] = package_hash_of(document)  # the code Ray runs now
            self.store.update_cluster(action.cluster, **changes)
        elif isinstance(action, act.UpdateClusters):
            with self.store.transaction():
                for name, changes in action.changes:
                    self.store.update_cluster(name, **changes)
        elif isinstance(action, act.SetRoute):
            await self._set_route(service, spec, action, tick)
        elif isinstance(action, act.SetTargetCapacity):
            await self._set_target_capacity(action, service, tick)
        elif isinstance(action, act.RemoveRoute):
            try:
                await self.dataplane.remove_route(service.name)
            except DataPlaneError as exc:
                tick.events.append(Event(service.name, self.clock(), "Warning", "RouteFailed", str(exc)))
                raise _StopTick from exc
        elif isinstance(action, act.DeleteCluster):
            self._delete_cluster(action.cluster, service.name)
        elif isinstance(action, act.ForgetService):
            # Only the row this tick saw being deleted: an apply stored meanwhile survives.
            self.store.delete_service_row(service.name, expected_generation=service.generation)

    def _auth(self, cluster: ClusterRecord) -> dict[str, Any]:
        """Keyword arguments of Serve API calls: a pool cluster's token (token authentication)."""
        return {"headers": self.pools.headers(cluster)} if cluster.pool is not None else {}

    async def _create_cluster(self, service: ServiceRecord, spec: ServiceSpec, role: ClusterRole) -> None:
        config = spec.spec.rayClusterConfig
        reserved = [port for c in self.store.list_clusters() for port in c.ports.all_ports()]
        ports = PortAllocator(reserved).cluster(worker_nodes=config.worker_count())
        suffix = secrets.token_hex(3)
        name = f"{service.name}-g{service.generation}-{suffix}"
        cluster = ClusterRecord(
            name=name,
            service=service.name,
            generation=service.generation,
            cluster_spec_hash=spec.cluster_spec_hash(),
            cluster_spec_json=config.model_dump_json(),
            role=role,
            ports=ports,
            # Short on purpose: Ray's unix socket paths under it must stay below 107 bytes.
            temp_dir=f"/tmp/sk-{suffix}{secrets.token_hex(2)}",
            log_dir=str(self.state_dir / "clusters" / name),
            created_at=self.clock(),
        )
        if config.hostPool is not None:
            async with self.pools.creating:  # the pool's room and ports, as seen, until stored
                try:
                    cluster = await self.pools.new_record(cluster, config)
                except HostRefused as exc:
                    # Waiting would not mend it: stored failed, without nodes (nothing to stop),
                    # so that the planner fails the rollout with the host's refusal.
                    self._shortfalls.pop(service.name, None)
                    failed = cluster.with_changes(pool=config.hostPool, failure_reason=f"StartFailed: {exc}")
                    self.store.put_cluster(failed)
                    return
                except (Shortfall, ProviderError) as exc:
                    # The rollout waits (level-triggered: the next tick tries again) and says why.
                    if self._shortfalls.get(service.name) != str(exc):
                        event = Event(service.name, self.clock(), "Warning", "InsufficientCapacity", str(exc))
                        self.store.add_events([event])
                    self._shortfalls[service.name] = str(exc)
                    return
                self._shortfalls.pop(service.name, None)
                self.pools.put_new(cluster)  # intent first (and the cluster's token)
        else:
            self.store.put_cluster(cluster)  # intent first: a crash from here on leaves nothing unknown
        self.hooks.reached("cluster-intent-written", cluster)
        self._start_cluster(cluster)

    def _start_cluster(self, cluster: ClusterRecord) -> None:
        if cluster.name in self._background:
            return  # its start (or stop) is in progress
        if cluster.failure_reason is not None:
            return  # failed: the planner deletes it; starting it again would only hide the cause
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if cluster.pool is not None:
            self._in_background(cluster, f"start-{cluster.name}", self._start_pool_nodes(cluster, config))
            return
        try:
            if cluster.head_pid is None:
                cluster = self.provider.start_head(cluster, config)
                self.store.update_cluster(cluster.name, head_pid=cluster.head_pid)
                self.hooks.reached("pending-started", cluster)
        except (OSError, ProviderError) as exc:
            self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")
            return
        if len(cluster.worker_pids) < config.worker_count():
            self._in_background(cluster, f"start-{cluster.name}", self._start_workers(cluster, config))

    async def _start_pool_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        def record(updated: ClusterRecord) -> None:
            # Only the nodes this start launched, into the record as stored now: a tick may have
            # cleared another node's pid meanwhile (RestartWorkers), which must not come back.
            current = self.store.get_cluster(updated.name) or updated
            launched = {i for i, (a, b) in enumerate(zip(cluster.nodes, updated.nodes, strict=True)) if a.pid != b.pid}
            nodes = tuple(updated.nodes[i] if i in launched else node for i, node in enumerate(current.nodes))
            pids = [node.pid for node in nodes]
            worker_pids = tuple(pid for pid in pids[1:] if pid is not None)
            self.store.update_cluster(updated.name, nodes=nodes, head_pid=pids[0], worker_pids=worker_pids)
            if updated.head_pid is not None and cluster.head_pid is None:
                self.hooks.reached("pending-started", updated)

        try:
            await self.pools.start(cluster, config, record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("[%s/%s] node start failed: %s", cluster.service, cluster.name, exc)
            current = self.store.get_cluster(cluster.name)
            if current is not None and current.role != ClusterRole.PENDING:
                # A worker of a serving cluster started again: the cluster stays (one node short,
                # unhealthy, replaced after the threshold); the next tick tries the start again.
                event = Event(cluster.service, self.clock(), "Warning", "NodeStartFailed", f"{cluster.name}: {exc}")
                self.store.add_events([event])
                return
            with contextlib.suppress(KeyError):  # an SSH or launch failure fails the rollout, with the cause
                self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")

    def _restart_workers(self, action: act.RestartWorkers) -> None:
        """Clear the exited nodes' pids in the record as stored now (a start beside the ticks may
        have recorded others since the tick's look), then start them again."""
        current = self.store.get_cluster(action.cluster)
        if current is None or current.role == ClusterRole.DELETING:
            return
        gone = set(action.pids)
        nodes = tuple(
            replace(node, pid=None, session_id=None, restarts=node.restarts + 1) if node.pid in gone else node
            for node in current.nodes
        )
        worker_pids = tuple(pid for pid in current.worker_pids if pid not in gone)
        self.store.update_cluster(current.name, nodes=nodes, worker_pids=worker_pids)
        self._start_cluster(current.with_changes(nodes=nodes, worker_pids=worker_pids))

    async def _start_workers(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        def record(updated: ClusterRecord) -> None:
            self.store.update_cluster(updated.name, worker_pids=updated.worker_pids)

        try:
            await self.provider.start_workers(cluster, config, record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever stops a start fails that cluster's rollout, with the cause
            logger.warning("[%s/%s] worker start failed: %s", cluster.service, cluster.name, exc)
            with contextlib.suppress(KeyError):
                self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")

    def _in_background(
        self, cluster: ClusterRecord, task_name: str, work: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        """Run a cluster's start or stop beside the ticks; tracked until it ends, its failure an event."""
        task = asyncio.create_task(work, name=task_name)
        self._background[cluster.name] = task

        def finished(done: asyncio.Task[None]) -> None:
            if self._background.get(cluster.name) is done:
                del self._background[cluster.name]
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:
                logger.error("[%s/%s] %s failed: %r", cluster.service, cluster.name, task_name, error)
                self.store.add_events(
                    [
                        Event(
                            cluster.service,
                            self.clock(),
                            "Warning",
                            "BackgroundTaskFailed",
                            f"{task_name}: {type(error).__name__}: {error}",
                        )
                    ]
                )
            self.wake(cluster.service)

        task.add_done_callback(finished)
        return task

    async def _submit_config(
        self, action: act.SubmitConfig, service: ServiceRecord, spec: ServiceSpec, tick: _Tick
    ) -> None:
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None:
            return
        document = await self._document_for(action, cluster, service, spec, tick)
        cluster = self.store.update_cluster(
            cluster.name, submitted_config_hash=action.config_hash, config_submitted_at=None
        )
        # Audited before the PUT: a second attempt on the same cluster can never go unseen, and
        # the document is kept to recognise it in Ray's answers and to restore it later.
        self.store.record_submission(cluster.name, action.config_hash, self.clock(), json.dumps(document))
        self._documents[(cluster.name, action.config_hash)] = document
        self.hooks.reached("config-audited", cluster, service.generation)
        self.metrics.config_submitted(service.name)
        try:
            await self.hooks.before_config_put(cluster, service.generation)
            await self.serve.put_config(cluster.dashboard_url, document, **self._auth(cluster))
        except RetryableServeError as exc:
            logger.info("[%s/%s] config PUT will be retried: %s", service.name, cluster.name, exc)
            tick.events.append(Event(service.name, self.clock(), "Warning", "ConfigSubmitRetry", str(exc)))
            raise _StopTick from exc
        except PermanentServeError as exc:
            self._rejected(cluster, service, f"ConfigRejected: {exc.body}", tick)
            raise _StopTick from exc
        self.hooks.reached("config-submitted", cluster, service.generation)
        self.store.update_cluster(cluster.name, config_submitted_at=self.clock())

    async def _set_target_capacity(self, action: act.SetTargetCapacity, service: ServiceRecord, tick: _Tick) -> None:
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None or cluster.applied_config_hash is None:
            return
        document = self._submitted_document(cluster.name, cluster.applied_config_hash)
        if document is None:
            return
        try:
            targeted = {**document, "target_capacity": action.capacity}
            await self.serve.put_config(cluster.dashboard_url, targeted, **self._auth(cluster))
        except (RetryableServeError, PermanentServeError) as exc:
            # Level-triggered: the planner asks again while Ray shows another capacity.
            tick.events.append(Event(service.name, self.clock(), "Warning", "TargetCapacityRetry", str(exc)))
            raise _StopTick from exc
        logger.info("[%s/%s] target_capacity %g%%", service.name, cluster.name, action.capacity)

    async def _document_for(
        self, action: act.SubmitConfig, cluster: ClusterRecord, service: ServiceRecord, spec: ServiceSpec, tick: _Tick
    ) -> dict[str, Any]:
        document = await self._untargeted_document_for(action, cluster, service, spec, tick)
        if cluster.target_capacity is not None:
            document = {**document, "target_capacity": cluster.target_capacity}
        return document

    async def _untargeted_document_for(
        self, action: act.SubmitConfig, cluster: ClusterRecord, service: ServiceRecord, spec: ServiceSpec, tick: _Tick
    ) -> dict[str, Any]:
        if self.store.count_submissions(cluster.name, action.config_hash) >= MAX_PUTS_PER_CONFIG:
            # Ray keeps acknowledging the PUT but never reports the config as sent: something
            # rewrites it. Failing the rollout beats re-sending it forever.
            reason = (
                f"ConfigNotObserved: Ray acknowledged config {action.config_hash} {MAX_PUTS_PER_CONFIG} times "
                f"on {cluster.name} but never reports it deployed as sent"
            )
            self._rejected(cluster, service, reason, tick)
            raise _StopTick
        if action.restore:
            document = self._submitted_document(cluster.name, action.config_hash)
            if document is None:
                # Not restorable (a store from before documents were kept): forget it, so that
                # the cluster is judged by its health again instead of retrying this every tick.
                self.store.update_cluster(cluster.name, good_config_hash=None)
                message = f"the last good config {action.config_hash} of {cluster.name} is not stored"
                tick.events.append(Event(service.name, self.clock(), "Warning", "RestoreImpossible", message))
                raise _StopTick
            restored = package_hash_of(document)
            if restored is not None:  # Ray may have let go of the old package: upload it again
                await self._ensure_package(cluster, service, self._package_by_hash(restored), tick)
            return document
        package = self._package(service)
        if package is not None:
            await self._ensure_package(cluster, service, package, tick)
        return build_serve_config(spec, cluster, package.uri if package else None)

    async def _ensure_package(
        self, cluster: ClusterRecord, service: ServiceRecord, package: Package, tick: _Tick
    ) -> None:
        try:
            if await self.serve.ensure_package(cluster.dashboard_url, package, **self._auth(cluster)):
                logger.info("[%s/%s] code package %s uploaded", service.name, cluster.name, package.hash[:12])
        except (RetryableServeError, FileNotFoundError) as exc:
            # FileNotFoundError: a newer apply pruned the package this (stale) tick wanted.
            logger.info("[%s/%s] package upload will be retried: %s", service.name, cluster.name, exc)
            raise _StopTick from exc
        except (PermanentServeError, OSError) as exc:
            self._rejected(cluster, service, f"PackageUploadFailed: {exc}", tick)
            raise _StopTick from exc

    def _rejected(self, cluster: ClusterRecord, service: ServiceRecord, reason: str, tick: _Tick) -> None:
        """Ray refused the change: a pending cluster fails its rollout; on the active cluster the
        generation is failed (not retried blindly) and the active keeps what it runs."""
        tick.events.append(Event(service.name, self.clock(), "Warning", reason.partition(":")[0], reason))
        if cluster.role == ClusterRole.PENDING:
            self.store.update_cluster(cluster.name, failure_reason=reason)
        else:
            tick.rejected = reason

    async def _set_route(self, service: ServiceRecord, spec: ServiceSpec, action: act.SetRoute, tick: _Tick) -> None:
        try:
            self._unacknowledged_routes.add(service.name)
            await self.dataplane.set_route(self._service_route(service, spec, action))
            self._unacknowledged_routes.discard(service.name)
        except DataPlaneError as exc:
            # Nothing after the switch may run: roles change only once the ingress acknowledged.
            tick.events.append(Event(service.name, self.clock(), "Warning", "RouteFailed", str(exc)))
            raise _StopTick from exc
        switched = self.store.get_cluster(action.active)
        if switched is not None and switched.role == ClusterRole.PENDING:
            self.hooks.reached("route-switched", switched)

    def _service_route(self, service: ServiceRecord, spec: ServiceSpec, action: act.SetRoute) -> ServiceRoute:
        """All traffic to `action.active`; the other clusters listed at weight 0, so that their
        in-flight requests and open streams stay counted while they drain."""
        ingress = spec.spec.ingress
        backends = []
        for name in action.upstreams:
            cluster = self.store.get_cluster(name)
            if cluster is None:
                continue
            if cluster.pool is not None:  # a Serve proxy on every node: Envoy spreads over them, ejects a dead one
                http = self.pools.endpoints(cluster, grpc=False)
                grpc = self.pools.endpoints(cluster, grpc=True) if ingress.grpcPort is not None else ()
            else:
                http = (Endpoint("127.0.0.1", cluster.ports.serve_http),)
                grpc = (Endpoint("127.0.0.1", cluster.ports.serve_grpc),) if ingress.grpcPort is not None else ()
            backends.append(Backend(name, http=http, grpc=grpc))
        weights = action.weights()
        return ServiceRoute(
            service=service.name,
            port=ingress.port,
            backends=tuple(backends),
            weights={b.name: weights.get(b.name, 0) for b in backends},
            preview_port=ingress.previewPort,
            preview_backend=action.preview if any(b.name == action.preview for b in backends) else None,
            grpc_port=ingress.grpcPort,
            max_request_bytes=ingress.maxRequestBytes,
            request_timeout_s=ingress.requestTimeoutSeconds,
            idle_timeout_s=ingress.idleTimeoutSeconds,
        )

    def _delete_cluster(self, name: str, service: str) -> None:
        cluster = self.store.get_cluster(name)
        if cluster is None:
            return
        if cluster.role != ClusterRole.DELETING:
            cluster = self.store.update_cluster(name, role=ClusterRole.DELETING)
        running = self._background.get(name)
        if running is not None:
            if running.get_name().startswith("stop-"):
                return
            running.cancel()  # a start still in progress: stop it, then delete
        self._in_background(cluster, f"stop-{name}", self._stop_cluster(cluster, after=running))

    async def _stop_cluster(self, cluster: ClusterRecord, after: asyncio.Task[None] | None = None) -> None:
        if after is not None:
            # The cancelled start first finishes a node launch under way and records it (a pool
            # cluster's start does): stopped before that, the node would outlive its record.
            await asyncio.wait({after})
            cluster = self.store.get_cluster(cluster.name) or cluster
        leftovers = await self._stop_any(cluster)
        if leftovers:
            self.store.add_events(
                [
                    Event(
                        cluster.service,
                        self.clock(),
                        "Warning",
                        "ClusterStopIncomplete",
                        f"{cluster.name}: pids {leftovers} still alive; will retry",
                    )
                ]
            )
            return
        self.store.remove_cluster(cluster.name)
        self.probes.forget(cluster.name)
        for key in [key for key in self._documents if key[0] == cluster.name]:
            del self._documents[key]
        self.store.add_events(
            [Event(cluster.service, self.clock(), "Normal", "ClusterDeleted", f"{cluster.name} stopped and removed")]
        )
        logger.info("[%s/%s] cluster deleted", cluster.service, cluster.name)

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self, stop_clusters: bool) -> None:
        self._stopping = True
        for task in self._service_tasks.values():
            task.cancel()
        await asyncio.gather(*self._service_tasks.values(), return_exceptions=True)
        await self.probes.close()
        background = list(self._background.values())
        if stop_clusters:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            clusters = self.store.list_clusters()
            leftovers = await asyncio.gather(*(self._stop_any(c) for c in clusters))
            for cluster, left in zip(clusters, leftovers, strict=True):
                if left:  # kept on record, so that the next `down` or `up` stops them again
                    logger.warning("[%s/%s] pids %s survived the stop", cluster.service, cluster.name, left)
                    continue
                self.store.remove_cluster(cluster.name)
        else:
            await asyncio.gather(*background, return_exceptions=True)
        await self.pools.close()

    async def _stop_any(self, cluster: ClusterRecord) -> list[int] | list[str]:
        if cluster.pool is not None:

            def record(updated: ClusterRecord) -> None:  # a node stopped: its room is free again
                with contextlib.suppress(KeyError):
                    self.store.update_cluster(updated.name, nodes=updated.nodes)

            return await self.pools.stop(cluster, record)
        return await self.provider.stop(cluster)

    def status_snapshot(self, name: str) -> Observation | None:
        return self.observations.get(name)

    def debug_state(self) -> dict[str, Any]:
        return {"services": sorted(self._service_tasks), "background": sorted(self._background)}


class _StopTick(Exception):
    """The rest of this tick's actions must not run (their precondition failed)."""


def _failure_fields(service: ServiceRecord) -> dict[str, Any]:
    return {"failed_generation": service.failed_generation, "failure_reason": service.failure_reason}


def _listener_settings_changed(route: ServiceRoute | None, spec: ServiceSpec) -> bool:
    if route is None:
        return False
    ingress = spec.spec.ingress
    observed = (
        route.port,
        route.grpc_port,
        route.max_request_bytes,
        route.request_timeout_s,
        route.idle_timeout_s,
        route.preview_port,
    )
    return observed != (
        ingress.port,
        ingress.grpcPort,
        ingress.maxRequestBytes,
        ingress.requestTimeoutSeconds,
        ingress.idleTimeoutSeconds,
        ingress.previewPort,
    )


def _counters(stats: dict[str, BackendStats]) -> dict[str, BackendCounters]:
    return {
        name: BackendCounters(
            requests=backend.rq_total,
            errors_5xx=backend.rq_5xx,
            latency_ms_buckets=tuple(sorted(backend.latency_ms_buckets.items())),
            epoch=backend.epoch,
        )
        for name, backend in stats.items()
    }


def _is_ready(service: ServiceRecord) -> bool:
    ready = service.condition(ConditionType.READY)
    return ready is not None and ready.status
