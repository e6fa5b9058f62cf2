"""A hot standby (`spec.standby`): a second cluster of the active's spec with the apps deployed
and ready, taking no traffic of its own. The ingress sends it the active's traffic the moment
the active refuses connections: the data plane fails over, not a tick. The planner then makes
it the active, deletes the dead cluster, and builds the next standby; after a rollout the
standby of the old spec is replaced by one of the new."""

from __future__ import annotations

from servekeeper.core.actions import UpdateClusters
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.serve import apply_config, scale
from servekeeper.core.planner.traffic import ready_standby, route_as_planned
from servekeeper.core.planner.workers import restart_workers
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord


def fail_over_to_standby(ctx: PlanContext) -> None:
    """The active's head exited (its host answered; a silent one may still run) and a ready
    standby of its spec runs: the standby takes over. A hot one at once (the ingress already
    sends it the traffic; this makes the roles say so), a warm one once its replicas run."""
    active = ctx.newest(ClusterRole.ACTIVE)
    if active is None or ctx.newest(ClusterRole.PENDING) is not None:
        return  # during a rollout the pending cluster's path decides (it may take over itself)
    observed = ctx.observed(active)
    if active.head_pid is None or observed.processes_alive or observed.head_silent_since is not None:
        return
    if active.name not in ctx.observation.clusters:
        return  # not looked at this tick: nothing is known to be wrong with it
    cause = f": {observed.error}" if observed.error else ""
    take_over(ctx, active, f"the head of {active.name} exited{cause}")


def take_over(ctx: PlanContext, active: ClusterRecord, why: str) -> bool:
    """The standby takes over from `active`, which is deleted; False when no standby can (none,
    not ready, of another spec, or not running). A warm standby is scaled to all its replicas
    first: True while that goes on (the dead active keeps the route, which answers 503)."""
    standby = ready_standby(ctx, active) or warm_standby(ctx, active)
    if standby is None or not ctx.observed(standby).processes_alive:
        return False
    if standby.target_capacity is not None and not ctx.settled_at(standby, 100.0):
        if standby.target_capacity != 100.0:
            ctx.event("StandbyScalingUp", f"{why}; scaling warm standby {standby.name} to all its replicas", True)
        scale(ctx, standby, 100.0)
        return True
    ctx.set_planned(standby.with_changes(role=ClusterRole.ACTIVE))
    ctx.set_planned(active.with_changes(role=ClusterRole.DELETING))
    route_as_planned(ctx)  # the route first: roles change only once the ingress acknowledged it
    # One transaction: a crash never leaves two actives, or the dead one active.
    swap = ((standby.name, {"role": ClusterRole.ACTIVE}), (active.name, {"role": ClusterRole.DELETING}))
    ctx.do(UpdateClusters(swap))
    ctx.delete_cluster(active, "StandbyPromoted")
    ctx.update_service(unhealthy_since=None)
    how = "the ingress sent its traffic to" if standby.target_capacity is None else "traffic moved to the scaled-up"
    ctx.event(
        "StandbyPromoted",
        f"{why}; {how} standby {standby.name}, now the active cluster; deleting {active.name}",
        warning=True,
    )
    return True


def warm_standby(ctx: PlanContext, active: ClusterRecord) -> ClusterRecord | None:
    """A ready warm standby of the active's spec (its replicas at target_capacity 0, or being scaled up)."""
    standby = ctx.newest(ClusterRole.STANDBY)
    if standby is None or standby.ready_at is None or standby.target_capacity is None:
        return None
    return standby if standby.cluster_spec_hash == active.cluster_spec_hash else None


def maintain_standby(ctx: PlanContext) -> None:
    """Build the standby once the active is ready and healthy (never during a rollout), keep its
    config the desired one, mark it ready, and replace it when it dies, fails, lags the active's
    spec, or is no longer wanted."""
    standby = ctx.newest(ClusterRole.STANDBY)
    active = ctx.newest(ClusterRole.ACTIVE)
    if standby is not None:
        why = unfit(ctx, standby, active)
        if why is None:
            advance(ctx, standby)
            return
        drop(ctx, standby, why)
    if ctx.spec.spec.standby is None or active is None or ctx.newest(ClusterRole.PENDING) is not None:
        return
    healthy = ctx.plan.service.unhealthy_since is None and active.ready_at is not None
    if healthy and active.cluster_spec_hash == ctx.desired_cluster_hash and not ctx.rollout_failed:
        ctx.create_cluster(ClusterRole.STANDBY, f"StandbyBuilding: a hot standby for {active.name}")


