"""A standby (`spec.standby`): a second cluster of the active's spec with the apps deployed,
taking no traffic of its own.

Hot: all its replicas run, and the ingress sends it the active's traffic the moment the active
refuses connections (the data plane fails over, not a tick); the planner then makes it the
active, deletes the dead cluster, and builds the next standby. Warm: its apps are deployed at
Serve's target_capacity 0; when the active dies it is scaled up and takes the traffic once its
replicas run. After a rollout the standby of the old spec is replaced by one of the new."""

from __future__ import annotations

from servekeeper.core.actions import UpdateClusters
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.serve import apply_config, scale, submit
from servekeeper.core.planner.traffic import ready_standby, route_as_planned
from servekeeper.core.planner.workers import restart_workers
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord

# A standby that cannot be built (or dies) is built again after 5 s, 10 s, 20 s, ... up to 300 s.
RETRY_FIRST_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0
# After a takeover the next standby waits this long: on one machine a head's start takes both
# cores for seconds, and the cluster that just took the traffic needs them to answer it.
REBUILD_AFTER_TAKEOVER_SECONDS = 15.0


def fail_over_to_standby(ctx: PlanContext) -> None:
    """The active's head exited (its host answered; a silent one may still run) and a ready
    standby of its spec runs: the standby takes over."""
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
    """The standby takes over from `active`; False when no standby can (none, not ready, of
    another spec, not running, or its apps not passing the switch gate). A warm standby is
    scaled to all its replicas first: True while that goes on (the route stays, answering 503)."""
    standby = ready_standby(ctx, active) or warm_standby(ctx, active)
    if standby is None or not ctx.observed(standby).processes_alive:
        return False
    if standby.target_capacity is not None and not scaled_up(ctx, standby):
        if standby.takeover_started_at is None:
            standby = ctx.update_cluster(standby, takeover_started_at=ctx.now)
            ctx.event("StandbyScalingUp", f"{why}; scaling warm standby {standby.name} to all its replicas", True)
        scale(ctx, standby, 100.0)
        return True
    if not ctx.switch_verdict(ctx.observed(standby)).ok:
        return False
    ctx.set_planned(standby.with_changes(role=ClusterRole.ACTIVE))
    # A dead active goes at once; a live one (unhealthy past the threshold) drains like any old one.
    alive = ctx.observed(active).processes_alive
    old_role = {"role": ClusterRole.DRAINING, "drain_started_at": ctx.now} if alive else {"role": ClusterRole.DELETING}
    ctx.set_planned(active.with_changes(**old_role))
    route_as_planned(ctx)  # the route first: roles change only once the ingress acknowledged it
    # One transaction: a crash never leaves two actives, or the dead one active.
    ctx.do(
        UpdateClusters(
            ((standby.name, {"role": ClusterRole.ACTIVE, "takeover_started_at": None}), (active.name, old_role))
        )
    )
    if not alive:
        ctx.delete_cluster(active, "StandbyPromoted")
    ctx.update_service(unhealthy_since=None, standby_retry_at=ctx.now + REBUILD_AFTER_TAKEOVER_SECONDS)
    how = "the ingress sent its traffic to" if standby.target_capacity is None else "traffic moved to the scaled-up"
    ctx.event(
        "StandbyPromoted",
        f"{why}; {how} standby {standby.name}, now the active cluster; "
        + ("draining" if alive else "deleting")
        + f" {active.name}",
        warning=True,
    )
    return True


