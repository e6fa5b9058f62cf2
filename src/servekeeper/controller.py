"""The reconcile loop: observe -> plan -> execute -> persist, one task per service.

A tick never blocks on a long operation: cluster starts and deletions run as background tasks
whose progress is recorded in the store, and later ticks observe where they got to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from servekeeper import faults
from servekeeper.core import actions as act
from servekeeper.core.planner import plan
from servekeeper.core.serve_config import build_serve_config
from servekeeper.ingress.client import IngressClient, IngressError
from servekeeper.ports import PortAllocator
from servekeeper.probes import ProbeRunner
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.serve_api import PermanentServeError, RetryableServeError, ServeClient
from servekeeper.spec import RayClusterConfigSpec, ServiceSpec
from servekeeper.status import (
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
from servekeeper.store import Store

logger = logging.getLogger(__name__)

PENDING_TICK_SECONDS = 0.25  # a cluster is coming up: each poll saved is latency off the switch
FAST_TICK_SECONDS = 0.5  # something else is changing (draining, deleting, not ready)
STEADY_TICK_SECONDS = 2.0  # the reference polls every 2 s, always
SERVICE_SCAN_SECONDS = 1.0


class Controller:
    def __init__(
        self,
        store: Store,
        provider: ClusterProvider,
        ingress: IngressClient,
        session: aiohttp.ClientSession,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        gate: SwitchGate = SwitchGate.READY,
    ) -> None:
        self.store = store
        self.provider = provider
        self.ingress = ingress
        self.serve = ServeClient(session)
        self.probes = ProbeRunner(session, clock)
        self.state_dir = state_dir
        self.clock = clock
        self.gate = gate
        self.observations: dict[str, Observation] = {}
        self._service_tasks: dict[str, asyncio.Task[None]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._background: dict[str, asyncio.Task[None]] = {}  # cluster name -> start/stop task
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SERVICE_SCAN_SECONDS)

    def wake(self, name: str) -> None:
        event = self._wakeups.get(name)
        if event is not None:
            event.set()

    async def _guarded_service_loop(self, name: str) -> None:
        wakeup = self._wakeups.setdefault(name, asyncio.Event())
        while not self._stopping:
            try:
                delay = await self.tick(name)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("[%s] tick failed; retrying", name)
                delay = STEADY_TICK_SECONDS
            if delay is None:
                self._wakeups.pop(name, None)
                return  # the service is gone
            wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), delay)

    async def tick(self, name: str) -> float | None:
        """One reconcile pass for one service; returns the delay before the next, or None."""
        service = self.store.get_service(name)
        if service is None:
            return None
        spec = ServiceSpec.model_validate_json(service.spec_json)
        clusters = self.store.list_clusters(name)
        observation = await self.observe(name, clusters, spec)
        self.observations[name] = observation
        decision = plan(spec, service, clusters, observation, self.clock(), self.gate)
        events = list(decision.events)
        try:
            for action in decision.actions:
                await self._execute(action, service, spec, events)
        except _StopTick:
            pass  # logged where raised; the next tick re-plans from what is stored
        finally:
            self._persist_status(service, decision.service)
            self.store.add_events(events)
            for event in events:
                log = logger.warning if event.type == "Warning" else logger.info
                log("[%s] %s: %s", name, event.reason, event.message)
        if faults.armed():
            self._crash_points_after_tick(decision.actions)
        if any(isinstance(action, act.ForgetService) for action in decision.actions):
            self.observations.pop(name, None)
            return None
        if any(c.role == ClusterRole.PENDING for c in clusters) or any(
            isinstance(a, act.CreateCluster) for a in decision.actions
        ):
            return PENDING_TICK_SECONDS
        busy = decision.actions or any(c.role != ClusterRole.ACTIVE for c in clusters)
        return FAST_TICK_SECONDS if busy or not _is_ready(decision.service) else STEADY_TICK_SECONDS

    def _crash_points_after_tick(self, actions: list[act.Action]) -> None:
        roles = {c.role: c for c in self.store.list_clusters()}
        pending = roles.get(ClusterRole.PENDING)
        if (
            pending is not None
            and pending.applied_config_hash
            and not any(isinstance(a, act.SetRoute) for a in actions)
        ):
            faults.crash_point("waiting-for-ready")
        if ClusterRole.DRAINING in roles and not any(isinstance(a, act.DeleteCluster) for a in actions):
            faults.crash_point("draining")

    def _persist_status(self, before: ServiceRecord, after: ServiceRecord) -> None:
        # The API may have stored a new spec while this tick ran: keep it, and let the next
        # tick act on it. Only the controller-owned fields are written, and only if unchanged.
        current = self.store.get_service(before.name)
        if current is None or current.generation != before.generation or current.deleting != before.deleting:
            return
        updated = current.with_changes(
            observed_generation=after.observed_generation,
            unhealthy_since=after.unhealthy_since,
            failed_generation=after.failed_generation,
            failure_reason=after.failure_reason,
            conditions=after.conditions,
        )
        if updated != current:  # a steady tick writes nothing
            self.store.put_service(updated)

    # -- observe -------------------------------------------------------------------------

    async def observe(self, name: str, clusters: list[ClusterRecord], spec: ServiceSpec) -> Observation:
        live = [c for c in clusters if c.role != ClusterRole.DELETING]
        observed = await asyncio.gather(*(self._observe_cluster(c, spec) for c in live))
        route: IngressRouteObservation | None = None
        ingress_ok = True
        try:
            route = (await self.ingress.routes()).get(name)
        except IngressError as exc:
            ingress_ok = False
            logger.warning("[%s] ingress not reachable: %s", name, exc)
        return Observation(clusters={o.name: o for o in observed}, route=route, ingress_ok=ingress_ok)

    async def _observe_cluster(self, cluster: ClusterRecord, spec: ServiceSpec) -> ClusterObservation:
        alive = self.provider.processes_alive(cluster)
        if not alive:
            reason = self.provider.exit_reason(cluster) if cluster.head_pid is not None else None
            return ClusterObservation(name=cluster.name, processes_alive=False, error=reason)
        dead_workers = self.provider.dead_workers(cluster)
        if dead_workers:
            reason = f"worker pid {dead_workers[0]} exited: {self.provider.exit_reason(cluster, dead_workers[0])}"
            return ClusterObservation(
                name=cluster.name, processes_alive=True, dead_workers=len(dead_workers), error=reason
            )
        try:
            apps = await self.serve.applications(cluster.dashboard_url)
        except (RetryableServeError, PermanentServeError) as exc:
            return ClusterObservation(name=cluster.name, processes_alive=True, error=str(exc))
        healthy, routes, probes = await asyncio.gather(
            self.serve.proxy_healthy(cluster.serve_url),
            self.serve.proxy_routes(cluster.serve_url),
            self.probes.run(cluster.name, cluster.serve_url, spec.spec.readiness.probes),
        )
        return ClusterObservation(
            probes=probes,
            name=cluster.name,
            processes_alive=True,
            dashboard_ok=True,
            apps=apps,
            proxy_healthy=healthy,
            routes=routes,
        )

    # -- execute -------------------------------------------------------------------------

    async def _execute(
        self, action: act.Action, service: ServiceRecord, spec: ServiceSpec, events: list[Event]
    ) -> None:
        if isinstance(action, act.CreateCluster):
            self._create_cluster(service, spec, action.role)
        elif isinstance(action, act.StartCluster):
            cluster = self.store.get_cluster(action.cluster)
            if cluster is not None:
                self._start_cluster(cluster)
        elif isinstance(action, act.SubmitConfig):
            await self._submit_config(action, service, spec, events)
        elif isinstance(action, act.UpdateCluster):
            self.store.update_cluster(action.cluster, **action.changes)
        elif isinstance(action, act.SetRoute):
            await self._set_route(service, spec, action, events)
        elif isinstance(action, act.RemoveRoute):
            await self.ingress.remove_route(service.name)
        elif isinstance(action, act.DeleteCluster):
            self._delete_cluster(action.cluster, service.name, events)
        elif isinstance(action, act.ForgetService):
            self.store.delete_service_row(service.name)

    def _create_cluster(self, service: ServiceRecord, spec: ServiceSpec, role: ClusterRole) -> None:
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
        self.store.put_cluster(cluster)  # intent first: a crash from here on leaves nothing unknown
        if faults.armed() and self.store.list_clusters(service.name) != [cluster]:
            faults.crash_point("cluster-intent-written")
        self._start_cluster(cluster)

    def _start_cluster(self, cluster: ClusterRecord) -> None:
        if cluster.name in self._background and not self._background[cluster.name].done():
            return
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        try:
            if cluster.head_pid is None:
                cluster = self.provider.start_head(cluster, config)
                self.store.update_cluster(cluster.name, head_pid=cluster.head_pid)
                if faults.armed() and len(self.store.list_clusters(cluster.service)) > 1:
                    faults.crash_point("pending-started")
        except (OSError, ProviderError) as exc:
            self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")
            return
        if len(cluster.worker_pids) < config.worker_count():
            self._background[cluster.name] = asyncio.create_task(self._start_workers(cluster, config))

    async def _start_workers(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        def record(updated: ClusterRecord) -> None:
            self.store.update_cluster(updated.name, worker_pids=updated.worker_pids)

        try:
            await self.provider.start_workers(cluster, config, record)
        except (OSError, ProviderError) as exc:
            logger.warning("[%s/%s] worker start failed: %s", cluster.service, cluster.name, exc)
            with contextlib.suppress(KeyError):
                self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")

    async def _submit_config(
        self, action: act.SubmitConfig, service: ServiceRecord, spec: ServiceSpec, events: list[Event]
    ) -> None:
        cluster = self.store.update_cluster(action.cluster, submitted_config_hash=action.config_hash)
        document = build_serve_config(spec, cluster)
        # Audited before the PUT: a second attempt on the same cluster can never go unseen.
        self.store.record_submission(cluster.name, action.config_hash, self.clock())
        try:
            await self.serve.put_config(cluster.dashboard_url, document)
        except RetryableServeError as exc:
            logger.info("[%s/%s] config PUT will be retried: %s", service.name, cluster.name, exc)
            raise _StopTick from exc
        except PermanentServeError as exc:
            reason = f"ConfigRejected: {exc.body}"
            self.store.update_cluster(cluster.name, failure_reason=reason)
            if cluster.role == ClusterRole.ACTIVE:
                current = self.store.get_service(service.name)
                if current is not None and current.generation == service.generation:
                    self.store.put_service(
                        current.with_changes(failed_generation=service.generation, failure_reason=reason)
                    )
            events.append(Event(service.name, self.clock(), "Warning", "ConfigRejected", str(exc)))
            raise _StopTick from exc
        if (
            faults.armed()
            and cluster.role == ClusterRole.PENDING
            and len(self.store.list_clusters(cluster.service)) > 1
        ):
            faults.crash_point("config-submitted")
        now = self.clock()
        self.store.update_cluster(cluster.name, applied_config_hash=action.config_hash, config_submitted_at=now)

    async def _set_route(
        self, service: ServiceRecord, spec: ServiceSpec, action: act.SetRoute, events: list[Event]
    ) -> None:
        upstreams = {}
        for name in action.upstreams:
            cluster = self.store.get_cluster(name)
            if cluster is not None:
                upstreams[name] = cluster.serve_url
        try:
            await self.ingress.set_route(service.name, spec.spec.ingress.port, action.active, upstreams)
        except IngressError as exc:
            # Nothing after the switch may run: roles change only once the ingress acknowledged.
            events.append(Event(service.name, self.clock(), "Warning", "RouteFailed", str(exc)))
            raise _StopTick from exc
        switched = self.store.get_cluster(action.active) if faults.armed() else None
        if switched is not None and switched.role == ClusterRole.PENDING:
            faults.crash_point("route-switched")

    def _delete_cluster(self, name: str, service: str, events: list[Event]) -> None:
        cluster = self.store.get_cluster(name)
        if cluster is None:
            return
        if cluster.role != ClusterRole.DELETING:
            cluster = self.store.update_cluster(name, role=ClusterRole.DELETING)
        running = self._background.get(name)
        if running is not None and not running.done():
            if self._is_stop_task(running):
                return
            running.cancel()  # a start still in progress: stop it, then delete
        self._background[name] = asyncio.create_task(self._stop_cluster(cluster), name=f"stop-{name}")

    @staticmethod
    def _is_stop_task(task: asyncio.Task[None]) -> bool:
        return task.get_name().startswith("stop-")

    async def _stop_cluster(self, cluster: ClusterRecord) -> None:
        leftovers = await self.provider.stop(cluster)
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
        self.store.add_events(
            [Event(cluster.service, self.clock(), "Normal", "ClusterDeleted", f"{cluster.name} stopped and removed")]
        )
        logger.info("[%s/%s] cluster deleted", cluster.service, cluster.name)
        self.wake(cluster.service)

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self, stop_clusters: bool) -> None:
        self._stopping = True
        for task in self._service_tasks.values():
            task.cancel()
        await asyncio.gather(*self._service_tasks.values(), return_exceptions=True)
        if stop_clusters:
            for task in self._background.values():
                task.cancel()
            await asyncio.gather(*self._background.values(), return_exceptions=True)
            clusters = self.store.list_clusters()
            await asyncio.gather(*(self.provider.stop(c) for c in clusters))
            for cluster in clusters:
                self.store.remove_cluster(cluster.name)
        else:
            await asyncio.gather(*self._background.values(), return_exceptions=True)

    def status_snapshot(self, name: str) -> Observation | None:
        return self.observations.get(name)

    def debug_state(self) -> dict[str, Any]:
        return {"services": sorted(self._service_tasks), "background": sorted(self._background)}


class _StopTick(Exception):
    """The rest of this tick's actions must not run (their precondition failed)."""


def _is_ready(service: ServiceRecord) -> bool:
    ready = service.condition(ConditionType.READY)
    return ready is not None and ready.status
