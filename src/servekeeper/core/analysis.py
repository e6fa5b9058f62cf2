"""Canary analysis: figures of one interval from the ingress's counters, and their verdict.

Pure: counters in, figures out. The counters only grow, so an interval's figures are the
difference between its end and its start; a counter that went down means an ingress process
restarted (its counters start again at 0), and that interval is inconclusive, never a pass.
"""

from __future__ import annotations

from servekeeper.model.canary_spec import AnalysisSpec
from servekeeper.model.observation import BackendCounters
from servekeeper.model.records import AnalysisFigures

PASSED = "passed"
FAILED = "failed"
INCONCLUSIVE = "inconclusive"


def difference(end: BackendCounters, start: BackendCounters) -> BackendCounters | None:
    """What happened between two readings; None across an ingress restart (another epoch, or a
    counter that went down)."""
    if end.epoch != start.epoch:
        return None
    requests = end.requests - start.requests
    errors = end.errors_5xx - start.errors_5xx
    started = dict(start.latency_ms_buckets)
    buckets = tuple((bound, count - started.get(bound, 0)) for bound, count in end.latency_ms_buckets)
    if requests < 0 or errors < 0 or any(count < 0 for _, count in buckets):
        return None
    return BackendCounters(requests=requests, errors_5xx=errors, latency_ms_buckets=buckets)


def p99_ms(counters: BackendCounters) -> float | None:
    """The 99th percentile of upstream time, interpolated inside its bucket (as Prometheus'
    histogram_quantile does). None without samples."""
    return quantile_ms(counters, 0.99)


def quantile_ms(counters: BackendCounters, q: float) -> float | None:
    buckets = sorted(counters.latency_ms_buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0
    for bound, count in buckets:
        if count >= rank:
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return buckets[-1][0]


def success_rate(counters: BackendCounters) -> float | None:
    if counters.requests <= 0:
        return None
    return 1.0 - min(counters.errors_5xx, counters.requests) / counters.requests


def analyse(
    spec: AnalysisSpec,
    canary: BackendCounters | None,
    stable: BackendCounters | None,
    started_at: float,
    now: float,
) -> AnalysisFigures:
    """The verdict of one interval: `canary` and `stable` are what each did in it (None: unknown)."""
    requests = canary.requests if canary is not None else 0
    rate = success_rate(canary) if canary is not None else None
    p99 = p99_ms(canary) if canary is not None else None
    problems = []
    if canary is None:
        verdict, message = INCONCLUSIVE, "the ingress counters restarted during the interval"
    elif requests < spec.minRequests:
        verdict, message = INCONCLUSIVE, f"{requests} requests, fewer than minRequests {spec.minRequests}"
    else:
        if spec.successRate is not None and rate is not None and rate < spec.successRate.min:
            problems.append(f"success rate {rate:.4f} < {spec.successRate.min:g}")
        if spec.latencyP99Ms is not None and p99 is not None and p99 > spec.latencyP99Ms.max:
            problems.append(f"p99 {p99:.0f} ms > {spec.latencyP99Ms.max:g} ms")
        verdict = FAILED if problems else PASSED
        message = "; ".join(problems)
    return AnalysisFigures(
        started_at=started_at,
        ended_at=now,
        requests=requests,
        success_rate=rate,
        p99_ms=p99,
        stable_requests=stable.requests if stable is not None else 0,
        stable_success_rate=success_rate(stable) if stable is not None else None,
        stable_p99_ms=p99_ms(stable) if stable is not None else None,
        verdict=verdict,
        message=message,
    )


def describe(figures: AnalysisFigures) -> str:
    """One line for events and RolloutFailed: the canary's figures beside the stable cluster's."""

    def rate(value: float | None) -> str:
        return f"{value * 100:.2f}%" if value is not None else "n/a"

    def latency(value: float | None) -> str:
        return f"{value:.0f} ms" if value is not None else "n/a"

    seconds = figures.ended_at - figures.started_at
    head = f"{figures.message}: " if figures.message else ""
    return (
        f"{head}canary {figures.requests} requests, success {rate(figures.success_rate)}, p99 "
        f"{latency(figures.p99_ms)}; stable {figures.stable_requests} requests, success "
        f"{rate(figures.stable_success_rate)}, p99 {latency(figures.stable_p99_ms)} (over {seconds:.1f}s)"
    )
