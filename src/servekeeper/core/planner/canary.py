"""The planner's side of a canary: readiness, capacity and the stable cluster around the step
machine (`core/canary_steps.py`), and what the ingress and the store are asked to do each tick."""

from __future__ import annotations

from servekeeper.core import canary_steps
from servekeeper.core.actions import UpdateCluster
from servekeeper.core.health import Verdict, health
from servekeeper.core.planner.active import track_health
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.failure import fail_rollout
from servekeeper.core.planner.serve import scale
from servekeeper.core.planner.traffic import desired_route, switch_all_traffic
from servekeeper.model.canary_spec import CanarySpec
from servekeeper.model.records import CanaryState, ClusterRecord


def canary_applies(ctx: PlanContext, pending: ClusterRecord, active: ClusterRecord) -> bool:
    """Steps for a new generation beside a healthy active; a replacement of a broken active
    (or a first cluster) takes all the traffic at once."""
    if pending.canary is not None:
        return True
    strategy = ctx.spec.spec.upgradeStrategy
    return (
        strategy.type == "Canary"
        and strategy.canary is not None
        and active.generation < pending.generation
        and ctx.plan.service.unhealthy_since is None
    )


def capacity_follows_traffic(ctx: PlanContext) -> bool:
    strategy = ctx.spec.spec.upgradeStrategy.canary
    return strategy is not None and strategy.capacityFollowsTraffic


def first_canary_capacity(ctx: PlanContext) -> float:
    """The first step's share (a weight, or a mirror's copies): the replicas a canary is born with."""
    strategy = ctx.spec.spec.upgradeStrategy.canary
    steps = strategy.steps if strategy else []
    shares = [share for step in steps if (share := step.setWeight or (step.mirror.percent if step.mirror else 0))]
    return float(shares[0]) if shares else 100.0


def canary_tick(ctx: PlanContext, pending: ClusterRecord, active: ClusterRecord) -> None:
    """One tick of a canary beside `active`, from its first ready look to promotion or abort."""
    strategy = ctx.spec.spec.upgradeStrategy.canary
    if strategy is None:  # unreachable: a spec change is a new generation, which retires the canary
        switch_all_traffic(ctx, pending)
        return
    observed = ctx.observed(pending)
    verdict = ctx.switch_verdict(observed)
    ready = (
        observed.dashboard_ok
        and pending.applied_config_hash == ctx.desired_config_hash
        and observed.deployed_config_hash == ctx.desired_config_hash
        and verdict.ok
    )
    if stable_lost(ctx, active):
        if ready:
            ctx.event("CanaryTakesOver", f"stable cluster {active.name} is lost: all traffic to {pending.name}", True)
            switch_all_traffic(ctx, pending)
            return
    state = pending.canary or canary_steps.start(ctx.now)
    if pending.canary is None:
        ctx.event("CanaryStarted", f"canary {pending.name} is ready: {len(strategy.steps)} steps beside {active.name}")
    decision = _decide(ctx, strategy, state, pending, active, verdict if not ready else None)
    _carry_out(ctx, state, decision, pending, active)


def _decide(
    ctx: PlanContext,
    strategy: CanarySpec,
    state: CanaryState,
    pending: ClusterRecord,
    active: ClusterRecord,
    not_ready: Verdict | None,
) -> canary_steps.CanaryDecision:
    """The step machine's decision, held while the canary is not ready (`not_ready` says why)
    or its replicas are not yet at the capacity the step needs; held too long, it aborts."""
    commands = canary_steps.CanaryCommands(pending.promote_requests, pending.promote_full, pending.abort_requested)

    def decide(hold: bool) -> canary_steps.CanaryDecision:
        return canary_steps.advance(
            strategy, state, commands, ctx.observation.backend_counters, pending.name, active.name, ctx.now, hold
        )

    hold = not_ready is not None
    decision = decide(hold)
    why_held = f"not ready ({not_ready.reason}: {not_ready.message})" if not_ready is not None else ""
    if decision.outcome != canary_steps.ABORT and pending.target_capacity is not None and not hold:
        copies = canary_steps.mirror(strategy, decision.state)  # copies need replicas like traffic does
        share = max(decision.state.weight, copies.percent if copies is not None else 0)
        wanted = 100.0 if decision.outcome == canary_steps.PROMOTE else float(share)
        if wanted > pending.target_capacity or not ctx.settled_at(pending, pending.target_capacity):
            # Capacity before traffic: the step waits until the canary's replicas run there.
            scale(ctx, pending, max(wanted, pending.target_capacity))
            hold, why_held = True, f"capacity {max(wanted, pending.target_capacity):g}% not reached"
            decision = decide(hold)
    held_since = (state.held_since if state.held_since is not None else ctx.now) if hold else None
    decision.state = decision.state.with_changes(held_since=held_since)
    limit = ctx.spec.spec.readinessTimeoutSeconds
    if held_since is not None and decision.outcome != canary_steps.ABORT and ctx.now - held_since > limit:
        decision.outcome = canary_steps.ABORT
        decision.reason = f"CanaryStuck: canary {pending.name} held for more than {limit:g}s: {why_held}"
    return decision


def _carry_out(
    ctx: PlanContext,
    state: CanaryState,
    decision: canary_steps.CanaryDecision,
    pending: ClusterRecord,
    active: ClusterRecord,
) -> None:
    """Abort, promote, or move the ingress to the decided step and record it."""
    for reason, message, warning in decision.events:
        ctx.event(reason, message, warning)
    starting = pending.canary is None  # its first state is stored even when no step moved yet
    # The record as this tick found it, with the decided state (a capacity asked for while
    # deciding went out as an UpdateCluster of its own).
    pending = ctx.set_planned(pending.with_changes(canary=decision.state))
    if decision.outcome == canary_steps.ABORT:
        fail_rollout(ctx, pending, decision.reason)
        return
    if decision.outcome == canary_steps.PROMOTE:
        ctx.do(UpdateCluster(pending.name, {"canary": decision.state}))
        switch_all_traffic(ctx, pending)
        return
    route_action = desired_route(ctx)
    strategy = ctx.spec.spec.upgradeStrategy.canary
    assert strategy is not None  # a canary's tick runs only under a canary strategy
    header_moved = canary_steps.header_route(strategy, decision.state) != canary_steps.header_route(strategy, state)
    mirror_moved = canary_steps.mirror(strategy, decision.state) != canary_steps.mirror(strategy, state)
    moved = decision.state.weight != state.weight or header_moved or mirror_moved or starting
    if route_action is not None and (moved or ctx.observation.route is None):
        ctx.do(route_action)  # the ingress first, then the step is recorded
    if decision.state != state or starting:
        ctx.do(UpdateCluster(pending.name, {"canary": decision.state}))
    if pending.target_capacity is not None:
        # From the stored weight, every tick: the stable shrinks to what it carries, after the move.
        scale(ctx, active, float(100 - decision.state.weight))


def stable_lost(ctx: PlanContext, active: ClusterRecord) -> bool:
    """The stable cluster's head exited (its host said so), or it has been unhealthy past the
    threshold: a canary beside it must not wait on it. A head whose host is silent is unknown,
    not lost: one SSH hiccup must not hand all traffic to a canary still being checked."""
    observed = ctx.observed(active)
    verdict = health(observed, ctx.declared, ctx.all_apps)
    track_health(ctx, verdict)
    if verdict.ok:
        return False
    if active.head_pid is not None and not observed.processes_alive and observed.head_silent_since is None:
        return True
    since = ctx.plan.service.unhealthy_since
    return since is not None and ctx.now - since >= ctx.spec.spec.serviceUnhealthySecondThreshold
