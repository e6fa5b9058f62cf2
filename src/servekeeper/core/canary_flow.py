"""The planner's side of a canary: readiness, capacity and the stable cluster around the step
machine (`canary.py`), and what the ingress and the store are asked to do each tick.

Split from planner.py to keep each module in a head; it works on the planner's plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servekeeper.core import canary
from servekeeper.core.actions import UpdateCluster
from servekeeper.core.health import health
from servekeeper.model.status import ClusterRecord

if TYPE_CHECKING:
    from servekeeper.core.planner import _Planner


def canary_tick(planner: _Planner, pending: ClusterRecord, active: ClusterRecord) -> None:
    """One tick of a canary beside `active`, from its first ready look to promotion or abort."""
    p = planner
    strategy = p.spec.spec.upgradeStrategy.canary
    if strategy is None:  # unreachable: a spec change is a new generation, which retires the canary
        p._switch_all_traffic(pending)
        return
    observed = p._observed(pending)
    verdict = p._switch_verdict(observed)
    ready = (
        observed.dashboard_ok
        and pending.applied_config_hash == p.desired_config_hash
        and observed.deployed_config_hash == p.desired_config_hash
        and verdict.ok
    )
    if _stable_lost(p, active):
        if ready:
            p._event("CanaryTakesOver", f"stable cluster {active.name} is lost: all traffic to {pending.name}", True)
            p._switch_all_traffic(pending)
            return
    state = pending.canary or canary.start(p.now)
    if pending.canary is None:
        p._event("CanaryStarted", f"canary {pending.name} is ready: {len(strategy.steps)} steps beside {active.name}")
    commands = canary.CanaryCommands(pending.promote_requests, pending.promote_full, pending.abort_requested)

    def decide(hold: bool) -> canary.CanaryDecision:
        return canary.advance(
            strategy, state, commands, p.observation.backend_counters, pending.name, active.name, p.now, hold
        )

    hold = not ready
    decision = decide(hold)
    why_held = f"not ready ({verdict.reason}: {verdict.message})" if not ready else ""
    if decision.outcome != canary.ABORT and pending.target_capacity is not None and not hold:
        wanted = 100.0 if decision.outcome == canary.PROMOTE else float(decision.state.weight)
        if wanted > pending.target_capacity or not p._settled_at(pending, pending.target_capacity):
            # Capacity before traffic: the step waits until the canary's replicas run there.
            p._scale(pending, max(wanted, pending.target_capacity))
            hold, why_held = True, f"capacity {max(wanted, pending.target_capacity):g}% not reached"
            decision = decide(hold)
    held_since = (state.held_since if state.held_since is not None else p.now) if hold else None
    decision.state = decision.state.with_changes(held_since=held_since)
    limit = p.spec.spec.readinessTimeoutSeconds
    if held_since is not None and decision.outcome != canary.ABORT and p.now - held_since > limit:
        decision.outcome = canary.ABORT
        decision.reason = f"CanaryStuck: canary {pending.name} held for more than {limit:g}s: {why_held}"
    for reason, message, warning in decision.events:
        p._event(reason, message, warning)
    pending = pending.with_changes(canary=decision.state)
    p.clusters[pending.name] = pending
    if decision.outcome == canary.ABORT:
        p._fail_rollout(pending, decision.reason)
        return
    if decision.outcome == canary.PROMOTE:
        p._do(UpdateCluster(pending.name, {"canary": decision.state}))
        p._switch_all_traffic(pending)
        return
    route_action = p._desired_route_action()
    if route_action is not None and (decision.state.weight != state.weight or p.observation.route is None):
        p._do(route_action)  # the ingress first, then the step is recorded
    if decision.state != state or pending.canary is None:
        p._do(UpdateCluster(pending.name, {"canary": decision.state}))
    if pending.target_capacity is not None:
        # From the stored weight, every tick: the stable shrinks to what it carries, after the move.
        p._scale(active, float(100 - decision.state.weight))


def _stable_lost(p: _Planner, active: ClusterRecord) -> bool:
    """The stable cluster's head died, or it has been unhealthy past the threshold: a canary
    beside it must not wait on it."""
    observed = p._observed(active)
    verdict = health(observed, p.declared, p.all_apps)
    p._track_health(verdict)
    if verdict.ok:
        return False
    if active.head_pid is not None and not observed.processes_alive:
        return True
    since = p.plan.service.unhealthy_since
    return since is not None and p.now - since >= p.spec.spec.serviceUnhealthySecondThreshold
