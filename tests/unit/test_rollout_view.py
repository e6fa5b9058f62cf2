"""The rollout phase, derived from the service view (pure), table by table; the tracker; the
plain and live renderings of `rollout status --watch`."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from servekeeper.cli.live import render, watch_rollout
from servekeeper.views.rollout import (
    Phase,
    RolloutStatus,
    RolloutTracker,
    events_since,
    rollout_status,
)


def cluster(name: str, role: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": name,
        "role": role,
        "trafficPercent": 100 if role == "active" else 0,
        "headPid": 100,
        "headAlive": True,
        "dashboardOk": True,
        "workerPids": [],
        "workersExpected": 0,
        "submittedConfigHash": "c1",
        "configSubmittedAt": 10.0,
        "appliedConfigHash": "c1",
        "applications": {"hello": {"status": "RUNNING", "source": "declarative", "message": ""}},
        "probes": [],
        "inflightRequests": 0,
    }
    base.update(fields)
    return base


def view(
    generation: int = 2,
    observed: int = 1,
    active: dict[str, Any] | None = None,
    pending: dict[str, Any] | None = None,
    others: list[dict[str, Any]] | None = None,
    ready: bool = True,
    upgrading: bool = False,
    failed: tuple[str, str] | None = None,
    outdated: bool = False,
) -> dict[str, Any]:
    def condition(kind: str, status: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        return {"type": kind, "status": str(status), "reason": reason, "message": message, "lastTransitionTime": 1.0}

    return {
        "name": "hello",
        "generation": generation,
        "observedGeneration": observed,
        "deleting": False,
        "conditions": [
            condition("Ready", ready, "AppsRunning"),
            condition("UpgradeInProgress", upgrading, "PendingClusterNotReady" if upgrading else "NoPendingCluster"),
            condition("RolloutFailed", failed is not None, *(failed or ("NoFailure", ""))),
            condition("ClusterSpecOutdated", outdated, "UpgradeStrategyNone" if outdated else "UpToDate"),
        ],
        "activeCluster": active,
        "pendingCluster": pending,
        "otherClusters": others or [],
        "declaredApplications": ["hello"],
        "ingress": {"url": "http://127.0.0.1:8000", "port": 8000, "routedTo": active["name"] if active else None},
    }


OLD = cluster("hello-g1-aaaaaa", "active")


def pending(**fields: Any) -> dict[str, Any]:
    return cluster("hello-g2-bbbbbb", "pending", **fields)


DEPLOYING_APPS = {"hello": {"status": "DEPLOYING", "source": "declarative", "message": ""}}


@pytest.mark.parametrize(
    ("the_view", "phase", "detail"),
    [
        pytest.param(view(active=OLD), Phase.WAITING, "generation 1/2", id="controller-not-yet"),
        pytest.param(
            view(active=OLD, upgrading=True), Phase.STARTING_HEAD, "creating the new cluster", id="pending-creating"
        ),
        pytest.param(
            view(active=OLD, pending=pending(headPid=None, headAlive=None, dashboardOk=None)),
            Phase.STARTING_HEAD,
            "hello-g2-bbbbbb",
            id="head-spawning",
        ),
        pytest.param(
            view(active=OLD, pending=pending(dashboardOk=False, workersExpected=2)),
            Phase.STARTING_HEAD,
            "hello-g2-bbbbbb",
            id="head-booting-before-workers",
        ),
        pytest.param(
            view(active=OLD, pending=pending(workerPids=[7], workersExpected=2)),
            Phase.STARTING_WORKERS,
            "workers 1/2",
            id="workers",
        ),
        pytest.param(
            view(active=OLD, pending=pending(submittedConfigHash=None, appliedConfigHash=None, applications={})),
            Phase.SUBMITTING_CONFIG,
            "to hello-g2-bbbbbb",
            id="config-not-sent",
        ),
        pytest.param(
            view(active=OLD, pending=pending(configSubmittedAt=None, appliedConfigHash=None, applications={})),
            Phase.SUBMITTING_CONFIG,
            "to hello-g2-bbbbbb",
            id="put-in-flight",
        ),
        pytest.param(
            view(active=OLD, pending=pending(appliedConfigHash=None, applications={})),
            Phase.CONFIG_SUBMITTED,
            "apps 0/1 RUNNING",
            id="put-acknowledged",
        ),
        pytest.param(
            view(active=OLD, pending=pending(applications=DEPLOYING_APPS)),
            Phase.DEPLOYING,
            "apps 0/1 RUNNING",
            id="apps-deploying",
        ),
        pytest.param(
            view(
                active=OLD,
                pending=pending(
                    applications={
                        **DEPLOYING_APPS,
                        "model-x": {"status": "DEPLOY_FAILED", "source": "imperative", "message": ""},
                    }
                ),
            ),
            Phase.DEPLOYING,
            "apps 0/1 RUNNING",
            id="imperative-apps-do-not-count",
        ),
        pytest.param(
            view(active=OLD, pending=pending(probes=[{"passing": True}, {"passing": False}])),
            Phase.PROBING,
            "probes 1/2 passing",
            id="probes",
        ),
        pytest.param(
            view(active=OLD, pending=pending()),
            Phase.SWITCHING,
            "hello-g1-aaaaaa -> hello-g2-bbbbbb",
            id="ready-to-switch",
        ),
        pytest.param(
            view(
                observed=2,
                active=cluster("hello-g2-bbbbbb", "active"),
                others=[cluster("hello-g1-aaaaaa", "draining", trafficPercent=0, inflightRequests=3)],
            ),
            Phase.DRAINING,
            "hello-g1-aaaaaa (3 in flight)",
            id="draining",
        ),
        pytest.param(
            view(
                observed=2,
                active=cluster("hello-g2-bbbbbb", "active"),
                others=[cluster("hello-g1-aaaaaa", "draining", trafficPercent=0, inflightRequests=None)],
            ),
            Phase.DRAINING,
            "hello-g1-aaaaaa (? in flight)",
            id="draining-unread",
        ),
        pytest.param(
            view(
                observed=2,
                active=cluster("hello-g2-bbbbbb", "active"),
                others=[cluster("hello-g1-aaaaaa", "deleting", trafficPercent=0)],
            ),
            Phase.DELETING,
            "hello-g1-aaaaaa",
            id="deleting",
        ),
        pytest.param(
            view(observed=2, active=cluster("hello-g2-bbbbbb", "active")),
            Phase.ROLLED_OUT,
            "generation 2 on hello-g2-bbbbbb",
            id="rolled-out",
        ),
        pytest.param(
            view(observed=2, active=OLD, failed=("AppFailed", "application 'hello' is DEPLOY_FAILED")),
            Phase.FAILED,
            "AppFailed: application 'hello' is DEPLOY_FAILED",
            id="failed",
        ),
        pytest.param(
            view(observed=2, active=OLD, outdated=True),
            Phase.FAILED,
            "UpgradeStrategyNone",
            id="upgrade-strategy-none",
        ),
        pytest.param(
            view(observed=2, active=cluster("hello-g2-bbbbbb", "active"), ready=False),
            Phase.WAITING,
            "Ready: AppsRunning",
            id="current-not-ready",
        ),
    ],
)
def test_phase_of_a_new_cluster_rollout(the_view: dict[str, Any], phase: Phase, detail: str) -> None:
    status = rollout_status(the_view)
    assert (status.phase, status.detail) == (phase, detail)


@pytest.mark.parametrize(
    ("active", "phase", "detail"),
    [
        pytest.param(cluster("c", "active", submittedConfigHash="c1"), Phase.WAITING, "generation 1/2", id="not-sent"),
        pytest.param(
            cluster("c", "active", submittedConfigHash="c2", applications=DEPLOYING_APPS),
            Phase.CONFIG_SUBMITTED,
            "apps 0/1 RUNNING",
            id="sent",
        ),
        pytest.param(
            cluster("c", "active", submittedConfigHash="c2", appliedConfigHash="c2", applications=DEPLOYING_APPS),
            Phase.DEPLOYING,
            "apps 0/1 RUNNING",
            id="deploying",
        ),
    ],
)
def test_phase_of_an_in_place_change(active: dict[str, Any], phase: Phase, detail: str) -> None:
    status = rollout_status(view(active=active))
    assert (status.phase, status.detail) == (phase, detail)


def test_failure_without_a_message_names_the_latest_warning() -> None:
    failed = view(observed=2, active=OLD, failed=("", ""))
    events = [
        {"type": "Warning", "reason": "X", "message": "first"},
        {"type": "Warning", "reason": "Y", "message": "why"},
    ]
    assert rollout_status(failed, events).detail == "why"


def test_exit_codes_and_traffic() -> None:
    rolled = rollout_status(view(observed=2, active=cluster("hello-g2-bbbbbb", "active")))
    assert rolled.exit_code == 0
    assert rollout_status(view(observed=2, active=OLD, failed=("AppFailed", "x"))).exit_code == 1
    going = rollout_status(view(active=OLD, pending=pending()))
    assert going.exit_code is None
    assert going.traffic == {"hello-g1-aaaaaa": 100, "hello-g2-bbbbbb": 0}


def test_tracker_spans_phases_and_keeps_the_latest_detail() -> None:
    tracker = RolloutTracker(started=100.0)
    assert tracker.observe(RolloutStatus(Phase.STARTING_HEAD, "c"), 100.0)
    assert tracker.observe(RolloutStatus(Phase.DEPLOYING, "apps 0/1 RUNNING"), 106.0)
    assert not tracker.observe(RolloutStatus(Phase.DEPLOYING, "apps 1/1 RUNNING"), 108.0)
    assert tracker.observe(RolloutStatus(Phase.ROLLED_OUT, "done"), 109.5)
    assert [(s.phase, s.detail, s.elapsed(200.0)) for s in tracker.spans] == [
        (Phase.STARTING_HEAD, "c", 6.0),
        (Phase.DEPLOYING, "apps 1/1 RUNNING", 3.5),
        (Phase.ROLLED_OUT, "done", 0.0),
    ]
    assert tracker.total(110.0) == 10.0


def test_events_since_keeps_the_latest() -> None:
    events = [{"time": t, "reason": str(t)} for t in range(10)]
    assert [e["reason"] for e in events_since(events, 3, limit=2)] == ["8", "9"]
    assert events_since(events, 20) == []


class Script:
    """A fake API: each look returns the next view (the last one repeats); a fake clock."""

    def __init__(self, views: list[dict[str, Any]]) -> None:
        self.views = views
        self.looks = 0
        self.now = 0.0

    def fetch(self) -> dict[str, Any]:
        self.looks += 1
        return self.views[min(self.looks - 1, len(self.views) - 1)]

    def sleep(self, seconds: float) -> None:
        self.now += seconds


UPGRADE = [
    view(active=OLD),
    view(active=OLD, pending=pending(headPid=None, headAlive=None, dashboardOk=None)),
    view(active=OLD, pending=pending(headPid=None, headAlive=None, dashboardOk=None)),
    view(active=OLD, pending=pending(applications=DEPLOYING_APPS)),
    view(
        observed=2,
        active=cluster("hello-g2-bbbbbb", "active"),
        others=[cluster("hello-g1-aaaaaa", "draining", trafficPercent=0, inflightRequests=2)],
    ),
    view(observed=2, active=cluster("hello-g2-bbbbbb", "active")),
]


def test_plain_output_is_one_line_per_phase_and_exits_like_wait() -> None:
    script = Script(UPGRADE)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    code = watch_rollout(script.fetch, list, console, clock=lambda: script.now, sleep=script.sleep)
    lines = out.getvalue().splitlines()
    assert code == 0
    assert [line.split("] ", 1)[1].split(":")[0].split("  (")[0] for line in lines] == [
        "waiting for the controller",
        "starting head",
        "deploying apps",
        "draining old cluster",
        "rolled out",
    ]
    assert "\x1b" not in out.getvalue()  # no terminal control codes in a log
    assert "(3 in flight)" not in lines[-2] and "(2 in flight)" in lines[-2]
    assert lines[-2].endswith("(traffic hello-g2-bbbbbb=100% hello-g1-aaaaaa=0%)")
    assert lines[-1].endswith("(traffic hello-g2-bbbbbb=100%)")


def test_plain_output_times_out_with_exit_2() -> None:
    script = Script([view(active=OLD, pending=pending(applications=DEPLOYING_APPS))])
    out = io.StringIO()
    code = watch_rollout(
        script.fetch, list, Console(file=out, width=200), timeout=3, clock=lambda: script.now, sleep=script.sleep
    )
    assert code == 2
    assert "timed out after 3s; the rollout is at: deploying apps: apps 0/1 RUNNING" in out.getvalue()


def test_failed_rollout_exits_1() -> None:
    script = Script([view(observed=2, active=OLD, failed=("ReadinessTimeout", "not ready"))])
    out = io.StringIO()
    assert watch_rollout(script.fetch, list, Console(file=out, width=200), clock=lambda: 0.0, sleep=script.sleep) == 1
    assert "failed: ReadinessTimeout: not ready" in out.getvalue()


def test_snapshot_without_watch_exits_2_while_in_progress() -> None:
    script = Script([view(active=OLD, pending=pending(applications=DEPLOYING_APPS))])
    out = io.StringIO()
    code = watch_rollout(script.fetch, list, Console(file=out, width=200), follow=False, clock=lambda: 0.0)
    assert code == 2 and script.looks == 1


def test_live_frame_shows_phase_clusters_history_and_events() -> None:
    tracker = RolloutTracker(0.0)
    the_view = UPGRADE[4]
    status = rollout_status(the_view)
    tracker.observe(RolloutStatus(Phase.STARTING_HEAD, "hello-g2-bbbbbb"), 0.0)
    tracker.observe(status, 7.0)
    out = io.StringIO()
    Console(file=out, width=160).print(
        render(
            the_view, status, tracker, [{"time": 0, "type": "Normal", "reason": "TrafficSwitched", "message": "m"}], 9.0
        )
    )
    screen = out.getvalue()
    for text in ("phase  draining old cluster: hello-g1-aaaaaa (2 in flight)", "starting head", "7.0s", "2.0s"):
        assert text in screen
    assert "TrafficSwitched" in screen and "hello-g2-bbbbbb" in screen


def test_live_display_on_a_terminal_ends_with_the_final_frame() -> None:
    script = Script(UPGRADE)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    code = watch_rollout(script.fetch, list, console, clock=lambda: script.now, sleep=script.sleep)
    assert code == 0
    assert "rolled out" in out.getvalue()
