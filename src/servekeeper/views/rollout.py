"""Pure: where a rollout is, derived from the service view (`views/service.py`) and its events.

`rollout status --watch`, `apply --watch` and the web dashboard all show this; none of them
decides anything with it. The exit codes are `wait`'s: 0 rolled out, 1 failed, 2 timed out
(the timeout is the caller's business: it holds the clock).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

View = Mapping[str, Any]


class Phase(str, enum.Enum):
    WAITING = "waiting for the controller"
    STARTING_HEAD = "starting head"
    STARTING_WORKERS = "starting workers"
    SUBMITTING_CONFIG = "submitting config"
    CONFIG_SUBMITTED = "config submitted"
    DEPLOYING = "deploying apps"
    PROBING = "readiness probes"
    CANARY = "canary"
    SWITCHING = "switching traffic"
    DRAINING = "draining old cluster"
    DELETING = "deleting old cluster"
    ROLLED_OUT = "rolled out"
    FAILED = "failed"
    SERVICE_DELETING = "service deleting"

    @property
    def ended(self) -> bool:
        return self in (Phase.ROLLED_OUT, Phase.FAILED)


EXIT_ROLLED_OUT = 0
EXIT_FAILED = 1
EXIT_TIMEOUT = 2


@dataclass(frozen=True)
class RolloutStatus:
    phase: Phase
    detail: str = ""
    cluster: str | None = None  # the cluster the phase is about
    traffic: dict[str, int] = field(default_factory=dict)  # cluster -> percent of the service's traffic
    step: int | None = None  # the canary step: each is a phase of its own in the tracker

    @property
    def exit_code(self) -> int | None:
        """`wait`'s exit code once the rollout ended; None while it goes on."""
        if self.phase == Phase.ROLLED_OUT:
            return EXIT_ROLLED_OUT
        if self.phase == Phase.FAILED:
            return EXIT_FAILED
        return None

    @property
    def label(self) -> str:
        return f"{self.phase.value}: {self.detail}" if self.detail else self.phase.value


def _condition(view: View, condition_type: str) -> Mapping[str, Any] | None:
    for condition in view.get("conditions", []):
        if condition["type"] == condition_type:
            return dict(condition)
    return None


def _is_true(view: View, condition_type: str) -> bool:
    condition = _condition(view, condition_type)
    return condition is not None and condition["status"] == "True"


def traffic_split(view: View) -> dict[str, int]:
    clusters = [view.get("activeCluster"), view.get("pendingCluster"), *view.get("otherClusters", [])]
    return {c["name"]: int(c.get("trafficPercent", 0)) for c in clusters if c}


def apps_running(view: View, cluster: Mapping[str, Any]) -> tuple[int, int]:
    """(RUNNING, total) over the declared apps; apps created at run time never count here."""
    apps = cluster.get("applications", {})
    declared = list(view.get("declaredApplications") or [])
    if not declared:
        declared = [name for name, app in apps.items() if app.get("source") == "declarative"]
    running = sum(1 for name in declared if apps.get(name, {}).get("status") == "RUNNING")
    return running, len(declared)


def _probes_passing(cluster: Mapping[str, Any]) -> tuple[int, int]:
    probes = cluster.get("probes") or []
    return sum(1 for probe in probes if probe.get("passing")), len(probes)


def canary_of(view: View) -> Mapping[str, Any] | None:
    """The pending cluster's canary block (`views/service.py` `canary_view`), or None."""
    pending = view.get("pendingCluster")
    canary = pending.get("canary") if pending else None
    return dict(canary) if canary else None


def canary_detail(canary: Mapping[str, Any]) -> str:
    """ "step 2/4: pause 30s, weight 10%, 12s left; analysis 1 passed, 0 failed, 0 inconclusive"."""
    step = canary.get("stepDescription") or f"step {int(canary.get('step', 0)) + 1}"
    parts = [f"{step}, weight {canary.get('weight', 0)}%"]
    remaining = canary.get("pauseRemainingSeconds")
    if remaining is not None:
        parts.append(f"{remaining:.0f}s left")
    counts = (
        f"analysis {canary.get('passedIntervals', 0)} passed, {canary.get('failedIntervals', 0)} failed, "
        f"{canary.get('inconclusiveIntervals', 0)} inconclusive"
    )
    return ", ".join(parts) + "; " + counts


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def _ms(p99: float | None) -> str:
    return "-" if p99 is None else f"{p99:.0f} ms"


