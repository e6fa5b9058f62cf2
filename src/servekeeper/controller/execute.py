"""Execute: run the actions of one tick's plan against the world (clusters through the
provider, Serve configs through Ray's REST API, routes through the data plane), recording
intent in the store before each effect. Cluster starts and stops run beside the ticks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from servekeeper.controller.bounds import AutoscalerBounds
from servekeeper.controller.documents import Packages, SubmittedDocuments
from servekeeper.controller.environments import EnvironmentBuilds
from servekeeper.controller.head_moves import HeadMoves
from servekeeper.controller.metrics import ControllerMetrics
from servekeeper.controller.observe import DataPlanePort
from servekeeper.controller.probes import ProbeRunner
from servekeeper.controller.start_retries import StartRetries
from servekeeper.controller.submit import ConfigSubmissions, StopTick, TickOutcome
from servekeeper.core import actions as act
from servekeeper.core.hooks import Hooks
from servekeeper.core.serve_config import package_hash_of
from servekeeper.dataplane import Backend, DataPlaneError, ServiceRoute
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterPorts, ClusterRecord, Event, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.providers.base import ClusterProvider, ProviderError, launched_into
from servekeeper.providers.environments import environments_of, pinned
from servekeeper.providers.local_processes import local_temp_dir
from servekeeper.rayapi.serve_api import ServeClient
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)

UNPLACED = ClusterPorts(0, 0, 0, 0, 0, ())  # a draft's ports: the provider places the cluster


class Executor:
    def __init__(
        self,
        store: Store,
        provider: ClusterProvider,
        dataplane: DataPlanePort,
        serve: ServeClient,
        probes: ProbeRunner,
        documents: SubmittedDocuments,
        packages: Packages,
        state_dir: Path,
        clock: Callable[[], float],
        hooks: Hooks,
        metrics: ControllerMetrics,
        wake: Callable[[str], None],
    ) -> None:
        self.store = store
        self.provider = provider
        self.dataplane = dataplane
        self.serve = serve
        self.probes = probes
        self.documents = documents
        self.packages = packages
        self.state_dir = state_dir
        self.clock = clock
        self.hooks = hooks
        self.metrics = metrics
        self.wake = wake
        self.shortfalls: dict[str, str] = {}  # service -> why its next cluster cannot be placed now
        self.route_failures: dict[str, str] = {}  # service -> why its route was last refused
        self.unacknowledged_routes: set[str] = set()  # services whose last route push failed
        self.background: dict[str, asyncio.Task[None]] = {}  # cluster name -> its start or stop task
        self.pruning: asyncio.Task[None] | None = None  # environments pruned after a service's deletion
        self.prune_again = False  # a prune asked for while one ran
        self.start_retries = StartRetries(store, clock)
        self.head_moves = HeadMoves(store, provider, clock)
        self.autoscaler_bounds = AutoscalerBounds(store, provider, clock)
        self.environment_builds = EnvironmentBuilds(
            store, environments_of(state_dir), clock, prune_elsewhere=provider.prune_environments
        )
        self.submissions = ConfigSubmissions(store, provider, serve, documents, packages, clock, hooks, metrics)

    async def execute(self, action: act.Action, service: ServiceRecord, spec: ServiceSpec, tick: TickOutcome) -> None:
        if isinstance(action, act.CreateCluster):
            await self._create_cluster(service, spec, action.role)
        elif isinstance(action, act.StartCluster):
            cluster = self.store.get_cluster(action.cluster)
            if cluster is not None:
                cluster = None if cluster.name in self.background else self.start_retries.due(cluster)
            if cluster is not None:
                self._start_cluster(cluster)
        elif isinstance(action, act.RestartNodes):
            self._restart_nodes(action)
        elif isinstance(action, act.MoveHead):
            if action.cluster not in self.background:  # a start or stop under way ends first
                moved = await self.head_moves.move(action)
                if moved is not None:  # its endpoints changed: the route is pushed again
                    self.unacknowledged_routes.add(service.name)
                    self._start_cluster(moved)
        elif isinstance(action, act.SubmitConfig):
            await self.submissions.submit_config(action, service, spec, tick)
        elif isinstance(action, act.UpdateCluster):
            changes = dict(action.changes)
            applied = changes.get("applied_config_hash")
            if applied is not None:
                document = self.documents.get(action.cluster, applied)
                if document is not None:
                    changes["package_hash"] = package_hash_of(document)  # the code Ray runs now
            self.store.update_cluster(action.cluster, **changes)
        elif isinstance(action, act.UpdateAutoscaler):
            await self.autoscaler_bounds.update(action, tick)
        elif isinstance(action, act.UpdateClusters):
            with self.store.transaction():
                for name, changes in action.changes:
                    self.store.update_cluster(name, **changes)
        elif isinstance(action, act.SetRoute):
            await self._set_route(service, spec, action, tick)
        elif isinstance(action, act.SetTargetCapacity):
            await self.submissions.set_target_capacity(action, service, tick)
        elif isinstance(action, act.RemoveRoute):
            try:
                await self.dataplane.remove_route(service.name)
            except DataPlaneError as exc:
                self._route_failed(service.name, exc, tick)
                raise StopTick from exc
            self.route_failures.pop(service.name, None)
        elif isinstance(action, act.DeleteCluster):
            self._delete_cluster(action.cluster, service.name)
        elif isinstance(action, act.ForgetService):
            # Only the row this tick saw being deleted: an apply stored meanwhile survives.
            self.store.delete_service_row(service.name, expected_generation=service.generation)
            # Its last cluster went before its row did: its environment may be out of use only now.
            self._prune_soon()

    async def _create_cluster(self, service: ServiceRecord, spec: ServiceSpec, role: ClusterRole) -> None:
        config = pinned(spec.spec.rayClusterConfig)  # its environment fixed for its life
        suffix = secrets.token_hex(3)
        name = f"{service.name}-g{service.generation}-{suffix}"
        draft = ClusterRecord(
            name=name,
            service=service.name,
            generation=service.generation,
            cluster_spec_hash=spec.cluster_spec_hash(),
            cluster_spec_json=config.model_dump_json(),
            role=role,
            ports=UNPLACED,
            # Under a private per-user parent (Ray opens the dir itself to everyone), and short.
            temp_dir=local_temp_dir(f"{suffix}{secrets.token_hex(2)}"),
            log_dir=str(self.state_dir / "clusters" / name),
            created_at=self.clock(),
        )
        try:
            # Intent first: the provider stores the record before anything starts, so that a
            # crash from here on leaves nothing unknown.
            cluster = await self.provider.create(draft, config, self.store)
        except ProviderError as exc:
            # The rollout waits (level-triggered: the next tick tries again) and says why.
            if self.shortfalls.get(service.name) != str(exc):
                event = Event(service.name, self.clock(), "Warning", "InsufficientCapacity", str(exc))
                self.store.add_events([event])
            self.shortfalls[service.name] = str(exc)
            return
        self.shortfalls.pop(service.name, None)
        if cluster.failure_reason is not None:
            return  # stored failed (waiting would not mend it): the planner fails the rollout
        self.hooks.reached("cluster-intent-written", cluster)
        self._start_cluster(cluster)

    def _start_cluster(self, cluster: ClusterRecord) -> None:
        if cluster.name in self.background:
            return  # its start (or stop) is in progress
        if cluster.failure_reason is not None:
            return  # failed: the planner deletes it; starting it again would only hide the cause
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if not self.environment_builds.ready(config):  # built first; a later tick starts it
            build = self.environment_builds.build(cluster, config)
            self._in_background(cluster, f"environment-{cluster.name}", build)
            return
        try:
            if cluster.head_pid is None:
                started = self.provider.start_head(cluster, config)
                if started.head_pid is not None:  # spawned within the tick (a local head)
                    cluster = started
                    self.store.update_cluster(cluster.name, head_pid=cluster.head_pid, nodes=cluster.nodes)
                    self.hooks.reached("pending-started", cluster)
        except (OSError, ProviderError) as exc:
            self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")
            return
        if self.provider.needs_nodes(cluster, config):
            self._in_background(cluster, f"start-{cluster.name}", self._start_nodes(cluster, config))

    async def _start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        head_started = False

        def record(**changes: Any) -> None:
            nonlocal head_started
            if "nodes" in changes:  # only the nodes this start launched: a tick may have cleared others
                current = self.store.get_cluster(cluster.name) or cluster
                merged = launched_into(current, cluster, changes["nodes"])
                changes = {**changes, "nodes": merged.nodes, "head_pid": merged.head_pid}
                changes["worker_pids"] = merged.worker_pids
            updated = self.store.update_cluster(cluster.name, **changes)
            if updated.head_pid is not None and cluster.head_pid is None:
                if not head_started and updated.nodes and updated.nodes[0].restarts > 0:
                    self._head_restarted(updated)
                head_started = True
                self.hooks.reached("pending-started", updated)

        try:
            await self.provider.start_nodes(cluster, config, record)
            self.start_retries.forget(cluster.name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            current = self.store.get_cluster(cluster.name)
            if current is not None and current.role not in (ClusterRole.PENDING, ClusterRole.STANDBY):
                # A node of a serving cluster started again: the cluster stays (one node short,
                # unhealthy, replaced after the threshold); the start is tried again after a pause.
                message = f"{cluster.name}: {exc}; {self.start_retries.failed(cluster, exc)}"
                logger.warning("[%s/%s] node start failed: %s", cluster.service, cluster.name, message)
                event = Event(cluster.service, self.clock(), "Warning", "NodeStartFailed", message)
                self.store.add_events([event])
                return
            logger.warning("[%s/%s] node start failed: %s", cluster.service, cluster.name, exc)
            with contextlib.suppress(KeyError):  # whatever stops a start fails that cluster's rollout
                self.store.update_cluster(cluster.name, failure_reason=f"StartFailed: {exc}")
        finally:
            await self.autoscaler_bounds.after_start(cluster)

    def _head_restarted(self, cluster: ClusterRecord) -> None:
        """The head started again in place runs (its pid recorded): its GCS store was found."""
        head = cluster.nodes[0]
        message = f"the head of {cluster.name} runs again on host {head.host} (pid {head.pid}) with its GCS state"
        self.store.add_events([Event(cluster.service, self.clock(), "Normal", "HeadRestarted", message)])

    def _restart_nodes(self, action: act.RestartNodes) -> None:
        """Clear the exited nodes' pids in the record as stored now (a start beside the ticks may
        have recorded others since the tick's look), then start them again."""
        current = self.store.get_cluster(action.cluster)
        if current is None or current.role == ClusterRole.DELETING:
            return
        restarted = self.provider.restarted(current, action.pids)
        self.store.update_cluster(
            current.name, nodes=restarted.nodes, worker_pids=restarted.worker_pids, head_pid=restarted.head_pid
        )
        self._start_cluster(restarted)

    def _prune_soon(self) -> None:
        """Prune the environments beside the ticks (a pool's hosts answer over SSH), one prune at
        a time; one asked for while another runs follows it (that one read the store before)."""
        if self.pruning is not None and not self.pruning.done():
            self.prune_again = True
            return
        self.pruning = asyncio.create_task(self._prune_while_asked(), name="prune-environments")
        self.pruning.add_done_callback(_log_failure)

    async def _prune_while_asked(self) -> None:
        self.prune_again = True
        while self.prune_again:
            self.prune_again = False
            await self.environment_builds.prune()

    def _in_background(
        self, cluster: ClusterRecord, task_name: str, work: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        """Run a cluster's start or stop beside the ticks; tracked until it ends, its failure an event."""
        task = asyncio.create_task(work, name=task_name)
        self.background[cluster.name] = task

        def finished(done: asyncio.Task[None]) -> None:
            if self.background.get(cluster.name) is done:
                del self.background[cluster.name]
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:
                logger.error("[%s/%s] %s failed: %r", cluster.service, cluster.name, task_name, error)
                message = f"{task_name}: {type(error).__name__}: {error}"
                event = Event(cluster.service, self.clock(), "Warning", "BackgroundTaskFailed", message)
                self.store.add_events([event])
            self.wake(cluster.service)

        task.add_done_callback(finished)
        return task

    def _route_failed(self, service: str, exc: DataPlaneError, tick: TickOutcome) -> None:
        """One event per distinct failure: the tick is retried at once, and a port held by
        another program fails the same way until it is freed."""
        if self.route_failures.get(service) != str(exc):
            tick.events.append(Event(service, self.clock(), "Warning", "RouteFailed", str(exc)))
        self.route_failures[service] = str(exc)

    async def _set_route(
        self, service: ServiceRecord, spec: ServiceSpec, action: act.SetRoute, tick: TickOutcome
    ) -> None:
        try:
            self.unacknowledged_routes.add(service.name)
            await self.dataplane.set_route(self._service_route(service, spec, action))
            self.unacknowledged_routes.discard(service.name)
        except DataPlaneError as exc:
            # Nothing after the switch may run: roles change only once the ingress acknowledged.
            self._route_failed(service.name, exc, tick)
            raise StopTick from exc
        self.route_failures.pop(service.name, None)
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
            # A Serve proxy on every node of a multi-host cluster: Envoy spreads over them, ejects a dead one.
            http = self.provider.endpoints(cluster, grpc=False)
            grpc = self.provider.endpoints(cluster, grpc=True) if ingress.grpcPort is not None else ()
            backends.append(Backend(name, http=http, grpc=grpc))
        weights = action.weights()
        return ServiceRoute(
            service=service.name,
            port=ingress.port,
            backends=tuple(backends),
            weights={b.name: weights.get(b.name, 0) for b in backends},
            preview_port=ingress.previewPort,
            preview_backend=action.preview if any(b.name == action.preview for b in backends) else None,
            standby=action.standby if any(b.name == action.standby for b in backends) else None,
            header_route=action.header_route if any(b.name == action.header_backend for b in backends) else None,
            header_backend=action.header_backend if any(b.name == action.header_backend for b in backends) else None,
            mirror=action.mirror if action.mirror and any(b.name == action.mirror.backend for b in backends) else None,
            grpc_port=ingress.grpcPort,
            max_request_bytes=ingress.maxRequestBytes,
            request_timeout_s=ingress.requestTimeoutSeconds,
            idle_timeout_s=ingress.idleTimeoutSeconds,
            silent_upstream_s=ingress.silentUpstreamSeconds,
        )

    def _delete_cluster(self, name: str, service: str) -> None:
        cluster = self.store.get_cluster(name)
        if cluster is None:
            return
        if cluster.role != ClusterRole.DELETING:
            cluster = self.store.update_cluster(name, role=ClusterRole.DELETING)
        running = self.background.get(name)
        if running is not None:
            if running.get_name().startswith("stop-"):
                return
            running.cancel()  # a start still in progress: stop it, then delete
        self._in_background(cluster, f"stop-{name}", self._stop_cluster(cluster, after=running))

    async def _stop_cluster(self, cluster: ClusterRecord, after: asyncio.Task[None] | None = None) -> None:
        if after is not None:
            # The cancelled start first finishes a node launch under way and records it (a start
            # over SSH does): stopped before that, the node would outlive its record.
            await asyncio.wait({after})
            cluster = self.store.get_cluster(cluster.name) or cluster
        leftovers = await self.stop_any(cluster)
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
        self.start_retries.forget(cluster.name)
        self.head_moves.forget(cluster.name)
        self.autoscaler_bounds.failures.pop(cluster.name, None)
        self.probes.forget(cluster.name)
        self.documents.forget(cluster.name)
        self.store.add_events(
            [Event(cluster.service, self.clock(), "Normal", "ClusterDeleted", f"{cluster.name} stopped and removed")]
        )
        await self.environment_builds.prune()
        logger.info("[%s/%s] cluster deleted", cluster.service, cluster.name)

    async def stop_any(self, cluster: ClusterRecord) -> list[int | str]:
        def record(**changes: Any) -> None:  # a part stopped: its room is free again
            with contextlib.suppress(KeyError):
                self.store.update_cluster(cluster.name, **changes)

        return list(await self.provider.stop(cluster, record))


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("environments not pruned: %r", task.exception())
