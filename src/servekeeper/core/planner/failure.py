"""A failed rollout: the pending cluster is taken out and the failure is recorded on the
service for its generation, so the same spec is not retried blindly."""

from __future__ import annotations

from servekeeper.core.actions import UpdateCluster
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.traffic import retire
from servekeeper.model.records import ClusterRecord


def fail_rollout(ctx: PlanContext, pending: ClusterRecord, reason: str) -> None:
    if pending.canary is not None and not pending.failure_reason:
        # First of all: a restart between here and the weight going to 0 must abort again,
        # not resume (an analysis verdict is not made twice the same).
        ctx.do(UpdateCluster(pending.name, {"failure_reason": reason}))
    retire(ctx, pending, "RolloutFailed")
    if pending.generation == ctx.service.generation:
        # Recorded per generation: the same spec is not retried blindly; a new apply retries.
        ctx.update_service(failed_generation=ctx.service.generation, failure_reason=reason)
    # A failed replacement of an unhealthy cluster waits a full threshold before the next try.
    if ctx.plan.service.unhealthy_since is not None:
        ctx.update_service(unhealthy_since=ctx.now)
    aborted = reason.startswith(("Aborted", "AnalysisFailed"))
    ctx.event("RolloutAborted" if aborted else "RolloutFailed", reason, warning=True)
