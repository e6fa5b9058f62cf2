"""Where the traffic goes: the route the clusters' roles want, the switch to a new cluster,
taking a cluster out of the ingress (retire, drain) and deleting it, and a service's teardown."""

from __future__ import annotations

from servekeeper.core import canary_steps
from servekeeper.core.actions import ForgetService, RemoveRoute, SetRoute, UpdateCluster
from servekeeper.core.planner.context import PlanContext
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord
from servekeeper.model.routing import HeaderMatch, Mirror

# An old cluster is kept at least this long after the switch: requests already on their way
# to it (accepted by the ingress a moment before the switch) must reach it.
MIN_DRAIN_SECONDS = 2.0


def desired_route(ctx: PlanContext) -> SetRoute | None:
    """The route as the clusters' roles (as planned so far) want it: the active takes what
    a canary does not; draining clusters stay listed at 0 so their in-flight requests are
    counted; the preview port goes to the pending cluster."""
    active = ctx.newest(ClusterRole.ACTIVE)
    if active is None:
        return None
    pending = ctx.newest(ClusterRole.PENDING)
    canary_weight = pending.canary.weight if pending is not None and pending.canary is not None else 0
    preview = None
    if pending is not None and ctx.spec.spec.ingress.previewPort is not None and pending.head_pid is not None:
        preview = pending.name
    header = header_route(ctx, pending)
    copies = mirror(ctx, pending)
    upstreams = [active.name]
    if pending is not None and (canary_weight > 0 or preview is not None or header is not None or copies):
        upstreams.append(pending.name)
    upstreams += [c.name for c in ctx.clusters_with_role(ClusterRole.DRAINING)]
    standby = ready_standby(ctx, active)
    if standby is not None:
        upstreams.append(standby.name)
    return SetRoute(
        active=active.name,
        upstreams=tuple(upstreams),
        canary=pending.name if pending is not None and canary_weight > 0 else None,
        canary_weight=canary_weight,
        preview=preview,
        standby=standby.name if standby is not None else None,
        header_route=header,
        header_backend=pending.name if pending is not None and header is not None else None,
        mirror=copies,
    )


def mirror(ctx: PlanContext, pending: ClusterRecord | None) -> Mirror | None:
    """The copies a running canary's shadow step asks for (none before it is ready, or after)."""
    strategy = ctx.spec.spec.upgradeStrategy.canary
    if pending is None or pending.canary is None or strategy is None or pending.failure_reason:
        return None
    step = canary_steps.mirror(strategy, pending.canary)
    return Mirror(pending.name, step.percent, tuple(step.methods)) if step is not None else None


def header_route(ctx: PlanContext, pending: ClusterRecord | None) -> HeaderMatch | None:
    """The running canary's header route in force (none before the canary is ready, or after)."""
    strategy = ctx.spec.spec.upgradeStrategy.canary
    if pending is None or pending.canary is None or strategy is None or pending.failure_reason:
        return None
    return canary_steps.header_route(strategy, pending.canary)


def ready_standby(ctx: PlanContext, active: ClusterRecord) -> ClusterRecord | None:
    """The hot standby the ingress may fail the active over to: ready, all its replicas (a warm
    one has none), and of the active's spec (one of an older spec is being replaced)."""
    standby = ctx.newest(ClusterRole.STANDBY)
    if standby is None or standby.ready_at is None or standby.target_capacity is not None:
        return None
    return standby if standby.cluster_spec_hash == active.cluster_spec_hash else None


def route_as_planned(ctx: PlanContext) -> None:
    """Send the route the roles now want (after a change of roles in this tick)."""
    route_action = desired_route(ctx)
    if route_action is not None:
        ctx.do(route_action)


def maintain_route(ctx: PlanContext) -> None:
    """Correct the ingress when it routes otherwise than the roles want (and no step of this
    tick already set the route)."""
    if not ctx.observation.ingress_ok:
        return  # the data plane could not be read: nothing is known to be wrong with it
    wanted = desired_route(ctx)
    if wanted is None:
        return
    route = ctx.observation.route
    differs = (
        route is None
        or route.upstreams != frozenset(wanted.upstreams)
        or any(route.weight_of(name) != weight for name, weight in wanted.weights().items())
        or route.preview != wanted.preview
        or route.failover != (wanted.standby is not None)
        or route.header_route != wanted.header_route
        or route.header_backend != wanted.header_backend
        or route.mirror != wanted.mirror
    )
    if differs and not ctx.planned(SetRoute):
        ctx.do(wanted)


