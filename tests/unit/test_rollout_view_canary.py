"""The canary in the rollout view: its phase and detail, one tracker span per step, the canary
block of the live frame and `describe`, and the plain lines (a step, an analysis interval)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from servekeeper.cli.live import render, watch_rollout
from servekeeper.views.rollout import (
    Phase,
    RolloutTracker,
    analysis_figures,
    analysis_summary,
    canary_detail,
    rollout_status,
)
from tests.unit.test_rollout_view import OLD, Script, cluster, pending, view

ANALYSIS = {
    "started_at": 100.0,
    "ended_at": 110.0,
    "requests": 120,
    "success_rate": 0.9916,
    "p99_ms": 45.2,
    "stable_requests": 1080,
    "stable_success_rate": 1.0,
    "stable_p99_ms": 40.0,
    "verdict": "passed",
    "message": "",
}


def canary(step: int = 1, weight: int = 10, remaining: float | None = 12.4, **fields: Any) -> dict[str, Any]:
    descriptions = ["step 1/4: setWeight 10", "step 2/4: pause 30s", "step 3/4: setWeight 50", "step 4/4: pause 30s"]
    block: dict[str, Any] = {
        "weight": weight,
        "step": step,
        "steps": 4,
        "stepDescription": descriptions[step],
        "pauseRemainingSeconds": remaining,
        "stepStartedAt": 100.0,
        "passedIntervals": 1,
        "failedIntervals": 0,
        "inconclusiveIntervals": 2,
        "lastAnalysis": None,
    }
    block.update(fields)
    return block


def canary_view(block: dict[str, Any]) -> dict[str, Any]:
    weight = int(block["weight"])
    return view(
        active=cluster("hello-g1-aaaaaa", "active", trafficPercent=100 - weight),
        pending=pending(trafficPercent=weight, canary=block),
        upgrading=True,
    )


def test_a_ready_canary_is_the_canary_phase_with_its_step() -> None:
    status = rollout_status(canary_view(canary()))
    assert status.phase == Phase.CANARY and status.step == 1 and status.cluster == "hello-g2-bbbbbb"
    assert status.detail == "step 2/4: pause 30s, weight 10%, 12s left; analysis 1 passed, 0 failed, 2 inconclusive"
    assert status.traffic == {"hello-g1-aaaaaa": 90, "hello-g2-bbbbbb": 10}
    assert status.exit_code is None


def test_a_canary_cluster_still_starting_shows_the_start() -> None:
    starting = view(active=OLD, pending=pending(headAlive=None, canary=canary(step=0, weight=0, remaining=None)))
    assert rollout_status(starting).phase == Phase.STARTING_HEAD


def test_detail_without_a_timed_pause_or_a_spec() -> None:
    assert canary_detail(canary(step=2, weight=50, remaining=None)) == (
        "step 3/4: setWeight 50, weight 50%; analysis 1 passed, 0 failed, 2 inconclusive"
    )
    assert canary_detail({"step": 0, "weight": 0}).startswith("step 1, weight 0%; analysis 0 passed")


def test_each_step_is_a_span_and_the_pause_counts_down_in_place() -> None:
    tracker = RolloutTracker(0.0)
    assert tracker.observe(rollout_status(canary_view(canary(step=0, remaining=None))), 1.0)
    assert tracker.observe(rollout_status(canary_view(canary(step=1, remaining=30))), 2.0)
    assert not tracker.observe(rollout_status(canary_view(canary(step=1, remaining=10))), 22.0)
    assert tracker.observe(rollout_status(canary_view(canary(step=2, weight=50, remaining=None))), 32.0)
    assert [(span.phase, span.step) for span in tracker.spans] == [
        (Phase.CANARY, 0),
        (Phase.CANARY, 1),
        (Phase.CANARY, 2),
    ]
    assert tracker.spans[1].detail.startswith("step 2/4: pause 30s, weight 10%, 10s left")
    assert tracker.spans[1].elapsed(40.0) == 30.0


def test_analysis_figures_canary_beside_stable() -> None:
    assert analysis_figures(ANALYSIS) == [("canary", "120", "99.2%", "45 ms"), ("stable", "1080", "100.0%", "40 ms")]
    empty = dict(ANALYSIS, requests=0, success_rate=None, p99_ms=None, verdict="inconclusive", message="0 < 50")
    assert analysis_summary(empty) == (
        "inconclusive over 10s (0 < 50): canary 0 req - p99 - | stable 1080 req 100.0% p99 40 ms"
    )


def test_live_frame_shows_the_canary_block() -> None:
    the_view = canary_view(canary(lastAnalysis=ANALYSIS))
    status = rollout_status(the_view)
    tracker = RolloutTracker(0.0)
    tracker.observe(status, 1.0)
    out = io.StringIO()
    Console(file=out, width=160).print(render(the_view, status, tracker, [], 5.0))
    screen = out.getvalue()
    for text in (
        "phase  canary: step 2/4: pause 30s, weight 10%",
        "canary step 2/4: pause 30s  weight 10%  pause 12s left",
        "analysis 1 passed, 0 failed, 2 inconclusive",
        "LAST INTERVAL",
        "99.2%",
        "1080",
        "passed over 10s",
        "90%",
    ):
        assert text in screen, text


def test_plain_output_has_a_line_per_step_and_per_analysis_interval() -> None:
    later = dict(ANALYSIS, started_at=110.0, ended_at=120.0, verdict="failed", message="success rate 0.8 < 0.99")
    script = Script(
        [
            canary_view(canary(step=0, remaining=None)),
            canary_view(canary(step=1, remaining=30)),
            canary_view(canary(step=1, remaining=29, lastAnalysis=ANALYSIS)),
            canary_view(canary(step=1, remaining=28, lastAnalysis=ANALYSIS)),
            canary_view(canary(step=1, remaining=27, lastAnalysis=later)),
            view(observed=2, active=OLD, failed=("AnalysisFailed", "success rate 0.8 < 0.99")),
        ]
    )
    out = io.StringIO()
    console = Console(file=out, width=300)
    code = watch_rollout(script.fetch, list, console, clock=lambda: script.now, sleep=script.sleep)
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert code == 1
    assert [line.split(",")[0].split("  (traffic")[0] for line in lines] == [
        "canary: step 1/4: setWeight 10",
        "canary: step 2/4: pause 30s",
        "canary analysis passed over 10s: canary 120 req 99.2% p99 45 ms | stable 1080 req 100.0% p99 40 ms",
        "canary analysis failed over 10s (success rate 0.8 < 0.99): "
        "canary 120 req 99.2% p99 45 ms | stable 1080 req 100.0% p99 40 ms",
        "failed: AnalysisFailed: success rate 0.8 < 0.99",
    ]
    assert lines[1].endswith("(traffic hello-g1-aaaaaa=90% hello-g2-bbbbbb=10%)")
