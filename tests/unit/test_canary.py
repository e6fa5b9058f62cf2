"""Canary delivery in the planner, tick by tick on a fake clock: steps, pauses, commands,
analysis from the ingress's counters, abort, rollback window, preview."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from servekeeper.core import actions as act
from servekeeper.core import canary_steps
from servekeeper.core.analysis import analyse, difference, p99_ms
from servekeeper.core.planner import plan
from servekeeper.model.canary_spec import AnalysisSpec
from servekeeper.model.enums import AppStatus, ClusterRole
from servekeeper.model.observation import BackendCounters, ClusterObservation
from servekeeper.model.records import CanaryState, ClusterRecord
from servekeeper.model.routing import HeaderMatch, Mirror
from servekeeper.model.spec import ServiceSpec, SpecError, parse_spec
from servekeeper.testing.sim import SimWorld
from servekeeper.views.service import canary_view
from tests.unit.test_planner import make_spec

STEPS: list[dict[str, Any]] = [
    {"setWeight": 10},
    {"pause": {"duration": "30s"}},
    {"setWeight": 50},
    {"pause": {}},
]


def canary_spec(
    msg: str = "v1", steps: list[dict[str, Any]] | None = None, analysis: dict[str, Any] | None = None, **more: Any
) -> ServiceSpec:
    canary: dict[str, Any] = {"steps": steps if steps is not None else STEPS}
    if analysis is not None:
        canary["analysis"] = analysis
    return make_spec(msg=msg, upgradeStrategy={"type": "Canary", "canary": canary}, **more)


def ready_world(spec: ServiceSpec) -> SimWorld:
    world = SimWorld(spec)
    world.run_for(15)
    assert world.condition("Ready")
    return world


def canary_started(
    world: SimWorld, spec: ServiceSpec, until: Callable[[], bool] | None = None
) -> tuple[ClusterRecord, ClusterRecord]:
    """Apply `spec` and tick until its cluster is ready and carries its first weight (or `until`)."""
    stable = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(spec)

    def carries_weight() -> bool:
        pending = world.with_role(ClusterRole.PENDING)
        return bool(pending) and pending[0].canary is not None and pending[0].canary.weight > 0

    started = until or carries_weight
    for _ in range(60):
        world.tick()
        world.advance(0.5)
        if started():
            return stable, pending_of(world)
    raise AssertionError("the canary never started")


def weights(world: SimWorld) -> dict[str, int]:
    assert world.route is not None
    return {name: world.route.weight_of(name) for name in world.route.upstreams}


def pending_of(world: SimWorld) -> ClusterRecord:
    return world.with_role(ClusterRole.PENDING)[0]


def reasons(world: SimWorld) -> list[str]:
    return [event.reason for event in world.events]


def test_steps_move_the_weight_pause_for_their_duration_and_wait_for_promote() -> None:
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    assert weights(world) == {stable.name: 90, canary.name: 10}
    assert world.condition("UpgradeInProgress") and world.condition("Ready")
    assert world.service.observed_generation == 1, "a canary is not a finished rollout"
    started = pending_of(world).canary
    assert started is not None and started.step == 1  # in the 30 s pause

    world.run_for(29)
    assert weights(world)[canary.name] == 10, "the pause holds the weight for its whole duration"
    world.run_for(2)
    assert weights(world) == {stable.name: 50, canary.name: 50}

    world.run_for(120)  # `pause: {}` waits for promote, however long
    assert weights(world)[canary.name] == 50
    state = pending_of(world).canary
    assert state is not None and state.step == 3
    message = next(c.message for c in world.service.conditions if c.type.value == "UpgradeInProgress")
    assert "at 50%" in message and "step 4/4: pause until promote" in message

    world.clusters[canary.name] = pending_of(world).with_changes(promote_requests=1)
    world.tick()
    assert weights(world)[canary.name] == 100
    assert world.clusters[canary.name].role == ClusterRole.ACTIVE
    assert world.clusters[stable.name].role == ClusterRole.DRAINING
    world.run_for(1)
    assert world.service.observed_generation == 2
    assert {"CanaryStarted", "CanaryWeight", "CanaryResumed", "TrafficSwitched"} <= set(reasons(world))


def test_a_stopped_controller_resumes_the_pause_where_it_was_not_from_zero() -> None:
    world = ready_world(canary_spec())
    _, canary = canary_started(world, canary_spec(msg="v2"))
    world.run_for(10)
    stored = pending_of(world).canary
    assert stored is not None and stored.step == 1
    # The planner keeps nothing between ticks: 15 s without a tick (controller down), then the
    # next one must see 25 s of the 30 s pause gone, from the stored step start.
    world.advance(15)
    world.tick()
    message = next(c.message for c in world.service.conditions if c.type.value == "UpgradeInProgress")
    remaining = stored.step_started_at + 30 - world.now
    assert 4 <= remaining <= 5 and f"{remaining:.0f}s left" in message, message
    world.run_for(remaining + 0.5)
    assert weights(world)[canary.name] == 50


def test_promote_full_skips_every_step_and_abort_drains_the_canary() -> None:
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.clusters[canary.name] = pending_of(world).with_changes(promote_full=True)
    world.tick()
    assert weights(world)[canary.name] == 100 and world.clusters[canary.name].role == ClusterRole.ACTIVE
    assert "CanaryPromoted" in reasons(world)

    world.run_for(5)
    stable, canary = canary_started(world, canary_spec(msg="v3"))
    world.clusters[canary.name] = pending_of(world).with_changes(abort_requested=True)
    world.tick()
    assert weights(world) == {stable.name: 100, canary.name: 0}, "weight back to 0 at once, still counted"
    assert world.clusters[canary.name].role == ClusterRole.DRAINING
    assert world.condition("RolloutFailed") and world.condition("Ready")
    assert world.service.failure_reason is not None and world.service.failure_reason.startswith("Aborted")
    assert "RolloutAborted" in reasons(world)
    world.inflight[canary.name] = 2
    world.run_for(5)
    assert canary.name in world.clusters, "requests still on the canary are served out"
    world.inflight[canary.name] = 0
    world.tick()
    assert canary.name not in world.clusters
    world.run_for(60)
    assert not world.with_role(ClusterRole.PENDING), "an aborted generation is not retried"


ANALYSIS = {"interval": "10s", "minRequests": 50, "successRate": {"min": 0.99}, "failureLimit": 1}


def run_with_traffic(world: SimWorld, seconds: float, per_tick: int = 50, **behaviour: Any) -> None:
    end = world.now + seconds
    while world.now < end:
        world.serve_traffic(per_tick, **behaviour)
        world.tick()
        world.advance(0.5)


def test_analysis_aborts_a_canary_that_fails_one_request_in_five() -> None:
    steps = [{"setWeight": 20}, {"pause": {"duration": "5m"}}]
    world = ready_world(canary_spec(steps=steps, analysis=ANALYSIS))
    stable, canary = canary_started(world, canary_spec(msg="v2", steps=steps, analysis=ANALYSIS))
    started = world.now
    while world.with_role(ClusterRole.PENDING):
        run_with_traffic(world, 0.5, error_rate={canary.name: 0.2})
        assert world.now - started < 10 * (1 + 1) + 5, "aborted within interval x (failureLimit + 1) + 5 s"
    assert weights(world) == {stable.name: 100, canary.name: 0}
    reason = world.service.failure_reason or ""
    assert reason.startswith("AnalysisFailed: 2 failed interval(s)"), reason
    assert "success rate 0.8000 < 0.99" in reason and "stable" in reason
    assert world.clusters[stable.name].role == ClusterRole.ACTIVE


def test_analysis_aborts_on_p99_and_names_the_measured_figure() -> None:
    analysis = {"interval": "10s", "minRequests": 20, "latencyP99Ms": {"max": 500}, "failureLimit": 0}
    steps = [{"setWeight": 50}, {"pause": {}}]
    world = ready_world(canary_spec(steps=steps, analysis=analysis))
    _, canary = canary_started(world, canary_spec(msg="v2", steps=steps, analysis=analysis))
    run_with_traffic(world, 12, latency_ms={canary.name: 800})
    reason = world.service.failure_reason or ""
    assert reason.startswith("AnalysisFailed") and "p99" in reason and "> 500 ms" in reason, reason
    assert "p99 9" in reason  # interpolated inside the 500-1000 ms bucket: 995 ms


def test_too_few_requests_are_inconclusive_and_a_good_canary_passes() -> None:
    steps = [{"setWeight": 10}, {"pause": {"duration": "25s"}}]
    world = ready_world(canary_spec(steps=steps, analysis=ANALYSIS))
    _, canary = canary_started(world, canary_spec(msg="v2", steps=steps, analysis=ANALYSIS))
    run_with_traffic(world, 11, per_tick=4, error_rate={canary.name: 1.0})  # 0-1 requests per tick on it
    state = pending_of(world).canary
    assert state is not None and state.inconclusive_intervals == 1 and state.failed_intervals == 0
    run_with_traffic(world, 16, per_tick=100)
    assert not world.with_role(ClusterRole.PENDING), "promoted after its steps"
    assert not world.condition("RolloutFailed")


def test_an_ingress_restart_makes_the_interval_inconclusive_not_a_pass() -> None:
    steps = [{"setWeight": 50}, {"pause": {}}]
    world = ready_world(canary_spec(steps=steps, analysis=ANALYSIS))
    _, canary = canary_started(world, canary_spec(msg="v2", steps=steps, analysis=ANALYSIS))
    run_with_traffic(world, 5)
    world.ingress_epoch = "2"  # every Envoy process restarted: counters start again at 0
    run_with_traffic(world, 6)
    state = pending_of(world).canary
    assert state is not None and state.inconclusive_intervals == 1 and state.passed_intervals == 0


def test_rollback_window_keeps_the_old_cluster_and_undo_switches_back_without_a_new_cluster() -> None:
    steps = [{"setWeight": 50}, {"pause": {"duration": "2s"}}]
    v1 = canary_spec(steps=steps, rollbackWindowSeconds=120)
    world = ready_world(v1)
    stable, canary = canary_started(world, canary_spec(msg="v2", steps=steps, rollbackWindowSeconds=120))
    world.run_for(5)
    assert world.clusters[canary.name].role == ClusterRole.ACTIVE
    world.run_for(60)  # idle, past the deletion delay's minimum: kept for the window
    assert world.clusters[stable.name].role == ClusterRole.DRAINING
    creations = sum(isinstance(a, act.CreateCluster) for a in world.actions)

    world.apply(v1)  # what `undo` stores: the earlier revision's spec as a new generation
    world.tick()
    assert weights(world) == {stable.name: 100, canary.name: 0}
    assert world.clusters[stable.name].role == ClusterRole.ACTIVE
    assert sum(isinstance(a, act.CreateCluster) for a in world.actions) == creations
    assert "TrafficSwitchedBack" in reasons(world)
    world.run_for(1)
    assert world.service.observed_generation == world.service.generation

    world.run_for(125)
    assert canary.name not in world.clusters, "deleted once the window is over (and idle)"


def test_a_new_apply_mid_canary_drains_that_canary_and_starts_over() -> None:
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.apply(canary_spec(msg="v3"))
    world.tick()
    assert world.clusters[canary.name].role == ClusterRole.DRAINING
    assert weights(world)[canary.name] == 0 and weights(world)[stable.name] == 100
    _, third = canary_started(world, canary_spec(msg="v3"))
    assert third.generation == 3 and weights(world)[third.name] == 10


def test_preview_port_goes_to_the_pending_cluster_only_while_there_is_one() -> None:
    ingress = {"port": 8000, "previewPort": 8001}
    world = ready_world(canary_spec(ingress=ingress))
    world.apply(canary_spec(msg="v2", ingress=ingress))
    world.tick()
    world.advance(0.5)
    world.tick()
    pending = pending_of(world)
    assert world.route is not None and world.route.preview == pending.name
    assert weights(world)[pending.name] == 0, "the preview carries no user traffic"
    world.clusters[pending.name] = pending.with_changes(promote_full=True)
    world.run_for(12)
    assert world.route.preview is None


def test_replacing_a_broken_active_takes_all_traffic_at_once() -> None:
    world = ready_world(canary_spec())
    active = world.with_role(ClusterRole.ACTIVE)[0]
    world.sim[active.name].head_alive = False
    world.run_for(60)
    new = world.with_role(ClusterRole.ACTIVE)
    assert new and new[0].name != active.name and new[0].canary is None


# -- analysis and spec -----------------------------------------------------------------------


def counters(requests: int, errors: int, buckets: dict[float, int]) -> BackendCounters:
    return BackendCounters(requests, errors, tuple(sorted(buckets.items())))


def test_p99_is_interpolated_inside_its_bucket_and_a_counter_reset_is_no_difference() -> None:
    later = counters(200, 10, {100: 150, 500: 198, 1000: 200})
    earlier = counters(100, 5, {100: 75, 500: 99, 1000: 100})
    delta = difference(later, earlier)
    assert delta == counters(100, 5, {100: 75, 500: 99, 1000: 100})
    assert p99_ms(delta) == pytest.approx(500.0)
    assert p99_ms(counters(100, 0, {100: 98, 500: 100})) == pytest.approx(300.0)
    assert difference(earlier, later) is None
    spec = AnalysisSpec(successRate={"min": 0.99}, minRequests=10)  # type: ignore[arg-type]
    figures = analyse(spec, delta, None, 0.0, 10.0)
    assert figures.verdict == "failed" and figures.success_rate == pytest.approx(0.95)


def test_canary_state_round_trips_through_json() -> None:
    state = CanaryState(
        step=2,
        step_started_at=5.0,
        weight=50,
        promotes_seen=1,
        interval_started_at=7.0,
        baseline={"a": counters(3, 1, {1.0: 3})},
        failed_intervals=1,
    )
    assert CanaryState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    ("strategy", "problem"),
    [
        pytest.param({"type": "Canary"}, "needs a canary", id="canary-without-steps"),
        pytest.param(
            {"type": "NewCluster", "canary": {"steps": [{"setWeight": 5}]}},
            "only read with type Canary",
            id="steps-without-canary",
        ),
        pytest.param(
            {"type": "Canary", "canary": {"steps": [{"setWeight": 100}, {"pause": {}}]}}, "last step", id="100-not-last"
        ),
        pytest.param(
            {"type": "Canary", "canary": {"steps": [{"setWeight": 5, "pause": {}}]}}, "one of", id="two-in-one-step"
        ),
        pytest.param(
            {"type": "Canary", "canary": {"steps": [{"pause": {"duration": "soon"}}]}},
            "not a duration",
            id="bad-duration",
        ),
        pytest.param(
            {"type": "Canary", "canary": {"steps": [{"setWeight": 5}], "analysis": {"interval": "5s"}}},
            "successRate or latencyP99Ms",
            id="analysis-without-checks",
        ),
    ],
)
def test_canary_spec_errors_name_the_field(strategy: dict[str, Any], problem: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec(
            {
                "apiVersion": "servekeeper/v1alpha1",
                "kind": "RayService",
                "metadata": {"name": "svc"},
                "spec": {
                    "ingress": {"port": 8000},
                    "serveConfig": {"applications": [{"import_path": "a:b"}]},
                    "upgradeStrategy": strategy,
                },
            }
        )
    assert any(p.startswith("spec.upgradeStrategy") and problem in p for p in raised.value.problems), (
        raised.value.problems
    )


def running_replicas(world: SimWorld) -> int:
    total = 0
    for cluster in world.clusters.values():
        observed = world.observe_cluster(cluster)
        total += sum(app.running_replicas for app in (observed.apps or {}).values())
    return total


def test_capacity_follows_traffic_never_needs_twice_the_replicas() -> None:
    # Steps of 25 points (the last one is the promotion, 75 -> 100).
    steps = [{"setWeight": 25}, {"pause": {"duration": "5s"}}, {"setWeight": 50}, {"pause": {"duration": "5s"}}]
    steps += [{"setWeight": 75}, {"pause": {"duration": "5s"}}]
    strategy = {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}
    world = ready_world(make_spec(upgradeStrategy=strategy))
    stable = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(msg="v2", upgradeStrategy=strategy))
    peak, weights_seen = 0, []
    for _ in range(200):
        world.tick()
        world.advance(0.25)
        peak = max(peak, running_replicas(world))
        pending = world.with_role(ClusterRole.PENDING)
        if pending and pending[0].canary is not None:
            weights_seen.append((pending[0].canary.weight, pending[0].target_capacity, stable_capacity(world, stable)))
        if world.service.observed_generation == 2:
            break
    assert world.service.observed_generation == 2
    assert peak <= 4 + 1, f"{peak} replicas ran at once: declared 4 + one step's share (25% of 4)"
    for weight, canary_capacity, _ in weights_seen:
        assert canary_capacity is not None and canary_capacity >= weight, "capacity before traffic"
    assert {(25, 25.0, 75.0), (50, 50.0, 50.0), (75, 75.0, 25.0)} <= set(weights_seen)
    new = world.with_role(ClusterRole.ACTIVE)[0]
    assert new.target_capacity == 100.0 and world.sim[new.name].target_capacity == 100.0


def stable_capacity(world: SimWorld, stable: ClusterRecord) -> float | None:
    return world.clusters[stable.name].target_capacity if stable.name in world.clusters else None


def test_an_aborted_capacity_canary_gives_the_stable_cluster_its_replicas_back() -> None:
    steps = [{"setWeight": 50}, {"pause": {}}]
    strategy = {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}
    world = ready_world(make_spec(upgradeStrategy=strategy))
    stable, canary = canary_started(world, make_spec(msg="v2", upgradeStrategy=strategy))
    world.run_for(3)
    assert world.sim[stable.name].target_capacity == 50.0
    world.clusters[canary.name] = pending_of(world).with_changes(abort_requested=True)
    world.tick()
    assert weights(world)[stable.name] == 100
    assert world.sim[stable.name].target_capacity == 100.0


# -- found by review: a canary never gets stuck, never outlives its failure ---------------------


def test_the_canary_takes_over_when_the_stable_cluster_dies() -> None:
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.sim[stable.name].head_alive = False  # mid-canary, with `pause: {}` still ahead
    world.run_for(5)
    assert weights(world)[canary.name] == 100
    assert world.clusters[canary.name].role == ClusterRole.ACTIVE
    assert "CanaryTakesOver" in reasons(world)


def test_an_unready_canary_is_still_analysed_and_aborted() -> None:
    analysis = {"interval": "10s", "minRequests": 10, "successRate": {"min": 0.99}, "failureLimit": 0}
    world = ready_world(canary_spec(analysis=analysis))
    _, canary = canary_started(world, canary_spec(msg="v2", analysis=analysis))
    observe = world.observe_cluster

    def dashboard_down(cluster: ClusterRecord) -> ClusterObservation:
        seen = observe(cluster)
        if cluster.name == canary.name:
            return ClusterObservation(name=seen.name, processes_alive=True, error="dashboard: timeout")
        return seen

    world.observe_cluster = dashboard_down  # type: ignore[method-assign]
    run_with_traffic(world, 12, error_rate={canary.name: 0.5})
    assert (world.service.failure_reason or "").startswith("AnalysisFailed")
    assert weights(world)[canary.name] == 0


def test_a_canary_held_too_long_is_aborted_as_stuck() -> None:
    world = ready_world(canary_spec(readinessTimeoutSeconds=60))
    _, canary = canary_started(world, canary_spec(msg="v2", readinessTimeoutSeconds=60))
    world.sim[canary.name].app_status_after_deploy = AppStatus.DEPLOYING  # never ready again
    world.sim[canary.name].config_at = world.now
    world.run_for(70)
    assert (world.service.failure_reason or "").startswith("CanaryStuck")
    assert weights(world).get(canary.name, 0) == 0


def test_capacity_that_never_settles_still_lets_analysis_abort() -> None:
    steps = [{"setWeight": 25}, {"pause": {"duration": "5s"}}, {"setWeight": 50}, {"pause": {"duration": "5s"}}]
    analysis = {"interval": "10s", "minRequests": 10, "successRate": {"min": 0.99}, "failureLimit": 1}
    strategy = {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True, "analysis": analysis}}
    world = ready_world(make_spec(upgradeStrategy=strategy))
    _, canary = canary_started(world, make_spec(msg="v2", upgradeStrategy=strategy))
    run_with_traffic(world, 6)
    world.sim[canary.name].scale_s = 1e9  # the next step's replicas never come up
    run_with_traffic(world, 40, error_rate={canary.name: 0.5})
    assert (world.service.failure_reason or "").startswith("AnalysisFailed: 2 failed")


def test_an_abort_decided_but_not_routed_before_a_crash_is_carried_out_after_it() -> None:
    analysis = {"interval": "10s", "minRequests": 10, "successRate": {"min": 0.99}, "failureLimit": 0}
    world = ready_world(canary_spec(analysis=analysis))
    _, canary = canary_started(world, canary_spec(msg="v2", analysis=analysis))
    while True:
        world.serve_traffic(100, error_rate={canary.name: 0.3})
        decision = plan(world.spec, world.service, list(world.clusters.values()), world.observe(), world.now)
        if decision.service.failed_generation == 2:
            break
        world.tick()
        world.advance(0.5)
    # Stored: the failure (before any action); then killed before the weight went to 0.
    world.service = world.service.with_changes(failed_generation=2, failure_reason=decision.service.failure_reason)
    run_with_traffic(world, 30)  # clean traffic afterwards must not let it resume
    assert world.clusters.get(canary.name) is None or world.clusters[canary.name].role != ClusterRole.ACTIVE
    assert weights(world).get(canary.name, 0) == 0


def test_steps_done_without_a_passed_interval_wait_for_one_or_for_promote() -> None:
    steps = [{"setWeight": 20}, {"pause": {"duration": "5s"}}]
    world = ready_world(canary_spec(steps=steps, analysis=ANALYSIS))
    _, canary = canary_started(world, canary_spec(msg="v2", steps=steps, analysis=ANALYSIS))
    world.counters = None  # the ingress's counters unreadable the whole time
    world.run_for(60)
    assert world.clusters[canary.name].role == ClusterRole.PENDING, "inconclusive is not a pass"
    world.clusters[canary.name] = pending_of(world).with_changes(promote_requests=1)
    world.tick()
    assert world.clusters[canary.name].role == ClusterRole.ACTIVE


# -- a silent host is not a dead one (issue 19, item 1) -----------------------------------------


def test_a_stable_head_silent_for_one_look_does_not_hand_the_traffic_to_the_canary() -> None:
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.sim[stable.name].head_silent = True  # one SSH look timed out: unknown, not dead
    world.tick()
    world.advance(0.5)
    world.sim[stable.name].head_silent = False
    world.run_for(5)
    assert "CanaryTakesOver" not in reasons(world)
    assert world.clusters[canary.name].role == ClusterRole.PENDING
    assert weights(world) == {stable.name: 90, canary.name: 10}, "the canary stays at its step"
    assert world.service.unhealthy_since is None and "ClusterHealthy" in reasons(world)


def test_a_stable_head_that_stays_silent_is_lost_only_after_the_unhealthy_threshold() -> None:
    world = ready_world(canary_spec())  # serviceUnhealthySecondThreshold: 30
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.sim[stable.name].head_silent = True
    world.run_for(29)
    assert "CanaryTakesOver" not in reasons(world) and weights(world)[canary.name] == 10
    unhealthy = [e for e in world.events if e.reason == "ClusterUnhealthy"]
    assert unhealthy and "HeadUnreachable" in unhealthy[-1].message
    world.run_for(2)
    assert "CanaryTakesOver" in reasons(world)
    assert weights(world)[canary.name] == 100 and world.clusters[canary.name].role == ClusterRole.ACTIVE


def test_a_canary_never_takes_the_hot_standby_which_guards_the_stable_cluster() -> None:
    steps = [{"setWeight": 25}, {"pause": {"duration": "5s"}}]
    strategy = {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}
    world = ready_world(make_spec(standby={"mode": "hot"}, upgradeStrategy=strategy))
    world.run_for(15)
    spare = world.with_role(ClusterRole.STANDBY)[0]
    assert spare.ready_at is not None
    stable, canary = canary_started(world, make_spec(msg="v2", standby={"mode": "hot"}, upgradeStrategy=strategy))
    assert canary.name != spare.name, "a canary runs on a cluster of its own"
    assert world.with_role(ClusterRole.STANDBY)[0].name == spare.name, "the standby still guards the stable"
    assert world.sim[canary.name].target_capacity == 25.0


# -- header routes (issue 23): requests with a header go to the canary, whatever its weight ---------


def test_a_header_route_is_one_of_value_or_regex_on_a_valid_header_name() -> None:
    def problems(header_route: dict[str, Any]) -> str:
        with pytest.raises(SpecError) as caught:
            canary_spec_with_header("v1", [{"setWeight": 10}], headerRoute=header_route)
        return "\n".join(caught.value.problems)

    assert "either {value: ...} or {regex: ...}" in problems({"header": "x-canary"})
    assert "either {value: ...} or {regex: ...}" in problems({"header": "x-canary", "value": "a", "regex": "a"})
    assert "headerRoute.header" in problems({"header": ":path", "value": "/"})
    assert "is not RE2" in problems({"header": "x-canary", "regex": "(unclosed"})
    with pytest.raises(SpecError) as caught:
        canary_spec(steps=[{"setWeight": 10, "setHeaderRoute": {"header": "x-canary", "value": "1"}}])
    assert "{setHeaderRoute: {...}} or {mirror: {...}}" in "\n".join(caught.value.problems)


def promote(world: SimWorld, count: int) -> None:
    """`servekeeper promote` as the API counts it (the `count`-th one on this canary)."""
    world.clusters[pending_of(world).name] = pending_of(world).with_changes(promote_requests=count)


def canary_spec_with_header(msg: str, steps: list[dict[str, Any]], **canary_more: Any) -> ServiceSpec:
    return make_spec(msg=msg, upgradeStrategy={"type": "Canary", "canary": {"steps": steps, **canary_more}})


def test_a_header_route_sends_to_the_canary_from_its_start_at_weight_0_and_goes_with_it() -> None:
    steps = [{"pause": {}}, {"setWeight": 50}, {"pause": {}}]
    header = {"header": "X-Canary", "value": "always"}
    world = ready_world(canary_spec_with_header("v1", steps, headerRoute=header))
    stable = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(canary_spec_with_header("v2", steps, headerRoute=header))
    world.run_for(30)
    canary = pending_of(world)
    assert canary.canary is not None and canary.canary.weight == 0
    assert world.route is not None
    assert world.route.header_route == HeaderMatch("x-canary", "always") and world.route.header_backend == canary.name
    assert weights(world) == {stable.name: 100, canary.name: 0}, "the canary is routed for the header alone"
    promote(world, 1)
    world.run_for(5)
    assert weights(world) == {stable.name: 50, canary.name: 50}
    assert world.route.header_route is not None, "kept at every step"
    promote(world, 2)
    world.run_for(10)
    assert world.with_role(ClusterRole.ACTIVE)[0].name == canary.name
    assert world.route.header_route is None and world.route.header_backend is None, "no canary, no header route"


def test_a_set_header_route_step_turns_it_on_mid_rollout_and_an_abort_takes_it_out() -> None:
    steps = [
        {"setWeight": 10},
        {"pause": {}},
        {"setHeaderRoute": {"header": "x-tester", "regex": "qa-.*"}},
        {"pause": {}},
    ]
    world = ready_world(canary_spec_with_header("v1", steps))
    stable, canary = canary_started(world, canary_spec_with_header("v2", steps))
    assert world.route is not None and world.route.header_route is None, "not before its step"
    promote(world, 1)
    world.run_for(5)
    assert world.route.header_route == HeaderMatch("x-tester", "qa-.*", regex=True)
    assert world.route.header_backend == canary.name
    assert "CanaryHeaderRoute" in reasons(world)
    world.clusters[canary.name] = pending_of(world).with_changes(abort_requested=True)
    world.run_for(3)
    assert world.route.header_route is None and weights(world)[stable.name] == 100


def test_the_step_machine_describes_and_derives_the_header_route() -> None:
    spec = canary_spec_with_header(
        "v1",
        [{"setHeaderRoute": {"header": "x-a", "value": "1"}}, {"pause": {}}],
        headerRoute={"header": "x-b", "value": "2"},
    ).spec.upgradeStrategy.canary
    assert spec is not None
    first = canary_steps.start(0.0)
    assert canary_steps.describe_step(spec, first) == "step 1/2: setHeaderRoute x-a: 1"
    assert canary_steps.header_route(spec, first) == HeaderMatch("x-b", "2"), "the canary's own, until the step"
    assert canary_steps.header_route(spec, first.with_changes(step=1)) == HeaderMatch("x-a", "1")


def test_a_canary_that_starts_with_a_pause_is_recorded_once_and_its_pause_ends() -> None:
    # Found with header routes: a first step at weight 0 never stored the canary's state, so
    # it "started" again every tick and its pause never ran out.
    steps = [{"pause": {"duration": "5s"}}, {"setWeight": 50}, {"pause": {}}]
    world = ready_world(canary_spec_with_header("v1", steps))
    stable = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(canary_spec_with_header("v2", steps))
    world.run_for(30)
    assert reasons(world).count("CanaryStarted") == 1
    canary = pending_of(world)
    assert canary.canary is not None and canary.canary.step == 2
    assert weights(world) == {stable.name: 50, canary.name: 50}, "the pause of 5 s ran out"


def test_requests_sent_by_the_header_route_are_analysed_at_weight_0() -> None:
    # Found in review: at weight 0 no interval ran, so a canary that failed every tester's
    # request went on to take a weight.
    steps = [{"pause": {}}, {"setWeight": 50}]
    header = {"header": "x-canary", "value": "always"}
    world = ready_world(canary_spec_with_header("v1", steps, headerRoute=header, analysis=ANALYSIS))
    stable, canary = canary_started(
        world,
        canary_spec_with_header("v2", steps, headerRoute=header, analysis=ANALYSIS),
        until=lambda: world.route is not None and world.route.header_route is not None,
    )
    started = world.now
    while world.with_role(ClusterRole.PENDING):
        run_with_traffic(world, 0.5, with_header=10, error_rate={canary.name: 1.0})
        assert world.now - started < 10 * (1 + 1) + 5, "aborted within interval x (failureLimit + 1) + 5 s"
    reason = world.service.failure_reason or ""
    assert reason.startswith("AnalysisFailed") and "success rate 0.0000" in reason, reason
    assert world.route is not None and world.route.header_route is None


def test_testers_alone_pass_no_interval_for_the_users_nor_flood_the_events() -> None:
    steps = [{"pause": {}}, {"setWeight": 50}]
    header = {"header": "x-canary", "value": "always"}
    world = ready_world(canary_spec_with_header("v1", steps, headerRoute=header, analysis=ANALYSIS))
    canary_started(
        world,
        canary_spec_with_header("v2", steps, headerRoute=header, analysis=ANALYSIS),
        until=lambda: world.route is not None and world.route.header_route is not None,
    )
    run_with_traffic(world, 30)  # no tester: nothing to judge, and nothing said of it
    assert "CanaryAnalysis" not in reasons(world)
    run_with_traffic(world, 30, with_header=60)  # testers, every answer good
    state = pending_of(world).canary
    assert state is not None and state.passed_intervals == 0 and state.last_analysis is not None
    assert state.last_analysis.verdict == "passed", "judged, but no pass for the users"


# -- shadow steps (issue 23): a share of the requests copied to the canary, its answers dropped -----


def mirror_started(world: SimWorld, spec: ServiceSpec) -> tuple[ClusterRecord, ClusterRecord]:
    """Apply `spec` and tick until the ingress copies requests to its canary."""
    return canary_started(world, spec, until=lambda: world.route is not None and world.route.mirror is not None)


def test_a_mirror_step_copies_to_the_canary_at_weight_0_then_the_steps_go_on() -> None:
    steps = [{"mirror": {"percent": 100, "duration": "10s"}}, {"setWeight": 20}, {"pause": {}}]
    world = ready_world(canary_spec(steps=steps))
    stable, canary = mirror_started(world, canary_spec(msg="v2", steps=steps))
    assert world.route is not None and world.route.mirror == Mirror(canary.name, 100, ("GET", "HEAD"))
    assert weights(world) == {stable.name: 100, canary.name: 0}, "the clients get the stable answer only"
    assert pending_of(world).canary is not None
    assert "mirror 100% of GET, HEAD 10s" in canary_steps.describe_step(
        canary_spec(steps=steps).spec.upgradeStrategy.canary,  # type: ignore[arg-type]
        pending_of(world).canary,  # type: ignore[arg-type]
    )
    world.run_for(12)
    assert world.route.mirror is None, "the copies end with their step"
    assert weights(world) == {stable.name: 80, canary.name: 20}


def test_analysis_judges_the_copies_and_aborts_a_broken_canary_before_any_client_sees_it() -> None:
    steps = [{"mirror": {"percent": 100, "methods": ["GET", "POST"]}}, {"setWeight": 50}]
    world = ready_world(canary_spec(steps=steps, analysis=ANALYSIS))
    stable, canary = mirror_started(world, canary_spec(msg="v2", steps=steps, analysis=ANALYSIS))
    assert world.route is not None and world.route.mirror == Mirror(canary.name, 100, ("GET", "POST"))
    started = world.now
    while world.with_role(ClusterRole.PENDING):
        run_with_traffic(world, 0.5, error_rate={canary.name: 1.0})
        assert world.route.weight_of(canary.name) == 0, "no client request ever went to it"
        assert world.now - started < 10 * (1 + 1) + 5, "aborted within interval x (failureLimit + 1) + 5 s"
    reason = world.service.failure_reason or ""
    assert reason.startswith("AnalysisFailed: 2 failed interval(s)") and "success rate 0.0000" in reason, reason
    assert world.route.mirror is None and weights(world) == {stable.name: 100, canary.name: 0}


def test_a_mirror_step_is_one_of_the_step_kinds_with_a_percent_and_known_methods() -> None:
    for step, problem in (
        ({"mirror": {"percent": 0}}, "percent"),
        ({"mirror": {"percent": 10, "methods": ["FETCH"]}}, "methods"),
        ({"mirror": {"percent": 10, "methods": []}}, "methods"),
        ({"mirror": {"percent": 10}, "setWeight": 5}, "one of"),
    ):
        with pytest.raises(SpecError) as caught:
            canary_spec(steps=[step])
        assert problem in "\n".join(caught.value.problems), (step, caught.value.problems)


def test_the_canary_view_shows_the_header_route_and_the_shadow_step() -> None:
    steps = [{"mirror": {"percent": 40}}, {"setWeight": 20}]
    header = {"header": "x-canary", "value": "always"}
    world = ready_world(canary_spec_with_header("v1", steps, headerRoute=header))
    _, canary = mirror_started(world, canary_spec_with_header("v2", steps, headerRoute=header))
    state = pending_of(world).canary
    assert state is not None
    view = canary_view(world.service, state, world.now)
    assert view.get("headerRoute") == "x-canary: always"
    assert view.get("mirror") == "40% of GET, HEAD copied"
    assert view.get("stepDescription") == "step 1/2: mirror 40% of GET, HEAD until promote"


def test_header_routes_and_mirrors_are_refused_where_envoy_or_http_could_not_follow() -> None:
    def problems(canary: dict[str, Any]) -> str:
        with pytest.raises(SpecError) as caught:
            make_spec(upgradeStrategy={"type": "Canary", "canary": canary})
        return "\n".join(caught.value.problems)

    steps = [{"setWeight": 10}]
    assert "is not RE2" in problems({"steps": steps, "headerRoute": {"header": "x-a", "regex": "(?=a)b"}})
    assert "is not RE2" in problems({"steps": steps, "headerRoute": {"header": "x-a", "regex": "(a)\\1"}})
    too_big = {"header": "x-a", "regex": "[a-z]{1,60}"}  # an RE2 program of 123 instructions
    assert "over Envoy's limit 100" in problems({"steps": steps, "headerRoute": too_big})
    assert "cannot be matched" in problems({"steps": steps, "headerRoute": {"header": "Host", "value": "a"}})
    assert "spaces at its ends" in problems({"steps": steps, "headerRoute": {"header": "x-a", "value": " a"}})
    shadow = [{"mirror": {"percent": 100, "duration": "5s"}}, {"setWeight": 10}]
    analysis = {"interval": "10s", "successRate": {"min": 0.99}}
    assert "ends before one analysis interval" in problems({"steps": shadow, "analysis": analysis})


def test_a_mirror_step_needs_replicas_for_its_copies_when_capacity_follows_traffic() -> None:
    steps = [{"mirror": {"percent": 50, "duration": "10s"}}, {"setWeight": 25}, {"pause": {}}]
    strategy = {"type": "Canary", "canary": {"steps": steps, "capacityFollowsTraffic": True}}
    world = ready_world(make_spec(upgradeStrategy=strategy))
    _, canary = mirror_started(world, make_spec(msg="v2", upgradeStrategy=strategy))
    assert pending_of(world).target_capacity == 50.0, "born at the copies' share, not at weight 0"
    world.run_for(15)
    assert weights(world)[canary.name] == 25 and pending_of(world).target_capacity == 50.0