def take_for_rollout(ctx: PlanContext, reason: str) -> bool:
    """A Serve config rolled on a new cluster of the active's cluster spec
    (`serveConfigUpdate: NewCluster`) takes the ready standby as that cluster: its nodes and
    Serve already run, so only the config PUT and the replicas' start remain. False when there
    is none to take, or it must keep guarding an active that is unhealthy. A canary never takes
    it: the standby guards the stable cluster for as long as the canary runs. The next standby
    is built once the rollout ends; a rollout that fails gives it back (`failure.give_back`)."""
    standby = ctx.newest(ClusterRole.STANDBY)
    if ctx.spec.spec.standby is None or ctx.spec.spec.upgradeStrategy.type == "Canary":
        return False
    if standby is None or standby.ready_at is None or standby.takeover_started_at is not None:
        return False
    observed = ctx.observed(standby)
    if standby.cluster_spec_hash != ctx.desired_cluster_hash or standby.failure_reason:
        return False
    if ctx.plan.service.unhealthy_since is not None or not ctx.observation.ingress_ok:
        return False  # the active may need it at any moment; or the route it leaves cannot be read
    if standby.name not in ctx.observation.clusters or not observed.processes_alive or not observed.dashboard_ok:
        return False
    # Born again as this generation's new cluster: its readiness timeout counts from now. A
    # warm one is wanted at 100: the switch then waits until Serve runs every replica there.
    taken = {
        "role": ClusterRole.PENDING,
        "generation": ctx.service.generation,
        "created_at": ctx.now,
        "ready_at": None,
        "target_capacity": 100.0 if standby.target_capacity is not None else None,
    }
    ctx.set_planned(standby.with_changes(**taken))
    if standby.target_capacity is None:  # a hot one leaves the failover route before the new config
        route_as_planned(ctx)
    ctx.update_cluster(standby, **taken)
    ctx.event(
        "StandbyTaken",
        f"{reason}: the rollout takes standby {standby.name} (running, of this cluster spec) as its "
        "new cluster: only the config PUT and the replicas' start remain",
    )
    return True


def scaled_up(ctx: PlanContext, standby: ClusterRecord) -> bool:
    """A warm standby scaled to 100 serves: Ray shows every deployment HEALTHY at that capacity
    and each app with a replica RUNNING (just after the PUT Serve may still call a deployment
    HEALTHY at its old target, with no replica yet: traffic moved then would get 503s)."""
    judged = ctx.judged_apps(ctx.observed(standby))
    return ctx.settled_at(standby, 100.0) and all(app.running_replicas > 0 for app in judged.values())


def warm_standby(ctx: PlanContext, active: ClusterRecord) -> ClusterRecord | None:
    """A ready warm standby of the active's spec (its replicas at target_capacity 0, or being scaled up)."""
    standby = ctx.newest(ClusterRole.STANDBY)
    if standby is None or standby.ready_at is None or standby.target_capacity is None:
        return None
    return standby if standby.cluster_spec_hash == active.cluster_spec_hash else None


def maintain_standby(ctx: PlanContext) -> None:
    """Build the standby once the active is ready and healthy (never during a rollout, each try
    after a growing pause), keep its config the one the active runs well, mark it ready, and
    replace it when it dies, fails, lags the active's spec, or is no longer wanted."""
    standby = ctx.newest(ClusterRole.STANDBY)
    active = ctx.newest(ClusterRole.ACTIVE)
    if standby is not None:
        why = unfit(ctx, standby, active)
        if why is None:
            advance(ctx, standby, active)
            return
        drop(ctx, standby, why)
    if ctx.spec.spec.standby is None or active is None or ctx.newest(ClusterRole.PENDING) is not None:
        return
    healthy = ctx.plan.service.unhealthy_since is None and active.ready_at is not None
    if not healthy or active.cluster_spec_hash != ctx.desired_cluster_hash or ctx.rollout_failed:
        return
    service = ctx.plan.service
    if service.standby_retry_at is not None and ctx.now < service.standby_retry_at:
        return
    tries = service.standby_failures + 1  # reset once a standby is ready
    pause = min(RETRY_FIRST_SECONDS * 2 ** min(tries - 1, 16), RETRY_MAX_SECONDS)
    ctx.update_service(standby_failures=tries, standby_retry_at=ctx.now + pause)
    ctx.create_cluster(
        ClusterRole.STANDBY, f"StandbyBuilding: a {ctx.spec.spec.standby.mode} standby for {active.name}"
    )


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
    rolling = active is not None and active.cluster_spec_hash != ctx.desired_cluster_hash
    if rolling and ctx.observation.placement_problem and ctx.newest(ClusterRole.PENDING) is None:
        # A pool with room for one more cluster: the rollout's new cluster comes first.
        return f"StandbyYielded: its room goes to the rollout ({ctx.observation.placement_problem})"
    observed = ctx.observed(standby)
    if standby.head_pid is not None and not observed.processes_alive and observed.head_silent_since is None:
        if standby.name in ctx.observation.clusters:
            cause = f": {observed.error}" if observed.error else ""
            return f"StandbyDied: the head of {standby.name} exited{cause}"
    timeout = ctx.spec.spec.readinessTimeoutSeconds
    age = ctx.now - standby.created_at
    if standby.ready_at is None and age > timeout:
        verdict = ctx.switch_verdict(observed)
        return f"StandbyNotReady: not ready after {age:g}s ({verdict.reason}: {verdict.message})"
    started = standby.takeover_started_at
    if started is not None and ctx.now - started > timeout:
        return f"StandbyNotReady: not at all its replicas {ctx.now - started:g}s after it began taking over"
    return None


