"""The live rollout view: `servekeeper rollout status NAME --watch` and `apply -f F --watch`.

On a terminal a Rich `Live` display redraws in place: the phase, the traffic split, every phase
seen so far with its duration, and the latest events. Anywhere else (CI logs, a pipe) it prints
one plain line per phase change. The phase comes from `core.rollout_view` (pure); this module
only polls, keeps time and draws.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from servekeeper.views.rollout import (
    EXIT_TIMEOUT,
    Phase,
    RolloutStatus,
    RolloutTracker,
    analysis_figures,
    analysis_summary,
    analysis_verdict,
    apps_running,
    canary_of,
    events_since,
    rollout_status,
)

View = Mapping[str, Any]
FetchView = Callable[[], View]
FetchEvents = Callable[[], Sequence[Mapping[str, Any]]]

PHASE_STYLE = {
    Phase.ROLLED_OUT: "bold green",
    Phase.FAILED: "bold red",
    Phase.DRAINING: "yellow",
    Phase.CANARY: "bold magenta",
}


def _clusters(view: View) -> list[tuple[str, Mapping[str, Any]]]:
    found: list[tuple[str, Mapping[str, Any]]] = []
    if view.get("activeCluster"):
        found.append(("active", view["activeCluster"]))
    if view.get("pendingCluster"):
        found.append(("pending", view["pendingCluster"]))
    if view.get("standbyCluster"):
        found.append((f"standby ({view.get('standby', 'building')})", view["standbyCluster"]))
    found += [(c.get("role", "?"), c) for c in view.get("otherClusters", [])]
    return found


def render(
    view: View,
    status: RolloutStatus,
    tracker: RolloutTracker,
    events: Sequence[Mapping[str, Any]],
    now: float,
) -> RenderableType:
    """One frame of the live view."""
    header = Text.assemble(
        ("service/", "dim"),
        (str(view.get("name")), "bold"),
        f"  generation {view.get('observedGeneration')}/{view.get('generation')}",
        f"  elapsed {tracker.total(now):.1f}s",
    )
    phase = Text.assemble("phase  ", (status.label, PHASE_STYLE.get(status.phase, "bold cyan")))
    clusters = Table("CLUSTER", "ROLE", "TRAFFIC", "IN FLIGHT", "WORKERS", "APPS RUNNING", box=None)
    for role, cluster in _clusters(view):
        running, total = apps_running(view, cluster)
        inflight = cluster.get("inflightRequests")
        expected = cluster.get("workersExpected")
        workers = f"{len(cluster.get('workerPids') or [])}/{expected}" if expected else "-"
        clusters.add_row(
            cluster["name"],
            role,
            f"{cluster.get('trafficPercent', 0)}%",
            "-" if inflight is None else str(inflight),
            workers,
            f"{running}/{total}",
        )
    phases = Table("", "PHASE", "DETAIL", "TIME", box=None)
    for index, span in enumerate(tracker.spans):
        last = index == len(tracker.spans) - 1
        mark = ("✔" if span.phase == Phase.ROLLED_OUT else "✘" if span.phase == Phase.FAILED else "▶") if last else "✔"
        phases.add_row(mark, span.phase.value, span.detail, f"{span.elapsed(now):.1f}s")
    recent = Table("TIME", "TYPE", "REASON", "MESSAGE", box=None)
    for event in events:
        recent.add_row(
            _when(event.get("time")), event.get("type", ""), event.get("reason", ""), event.get("message", "")
        )
    parts: list[RenderableType] = [header, phase, Text(""), clusters, Text("")]
    canary = canary_of(view)
    if canary is not None:
        parts += [canary_block(canary), Text("")]
    parts += [phases, Text(""), Text("recent events", "bold"), recent]
    return Group(*parts)


def canary_block(canary: Mapping[str, Any]) -> RenderableType:
    """The canary's step, weight, pause and analysis, with the last interval canary vs stable."""
    remaining = canary.get("pauseRemainingSeconds")
    pause = f"  pause {remaining:.0f}s left" if remaining is not None else ""
    step = canary.get("stepDescription") or f"step {int(canary.get('step', 0)) + 1}"
    header = canary.get("headerRoute")
    pinned = f"  + requests with {header}" if header else ""
    if canary.get("mirror"):
        pinned += f"  shadow: {canary['mirror']}"
    lines: list[RenderableType] = [
        Text.assemble(("canary ", "bold"), step, f"  weight {canary.get('weight', 0)}%", pinned, pause),
        Text(
            f"analysis {canary.get('passedIntervals', 0)} passed, {canary.get('failedIntervals', 0)} failed, "
            f"{canary.get('inconclusiveIntervals', 0)} inconclusive"
        ),
    ]
    last = canary.get("lastAnalysis")
    if last:
        figures = Table("LAST INTERVAL", "REQUESTS", "SUCCESS", "P99", box=None)
        for row in analysis_figures(last):
            figures.add_row(*row)
        lines += [figures, Text(analysis_verdict(last), "dim")]
    return Group(*lines)


