"""The pure reconcile decision: plan(spec, record, clusters, observation, now) -> Plan.

No I/O and no clock: everything the decision depends on comes in as an argument, so every
flow can be tested tick by tick on a fake clock. Running a plan twice is harmless: each tick
re-derives what to do from the stored record and a fresh observation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from servekeeper.core import canary
from servekeeper.core.actions import (
    Action,
    CreateCluster,
    DeleteCluster,
    ForgetService,
    RemoveRoute,
    RestartWorkers,
    SetRoute,
    SetTargetCapacity,
    StartCluster,
    SubmitConfig,
    UpdateCluster,
    UpdateClusters,
)
from servekeeper.core.canary_flow import canary_tick
from servekeeper.core.health import Verdict, health, judged_apps, readiness, switch_allowed
from servekeeper.core.serve_config import desired_config_hash
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.spec import CanarySpec, ServiceSpec
from servekeeper.model.status import (
    FAILED_APP_STATUSES,
    AppSource,
    AppStatus,
    CanaryState,
    ClusterObservation,
    ClusterRecord,
    ClusterRole,
    Condition,
    ConditionType,
    Event,
    NodePlacement,
    Observation,
    ServiceRecord,
    SwitchGate,
)

# An old cluster is kept at least this long after the switch: requests already on their way
# to it (accepted by the ingress a moment before the switch) must reach it.
MIN_DRAIN_SECONDS = 2.0
# Ray acknowledged a PUT but does not show the config yet: wait this long before sending it
# again (a PUT is idempotent for Ray, so a retry can only cost a little time).
CONFIG_VERIFY_SECONDS = 10.0
# A worker node whose process exited is started again at most this many times over its
# cluster's life; past it, it stays dead and the cluster's health says so.
MAX_WORKER_RESTARTS = 5


@dataclass
class Plan:
    service: ServiceRecord
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def _expected_workers(cluster: ClusterRecord) -> int:
    return RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json).worker_count()


def _restartable(cluster: ClusterRecord, exited: tuple[int, ...]) -> list[NodePlacement]:
    """The worker nodes among `exited` (pids) that may be started again where they were."""
    return [
        node
        for node in cluster.nodes
        if node.role == "worker" and node.pid in exited and not node.stopped and node.restarts < MAX_WORKER_RESTARTS
    ]


def _unobserved(name: str) -> ClusterObservation:
    return ClusterObservation(name=name, processes_alive=False, error="not observed")


class _Planner:
    def __init__(
        self,
        spec: ServiceSpec,
        service: ServiceRecord,
        clusters: list[ClusterRecord],
        observation: Observation,
        now: float,
        gate: SwitchGate,
    ) -> None:
        self.spec = spec
        self.service = service
        self.clusters = {cluster.name: cluster for cluster in clusters}
        self.observation = observation
        self.now = now
        self.gate = gate
        self.plan = Plan(service=service)
        self.declared = spec.declared_apps()
        self.all_apps = spec.judges_imperative_apps
        self.desired_cluster_hash = spec.cluster_spec_hash()
        self.desired_config_hash = desired_config_hash(spec, service.package_hash)

    # -- helpers -------------------------------------------------------------------------

    def _with_role(self, role: ClusterRole) -> list[ClusterRecord]:
        return sorted((c for c in self.clusters.values() if c.role == role), key=lambda c: (c.created_at, c.name))

    def _one(self, role: ClusterRole) -> ClusterRecord | None:
        found = self._with_role(role)
        return found[-1] if found else None

    def _observed(self, cluster: ClusterRecord) -> ClusterObservation:
        return self.observation.clusters.get(cluster.name) or _unobserved(cluster.name)

    def _do(self, action: Action) -> None:
        self.plan.actions.append(action)

    def _event(self, reason: str, message: str, warning: bool = False) -> None:
        self.plan.events.append(
            Event(
                service=self.service.name,
                time=self.now,
                type="Warning" if warning else "Normal",
                reason=reason,
                message=message,
            )
        )

    def _update_cluster(self, cluster: ClusterRecord, **changes: object) -> ClusterRecord:
        self._do(UpdateCluster(cluster.name, dict(changes)))
        updated = cluster.with_changes(**changes)
        self.clusters[cluster.name] = updated
        return updated

    def _delete(self, cluster: ClusterRecord, reason: str) -> None:
        self._do(DeleteCluster(cluster.name, reason))
        self.clusters[cluster.name] = cluster.with_changes(role=ClusterRole.DELETING)

    def _update_service(self, **changes: object) -> None:
        self.plan.service = self.plan.service.with_changes(**changes)

    @property
    def _rollout_failed(self) -> bool:
        return self.plan.service.failed_generation == self.plan.service.generation

    # -- flows ---------------------------------------------------------------------------

    def run(self) -> Plan:
        if self.service.deleting:
            self._delete_service()
            return self.plan
        self._restart_interrupted_work()
        self._record_deployed_configs()
        self._finish_acknowledged_switch()
        pending = self._one(ClusterRole.PENDING)
        if pending is not None:
            self._advance_pending(pending)
        if self._one(ClusterRole.PENDING) is None:
            self._maintain_active()
        self._maintain_route()
        self._drain()
        self._set_conditions()
        return self.plan

    def _delete_service(self) -> None:
        for cluster in list(self.clusters.values()):
            self._delete(cluster, "ServiceDeleted")
        if self.observation.route is not None:
            self._do(RemoveRoute())
        if not self.clusters:
            self._do(ForgetService())

    def _restart_interrupted_work(self) -> None:
        for cluster in self.clusters.values():
            if cluster.role == ClusterRole.DELETING:
                # Deletion is idempotent; a crash in the middle of it is finished here.
                self._do(DeleteCluster(cluster.name, "DeletionResumed"))
            elif cluster.head_pid is None or len(cluster.worker_pids) < _expected_workers(cluster):
                self._do(StartCluster(cluster.name))

    def _record_deployed_configs(self) -> None:
        """Applied means observed: record which config Ray runs, and the last one that ran well."""
        for cluster in list(self.clusters.values()):
            if cluster.role == ClusterRole.DELETING:
                continue
            observed = self._observed(cluster)
            deployed = observed.deployed_config_hash
            if deployed is None or observed.apps is None:
                continue
            if deployed != cluster.applied_config_hash:
                cluster = self._update_cluster(cluster, applied_config_hash=deployed)
            judged = judged_apps(observed.apps, self.declared, self.all_apps)
            running = all(name in judged for name in self.declared) and all(
                app.status == AppStatus.RUNNING for app in judged.values()
            )
            if running and cluster.good_config_hash != deployed:
                self._update_cluster(cluster, good_config_hash=deployed)

    def _finish_acknowledged_switch(self) -> None:
        """The ingress already routes to the pending cluster but the store does not say so:
        the controller stopped between the switch and recording it. Record it now."""
        pending = self._one(ClusterRole.PENDING)
        route = self.observation.route
        if pending is not None and route is not None and route.weight_of(pending.name) >= 100:
            self._promote(pending)

    def _promote(self, pending: ClusterRecord) -> None:
        for old in self._with_role(ClusterRole.ACTIVE):
            self._update_cluster(old, role=ClusterRole.DRAINING, drain_started_at=self.now)
        self._update_cluster(pending, role=ClusterRole.ACTIVE, ready_at=self.now)
        self._update_service(unhealthy_since=None)
        self._event("TrafficSwitched", f"100% of traffic now goes to cluster {pending.name}")

    def _pending_failure(self, pending: ClusterRecord, observed: ClusterObservation) -> str | None:
        if pending.abort_requested:
            return "Aborted: by `servekeeper abort`"
        if pending.failure_reason:
            return pending.failure_reason
        if self._rollout_failed and pending.canary is not None and pending.generation == self.service.generation:
            # Failed and stored, but stopped before the canary was retired: retire it now.
            return self.plan.service.failure_reason or "RolloutFailed"
        if pending.head_pid is not None and not observed.processes_alive:
            cause = f": {observed.error}" if observed.error else ""
            return f"HeadDied: the head of pending cluster {pending.name} exited before it was ready{cause}"
        # One on a silent host may not come back; one that keeps exiting will not.
        if observed.dead_workers > len(_restartable(pending, observed.exited_workers)):
            return f"WorkerDied: pending cluster {pending.name}: {observed.error}"
        if pending.applied_config_hash == self.desired_config_hash and observed.apps is not None:
            for name, app in sorted(judged_apps(observed.apps, self.declared, self.all_apps).items()):
                if app.status in FAILED_APP_STATUSES:
                    return f"AppFailed: application {name!r} is {app.status.value}: {app.message}".rstrip(": ")
        age = self.now - pending.created_at
        if pending.canary is None and age > self.spec.spec.readinessTimeoutSeconds:
            verdict = self._switch_verdict(observed)
            return (
                f"ReadinessTimeout: pending cluster {pending.name} not ready after "
                f"{self.spec.spec.readinessTimeoutSeconds:g}s ({verdict.reason}: {verdict.message})"
            )
        return None

    def _advance_pending(self, pending: ClusterRecord) -> None:
        # A canary runs one generation's spec: a newer one starts over on a cluster of its own.
        superseded_canary = pending.canary is not None and pending.generation != self.service.generation
        if pending.cluster_spec_hash != self.desired_cluster_hash or superseded_canary:
            self._retire(pending, "SpecChanged")
            self._event(
                "PendingClusterReplaced",
                f"the spec changed while {pending.name} was coming up or in canary; replacing it",
            )
            return
        observed = self._observed(pending)
        failure = self._pending_failure(pending, observed)
        if failure is not None:
            self._fail_rollout(pending, failure)
            return
        if observed.exited_workers:  # within the readiness timeout, a worker that exited gets another go
            pending = self._restart_workers(pending, observed.exited_workers)
        active = self._one(ClusterRole.ACTIVE)
        if pending.canary is not None and active is not None:
            canary_tick(self, pending, active)  # analysis and commands go on whatever it looks like
            return
        if not observed.dashboard_ok:
            return  # still starting
        if pending.applied_config_hash != self.desired_config_hash:
            active = self._one(ClusterRole.ACTIVE)
            first_config = pending.applied_config_hash is None and pending.target_capacity is None
            if first_config and self._capacity_follows_traffic and active and self._canary_applies(pending, active):
                # Born at the first step's share: the upgrade never needs twice the replicas.
                pending = self._update_cluster(pending, target_capacity=self._first_canary_capacity())
            self._apply_config(pending, observed)
            return
        if observed.deployed_config_hash != self.desired_config_hash:
            return  # Ray is not seen running it at this moment: judge nothing on this look
        verdict = self._switch_verdict(observed)
        if verdict.ok:
            active = self._one(ClusterRole.ACTIVE)
            if active is not None and self._canary_applies(pending, active):
                canary_tick(self, pending, active)
            elif pending.target_capacity is not None and not self._settled_at(pending, 100.0):
                self._scale(pending, 100.0)  # all the traffic needs all the replicas first
            else:
                self._switch_all_traffic(pending)

    def _switch_all_traffic(self, pending: ClusterRecord) -> None:
        active = self._one(ClusterRole.ACTIVE)
        draining = [c.name for c in self._with_role(ClusterRole.DRAINING)]
        upstreams = (pending.name,) + ((active.name,) if active else ()) + tuple(draining)
        self._do(SetRoute(active=pending.name, upstreams=upstreams))
        self._promote(pending)

    def _canary_applies(self, pending: ClusterRecord, active: ClusterRecord) -> bool:
        """Steps for a new generation beside a healthy active; a replacement of a broken active
        (or a first cluster) takes all the traffic at once."""
        if pending.canary is not None:
            return True
        strategy = self.spec.spec.upgradeStrategy
        return (
            strategy.type == "Canary"
            and strategy.canary is not None
            and active.generation < pending.generation
            and self.plan.service.unhealthy_since is None
        )

    @property
    def _capacity_follows_traffic(self) -> bool:
        strategy = self.spec.spec.upgradeStrategy.canary
        return strategy is not None and strategy.capacityFollowsTraffic

    def _first_canary_capacity(self) -> float:
        strategy = self.spec.spec.upgradeStrategy.canary
        weights = [step.setWeight for step in strategy.steps if step.setWeight] if strategy else []
        return float(weights[0]) if weights else 100.0

    def _scale(self, cluster: ClusterRecord, capacity: float) -> ClusterRecord:
        """Want Serve's target_capacity at `capacity` on `cluster`; PUT it while Ray shows another."""
        if cluster.target_capacity != capacity:
            cluster = self._update_cluster(cluster, target_capacity=capacity)
        observed = self._observed(cluster)
        shown = observed.target_capacity if observed.target_capacity is not None else 100.0
        if observed.dashboard_ok and cluster.applied_config_hash is not None and shown != capacity:
            if not any(isinstance(a, SetTargetCapacity) and a.cluster == cluster.name for a in self.plan.actions):
                self._do(SetTargetCapacity(cluster.name, capacity))
        return cluster

    def _settled_at(self, cluster: ClusterRecord, capacity: float) -> bool:
        """Ray runs `cluster` at `capacity`, every judged deployment HEALTHY (none still scaling)."""
        observed = self._observed(cluster)
        shown = observed.target_capacity if observed.target_capacity is not None else 100.0
        judged = judged_apps(observed.apps or {}, self.declared, self.all_apps)
        settled = all(app.settled and app.status == AppStatus.RUNNING for app in judged.values())
        return shown == capacity and bool(judged) and settled

    def _canary_status(self, name: str, state: CanaryState, strategy: CanarySpec) -> str:
        return _canary_status_line(name, state, strategy, self.now)

    def _switch_verdict(self, observed: ClusterObservation) -> Verdict:
        return switch_allowed(self.gate, observed, self.declared, self.all_apps)

    def _name_conflicts(self, observed: ClusterObservation) -> list[str]:
        """Declared names already taken by apps created at run time: a PUT would replace them."""
        apps = observed.apps or {}
        return sorted(n for n in self.declared if n in apps and apps[n].source == AppSource.IMPERATIVE)

    def _apply_config(self, cluster: ClusterRecord, observed: ClusterObservation) -> None:
        conflicts = self._name_conflicts(observed)
        if conflicts:
            # Never overwrite an app servekeeper did not declare.
            reason = f"NameConflict: declared applications {conflicts} exist on {cluster.name} as imperative apps"
            if cluster.role == ClusterRole.PENDING:
                self._fail_rollout(cluster, reason)
            elif not self._rollout_failed:
                self._update_service(failed_generation=self.service.generation, failure_reason=reason)
                self._event("RolloutFailed", reason, warning=True)
            return
        self._submit(cluster, self.desired_config_hash)

    def _submit(self, cluster: ClusterRecord, config_hash: str, restore: bool = False) -> None:
        """PUT a config unless Ray acknowledged that very PUT a moment ago.

        A config Ray already runs was recorded as applied before we get here, so a PUT that
        went through before a crash is never sent twice; one that failed, timed out or never
        happened is sent again (Ray treats the same config as a no-op)."""
        acknowledged = (
            cluster.submitted_config_hash == config_hash
            and cluster.config_submitted_at is not None
            and self.now - cluster.config_submitted_at < CONFIG_VERIFY_SECONDS
        )
        if acknowledged:
            return
        self._do(SubmitConfig(cluster.name, config_hash, restore=restore))
        self.clusters[cluster.name] = cluster.with_changes(submitted_config_hash=config_hash, config_submitted_at=None)
        verb = "restoring the last good" if restore else "submitted"
        self._event("ConfigSubmitted", f"Serve config {config_hash} {verb} to {cluster.name}")

    def _retire(self, pending: ClusterRecord, why: str) -> None:
        """Take a pending cluster out: at once when it never had traffic; drained (weight 0
        first, deleted once idle) when a canary or the preview port sent it requests."""
        route = self.observation.route
        routed = pending.canary is not None or (route is not None and pending.name in route.upstreams)
        if not routed:
            self._delete(pending, why)
            return
        self.clusters[pending.name] = pending.with_changes(role=ClusterRole.DRAINING, drain_started_at=self.now)
        route_action = self._desired_route_action()
        if route_action is not None:
            self._do(route_action)
        changes = {"role": ClusterRole.DRAINING, "drain_started_at": self.now, "canary": pending.canary}
        self._do(UpdateCluster(pending.name, changes))

    def _fail_rollout(self, pending: ClusterRecord, reason: str) -> None:
        if pending.canary is not None and not pending.failure_reason:
            # First of all: a restart between here and the weight going to 0 must abort again,
            # not resume (an analysis verdict is not made twice the same).
            self._do(UpdateCluster(pending.name, {"failure_reason": reason}))
        self._retire(pending, "RolloutFailed")
        if pending.generation == self.service.generation:
            # Recorded per generation: the same spec is not retried blindly; a new apply retries.
            self._update_service(failed_generation=self.service.generation, failure_reason=reason)
        # A failed replacement of an unhealthy cluster waits a full threshold before the next try.
        if self.plan.service.unhealthy_since is not None:
            self._update_service(unhealthy_since=self.now)
        aborted = reason.startswith(("Aborted", "AnalysisFailed"))
        self._event("RolloutAborted" if aborted else "RolloutFailed", reason, warning=True)

    def _maintain_active(self) -> None:
        active = self._one(ClusterRole.ACTIVE)
        if active is None:
            if not self._rollout_failed:
                first = not any(c.role != ClusterRole.DELETING for c in self.clusters.values())
                self._create(ClusterRole.PENDING, "FirstApply" if first else "NoActiveCluster")
            return
        observed = self._observed(active)
        if observed.exited_workers:
            active = self._restart_workers(active, observed.exited_workers)
        if active.abort_requested:
            # `abort` reached it while a tick was promoting it: say so, since abort was accepted.
            self._event(
                "AbortTooLate",
                f"{active.name} was promoted before the abort arrived; `servekeeper undo` rolls back",
                warning=True,
            )
            self._update_cluster(active, abort_requested=False)
        if active.target_capacity is not None:
            self._scale(active, 100.0)  # no canary beside it (any more): every replica
        if active.cluster_spec_hash == self.desired_cluster_hash and self._in_place_failed(active, observed):
            return
        if self._restoring(active):
            # The failure is the new config's and the last good one is going back: health is
            # not judged meanwhile, so no replacement (with the same broken config) starts.
            if observed.dashboard_ok and active.good_config_hash is not None:  # always set while restoring
                self._submit(active, active.good_config_hash, restore=True)
            return
        verdict = health(observed, self.declared, self.all_apps)
        self._track_health(verdict)
        if active.cluster_spec_hash != self.desired_cluster_hash:
            if self.spec.spec.upgradeStrategy.type != "None" and not self._rollout_failed:
                if not self._switch_back_to_kept(active):
                    self._create(ClusterRole.PENDING, "ClusterSpecChanged")
            return
        unhealthy_since = self.plan.service.unhealthy_since
        threshold = self.spec.spec.serviceUnhealthySecondThreshold
        if unhealthy_since is not None and self.now - unhealthy_since >= threshold:
            if self._rollout_failed:
                # The only spec to build a replacement from is the one whose rollout failed: a
                # replacement would fail the same way, over and over. Apply a fixed spec.
                return
            self._create(ClusterRole.PENDING, f"ActiveUnhealthy: {verdict.reason}: {verdict.message}")
            return
        if active.applied_config_hash != self.desired_config_hash and not self._rollout_failed:
            if self._switch_back_to_kept(active):
                return
            if self.spec.spec.rolls_config_changes_on_new_cluster:
                self._create(ClusterRole.PENDING, "ServeConfigChanged")
            elif observed.dashboard_ok:
                self._apply_config(active, observed)

    def _restart_workers(self, cluster: ClusterRecord, exited: tuple[int, ...]) -> ClusterRecord:
        """Worker nodes whose process exited are started again where they were (as KubeRay
        recreates a worker pod): the cluster is not replaced for a lost worker. Only nodes
        recorded with their placement (a host pool's) can be, each at most MAX_WORKER_RESTARTS
        times: one that keeps exiting stays dead (the rollout fails, or the active cluster is
        replaced after the unhealthy threshold)."""
        gone = _restartable(cluster, exited)
        if not gone:
            return cluster
        self._do(RestartWorkers(cluster.name, tuple(node.pid for node in gone if node.pid is not None)))
        for node in gone:
            self._event(
                "WorkerRestarting",
                f"worker node pid {node.pid} of {cluster.name} on host {node.host} exited; starting it again "
                f"there (restart {node.restarts + 1} of at most {MAX_WORKER_RESTARTS})",
                warning=True,
            )
        pids = {node.pid for node in gone}
        nodes = tuple(
            replace(n, pid=None, session_id=None, restarts=n.restarts + 1) if n in gone else n for n in cluster.nodes
        )
        updated = cluster.with_changes(nodes=nodes, worker_pids=tuple(p for p in cluster.worker_pids if p not in pids))
        self.clusters[cluster.name] = updated  # the controller writes it (RestartWorkers), from the stored record
        return updated

    def _switch_back_to_kept(self, active: ClusterRecord) -> bool:
        """A cluster still kept after a switch (rollback window, or draining) already runs what
        is desired now (an `undo`): traffic goes back to it at once, no new cluster."""
        for kept in reversed(self._with_role(ClusterRole.DRAINING)):
            observed = self._observed(kept)
            if (
                kept.ready_at is not None  # it served as active: never a retired canary
                and kept.cluster_spec_hash == self.desired_cluster_hash
                and kept.applied_config_hash == self.desired_config_hash
                and observed.deployed_config_hash == self.desired_config_hash
                and self._switch_verdict(observed).ok
            ):
                if kept.target_capacity is not None and not self._settled_at(kept, 100.0):
                    self._scale(kept, 100.0)  # shrunk by a canary: its replicas back before its traffic
                    return True
                self.clusters[kept.name] = kept.with_changes(role=ClusterRole.ACTIVE)
                self.clusters[active.name] = active.with_changes(role=ClusterRole.DRAINING)
                route_action = self._desired_route_action()
                if route_action is not None:
                    self._do(route_action)
                # One transaction: a crash can never leave both draining (or both active).
                swap = (
                    (active.name, {"role": ClusterRole.DRAINING, "drain_started_at": self.now}),
                    (kept.name, {"role": ClusterRole.ACTIVE, "drain_started_at": None, "ready_at": self.now}),
                )
                self._do(UpdateClusters(swap))
                self.clusters[active.name] = active.with_changes(**swap[0][1])
                self.clusters[kept.name] = kept.with_changes(**swap[1][1])
                self._event("TrafficSwitchedBack", f"100% of traffic back on kept cluster {kept.name}; no new cluster")
                return True
        return False

    def _in_place_failed(self, active: ClusterRecord, observed: ClusterObservation) -> bool:
        """The desired config runs on the active cluster and one of its apps failed: the
        rollout failed (never retried blindly, never replaced in a loop), and the last good
        config goes back on the cluster."""
        if self._rollout_failed or active.applied_config_hash != self.desired_config_hash:
            return False
        if observed.deployed_config_hash != self.desired_config_hash or observed.apps is None:
            return False
        if active.good_config_hash == self.desired_config_hash:
            return False  # it ran well under this config: a later failure is a health matter
        for name, app in sorted(judged_apps(observed.apps, self.declared, self.all_apps).items()):
            if app.status in FAILED_APP_STATUSES:
                reason = f"AppFailed: application {name!r} is {app.status.value}: {app.message}".rstrip(": ")
                self._update_service(
                    failed_generation=self.service.generation, failure_reason=reason, unhealthy_since=None
                )
                self._event("RolloutFailed", reason, warning=True)
                if active.good_config_hash is not None:
                    self._submit(active, active.good_config_hash, restore=True)
                return True
        return False

    def _restoring(self, active: ClusterRecord) -> bool:
        return (
            self._rollout_failed
            and active.good_config_hash is not None
            and active.applied_config_hash != active.good_config_hash
            and active.applied_config_hash == self.desired_config_hash
        )

    def _track_health(self, verdict: Verdict) -> None:
        since = self.plan.service.unhealthy_since
        if verdict.ok and since is not None:
            self._update_service(unhealthy_since=None)
            self._event("ClusterHealthy", "the active cluster is healthy again")
        elif not verdict.ok and since is None:
            self._update_service(unhealthy_since=self.now)
            self._event("ClusterUnhealthy", f"{verdict.reason}: {verdict.message}", warning=True)

    def _create(self, role: ClusterRole, reason: str) -> None:
        self._do(CreateCluster(role=role, reason=reason))
        self._event("ClusterCreating", f"creating a {role.value} cluster ({reason})")

    def _desired_route_action(self) -> SetRoute | None:
        """The route as the clusters' roles (as planned so far) want it: the active takes what
        a canary does not; draining clusters stay listed at 0 so their in-flight requests are
        counted; the preview port goes to the pending cluster."""
        active = self._one(ClusterRole.ACTIVE)
        if active is None:
            return None
        pending = self._one(ClusterRole.PENDING)
        canary_weight = pending.canary.weight if pending is not None and pending.canary is not None else 0
        preview = None
        if pending is not None and self.spec.spec.ingress.previewPort is not None and pending.head_pid is not None:
            preview = pending.name
        upstreams = [active.name]
        if pending is not None and (canary_weight > 0 or preview is not None):
            upstreams.append(pending.name)
        upstreams += [c.name for c in self._with_role(ClusterRole.DRAINING)]
        return SetRoute(
            active=active.name,
            upstreams=tuple(upstreams),
            canary=pending.name if pending is not None and canary_weight > 0 else None,
            canary_weight=canary_weight,
            preview=preview,
        )

    def _maintain_route(self) -> None:
        if not self.observation.ingress_ok:
            return  # the data plane could not be read: nothing is known to be wrong with it
        wanted = self._desired_route_action()
        if wanted is None:
            return
        route = self.observation.route
        differs = (
            route is None
            or route.upstreams != frozenset(wanted.upstreams)
            or any(route.weight_of(name) != weight for name, weight in wanted.weights().items())
            or route.preview != wanted.preview
        )
        if differs and not any(isinstance(action, SetRoute) for action in self.plan.actions):
            self._do(wanted)

    def _drain(self) -> None:
        route = self.observation.route
        window = self.spec.spec.rollbackWindowSeconds
        removed = []
        for cluster in self._with_role(ClusterRole.DRAINING):
            started = cluster.drain_started_at if cluster.drain_started_at is not None else self.now
            elapsed = self.now - started
            # A cluster that served as active is kept (no traffic) for the rollback window.
            kept_for = window if cluster.ready_at is not None else 0.0
            if elapsed < kept_for:
                continue
            deadline = max(self.spec.spec.rayClusterDeletionDelaySeconds, kept_for)
            counted = self.observation.ingress_ok and route is not None and cluster.name in route.upstreams
            idle = counted and route is not None and route.inflight.get(cluster.name, 0) == 0
            if idle and elapsed >= min(MIN_DRAIN_SECONDS, deadline):
                removed.append((cluster, f"no request in flight after {elapsed:.1f}s"))
            elif elapsed >= deadline:
                inflight = route.inflight.get(cluster.name, "unknown") if route else "unknown"
                removed.append((cluster, f"deletion delay of {deadline:g}s reached ({inflight} in flight)"))
        if not removed:
            return
        for cluster, _ in removed:
            self.clusters[cluster.name] = cluster.with_changes(role=ClusterRole.DELETING)
        # Take them out of the ingress first, then stop them.
        route_action = self._desired_route_action()
        if route_action is not None:
            self._do(route_action)
        for cluster, why in removed:
            self._delete(cluster, "Drained")
            self._event("ClusterDrained", f"deleting old cluster {cluster.name}: {why}")

    # -- status --------------------------------------------------------------------------

    def _set_conditions(self) -> None:
        active = self._one(ClusterRole.ACTIVE)
        pending = self._one(ClusterRole.PENDING)
        service = self.plan.service
        conditions: list[tuple[ConditionType, bool, str, str]] = []

        if active is not None:
            verdict = readiness(self._observed(active), self.declared, self.all_apps)
            ready = (verdict.ok, verdict.reason, verdict.message or f"serving from {active.name}")
        else:
            ready = (False, "NoActiveCluster", "no cluster serves this service yet")
        conditions.append((ConditionType.READY, *ready))

        strategy = self.spec.spec.upgradeStrategy.canary
        if pending is not None and pending.canary is not None and strategy is not None:
            message = self._canary_status(pending.name, pending.canary, strategy)
            conditions.append((ConditionType.UPGRADE_IN_PROGRESS, True, "CanaryInProgress", message))
        elif pending is not None:
            verdict = self._switch_verdict(self._observed(pending))
            message = f"waiting for {pending.name}: {verdict.reason}" + (
                f": {verdict.message}" if verdict.message else ""
            )
            conditions.append((ConditionType.UPGRADE_IN_PROGRESS, True, "PendingClusterNotReady", message))
        elif any(isinstance(action, CreateCluster) for action in self.plan.actions):
            if self.observation.placement_problem:
                shortfall = self.observation.placement_problem
                conditions.append((ConditionType.UPGRADE_IN_PROGRESS, True, "InsufficientCapacity", shortfall))
            else:
                conditions.append((ConditionType.UPGRADE_IN_PROGRESS, True, "PendingClusterCreating", ""))
        else:
            conditions.append((ConditionType.UPGRADE_IN_PROGRESS, False, "NoPendingCluster", ""))

        if self._rollout_failed:
            reason, _, message = (service.failure_reason or "RolloutFailed").partition(": ")
            conditions.append((ConditionType.ROLLOUT_FAILED, True, reason, message))
        else:
            conditions.append((ConditionType.ROLLOUT_FAILED, False, "NoFailure", ""))

        outdated = (
            active is not None
            and active.cluster_spec_hash != self.desired_cluster_hash
            and self.spec.spec.upgradeStrategy.type == "None"
        )
        conditions.append(
            (
                ConditionType.CLUSTER_SPEC_OUTDATED,
                outdated,
                "UpgradeStrategyNone" if outdated else "UpToDate",
                "the cluster spec changed but upgradeStrategy.type is None: not rolled out" if outdated else "",
            )
        )

        merged = []
        for condition_type, status, reason, message in conditions:
            previous = service.condition(condition_type)
            changed = previous is None or previous.status != status
            if previous is not None and changed and condition_type == ConditionType.READY:
                self._event("ReadyChanged", f"Ready is now {status}: {reason} {message}".strip(), not status)
            merged.append(
                Condition(
                    type=condition_type,
                    status=status,
                    reason=reason,
                    message=message,
                    last_transition_time=self.now if previous is None or changed else previous.last_transition_time,
                )
            )
        self._update_service(conditions=tuple(merged))

        rolled_out = (
            active is not None
            and pending is None
            and active.cluster_spec_hash == self.desired_cluster_hash
            and active.applied_config_hash == self.desired_config_hash
            # Seen in this very observation, taken after any PUT of an earlier tick: the apps
            # are RUNNING under the new config, not the old one.
            and self._observed(active).deployed_config_hash == self.desired_config_hash
            and ready[0]
        )
        if rolled_out or self._rollout_failed or outdated:
            self._update_service(observed_generation=service.generation)


def _canary_status_line(name: str, state: CanaryState, strategy: CanarySpec, now: float) -> str:
    remaining = canary.pause_remaining(strategy, state, now)
    left = f", {remaining:.0f}s left" if remaining is not None else ""
    line = f"canary {name} at {state.weight}% ({canary.describe_step(strategy, state)}{left})"
    if strategy.analysis is not None:
        line += (
            f"; analysis: {state.passed_intervals} passed, {state.failed_intervals} failed, "
            f"{state.inconclusive_intervals} inconclusive"
        )
    return line


def plan(
    spec: ServiceSpec,
    service: ServiceRecord,
    clusters: list[ClusterRecord],
    observation: Observation,
    now: float,
    gate: SwitchGate = SwitchGate.READY,
) -> Plan:
    """Decide the next actions for one service. Pure: no I/O, no clock."""
    return _Planner(spec, service, clusters, observation, now, gate).run()
