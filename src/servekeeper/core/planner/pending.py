"""The pending cluster: replaced when the spec moves on, failed when it cannot become ready,
its config applied, gated on readiness, then switched to (at once, or through a canary)."""

from __future__ import annotations

from servekeeper.core.planner.canary import canary_applies, canary_tick, capacity_follows_traffic, first_canary_capacity
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.failure import fail_rollout
from servekeeper.core.planner.serve import apply_config, scale
from servekeeper.core.planner.traffic import retire, switch_all_traffic
from servekeeper.core.planner.workers import restart_workers, restartable
from servekeeper.model.enums import FAILED_APP_STATUSES, ClusterRole
from servekeeper.model.observation import ClusterObservation
from servekeeper.model.records import ClusterRecord


def advance_pending(ctx: PlanContext, pending: ClusterRecord) -> None:
    # A canary runs one generation's spec: a newer one starts over on a cluster of its own.
    superseded_canary = pending.canary is not None and pending.generation != ctx.service.generation
    if pending.cluster_spec_hash != ctx.desired_cluster_hash or superseded_canary:
        retire(ctx, pending, "SpecChanged")
        ctx.event(
            "PendingClusterReplaced",
            f"the spec changed while {pending.name} was coming up or in canary; replacing it",
        )
        return
    observed = ctx.observed(pending)
    failure = pending_failure(ctx, pending, observed)
    if failure is not None:
        fail_rollout(ctx, pending, failure)
        return
    if observed.exited_workers:  # within the readiness timeout, a worker that exited gets another go
        pending = restart_workers(ctx, pending, observed.exited_workers)
    active = ctx.newest(ClusterRole.ACTIVE)
    if pending.canary is not None and active is not None:
        canary_tick(ctx, pending, active)  # analysis and commands go on whatever it looks like
        return
    if not observed.dashboard_ok:
        return  # still starting
    if pending.applied_config_hash != ctx.desired_config_hash:
        first_config = pending.applied_config_hash is None and pending.target_capacity is None
        if first_config and capacity_follows_traffic(ctx) and active and canary_applies(ctx, pending, active):
            # Born at the first step's share: the upgrade never needs twice the replicas.
            pending = ctx.update_cluster(pending, target_capacity=first_canary_capacity(ctx))
        apply_config(ctx, pending, observed)
        return
    if observed.deployed_config_hash != ctx.desired_config_hash:
        return  # Ray is not seen running it at this moment: judge nothing on this look
    if ctx.switch_verdict(observed).ok:
        switch_when_ready(ctx, pending, active)


def switch_when_ready(ctx: PlanContext, pending: ClusterRecord, active: ClusterRecord | None) -> None:
    """The pending cluster passed the gate: a canary starts beside a healthy active, or all
    the traffic moves once the cluster runs every replica."""
    if active is not None and canary_applies(ctx, pending, active):
        canary_tick(ctx, pending, active)
    elif pending.target_capacity is not None and not ctx.settled_at(pending, 100.0):
        scale(ctx, pending, 100.0)  # all the traffic needs all the replicas first
    else:
        switch_all_traffic(ctx, pending)


def pending_failure(ctx: PlanContext, pending: ClusterRecord, observed: ClusterObservation) -> str | None:
    """Why the pending cluster's rollout failed ("Reason: message"), or None."""
    if pending.abort_requested:
        return "Aborted: by `servekeeper abort`"
    if pending.failure_reason:
        return pending.failure_reason
    if ctx.rollout_failed and pending.canary is not None and pending.generation == ctx.service.generation:
        # Failed and stored, but stopped before the canary was retired: retire it now.
        return ctx.plan.service.failure_reason or "RolloutFailed"
    if pending.head_pid is not None and not observed.processes_alive:
        cause = f": {observed.error}" if observed.error else ""
        silent_since = observed.head_silent_since
        if silent_since is None:  # its host answered: the head exited
            return f"HeadDied: the head of pending cluster {pending.name} exited before it was ready{cause}"
        # Its host is silent: the head may still run. Lost only once silent past the threshold.
        silent_for = ctx.now - silent_since
        if silent_for >= ctx.spec.spec.serviceUnhealthySecondThreshold:
            return f"HeadUnreachable: the head of pending cluster {pending.name} unknown for {silent_for:g}s{cause}"
    # One that keeps exiting will not come back; one on a silent host may still run: it is lost
    # only once its host stays silent past the threshold.
    if observed.dead_workers - observed.silent_workers > len(restartable(pending, observed.exited_workers)):
        return f"WorkerDied: pending cluster {pending.name}: {observed.error}"
    workers_silent_since = observed.workers_silent_since
    if observed.silent_workers and workers_silent_since is not None:
        silent_for = ctx.now - workers_silent_since
        if silent_for >= ctx.spec.spec.serviceUnhealthySecondThreshold:
            return f"WorkerUnreachable: pending cluster {pending.name}, unknown for {silent_for:g}s: {observed.error}"
    if pending.applied_config_hash == ctx.desired_config_hash and observed.apps is not None:
        for name, app in sorted(ctx.judged_apps(observed).items()):
            if app.status in FAILED_APP_STATUSES:
                return f"AppFailed: application {name!r} is {app.status.value}: {app.message}".rstrip(": ")
    age = ctx.now - pending.created_at
    if pending.canary is None and age > ctx.spec.spec.readinessTimeoutSeconds:
        verdict = ctx.switch_verdict(observed)
        return (
            f"ReadinessTimeout: pending cluster {pending.name} not ready after "
            f"{ctx.spec.spec.readinessTimeoutSeconds:g}s ({verdict.reason}: {verdict.message})"
        )
    return None