def _when(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S") if timestamp else "-"


def plain_line(status: RolloutStatus, elapsed: float) -> str:
    traffic = " ".join(f"{name}={percent}%" for name, percent in status.traffic.items())
    return f"[{elapsed:6.1f}s] {status.label}" + (f"  (traffic {traffic})" if traffic else "")


def watch_rollout(
    fetch_view: FetchView,
    fetch_events: FetchEvents,
    console: Console,
    *,
    follow: bool = True,
    timeout: float = 900,
    events_from: float = 0.0,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Show the rollout until it ends; return `wait`'s exit code (0 rolled out, 1 failed,
    2 timed out, or, without `follow`, 2 while it still goes on)."""
    started = clock()
    tracker = RolloutTracker(started)

    def look() -> tuple[View, RolloutStatus, list[Mapping[str, Any]]]:
        events = list(fetch_events())
        view = fetch_view()
        status = rollout_status(view, events)
        tracker.observe(status, clock())
        return view, status, events_since(events, events_from)

    if not console.is_terminal:
        return _plain(
            look, tracker, console, follow=follow, timeout=timeout, interval=interval, clock=clock, sleep=sleep
        )
    view, status, events = look()
    if not follow:
        console.print(render(view, status, tracker, events, clock()))
        return status.exit_code if status.exit_code is not None else EXIT_TIMEOUT
    with Live(render(view, status, tracker, events, clock()), console=console, refresh_per_second=4) as live:
        while status.exit_code is None and clock() - started < timeout:
            sleep(interval)
            view, status, events = look()
            live.update(render(view, status, tracker, events, clock()))
    return _finish(status, tracker, console, clock())


def _plain(
    look: Callable[[], tuple[View, RolloutStatus, list[Mapping[str, Any]]]],
    tracker: RolloutTracker,
    console: Console,
    *,
    follow: bool,
    timeout: float,
    interval: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> int:
    printed = 0
    analysed: float | None = None  # the end of the last analysis interval printed
    status: RolloutStatus | None = None
    while True:
        view, status, _ = look()
        # One line per phase change (its detail as first seen); printed once it began.
        while printed < len(tracker.spans):
            span = tracker.spans[printed]
            shown = RolloutStatus(span.phase, span.detail, status.cluster, status.traffic)
            console.print(
                plain_line(shown, span.started - tracker.started), markup=False, highlight=False, soft_wrap=True
            )
            printed += 1
        last = (canary_of(view) or {}).get("lastAnalysis")
        if last and last.get("ended_at") != analysed:
            analysed = last.get("ended_at")
            line = f"[{clock() - tracker.started:6.1f}s] canary analysis {analysis_summary(last)}"
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        if status.exit_code is not None or not follow or clock() - tracker.started >= timeout:
            break
        sleep(interval)
    if not follow and status.exit_code is None:
        return EXIT_TIMEOUT
    return _finish(status, tracker, console, clock())


def _finish(status: RolloutStatus, tracker: RolloutTracker, console: Console, now: float) -> int:
    if status.exit_code is not None:
        return status.exit_code
    console.print(
        f"timed out after {tracker.total(now):.0f}s; the rollout is at: {status.label}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_TIMEOUT
