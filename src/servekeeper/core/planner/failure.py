"""A failed rollout: the pending cluster is taken out (or, when it was the standby the rollout
took, made the standby again) and the failure is recorded on the service for its generation, so
the same spec is not retried blindly."""

from __future__ import annotations

from servekeeper.core.actions import UpdateCluster
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.traffic import retire, route_as_planned
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord


def fail_rollout(ctx: PlanContext, pending: ClusterRecord, reason: str) -> None:
    if pending.canary is not None and not pending.failure_reason:
        # First of all: a restart between here and the weight going to 0 must abort again,
        # not resume (an analysis verdict is not made twice the same).
        ctx.do(UpdateCluster(pending.name, {"failure_reason": reason}))
    given_back = give_back(ctx, pending)
    if not given_back:
        retire(ctx, pending, "RolloutFailed")
    if pending.generation == ctx.service.generation:
        # Recorded per generation: the same spec is not retried blindly; a new apply retries.
        ctx.update_service(failed_generation=ctx.service.generation, failure_reason=reason)
    # A failed replacement of an unhealthy cluster waits a full threshold before the next try.
    if ctx.plan.service.unhealthy_since is not None:
        ctx.update_service(unhealthy_since=ctx.now)
    aborted = reason.startswith(("Aborted", "AnalysisFailed"))
    ctx.event("RolloutAborted" if aborted else "RolloutFailed", reason, warning=True)
    if given_back:
        ctx.event("StandbyGivenBack", f"{pending.name} is the standby again, with the active's config", warning=True)


def give_back(ctx: PlanContext, pending: ClusterRecord) -> bool:
    """A failed rollout on the standby it took: the cluster becomes the standby again (its last
    good config, the active's, restored by `standby.advance`) instead of being deleted, so a failed
    deploy never leaves the active without a standby. False for any other pending cluster."""
    active = ctx.newest(ClusterRole.ACTIVE)
    if ctx.spec.spec.standby is None or active is None or active.good_config_hash is None:
        return False
    ran_the_actives = pending.good_config_hash == active.good_config_hash
    if not ran_the_actives or pending.cluster_spec_hash != active.cluster_spec_hash or pending.canary is not None:
        return False
    if not ctx.observed(pending).processes_alive or ctx.newest(ClusterRole.STANDBY) is not None:
        return False  # dead; or a standby is being built already (never two)
    changes = {
        "role": ClusterRole.STANDBY,
        "created_at": ctx.now,
        "ready_at": None,
        "failure_reason": None,
        "abort_requested": False,
        "promote_requests": 0,
        "promote_full": False,
        "target_capacity": 0.0 if ctx.spec.spec.standby.mode == "warm" else None,
    }
    ctx.set_planned(pending.with_changes(**changes))
    route = ctx.observation.route
    if route is None or pending.name in route.upstreams:
        route_as_planned(ctx)  # off the preview port: a standby not ready is in no route
    ctx.update_cluster(pending, **changes)
    return True
