"""The active cluster: its health over time, its replacement (a new pending cluster) when the
spec changes or it stays unhealthy, a config applied in place, a failed config restored, and
an `undo` that sends traffic back to a cluster still kept."""

from __future__ import annotations

from servekeeper.core.actions import UpdateClusters
from servekeeper.core.health import Verdict, health
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.serve import apply_config, scale, submit
from servekeeper.core.planner.standby import take_for_rollout, take_over
from servekeeper.core.planner.traffic import route_as_planned
from servekeeper.core.planner.workers import restart_workers
from servekeeper.model.enums import FAILED_APP_STATUSES, ClusterRole
from servekeeper.model.observation import ClusterObservation
from servekeeper.model.records import ClusterRecord


def maintain_active(ctx: PlanContext) -> None:
    active = ctx.newest(ClusterRole.ACTIVE)
    if active is None:
        if not ctx.rollout_failed:
            first = not any(c.role != ClusterRole.DELETING for c in ctx.clusters.values())
            ctx.create_cluster(ClusterRole.PENDING, "FirstApply" if first else "NoActiveCluster")
        return
    observed = ctx.observed(active)
    if observed.exited_workers:
        active = restart_workers(ctx, active, observed.exited_workers)
    if active.abort_requested:
        # `abort` reached it while a tick was promoting it: say so, since abort was accepted.
        ctx.event(
            "AbortTooLate",
            f"{active.name} was promoted before the abort arrived; `servekeeper undo` rolls back",
            warning=True,
        )
        ctx.update_cluster(active, abort_requested=False)
    if active.target_capacity is not None:
        scale(ctx, active, 100.0)  # no canary beside it (any more): every replica
    if active.cluster_spec_hash == ctx.desired_cluster_hash and in_place_failed(ctx, active, observed):
        return
    if restoring(ctx, active):
        # The failure is the new config's and the last good one is going back: health is
        # not judged meanwhile, so no replacement (with the same broken config) starts.
        if observed.dashboard_ok and active.good_config_hash is not None:  # always set while restoring
            submit(ctx, active, active.good_config_hash, restore=True)
        return
    verdict = health(observed, ctx.declared, ctx.all_apps)
    track_health(ctx, verdict)
    if active.cluster_spec_hash != ctx.desired_cluster_hash:
        if ctx.spec.spec.upgradeStrategy.type != "None" and not ctx.rollout_failed:
            if not switch_back_to_kept(ctx, active):
                ctx.create_cluster(ClusterRole.PENDING, "ClusterSpecChanged")
        return
    unhealthy_since = ctx.plan.service.unhealthy_since
    threshold = ctx.spec.spec.serviceUnhealthySecondThreshold
    if unhealthy_since is not None and ctx.now - unhealthy_since >= threshold:
        if ctx.rollout_failed:
            # The only spec to build a replacement from is the one whose rollout failed: a
            # replacement would fail the same way, over and over. Apply a fixed spec.
            return
        if take_over(ctx, active, f"ActiveUnhealthy: {verdict.reason}: {verdict.message}"):
            return
        ctx.create_cluster(ClusterRole.PENDING, f"ActiveUnhealthy: {verdict.reason}: {verdict.message}")
        return
    if active.applied_config_hash != ctx.desired_config_hash and not ctx.rollout_failed:
        if switch_back_to_kept(ctx, active):
            return
        if ctx.spec.spec.rolls_config_changes_on_new_cluster:
            if not take_for_rollout(ctx, "ServeConfigChanged"):
                ctx.create_cluster(ClusterRole.PENDING, "ServeConfigChanged")
        elif observed.dashboard_ok:
            apply_config(ctx, active, observed)


def track_health(ctx: PlanContext, verdict: Verdict) -> None:
    """Record when the active cluster became unhealthy (or healthy again)."""
    since = ctx.plan.service.unhealthy_since
    if verdict.ok and since is not None:
        ctx.update_service(unhealthy_since=None)
        ctx.event("ClusterHealthy", "the active cluster is healthy again")
    elif not verdict.ok and since is None:
        ctx.update_service(unhealthy_since=ctx.now)
        ctx.event("ClusterUnhealthy", f"{verdict.reason}: {verdict.message}", warning=True)


def in_place_failed(ctx: PlanContext, active: ClusterRecord, observed: ClusterObservation) -> bool:
    """The desired config runs on the active cluster and one of its apps failed: the
    rollout failed (never retried blindly, never replaced in a loop), and the last good
    config goes back on the cluster."""
    if ctx.rollout_failed or active.applied_config_hash != ctx.desired_config_hash:
        return False
    if observed.deployed_config_hash != ctx.desired_config_hash or observed.apps is None:
        return False
    if active.good_config_hash == ctx.desired_config_hash:
        return False  # it ran well under this config: a later failure is a health matter
    for name, app in sorted(ctx.judged_apps(observed).items()):
        if app.status in FAILED_APP_STATUSES:
            reason = f"AppFailed: application {name!r} is {app.status.value}: {app.message}".rstrip(": ")
            ctx.update_service(failed_generation=ctx.service.generation, failure_reason=reason, unhealthy_since=None)
            ctx.event("RolloutFailed", reason, warning=True)
            if active.good_config_hash is not None:
                submit(ctx, active, active.good_config_hash, restore=True)
            return True
    return False


def restoring(ctx: PlanContext, active: ClusterRecord) -> bool:
    """The rollout failed on the active cluster and its last good config is not back yet."""
    return (
        ctx.rollout_failed
        and active.good_config_hash is not None
        and active.applied_config_hash != active.good_config_hash
        and active.applied_config_hash == ctx.desired_config_hash
    )


def runs_desired(ctx: PlanContext, kept: ClusterRecord) -> bool:
    """A kept cluster that served as active (never a retired canary) and runs what is desired
    now, ready for traffic."""
    observed = ctx.observed(kept)
    return (
        kept.ready_at is not None
        and kept.cluster_spec_hash == ctx.desired_cluster_hash
        and kept.applied_config_hash == ctx.desired_config_hash
        and observed.deployed_config_hash == ctx.desired_config_hash
        and ctx.switch_verdict(observed).ok
    )


def switch_back_to_kept(ctx: PlanContext, active: ClusterRecord) -> bool:
    """A cluster still kept after a switch (rollback window, or draining) already runs what
    is desired now (an `undo`): traffic goes back to it at once, no new cluster."""
    for kept in reversed(ctx.clusters_with_role(ClusterRole.DRAINING)):
        if not runs_desired(ctx, kept):
            continue
        if kept.target_capacity is not None and not ctx.settled_at(kept, 100.0):
            scale(ctx, kept, 100.0)  # shrunk by a canary: its replicas back before its traffic
            return True
        ctx.set_planned(kept.with_changes(role=ClusterRole.ACTIVE))
        ctx.set_planned(active.with_changes(role=ClusterRole.DRAINING))
        route_as_planned(ctx)
        # One transaction: a crash can never leave both draining (or both active).
        swap = (
            (active.name, {"role": ClusterRole.DRAINING, "drain_started_at": ctx.now}),
            (kept.name, {"role": ClusterRole.ACTIVE, "drain_started_at": None, "ready_at": ctx.now}),
        )
        ctx.do(UpdateClusters(swap))
        ctx.set_planned(active.with_changes(**swap[0][1]))
        ctx.set_planned(kept.with_changes(**swap[1][1]))
        ctx.event("TrafficSwitchedBack", f"100% of traffic back on kept cluster {kept.name}; no new cluster")
        return True
    return False
