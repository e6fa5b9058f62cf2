"""The reconcile loop: observe -> plan -> execute -> persist, one task per service.

A tick never blocks on a long operation: cluster starts and deletions run as background tasks
whose progress is recorded in the store, and later ticks observe where they got to. What a tick
sees is built in `observe.py`; its actions run in `execute.py` (Serve configs in `submit.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from servekeeper.controller.documents import Packages, SubmittedDocuments
from servekeeper.controller.execute import Executor
from servekeeper.controller.metrics import ControllerMetrics
from servekeeper.controller.observe import DataPlanePort, Observer
from servekeeper.controller.probes import ProbeRunner
from servekeeper.controller.submit import StopTick, TickOutcome
from servekeeper.core import actions as act
from servekeeper.core.hooks import Hooks
from servekeeper.core.planner import plan
from servekeeper.core.planner.workers import released_between
from servekeeper.model.enums import ClusterRole, ConditionType, SwitchGate
from servekeeper.model.observation import Observation
from servekeeper.model.records import ClusterRecord, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.providers.base import ClusterProvider
from servekeeper.rayapi.serve_api import ServeClient
from servekeeper.store.revisions import PROGRESSING
from servekeeper.store.store import Store

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
        dataplane: DataPlanePort,
        session: aiohttp.ClientSession,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        gate: SwitchGate = SwitchGate.READY,
        hooks: Hooks | None = None,
        serve: ServeClient | None = None,
        metrics: ControllerMetrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics or ControllerMetrics()  # rollouts, config PUTs, tick durations
        self.provider = provider  # every cluster's, on this machine or on other hosts: one seam
        self.dataplane = dataplane
        self.serve = serve or ServeClient(session)
        self.probes = ProbeRunner(session, clock)
        self.state_dir = state_dir
        self.clock = clock
        self.gate = gate
        self.documents = SubmittedDocuments(store)
        packages = Packages(state_dir / "packages")
        self.executor = Executor(
            store,
            provider,
            dataplane,
            self.serve,
            self.probes,
            self.documents,
            packages,
            state_dir,
            clock,
            hooks or Hooks(),
            self.metrics,
            self.wake,
        )
        self.observer = Observer(
            provider,
            dataplane,
            self.serve,
            self.probes,
            self.documents,
            packages,
            self.executor.shortfalls,
            self.executor.unacknowledged_routes,
            clock,
        )
        self.observations: dict[str, Observation] = {}
        self._service_tasks: dict[str, asyncio.Task[None]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._stopping = False

    @property
    def hooks(self) -> Hooks:
        return self.executor.hooks

    @hooks.setter
    def hooks(self, hooks: Hooks) -> None:
        """Tests swap the hooks after construction: every part that reaches a point gets them."""
        self.executor.hooks = hooks
        self.executor.submissions.hooks = hooks

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
                self._forget_service(name)
                return  # the service is gone
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wakeup.wait(), delay)

    def _forget_service(self, name: str) -> None:
        """Drop what the controller holds per service once it is gone (a new apply of the name
        starts afresh): without this, each name ever deleted would keep its state and series."""
        self._wakeups.pop(name, None)
        if self.store.get_service(name) is not None:
            return  # applied again while it was being forgotten: its next loop needs its state
        if self._service_tasks.get(name) is asyncio.current_task():
            del self._service_tasks[name]
        self.observations.pop(name, None)
        self.observer.forget_service(name)
        self.executor.shortfalls.pop(name, None)
        self.executor.route_failures.pop(name, None)
        self.executor.unacknowledged_routes.discard(name)
        self.metrics.forget_service(name)

    async def tick(self, name: str) -> float | None:
        """One reconcile pass for one service; returns the delay before the next, or None."""
        service = self.store.get_service(name)
        if service is None:
            return None
        spec = ServiceSpec.model_validate_json(service.spec_json)
        clusters = self.store.list_clusters(name)
        observation = await self.observer.observe(service, clusters, spec)
        if released_between(clusters, self.store.list_clusters(name)):
            return FAST_TICK_SECONDS  # a node Ray released as this tick looked: its exit is no death
        self.observations[name] = observation
        decision = plan(spec, service, clusters, observation, self.clock(), self.gate)
        if not any(isinstance(action, act.CreateCluster) for action in decision.actions):
            self.executor.shortfalls.pop(name, None)  # nothing waits for room now: no stale InsufficientCapacity
        failed = decision.service.failed_generation != service.failed_generation
        if failed:
            # A rollout failure is a decision, not a reading: stored before the actions that
            # follow from it (a restore PUT), so a crash after them cannot re-send the failed config.
            self._persist_status(service, service.with_changes(**_failure_fields(decision.service)), only_failure=True)
        tick = TickOutcome()
        completed = False
        try:
            for action in decision.actions:
                await self.executor.execute(action, service, spec, tick)
            completed = True
        except StopTick:
            pass  # logged where raised; the next tick re-plans from what is stored
        finally:
            # The plan's status and events describe the world after ALL its actions: when one
            # failed, neither is true, so only what this tick learned is kept (the next tick
            # re-plans from the store and says it again once it is so).
            after = decision.service if completed else service.with_changes(**_failure_fields(decision.service))
            failure_events = [e for e in decision.events if failed and e.reason in ("RolloutFailed", "RolloutAborted")]
            # A completed plan's events are stamped when its actions were done, not when it was
            # planned: "100% of traffic now goes to X" is true once the ingress acknowledged it,
            # which on loaded cores can be a second or more after the plan.
            done_at = self.clock()
            tick.events[:0] = [replace(e, time=done_at) for e in decision.events] if completed else failure_events
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
        busy = decision.actions or any(not _settled(c) for c in clusters)
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
            standby_failures=after.standby_failures,
            standby_retry_at=after.standby_retry_at,
        )

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self, stop_clusters: bool) -> None:
        self._stopping = True
        for task in self._service_tasks.values():
            task.cancel()
        await asyncio.gather(*self._service_tasks.values(), return_exceptions=True)
        await self.probes.close()
        background = list(self.executor.background.values())
        if stop_clusters:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            clusters = self.store.list_clusters()
            leftovers = await asyncio.gather(*(self.executor.stop_any(c) for c in clusters))
            for cluster, left in zip(clusters, leftovers, strict=True):
                if left:  # kept on record, so that the next `down` or `up` stops them again
                    logger.warning("[%s/%s] pids %s survived the stop", cluster.service, cluster.name, left)
                    continue
                self.store.remove_cluster(cluster.name)
        else:
            await asyncio.gather(*background, return_exceptions=True)
        if self.executor.pruning is not None:  # a prune is never worth waiting for at shutdown
            self.executor.pruning.cancel()
            await asyncio.gather(self.executor.pruning, return_exceptions=True)
        await self.provider.close()

    def status_snapshot(self, name: str) -> Observation | None:
        return self.observations.get(name)

    def debug_state(self) -> dict[str, Any]:
        return {"services": sorted(self._service_tasks), "background": sorted(self.executor.background)}


def _failure_fields(service: ServiceRecord) -> dict[str, Any]:
    return {"failed_generation": service.failed_generation, "failure_reason": service.failure_reason}


def _is_ready(service: ServiceRecord) -> bool:
    ready = service.condition(ConditionType.READY)
    return ready is not None and ready.status


def _settled(cluster: ClusterRecord) -> bool:
    """Nothing is changing on it: the active, or a standby that is ready."""
    return cluster.role == ClusterRole.ACTIVE or (cluster.role == ClusterRole.STANDBY and cluster.ready_at is not None)