def analysis_figures(last: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """The last analysis interval as rows (who, requests, success rate, p99): canary, then stable."""
    return [
        ("canary", str(last.get("requests", 0)), _rate(last.get("success_rate")), _ms(last.get("p99_ms"))),
        (
            "stable",
            str(last.get("stable_requests", 0)),
            _rate(last.get("stable_success_rate")),
            _ms(last.get("stable_p99_ms")),
        ),
    ]


def analysis_verdict(last: Mapping[str, Any]) -> str:
    """ "failed over 10s (success rate 0.800 < 0.99)"."""
    seconds = float(last.get("ended_at", 0.0)) - float(last.get("started_at", 0.0))
    message = f" ({last['message']})" if last.get("message") else ""
    return f"{last.get('verdict', '?')} over {seconds:.0f}s{message}"


def analysis_summary(last: Mapping[str, Any]) -> str:
    """The verdict, then "canary 120 req 99.2% p99 45 ms | stable 1080 req 99.9% p99 40 ms"."""
    figures = " | ".join(
        f"{who} {requests} req {rate} p99 {p99}" for who, requests, rate, p99 in analysis_figures(last)
    )
    return f"{analysis_verdict(last)}: {figures}"


def _starting(view: View, cluster: Mapping[str, Any]) -> RolloutStatus | None:
    """The phases of a new cluster before traffic can move to it; None once it is ready."""
    name = cluster["name"]
    traffic = traffic_split(view)
    if cluster.get("headPid") is None or not cluster.get("headAlive") or not cluster.get("dashboardOk"):
        return RolloutStatus(Phase.STARTING_HEAD, name, name, traffic)
    expected = cluster.get("workersExpected") or 0
    started = len(cluster.get("workerPids") or [])
    if started < expected:
        return RolloutStatus(Phase.STARTING_WORKERS, f"workers {started}/{expected}", name, traffic)
    running, total = apps_running(view, cluster)
    submitted = cluster.get("submittedConfigHash")
    if submitted is None or (
        cluster.get("configSubmittedAt") is None and cluster.get("appliedConfigHash") != submitted
    ):
        return RolloutStatus(Phase.SUBMITTING_CONFIG, f"to {name}", name, traffic)
    if cluster.get("appliedConfigHash") != submitted:
        return RolloutStatus(Phase.CONFIG_SUBMITTED, f"apps {running}/{total} RUNNING", name, traffic)
    if running < total:
        return RolloutStatus(Phase.DEPLOYING, f"apps {running}/{total} RUNNING", name, traffic)
    passing, probes = _probes_passing(cluster)
    if passing < probes:
        return RolloutStatus(Phase.PROBING, f"probes {passing}/{probes} passing", name, traffic)
    return None


def rollout_status(view: View, events: Sequence[Mapping[str, Any]] = ()) -> RolloutStatus:
    """The rollout's phase. `events` are the service's events, oldest first (the latest
    Warning names the cause of a failure when the condition has no message)."""
    traffic = traffic_split(view)
    if view.get("deleting"):
        return RolloutStatus(Phase.SERVICE_DELETING, "", None, traffic)
    current = view.get("observedGeneration") == view.get("generation")
    for failure_type in ("RolloutFailed", "ClusterSpecOutdated"):
        if current and _is_true(view, failure_type):
            condition = _condition(view, failure_type) or {}
            detail = ": ".join(p for p in (condition.get("reason"), condition.get("message")) if p)
            if not detail:
                warnings = [e for e in events if e.get("type") == "Warning"]
                detail = warnings[-1]["message"] if warnings else failure_type
            return RolloutStatus(Phase.FAILED, detail, None, traffic)
    active = view.get("activeCluster")
    pending = view.get("pendingCluster")
    if pending is not None:
        starting = _starting(view, pending)
        if starting is not None:
            return starting
        canary = canary_of(view)
        if canary is not None:
            step = int(canary.get("step", 0))
            return RolloutStatus(Phase.CANARY, canary_detail(canary), pending["name"], traffic, step)
        source = f"{active['name']} " if active else ""
        return RolloutStatus(Phase.SWITCHING, f"{source}-> {pending['name']}", pending["name"], traffic)
    if not current:
        upgrade = _condition(view, "UpgradeInProgress") or {}
        if upgrade.get("status") == "True":
            return RolloutStatus(Phase.STARTING_HEAD, "creating the new cluster", None, traffic)
        if active is not None and active.get("submittedConfigHash") not in (None, active.get("appliedConfigHash")):
            # An in-place change: the new Serve config went to the active cluster.
            running, total = apps_running(view, active)
            return RolloutStatus(Phase.CONFIG_SUBMITTED, f"apps {running}/{total} RUNNING", active["name"], traffic)
        if active is not None and active.get("appliedConfigHash") == active.get("submittedConfigHash"):
            running, total = apps_running(view, active)
            if running < total:
                return RolloutStatus(Phase.DEPLOYING, f"apps {running}/{total} RUNNING", active["name"], traffic)
        return RolloutStatus(
            Phase.WAITING, f"generation {view.get('observedGeneration')}/{view.get('generation')}", None, traffic
        )
    others = list(view.get("otherClusters", []))
    draining = [c for c in others if c.get("role") == "draining"]
    if draining:
        parts = []
        for cluster in draining:
            inflight = cluster.get("inflightRequests")
            parts.append(f"{cluster['name']} ({'?' if inflight is None else inflight} in flight)")
        return RolloutStatus(Phase.DRAINING, ", ".join(parts), draining[0]["name"], traffic)
    deleting = [c for c in others if c.get("role") == "deleting"]
    if deleting:
        return RolloutStatus(Phase.DELETING, ", ".join(c["name"] for c in deleting), deleting[0]["name"], traffic)
    if _is_true(view, "Ready") and not _is_true(view, "UpgradeInProgress"):
        name = active["name"] if active else None
        return RolloutStatus(Phase.ROLLED_OUT, f"generation {view.get('generation')} on {name}", name, traffic)
    ready = _condition(view, "Ready") or {}
    return RolloutStatus(Phase.WAITING, f"Ready: {ready.get('reason', '?')}", None, traffic)


@dataclass(frozen=True)
class PhaseSpan:
    phase: Phase
    detail: str
    started: float
    ended: float | None = None
    step: int | None = None  # the canary step of a CANARY span

    def elapsed(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.started


class RolloutTracker:
    """The phases seen so far, each with when it began and ended. Pure: the caller passes `now`.
    A phase is a new span only when the phase itself (or the canary's step) changes; its detail
    (workers 1/2 -> 2/2, in-flight counts, a pause counting down) updates the current span."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.spans: list[PhaseSpan] = []

    def observe(self, status: RolloutStatus, now: float) -> bool:
        """Record one look; True when the phase changed."""
        if self.spans and (self.spans[-1].phase, self.spans[-1].step) == (status.phase, status.step):
            last = self.spans[-1]
            self.spans[-1] = PhaseSpan(last.phase, status.detail, last.started, last.ended, last.step)
            return False
        if self.spans:
            last = self.spans[-1]
            self.spans[-1] = PhaseSpan(last.phase, last.detail, last.started, now, last.step)
        ended = now if status.phase.ended else None
        self.spans.append(PhaseSpan(status.phase, status.detail, now, ended, status.step))
        return True

    def total(self, now: float) -> float:
        return now - self.started


def events_since(events: Sequence[Mapping[str, Any]], since: float, limit: int = 5) -> list[Mapping[str, Any]]:
    """The latest `limit` events at or after `since` (oldest first)."""
    return [e for e in events if e.get("time", 0) >= since][-limit:]