def unfit(ctx: PlanContext, standby: ClusterRecord, active: ClusterRecord | None) -> str | None:
    """Why the standby must go ("Reason: message"), or None while it may stay."""
    if ctx.spec.spec.standby is None:
        return "StandbyRemoved: spec.standby is unset"
    if active is not None and standby.cluster_spec_hash != active.cluster_spec_hash:
        return f"StandbyOutdated: {active.name} runs another cluster spec"
    if standby.ready_at is not None and is_warm(ctx) != (standby.target_capacity is not None):
        return "StandbyModeChanged: spec.standby.mode changed"
    if standby.failure_reason:
        return f"StandbyFailed: {standby.failure_reason}"
    observed = ctx.observed(standby)
    if standby.head_pid is not None and not observed.processes_alive and observed.head_silent_since is None:
        if standby.name in ctx.observation.clusters:
            cause = f": {observed.error}" if observed.error else ""
            return f"StandbyDied: the head of {standby.name} exited{cause}"
    age = ctx.now - standby.created_at
    if standby.ready_at is None and age > ctx.spec.spec.readinessTimeoutSeconds:
        verdict = ctx.switch_verdict(observed)
        return f"StandbyNotReady: not ready after {age:g}s ({verdict.reason}: {verdict.message})"
    return None


def advance(ctx: PlanContext, standby: ClusterRecord) -> None:
    """The standby runs the desired config (except while a rollout is failing or under way) and
    is marked ready: a hot one once the switch gate would let traffic go to it, a warm one once
    Ray shows its apps deployed with no replicas (Serve's target_capacity 0, from its first PUT)."""
    observed = ctx.observed(standby)
    if observed.exited_workers:
        standby = restart_workers(ctx, standby, observed.exited_workers)
    if not observed.dashboard_ok:
        return
    steady = not ctx.rollout_failed and ctx.newest(ClusterRole.PENDING) is None
    if steady and standby.applied_config_hash != ctx.desired_config_hash:
        if is_warm(ctx) and standby.applied_config_hash is None and standby.target_capacity is None:
            standby = ctx.update_cluster(standby, target_capacity=0.0)  # born with no replicas
        apply_config(ctx, standby, observed)
        return
    if observed.deployed_config_hash != standby.applied_config_hash or standby.applied_config_hash is None:
        return
    if standby.ready_at is not None:
        return
    if standby.target_capacity is not None:
        if ctx.settled_at(scale(ctx, standby, 0.0), 0.0):
            ctx.update_cluster(standby, ready_at=ctx.now)
            ctx.event("StandbyReady", f"warm standby {standby.name} is ready: apps deployed, no replicas")
    elif ctx.switch_verdict(observed).ok:
        ctx.update_cluster(standby, ready_at=ctx.now)
        ctx.event("StandbyReady", f"standby {standby.name} is ready: the ingress fails the active over to it")


def is_warm(ctx: PlanContext) -> bool:
    return ctx.spec.spec.standby is not None and ctx.spec.spec.standby.mode == "warm"


def drop(ctx: PlanContext, standby: ClusterRecord, why: str) -> None:
    """Out of the route first (when it is in), then deleted."""
    ctx.set_planned(standby.with_changes(role=ClusterRole.DELETING))
    route = ctx.observation.route
    if route is not None and standby.name in route.upstreams:
        route_as_planned(ctx)
    ctx.delete_cluster(standby, why.partition(":")[0])
    warning = not why.startswith(("StandbyRemoved", "StandbyOutdated"))
    ctx.event("StandbyReplaced" if ctx.spec.spec.standby else "StandbyDeleted", f"{standby.name}: {why}", warning)
