"""The canary step machine: where a canary is, and where it goes next. Pure.

Argo-Rollouts-shaped steps: `setWeight` moves the canary's share of traffic at once and goes on;
`pause` waits for its duration, or for `promote` when it has none. Analysis runs beside the
steps whenever the canary has traffic: each interval's figures come from the ingress's counters,
and more failed intervals than `failureLimit` abort the canary. Everything the machine needs to
resume is in `CanaryState`, which the planner stores on the canary's cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servekeeper.core.analysis import FAILED, INCONCLUSIVE, PASSED, analyse, describe, difference
from servekeeper.model.canary_spec import CanarySpec, CanaryStepSpec, MirrorSpec
from servekeeper.model.observation import BackendCounters
from servekeeper.model.records import CanaryState
from servekeeper.model.routing import HeaderMatch

CONTINUE = "continue"
PROMOTE = "promote"  # every step done (or `promote --full`): all traffic to the canary
ABORT = "abort"


@dataclass(frozen=True)
class CanaryCommands:
    """What the operator asked of this canary (counted by the API on its cluster)."""

    promote_requests: int = 0
    promote_full: bool = False
    abort_requested: bool = False


@dataclass
class CanaryDecision:
    state: CanaryState
    outcome: str = CONTINUE
    reason: str = ""  # for ABORT: "Reason: message"
    events: list[tuple[str, str, bool]] = field(default_factory=list)  # (reason, message, warning)


def start(now: float) -> CanaryState:
    return CanaryState(step=0, step_started_at=now, weight=0)


def describe_step(spec: CanarySpec, state: CanaryState) -> str:
    """ "step 2/4: pause 30s" — for status lines and the live view."""
    total = len(spec.steps)
    if state.step >= total:
        return f"step {total}/{total}: done, waiting for a passed analysis interval (or promote)"
    step = spec.steps[state.step]
    if step.setWeight is not None:
        what = f"setWeight {step.setWeight}"
    elif step.setHeaderRoute is not None:
        what = f"setHeaderRoute {step.setHeaderRoute.match().describe()}"
    elif step.mirror is not None:
        how_long = f"{step.mirror.duration:g}s" if step.mirror.duration is not None else "until promote"
        what = f"mirror {step.mirror.percent}% of {', '.join(step.mirror.methods)} {how_long}"
    elif step.pause is not None and step.pause.duration is not None:
        what = f"pause {step.pause.duration:g}s"
    else:
        what = "pause until promote"
    return f"step {state.step + 1}/{total}: {what}"


def mirror(spec: CanarySpec, state: CanaryState) -> MirrorSpec | None:
    """The shadow step the canary is in (its copies go on until the step ends), or None."""
    return spec.steps[state.step].mirror if state.step < len(spec.steps) else None


def _wait_of(step: CanaryStepSpec) -> float | None:
    """How long a waiting step (a pause or a mirror) lasts; None: until `promote`."""
    if step.mirror is not None:
        return step.mirror.duration
    return step.pause.duration if step.pause is not None else None


def header_route(spec: CanarySpec, state: CanaryState) -> HeaderMatch | None:
    """The header route in force: that of the last `setHeaderRoute` step passed, else the
    canary's `headerRoute` (on from its start), else none."""
    for step in reversed(spec.steps[: state.step]):
        if step.setHeaderRoute is not None:
            return step.setHeaderRoute.match()
    return spec.headerRoute.match() if spec.headerRoute is not None else None


def pause_remaining(spec: CanarySpec, state: CanaryState, now: float) -> float | None:
    """Seconds left in the current timed pause (None: not in one)."""
    if state.step >= len(spec.steps):
        return None
    step = spec.steps[state.step]
    wait = _wait_of(step)
    if (step.pause is None and step.mirror is None) or wait is None:
        return None
    return max(0.0, state.step_started_at + wait - now)


def advance(
    spec: CanarySpec,
    state: CanaryState,
    commands: CanaryCommands,
    counters: dict[str, BackendCounters] | None,
    canary: str,
    stable: str,
    now: float,
    hold: bool = False,
) -> CanaryDecision:
    """One tick of a canary. `counters`: the ingress's per-backend counters now (None:
    unreadable on this look, so no analysis verdict is drawn). `hold`: the canary may not take
    more traffic now (not ready, or its capacity not reached): analysis and abort go on, the
    steps and promotions wait."""
    decision = CanaryDecision(state=state)
    if commands.abort_requested:
        decision.outcome, decision.reason = ABORT, "Aborted: by `servekeeper abort`"
        return decision
    if hold:
        _analyse(spec, decision, counters, canary, stable, now)
        return decision
    if commands.promote_full:
        decision.outcome = PROMOTE
        decision.events.append(("CanaryPromoted", "`promote --full`: every remaining step and analysis skipped", False))
        return decision
    _analyse(spec, decision, counters, canary, stable, now)
    if decision.outcome == ABORT:
        return decision
    _step(spec, decision, commands, now)
    return decision