def advance(ctx: PlanContext, standby: ClusterRecord, active: ClusterRecord | None) -> None:
    """The standby runs the config the active runs well (the desired one once the active has
    run it well: never one that is failing or not proven yet), and is marked ready: a hot one
    once the switch gate would let traffic go to it, a warm one once Ray shows its apps deployed
    with no replicas (Serve's target_capacity 0, from its first PUT)."""
    observed = ctx.observed(standby)
    if observed.exited_workers:
        standby = restart_workers(ctx, standby, observed.exited_workers)
    if not observed.dashboard_ok:
        return
    proven = active is not None and active.good_config_hash == ctx.desired_config_hash
    if proven and standby.applied_config_hash != ctx.desired_config_hash:
        if is_warm(ctx) and standby.applied_config_hash is None and standby.target_capacity is None:
            standby = ctx.update_cluster(standby, target_capacity=0.0)  # born with no replicas
        apply_config(ctx, standby, observed)
        return
    good = standby.good_config_hash
    if not proven and active is not None and good is not None and good == active.good_config_hash:
        if standby.applied_config_hash != good:  # given back by a failed rollout: the active's config again
            submit(ctx, standby, good, restore=True)
            return
    if observed.deployed_config_hash != standby.applied_config_hash or standby.applied_config_hash is None:
        return
    if standby.takeover_started_at is not None and active is not None and ctx.observed(active).processes_alive:
        # The active came back before the takeover ended (it recovered): no replicas again.
        standby = ctx.update_cluster(standby, takeover_started_at=None)
        scale(ctx, standby, 0.0)
        return
    if standby.ready_at is not None:
        return
    if standby.target_capacity is not None:
        if ctx.settled_at(scale(ctx, standby, 0.0), 0.0):
            standby_ready(ctx, standby, f"warm standby {standby.name} is ready: apps deployed, no replicas")
    elif ctx.switch_verdict(observed).ok:
        standby_ready(ctx, standby, f"standby {standby.name} is ready: the ingress fails the active over to it")


def standby_ready(ctx: PlanContext, standby: ClusterRecord, message: str) -> None:
    ctx.update_cluster(standby, ready_at=ctx.now)
    ctx.update_service(standby_failures=0, standby_retry_at=None)
    ctx.event("StandbyReady", message)


def is_warm(ctx: PlanContext) -> bool:
    return ctx.spec.spec.standby is not None and ctx.spec.spec.standby.mode == "warm"


def drop(ctx: PlanContext, standby: ClusterRecord, why: str) -> None:
    """Out of the route first (when it is or may be in it), then deleted."""
    ctx.set_planned(standby.with_changes(role=ClusterRole.DELETING))
    route = ctx.observation.route
    if standby.ready_at is not None or (route is not None and standby.name in route.upstreams):
        route_as_planned(ctx)
    ctx.delete_cluster(standby, why.partition(":")[0])
    warning = not why.startswith(("StandbyRemoved", "StandbyOutdated"))
    ctx.event("StandbyReplaced" if ctx.spec.spec.standby else "StandbyDeleted", f"{standby.name}: {why}", warning)