def promote(ctx: PlanContext, pending: ClusterRecord) -> None:
    """Record the switch: the pending cluster becomes active, the active ones start draining."""
    for old in ctx.clusters_with_role(ClusterRole.ACTIVE):
        ctx.update_cluster(old, role=ClusterRole.DRAINING, drain_started_at=ctx.now)
    ctx.update_cluster(pending, role=ClusterRole.ACTIVE, ready_at=ctx.now)
    ctx.update_service(unhealthy_since=None)
    ctx.event("TrafficSwitched", f"100% of traffic now goes to cluster {pending.name}")


def switch_all_traffic(ctx: PlanContext, pending: ClusterRecord) -> None:
    """All the traffic to `pending` at once; the clusters it leaves stay counted upstreams."""
    active = ctx.newest(ClusterRole.ACTIVE)
    draining = [c.name for c in ctx.clusters_with_role(ClusterRole.DRAINING)]
    upstreams = (pending.name,) + ((active.name,) if active else ()) + tuple(draining)
    ctx.do(SetRoute(active=pending.name, upstreams=upstreams))
    promote(ctx, pending)


def finish_acknowledged_switch(ctx: PlanContext) -> None:
    """The ingress already routes to the pending cluster but the store does not say so:
    the controller stopped between the switch and recording it. Record it now."""
    pending = ctx.newest(ClusterRole.PENDING)
    route = ctx.observation.route
    if pending is not None and route is not None and route.weight_of(pending.name) >= 100:
        promote(ctx, pending)


def retire(ctx: PlanContext, pending: ClusterRecord, why: str) -> None:
    """Take a pending cluster out: at once when it never had traffic; drained (weight 0
    first, deleted once idle) when a canary or the preview port sent it requests."""
    route = ctx.observation.route
    routed = pending.canary is not None or (route is not None and pending.name in route.upstreams)
    if not routed:
        ctx.delete_cluster(pending, why)
        return
    ctx.set_planned(pending.with_changes(role=ClusterRole.DRAINING, drain_started_at=ctx.now))
    route_as_planned(ctx)
    changes = {"role": ClusterRole.DRAINING, "drain_started_at": ctx.now, "canary": pending.canary}
    ctx.do(UpdateCluster(pending.name, changes))


def drained(ctx: PlanContext, cluster: ClusterRecord) -> str | None:
    """Why a draining cluster may go now, or None while it must stay."""
    route = ctx.observation.route
    started = cluster.drain_started_at if cluster.drain_started_at is not None else ctx.now
    elapsed = ctx.now - started
    # A cluster that served as active is kept (no traffic) for the rollback window.
    kept_for = ctx.spec.spec.rollbackWindowSeconds if cluster.ready_at is not None else 0.0
    if elapsed < kept_for:
        return None
    deadline = max(ctx.spec.spec.rayClusterDeletionDelaySeconds, kept_for)
    counted = ctx.observation.ingress_ok and route is not None and cluster.name in route.upstreams
    idle = counted and route is not None and route.inflight.get(cluster.name, 0) == 0
    if idle and elapsed >= min(MIN_DRAIN_SECONDS, deadline):
        return f"no request in flight after {elapsed:.1f}s"
    if elapsed >= deadline:
        inflight = route.inflight.get(cluster.name, "unknown") if route else "unknown"
        return f"deletion delay of {deadline:g}s reached ({inflight} in flight)"
    return None


def drain(ctx: PlanContext) -> None:
    """Delete the draining clusters that are idle (or past their deadline)."""
    removed = []
    for cluster in ctx.clusters_with_role(ClusterRole.DRAINING):
        why = drained(ctx, cluster)
        if why is not None:
            removed.append((cluster, why))
    if not removed:
        return
    for cluster, _ in removed:
        ctx.set_planned(cluster.with_changes(role=ClusterRole.DELETING))
    # Take them out of the ingress first, then stop them.
    route_as_planned(ctx)
    for cluster, why in removed:
        ctx.delete_cluster(cluster, "Drained")
        ctx.event("ClusterDrained", f"deleting old cluster {cluster.name}: {why}")


def delete_service(ctx: PlanContext) -> None:
    """The service is being deleted: its clusters and its route go, then the service itself."""
    for cluster in list(ctx.clusters.values()):
        ctx.delete_cluster(cluster, "ServiceDeleted")
    if ctx.observation.route is not None:
        ctx.do(RemoveRoute())
    if not ctx.clusters:
        ctx.do(ForgetService())