def _analyse(
    spec: CanarySpec,
    decision: CanaryDecision,
    counters: dict[str, BackendCounters] | None,
    canary: str,
    stable: str,
    now: float,
) -> None:
    analysis = spec.analysis
    state = decision.state
    answers = state.weight > 0 or mirror(spec, state) is not None or header_route(spec, state) is not None
    if analysis is None or counters is None or not answers:
        return  # nothing to judge: no answers of the canary (no traffic, no copies, no header route)
    if state.interval_started_at is None:
        # The first look with traffic on the canary: the interval starts here.
        decision.state = state.with_changes(interval_started_at=now, baseline=_pick(counters, canary, stable))
        return
    if now - state.interval_started_at < analysis.interval:
        return

    def delta(name: str) -> BackendCounters | None:
        end = counters.get(name, BackendCounters())
        # Not in Envoy's stats at the interval's start: it had answered nothing yet.
        return difference(end, state.baseline.get(name, BackendCounters(epoch=end.epoch)))

    canary_delta, stable_delta = delta(canary), delta(stable)
    figures = analyse(analysis, canary_delta, stable_delta, state.interval_started_at, now)
    passed, failed, inconclusive = state.passed_intervals, state.failed_intervals, state.inconclusive_intervals
    # At weight 0 without copies only the header route's requests (testers) reached the canary:
    # they may fail it, never pass it for the users (nor flood the events while none come).
    testers_only = state.weight <= 0 and mirror(spec, state) is None
    if figures.verdict == PASSED and not testers_only:
        passed += 1
    elif figures.verdict == FAILED:
        failed += 1
    elif figures.verdict == INCONCLUSIVE:
        inconclusive += 1
    decision.state = state.with_changes(
        interval_started_at=now,
        baseline=_pick(counters, canary, stable),
        passed_intervals=passed,
        failed_intervals=failed,
        inconclusive_intervals=inconclusive,
        last_analysis=figures,
    )
    line = describe(figures)
    if figures.verdict == FAILED and failed > analysis.failureLimit:
        decision.outcome = ABORT
        decision.reason = (
            f"AnalysisFailed: {failed} failed interval(s), more than failureLimit {analysis.failureLimit}: {line}"
        )
        return
    if testers_only and figures.verdict == INCONCLUSIVE:
        return
    warning = figures.verdict == FAILED
    decision.events.append(("CanaryAnalysis", f"{figures.verdict}: {line}", warning))


def _pick(counters: dict[str, BackendCounters], canary: str, stable: str) -> dict[str, BackendCounters]:
    return {name: counters[name] for name in (canary, stable) if name in counters}


def _step(spec: CanarySpec, decision: CanaryDecision, commands: CanaryCommands, now: float) -> None:
    """Go through the steps that are done; at most one weight change per tick (each one waits
    for the ingress to acknowledge it before the next is recorded)."""
    moved = False
    while True:
        state = decision.state
        if state.step >= len(spec.steps):
            # Inconclusive is not success: with analysis, all the traffic only after a passed
            # interval (or an explicit promote).
            promoted = commands.promote_requests > state.promotes_seen
            if spec.analysis is None or state.passed_intervals > 0 or promoted:
                decision.outcome = PROMOTE
            return
        step = spec.steps[state.step]
        if step.setWeight is not None:
            if moved:
                return
            if step.setWeight >= 100:
                decision.state = state.with_changes(step=len(spec.steps))
                continue
            decision.state = state.with_changes(step=state.step + 1, step_started_at=now, weight=step.setWeight)
            decision.events.append(("CanaryWeight", f"{step.setWeight}% of traffic to the canary", False))
            moved = True
            continue
        if step.setHeaderRoute is not None:
            # Like a weight, a route change the ingress acknowledges before the next is recorded.
            if moved:
                return
            decision.state = state.with_changes(step=state.step + 1, step_started_at=now)
            message = f"requests with {step.setHeaderRoute.match().describe()} go to the canary"
            decision.events.append(("CanaryHeaderRoute", message, False))
            moved = True
            continue
        wait = _wait_of(step)  # a pause, or a mirror step: both wait for their duration or promote
        promoted = commands.promote_requests > state.promotes_seen
        elapsed = now - state.step_started_at
        timed_out = wait is not None and elapsed >= wait
        if not (promoted or timed_out):
            return
        why = "`promote`" if promoted else f"{'mirror' if step.mirror else 'pause'} of {elapsed:.0f}s over"
        decision.state = state.with_changes(
            step=state.step + 1, step_started_at=now, promotes_seen=commands.promote_requests
        )
        last = state.step + 1 >= len(spec.steps)
        following = "done" if last else f"step {state.step + 2} of {len(spec.steps)} next"
        decision.events.append(("CanaryResumed", f"{why}: {following}", False))
        if promoted and last:
            decision.outcome = PROMOTE  # an explicit promote of the last pause: no analysis gate
            return
