"""The service's status conditions (Ready, UpgradeInProgress, RolloutFailed,
ClusterSpecOutdated), derived from the plan as it stands at the end of the tick, and the
observed generation once a rollout is done (or failed, or not rolled out by choice)."""

from __future__ import annotations

from servekeeper.core import canary_steps
from servekeeper.core.actions import CreateCluster
from servekeeper.core.health import readiness
from servekeeper.core.planner.context import PlanContext
from servekeeper.model.canary_spec import CanarySpec
from servekeeper.model.enums import ClusterRole, ConditionType
from servekeeper.model.records import CanaryState, ClusterRecord, Condition

# (type, status, reason, message)
ConditionFields = tuple[ConditionType, bool, str, str]


def set_conditions(ctx: PlanContext) -> None:
    active = ctx.newest(ClusterRole.ACTIVE)
    pending = ctx.newest(ClusterRole.PENDING)
    service = ctx.plan.service
    ready = ready_condition(ctx, active)
    outdated = cluster_spec_outdated(ctx, active)
    conditions = [
        ready,
        upgrade_condition(ctx, pending),
        rollout_failed_condition(ctx),
        outdated,
    ]
    ctx.update_service(conditions=tuple(merge_conditions(ctx, conditions)))

    rolled_out = (
        active is not None
        and pending is None
        and active.cluster_spec_hash == ctx.desired_cluster_hash
        and active.applied_config_hash == ctx.desired_config_hash
        # Seen in this very observation, taken after any PUT of an earlier tick: the apps
        # are RUNNING under the new config, not the old one.
        and ctx.observed(active).deployed_config_hash == ctx.desired_config_hash
        and ready[1]
    )
    if rolled_out or ctx.rollout_failed or outdated[1]:
        ctx.update_service(observed_generation=service.generation)


def ready_condition(ctx: PlanContext, active: ClusterRecord | None) -> ConditionFields:
    if active is None:
        return (ConditionType.READY, False, "NoActiveCluster", "no cluster serves this service yet")
    verdict = readiness(ctx.observed(active), ctx.declared, ctx.all_apps)
    return (ConditionType.READY, verdict.ok, verdict.reason, verdict.message or f"serving from {active.name}")


def upgrade_condition(ctx: PlanContext, pending: ClusterRecord | None) -> ConditionFields:
    upgrading = ConditionType.UPGRADE_IN_PROGRESS
    strategy = ctx.spec.spec.upgradeStrategy.canary
    if pending is not None and pending.canary is not None and strategy is not None:
        message = canary_status_line(pending.name, pending.canary, strategy, ctx.now)
        return (upgrading, True, "CanaryInProgress", message)
    if pending is not None:
        verdict = ctx.switch_verdict(ctx.observed(pending))
        message = f"waiting for {pending.name}: {verdict.reason}" + (f": {verdict.message}" if verdict.message else "")
        return (upgrading, True, "PendingClusterNotReady", message)
    if any(isinstance(a, CreateCluster) and a.role == ClusterRole.PENDING for a in ctx.plan.actions):
        if ctx.observation.placement_problem:
            return (upgrading, True, "InsufficientCapacity", ctx.observation.placement_problem)
        return (upgrading, True, "PendingClusterCreating", "")
    return (upgrading, False, "NoPendingCluster", "")


def rollout_failed_condition(ctx: PlanContext) -> ConditionFields:
    if ctx.rollout_failed:
        reason, _, message = (ctx.plan.service.failure_reason or "RolloutFailed").partition(": ")
        return (ConditionType.ROLLOUT_FAILED, True, reason, message)
    return (ConditionType.ROLLOUT_FAILED, False, "NoFailure", "")


def cluster_spec_outdated(ctx: PlanContext, active: ClusterRecord | None) -> ConditionFields:
    outdated = (
        active is not None
        and active.cluster_spec_hash != ctx.desired_cluster_hash
        and ctx.spec.spec.upgradeStrategy.type == "None"
    )
    return (
        ConditionType.CLUSTER_SPEC_OUTDATED,
        outdated,
        "UpgradeStrategyNone" if outdated else "UpToDate",
        "the cluster spec changed but upgradeStrategy.type is None: not rolled out" if outdated else "",
    )


def merge_conditions(ctx: PlanContext, conditions: list[ConditionFields]) -> list[Condition]:
    """The new conditions, each keeping its last transition time unless its status changed;
    a change of Ready is also an event."""
    service = ctx.plan.service
    merged = []
    for condition_type, status, reason, message in conditions:
        previous = service.condition(condition_type)
        changed = previous is None or previous.status != status
        if previous is not None and changed and condition_type == ConditionType.READY:
            ctx.event("ReadyChanged", f"Ready is now {status}: {reason} {message}".strip(), not status)
        merged.append(
            Condition(
                type=condition_type,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=ctx.now if previous is None or changed else previous.last_transition_time,
            )
        )
    return merged


def canary_status_line(name: str, state: CanaryState, strategy: CanarySpec, now: float) -> str:
    remaining = canary_steps.pause_remaining(strategy, state, now)
    left = f", {remaining:.0f}s left" if remaining is not None else ""
    line = f"canary {name} at {state.weight}% ({canary_steps.describe_step(strategy, state)}{left})"
    if strategy.analysis is not None:
        line += (
            f"; analysis: {state.passed_intervals} passed, {state.failed_intervals} failed, "
            f"{state.inconclusive_intervals} inconclusive"
        )
    return line
