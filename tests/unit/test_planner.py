"""The planner, tick by tick on a fake clock, for every flow of the core."""

from __future__ import annotations

from typing import Any

import pytest

from servekeeper.core import actions as act
from servekeeper.core.planner import MAX_WORKER_RESTARTS, plan
from servekeeper.model.enums import AppSource, AppStatus, ClusterRole, SwitchGate
from servekeeper.model.observation import AppState, IngressRouteObservation, Observation
from servekeeper.model.records import NodePlacement, NodePorts
from servekeeper.model.spec import ServiceSpec, SpecError, parse_spec
from servekeeper.testing.sim import SimCluster, SimWorld


def make_spec(msg: str = "v1", cpus: float = 1, **overrides: Any) -> ServiceSpec:
    body: dict[str, Any] = {
        "ingress": {"port": 8000},
        "rayClusterConfig": {"head": {"numCpus": cpus}},
        "serveConfig": {
            "applications": [{"name": "hello", "route_prefix": "/", "import_path": "hello:app", "args": {"msg": msg}}]
        },
        "rayClusterDeletionDelaySeconds": 60,
        "readinessTimeoutSeconds": 120,
        "serviceUnhealthySecondThreshold": 30,
    }
    body.update(overrides)
    return parse_spec(
        {"apiVersion": "servekeeper/v1alpha1", "kind": "RayService", "metadata": {"name": "svc"}, "spec": body}
    )


def rolled_out(world: SimWorld, seconds: float = 15) -> SimWorld:
    world.run_for(seconds)
    assert world.condition("Ready"), world.service.conditions
    return world


def step_until_draining(world: SimWorld, name: str) -> None:
    world.tick()
    while world.clusters[name].role != ClusterRole.DRAINING:
        world.advance(0.5)
        world.tick()


def kinds(actions: list[act.Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_first_apply_creates_submits_waits_for_ready_then_routes() -> None:
    world = SimWorld(make_spec())
    first = world.tick()
    assert kinds(first.actions) == ["CreateCluster"]
    assert not world.condition("Ready")

    world.advance(3)
    assert world.tick().actions == []  # head still starting: nothing to do, nothing blocks

    world.advance(3.5)
    assert kinds(world.tick().actions) == ["SubmitConfig"]
    world.advance(1)
    seen = world.tick()
    # Applied only once Ray is seen running it; DEPLOYING is healthy but not ready: no route yet.
    assert kinds(seen.actions) == ["UpdateCluster"]
    assert world.route is None
    assert world.tick().actions == []

    world.advance(2.5)
    switch = world.tick()
    assert kinds(switch.actions) == ["UpdateCluster", "SetRoute", "UpdateCluster"]  # last good config, switch
    assert world.route is not None and world.route.active == world.with_role(ClusterRole.ACTIVE)[0].name
    assert world.condition("Ready")
    assert world.service.observed_generation == 1
    assert world.tick().actions == []  # steady state: idempotent, nothing to do


def test_cluster_spec_change_rolls_a_pending_cluster_and_switches_only_when_ready() -> None:
    world = rolled_out(SimWorld(make_spec()))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(msg="v2", cpus=2))

    assert kinds(world.tick().actions) == ["CreateCluster"]
    assert world.condition("UpgradeInProgress")
    pending = world.with_role(ClusterRole.PENDING)[0]
    for _ in range(int(9 / 0.5) - 1):  # head start + deploy: the route must not move
        world.advance(0.5)
        world.tick()
        assert world.route is not None and world.route.active == old.name
    assert world.submissions == [old.name, pending.name], "config goes to the pending cluster only"
    world.run_for(2)
    assert world.route is not None and world.route.active == pending.name
    assert world.clusters[old.name].role == ClusterRole.DRAINING
    assert world.route.upstreams == frozenset({pending.name, old.name}), "the old cluster stays counted"
    assert not world.condition("UpgradeInProgress")
    assert world.service.observed_generation == 2


def test_old_cluster_is_deleted_when_idle_after_the_minimum_drain() -> None:
    world = rolled_out(SimWorld(make_spec()))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2))
    world.run_for(11)
    assert world.clusters[old.name].role == ClusterRole.DRAINING
    drain_started = world.clusters[old.name].drain_started_at
    assert drain_started is not None
    world.inflight[old.name] = 3
    world.run_for(10)
    assert old.name in world.clusters, "never deleted while requests are in flight (before the deadline)"
    world.inflight[old.name] = 0
    world.tick()
    assert old.name not in world.clusters
    assert world.route is not None and old.name not in world.route.upstreams


def test_old_cluster_is_idle_at_once_but_kept_for_the_minimum_drain() -> None:
    world = rolled_out(SimWorld(make_spec()))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2))
    step_until_draining(world, old.name)
    switched_at = world.clusters[old.name].drain_started_at
    assert switched_at is not None
    while old.name in world.clusters:
        world.advance(0.5)
        world.tick()
    assert world.now - switched_at >= 2.0


def test_old_cluster_is_deleted_at_the_deletion_delay_even_if_busy() -> None:
    world = rolled_out(SimWorld(make_spec(rayClusterDeletionDelaySeconds=20)))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2, rayClusterDeletionDelaySeconds=20))
    world.inflight[old.name] = 5
    world.run_for(12)
    started = world.clusters[old.name].drain_started_at
    assert started is not None
    world.run_for(started + 19.9 - world.now)
    assert old.name in world.clusters
    world.run_for(1)
    assert old.name not in world.clusters
    assert any("deletion delay" in e.message for e in world.events)


def test_serve_config_only_change_is_applied_in_place_once() -> None:
    world = rolled_out(SimWorld(make_spec()))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(msg="v2"))
    world.run_for(10)
    assert list(world.clusters) == [active.name], "no new cluster for a Serve-config-only change"
    assert world.submissions == [active.name, active.name]
    world.run_for(30)
    assert len(world.submissions) == 2, "never re-submitted once applied"


def test_config_already_put_before_a_crash_is_adopted_not_resubmitted() -> None:
    world = rolled_out(SimWorld(make_spec()))
    world.apply(make_spec(msg="v2"))
    # The controller wrote the intent and the PUT went through, but it died before recording success.
    name = world.with_role(ClusterRole.ACTIVE)[0].name
    desired = world.spec.serve_config_hash()
    world.clusters[name] = world.clusters[name].with_changes(submitted_config_hash=desired)
    world.sim[name].deployed_hash = desired
    world.sim[name].config_at = world.now
    decision = world.tick()
    assert [a for a in decision.actions if isinstance(a, act.SubmitConfig)] == []
    assert act.UpdateCluster(name, {"applied_config_hash": desired}) in decision.actions


def test_in_place_change_whose_put_never_reached_ray_is_sent_again() -> None:
    """The old planner saw the declared app names (the old apps) and called the change applied."""
    world = rolled_out(SimWorld(make_spec()))
    name = world.with_role(ClusterRole.ACTIVE)[0].name
    world.apply(make_spec(msg="v2"))
    desired = world.spec.serve_config_hash()
    # Crash between the audit and the PUT: the intent is stored, Ray never got the config.
    world.clusters[name] = world.clusters[name].with_changes(submitted_config_hash=desired, config_submitted_at=None)
    decision = world.tick()
    assert act.SubmitConfig(name, desired) in decision.actions
    assert world.service.observed_generation == 1, "not rolled out before Ray runs it"


def test_failed_put_is_retried_and_observed_generation_waits_for_running() -> None:
    world = rolled_out(SimWorld(make_spec()))
    name = world.with_role(ClusterRole.ACTIVE)[0].name
    world.sim[name].lost_puts = 1  # the first PUT fails (a 503, a timeout)
    world.apply(make_spec(msg="v2"))
    first = world.tick()
    assert act.SubmitConfig(name, world.spec.serve_config_hash()) in first.actions
    assert world.service.observed_generation == 1, "judged from an observation taken before the PUT"
    world.advance(0.5)
    assert any(isinstance(a, act.SubmitConfig) for a in world.tick().actions), "retried at once"
    assert world.submissions == [name, name, name]
    world.advance(0.5)
    world.tick()
    assert world.service.observed_generation == 1, "DEPLOYING under the new config is not rolled out"
    world.run_for(4)
    assert world.service.observed_generation == 2
    assert world.clusters[name].applied_config_hash == world.spec.serve_config_hash()


def test_acknowledged_put_that_ray_does_not_show_is_resent_after_the_verify_window() -> None:
    world = rolled_out(SimWorld(make_spec()))
    name = world.with_role(ClusterRole.ACTIVE)[0].name
    world.apply(make_spec(msg="v2"))
    world.tick()
    world.sim[name].deployed_hash = world.clusters[name].good_config_hash  # Ray lost it after the ack
    world.run_for(5)
    assert len(world.submissions) == 2, "an acknowledged PUT is not resent at once"
    world.sim[name].deployed_hash = world.clusters[name].good_config_hash
    world.run_for(6)
    assert len(world.submissions) == 3


def test_in_place_change_that_fails_to_deploy_fails_the_rollout_and_restores_the_last_good_config() -> None:
    world = rolled_out(SimWorld(make_spec()))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    good = active.good_config_hash
    assert good == world.spec.serve_config_hash()
    broken = make_spec(msg="broken")
    world.sim[active.name].failing_configs = frozenset({broken.serve_config_hash()})
    world.apply(broken)
    world.run_for(5)
    assert world.condition("RolloutFailed")
    assert world.service.observed_generation == 2, "wait ends (with the failure)"
    assert world.sim[active.name].deployed_hash == good, "the last good config went back"
    restores = [a for a in world.actions if isinstance(a, act.SubmitConfig) and a.restore]
    assert restores == [act.SubmitConfig(active.name, good, restore=True)]
    world.run_for(5)
    assert world.condition("Ready")
    threshold = world.spec.spec.serviceUnhealthySecondThreshold
    world.run_for(3 * threshold)
    assert not any(isinstance(a, act.CreateCluster) for a in world.actions[1:]), "no replacement loop"
    assert list(world.clusters) == [active.name]
    assert world.sim[active.name].deployed_hash == good, "the failed generation is not retried"
    world.apply(make_spec(msg="v3"))
    world.run_for(5)
    assert world.service.observed_generation == 3 and not world.condition("RolloutFailed")


def test_spec_change_while_pending_replaces_the_pending_cluster() -> None:
    world = rolled_out(SimWorld(make_spec()))
    world.apply(make_spec(cpus=2))
    world.run_for(3)
    first_pending = world.with_role(ClusterRole.PENDING)[0]
    world.apply(make_spec(cpus=3))
    decision = world.tick()
    assert act.DeleteCluster(first_pending.name, "SpecChanged") in decision.actions
    world.run_for(12)
    active = world.with_role(ClusterRole.ACTIVE)[0]
    assert active.generation == 3 and first_pending.name not in world.clusters


def test_pending_cluster_that_fails_to_deploy_fails_the_rollout_and_keeps_traffic() -> None:
    world = SimWorld(
        make_spec(), behaviours=[SimCluster(), SimCluster(app_status_after_deploy=AppStatus.DEPLOY_FAILED)]
    )
    rolled_out(world)
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2))
    world.run_for(15)
    assert world.condition("RolloutFailed")
    assert world.with_role(ClusterRole.PENDING) == []
    assert world.route is not None and world.route.active == old.name
    assert world.condition("Ready")
    assert world.service.observed_generation == 2
    created = sum(isinstance(a, act.CreateCluster) for a in world.actions)
    world.run_for(60)
    assert sum(isinstance(a, act.CreateCluster) for a in world.actions) == created, "a failed rollout is not retried"
    world.apply(make_spec(cpus=3))
    world.tick()
    assert not world.condition("RolloutFailed"), "a new generation is a new rollout"


def test_pending_cluster_not_ready_within_the_timeout_fails_the_rollout() -> None:
    world = SimWorld(make_spec(readinessTimeoutSeconds=20), behaviours=[SimCluster(), SimCluster(deploy_s=1000)])
    rolled_out(world)
    world.apply(make_spec(cpus=2, readinessTimeoutSeconds=20))
    world.run_for(19)
    assert not world.condition("RolloutFailed") and world.condition("UpgradeInProgress")
    world.run_for(3)
    assert world.condition("RolloutFailed")
    failed = next(c for c in world.service.conditions if c.type.value == "RolloutFailed")
    assert failed.reason == "ReadinessTimeout"
    assert any(e.reason == "RolloutFailed" and e.type == "Warning" for e in world.events)


def test_readiness_timeout_survives_a_restart_because_it_is_stored() -> None:
    world = SimWorld(make_spec(readinessTimeoutSeconds=20), behaviours=[SimCluster(), SimCluster(deploy_s=1000)])
    rolled_out(world)
    world.apply(make_spec(cpus=2, readinessTimeoutSeconds=20))
    world.run_for(15)
    # A restarted controller starts from the stored records only: created_at is among them.
    restarted = plan(world.spec, world.service, list(world.clusters.values()), world.observe(), world.now + 6)
    assert any(isinstance(a, act.DeleteCluster) for a in restarted.actions)


def test_upgrade_strategy_none_reports_cluster_spec_outdated_and_creates_nothing() -> None:
    world = rolled_out(SimWorld(make_spec(upgradeStrategy={"type": "None"})))
    world.apply(make_spec(cpus=2, upgradeStrategy={"type": "None"}))
    world.run_for(30)
    assert len(world.clusters) == 1
    assert world.condition("ClusterSpecOutdated")
    assert world.condition("Ready")
    assert world.service.observed_generation == 2


def test_unhealthy_active_cluster_is_replaced_after_the_threshold_ready_gated() -> None:
    world = rolled_out(SimWorld(make_spec(serviceUnhealthySecondThreshold=30)))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.sim[old.name].head_alive = False
    world.tick()
    assert not world.condition("Ready")
    assert world.service.unhealthy_since is not None
    world.run_for(29)
    assert world.with_role(ClusterRole.PENDING) == []
    world.run_for(1.5)
    replacement = world.with_role(ClusterRole.PENDING)
    assert len(replacement) == 1
    world.run_for(5)
    assert world.route is not None and world.route.active == old.name, "no switch before the replacement is ready"
    world.run_for(10)
    assert world.route.active == replacement[0].name
    assert world.condition("Ready")


def test_switch_acknowledged_by_the_ingress_but_not_recorded_is_completed() -> None:
    world = rolled_out(SimWorld(make_spec()))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2))
    world.run_for(5)
    pending = world.with_role(ClusterRole.PENDING)[0]
    # The controller pushed the route, then died before it stored the new roles.
    world.route = IngressRouteObservation(active=pending.name, upstreams=frozenset({pending.name, old.name}))
    world.tick()
    assert world.clusters[pending.name].role == ClusterRole.ACTIVE
    assert world.clusters[old.name].role == ClusterRole.DRAINING


def test_intent_without_process_is_started_and_deleting_clusters_are_finished() -> None:
    world = SimWorld(make_spec())
    world.tick()
    name = next(iter(world.clusters))
    world.clusters[name] = world.clusters[name].with_changes(head_pid=None)
    assert act.StartCluster(name) in world.tick().actions
    world.clusters[name] = world.clusters[name].with_changes(role=ClusterRole.DELETING)
    assert act.DeleteCluster(name, "DeletionResumed") in world.tick().actions


def test_delete_stops_every_cluster_removes_the_route_then_forgets_the_service() -> None:
    world = rolled_out(SimWorld(make_spec()))
    world.apply(make_spec(cpus=2))
    world.run_for(3)
    world.delete()
    decision = world.tick()
    assert sum(isinstance(a, act.DeleteCluster) for a in decision.actions) == 2
    assert act.RemoveRoute() in decision.actions
    assert act.ForgetService() in world.tick().actions


@pytest.mark.parametrize(
    ("gate", "switch_after_config_s"),
    [
        pytest.param(SwitchGate.READY, 3.0, id="ready-waits-for-RUNNING"),
        pytest.param(SwitchGate.HEALTHY, 0.0, id="healthy-switches-while-DEPLOYING"),
    ],
)
def test_gate_decides_when_traffic_moves(gate: SwitchGate, switch_after_config_s: float) -> None:
    world = SimWorld(make_spec(), gate=gate)
    world.tick()
    world.advance(6)
    world.tick()  # submits
    config_at = world.now
    while world.route is None:
        world.advance(0.5)
        world.tick()
    assert world.now - config_at == pytest.approx(max(switch_after_config_s, 0.5), abs=0.51)


def test_ingress_unreachable_never_counts_as_idle() -> None:
    world = rolled_out(SimWorld(make_spec()))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2))
    step_until_draining(world, old.name)
    observation = world.observe()
    blind = Observation(clusters=observation.clusters, route=observation.route, ingress_ok=False)
    decision = plan(world.spec, world.service, list(world.clusters.values()), blind, world.now + 5)
    assert not any(isinstance(a, act.DeleteCluster) for a in decision.actions)


PROBE = {"applications": "declarative", "probes": [{"path": "/router/ready", "successThreshold": 3}]}


def test_probes_gate_the_first_route_and_every_switch() -> None:
    world = SimWorld(make_spec(readiness=PROBE), default_behaviour=SimCluster(probe_pass_after_deploy_s=10))
    world.run_for(18)
    assert world.route is None, "apps RUNNING but the probe not passing: no traffic yet"
    ready = next(c for c in world.service.conditions if c.type.value == "Ready")
    assert ready.reason == "NoActiveCluster"
    pending_reason = next(c for c in world.service.conditions if c.type.value == "UpgradeInProgress").message
    assert "ProbeFailing" in pending_reason
    world.run_for(3)
    assert world.route is not None
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(cpus=2, readiness=PROBE))
    world.run_for(15)
    assert world.route.active == old.name
    world.run_for(6)
    assert world.route.active != old.name


def test_serve_config_update_new_cluster_rolls_a_cluster_for_a_serve_only_change() -> None:
    world = rolled_out(SimWorld(make_spec(serveConfigUpdate="NewCluster")))
    old = world.with_role(ClusterRole.ACTIVE)[0]
    world.apply(make_spec(msg="v2", serveConfigUpdate="NewCluster"))
    assert kinds(world.tick().actions) == ["CreateCluster"]
    world.run_for(12)
    assert world.route is not None and world.route.active != old.name
    assert world.submissions.count(old.name) == 1, "the old cluster never got the new config"


def _imperative(name: str, status: AppStatus) -> AppState:
    return AppState(name=name, status=status, source=AppSource.IMPERATIVE)


def test_failed_imperative_apps_never_make_the_service_unhealthy_by_default() -> None:
    broken = {"model-x": _imperative("model-x", AppStatus.DEPLOY_FAILED)}
    world = rolled_out(SimWorld(make_spec(), default_behaviour=SimCluster(extra_apps=broken)))
    world.run_for(120)
    assert world.condition("Ready")
    assert world.service.unhealthy_since is None
    assert sum(isinstance(a, act.CreateCluster) for a in world.actions) == 1


def test_with_applications_all_a_failed_imperative_app_blocks_ready_and_is_named() -> None:
    broken = {"model-x": _imperative("model-x", AppStatus.DEPLOY_FAILED)}
    world = SimWorld(make_spec(readiness={"applications": "all"}), default_behaviour=SimCluster(extra_apps=broken))
    world.run_for(15)
    assert world.condition("RolloutFailed")
    failed = next(c for c in world.service.conditions if c.type.value == "RolloutFailed")
    assert "model-x" in failed.message


def test_a_declared_name_taken_by_an_imperative_app_is_never_overwritten() -> None:
    taken = {"hello": _imperative("hello", AppStatus.RUNNING)}
    world = SimWorld(make_spec(), default_behaviour=SimCluster(extra_apps=taken))
    world.run_for(10)
    assert world.submissions == []
    assert world.condition("RolloutFailed")
    assert any(e.reason == "RolloutFailed" and "NameConflict" in e.message for e in world.events)


def _with_pool_nodes(world: SimWorld, name: str) -> list[NodePlacement]:
    """Give a simulated cluster a head and two workers placed on hosts (as on a host pool)."""
    ports = NodePorts(1, 2, 3, 4, 5, 6, 7, 8)
    nodes = [
        NodePlacement(f"h{i}", f"10.0.0.{i}", "head" if i == 0 else "worker", ports, f"/w/n{i}", 100 + i, 100 + i)
        for i in range(3)
    ]
    world.clusters[name] = world.clusters[name].with_changes(nodes=tuple(nodes), head_pid=100, worker_pids=(101, 102))
    return nodes


def test_a_worker_node_that_exited_is_started_again_where_it_was_not_replaced_with_the_cluster() -> None:
    world = rolled_out(SimWorld(make_spec(serviceUnhealthySecondThreshold=30)))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    nodes = _with_pool_nodes(world, active.name)
    world.sim[active.name].exited_workers = (102,)
    decision = world.tick()
    assert act.RestartNodes(active.name, (102,)) in decision.actions
    assert not [a for a in decision.actions if isinstance(a, act.CreateCluster)]
    assert any(e.reason == "WorkerRestarting" and "h2" in e.message for e in decision.events)
    restarted = world.clusters[active.name].nodes[2]
    assert (restarted.host, restarted.temp_dir, restarted.restarts) == ("h2", "/w/n2", 1), "same place, counted"
    assert restarted.pid not in (None, 102) and world.clusters[active.name].nodes[:2] == tuple(nodes[:2])
    world.run_for(40)  # past the unhealthy threshold
    assert world.with_role(ClusterRole.PENDING) == [] and world.with_role(ClusterRole.ACTIVE)[0].name == active.name
    assert world.condition("Ready")
    assert [e.reason for e in world.events].count("WorkerRestarting") == 1


def test_a_worker_that_keeps_exiting_is_restarted_a_bounded_number_of_times_then_the_cluster_is_replaced() -> None:
    world = rolled_out(SimWorld(make_spec(serviceUnhealthySecondThreshold=30)))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    _with_pool_nodes(world, active.name)
    world.sim[active.name].exited_workers = (102,)
    world.sim[active.name].workers_keep_exiting = True
    world.run_for(20)
    assert [e.reason for e in world.events].count("WorkerRestarting") == MAX_WORKER_RESTARTS
    assert world.with_role(ClusterRole.PENDING) == [], "within the threshold: kept"
    world.run_for(15)
    assert world.with_role(ClusterRole.PENDING), "unhealthy past the threshold: replaced"


def _gcs_kept(**overrides: Any) -> ServiceSpec:
    config = {"hostPool": "fleet", "head": {"numCpus": 1}, "gcsFaultTolerance": {"backend": "rocksdb"}}
    return make_spec(rayClusterConfig=config, **overrides)


def test_with_gcs_fault_tolerance_an_exited_head_is_started_again_in_place_and_the_cluster_kept() -> None:
    world = rolled_out(SimWorld(_gcs_kept(serviceUnhealthySecondThreshold=30)))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    nodes = _with_pool_nodes(world, active.name)
    submitted = len(world.submissions)
    world.sim[active.name].head_alive = False  # its host answered: exited for sure
    decision = world.tick()
    assert act.RestartNodes(active.name, (100,)) in decision.actions
    assert any(e.reason == "HeadRestarting" and "h0" in e.message for e in decision.events)
    head = world.clusters[active.name].nodes[0]
    assert (head.host, head.temp_dir, head.restarts) == ("h0", "/w/n0", 1), "same place, counted"
    assert head.pid not in (None, 100) and world.clusters[active.name].head_pid == head.pid
    assert world.clusters[active.name].nodes[1:] == tuple(nodes[1:]), "the workers untouched"
    world.run_for(40)  # past the unhealthy threshold
    assert world.with_role(ClusterRole.PENDING) == [] and world.with_role(ClusterRole.ACTIVE)[0].name == active.name
    assert world.condition("Ready") and len(world.submissions) == submitted, "no new cluster, no PUT"


def test_with_gcs_fault_tolerance_a_head_that_keeps_exiting_is_restarted_a_bounded_number_of_times() -> None:
    world = rolled_out(SimWorld(_gcs_kept(serviceUnhealthySecondThreshold=30)))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    _with_pool_nodes(world, active.name)
    world.sim[active.name].head_alive = False
    world.sim[active.name].head_keeps_exiting = True
    world.run_for(20)
    assert [e.reason for e in world.events].count("HeadRestarting") == MAX_WORKER_RESTARTS
    world.run_for(15)
    assert world.with_role(ClusterRole.PENDING), "unhealthy past the threshold: replaced"


def test_a_silent_head_host_is_never_restarted_even_with_gcs_fault_tolerance() -> None:
    world = rolled_out(SimWorld(_gcs_kept()))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    _with_pool_nodes(world, active.name)
    world.sim[active.name].head_silent = True  # may still run there: a second head would split it
    world.run_for(10)
    assert not [e for e in world.events if e.reason == "HeadRestarting"]


def test_redis_gcs_fault_tolerance_needs_a_host_pool_and_rocksdb_does_not() -> None:
    with pytest.raises(SpecError, match="gcsFaultTolerance.backend: redis needs a hostPool"):
        make_spec(rayClusterConfig={"gcsFaultTolerance": {"backend": "redis"}})
    local = make_spec(rayClusterConfig={"gcsFaultTolerance": {}})  # a head on this machine: RocksDB
    assert local.spec.rayClusterConfig.gcsFaultTolerance is not None
    assert local.spec.rayClusterConfig.gcsFaultTolerance.backend == "rocksdb"


def test_gcs_fault_tolerance_is_part_of_the_cluster_shape() -> None:
    # (unset, it hashes as before it existed: test_pool_placement pins a stored spec's hash)
    plain = make_spec(rayClusterConfig={"hostPool": "fleet", "head": {"numCpus": 1}})
    assert _gcs_kept().cluster_spec_hash() != plain.cluster_spec_hash()


def test_only_worker_nodes_are_restarted_in_place_never_the_head() -> None:
    world = rolled_out(SimWorld(make_spec()))
    active = world.with_role(ClusterRole.ACTIVE)[0]
    _with_pool_nodes(world, active.name)
    world.sim[active.name].exited_workers = (100,)  # the head's pid: not a worker
    assert not [a for a in world.tick().actions if isinstance(a, act.StartCluster)]


def _pending_with_exited_worker(world: SimWorld, cpus: float) -> str:
    """An upgrade whose pending cluster (head and two workers on hosts) lost a worker's process."""
    world.apply(make_spec(cpus=cpus))
    world.run_for(2)
    pending = world.with_role(ClusterRole.PENDING)[0]
    _with_pool_nodes(world, pending.name)
    world.sim[pending.name].exited_workers = (101,)
    return pending.name


def test_a_pending_cluster_whose_worker_exited_restarts_it_instead_of_failing_the_rollout() -> None:
    world = rolled_out(SimWorld(make_spec()))
    pending = _pending_with_exited_worker(world, cpus=2)
    world.tick()
    assert any(e.reason == "WorkerRestarting" for e in world.events)
    world.run_for(20)
    assert world.service.failure_reason is None
    assert world.route is not None and world.route.active == pending
    # A worker whose host fell silent (unknown, not known to have exited) is not restarted, and
    # fails the rollout only once silent past the unhealthy threshold (issue 19, item 1).
    doomed = _pending_with_exited_worker(world, cpus=3)
    world.sim[doomed].exited_workers, world.sim[doomed].silent_workers = (), 1
    world.run_for(29)
    assert world.service.failure_reason is None, world.service.failure_reason
    world.run_for(2)
    assert (world.service.failure_reason or "").startswith("WorkerUnreachable"), world.service.failure_reason
    assert [e.reason for e in world.events].count("WorkerRestarting") == 1


def test_a_pending_cluster_whose_worker_keeps_exiting_fails_the_rollout_after_the_restarts() -> None:
    world = rolled_out(SimWorld(make_spec()))
    pending = _pending_with_exited_worker(world, cpus=2)
    world.sim[pending].workers_keep_exiting = True
    world.run_for(10)
    assert [e.reason for e in world.events].count("WorkerRestarting") == MAX_WORKER_RESTARTS
    assert (world.service.failure_reason or "").startswith("WorkerDied"), world.service.failure_reason
    assert world.route is not None and world.route.active != pending


# -- a silent host is not a dead one (issue 19, item 1) -----------------------------------------


def _pending_started(world: SimWorld) -> str:
    world.apply(make_spec(cpus=2))  # a new cluster spec: a pending cluster, all traffic at once
    world.run_for(7)  # its head up, its config not yet running
    [pending] = world.with_role(ClusterRole.PENDING)
    return pending.name


def test_a_pending_head_silent_for_one_look_does_not_fail_the_rollout() -> None:
    world = rolled_out(SimWorld(make_spec()))
    pending = _pending_started(world)
    world.sim[pending].head_silent = True
    world.tick()
    assert world.service.failure_reason is None, world.service.failure_reason
    world.advance(0.5)
    world.sim[pending].head_silent = False
    world.run_for(10)
    assert world.service.failure_reason is None
    assert world.route is not None and world.route.active == pending


def test_a_pending_head_that_stays_silent_fails_the_rollout_after_the_threshold() -> None:
    world = rolled_out(SimWorld(make_spec(serviceUnhealthySecondThreshold=30)))
    pending = _pending_started(world)
    world.sim[pending].head_silent = True
    world.run_for(29)
    assert world.service.failure_reason is None, world.service.failure_reason
    world.run_for(2)
    reason = world.service.failure_reason or ""
    assert reason.startswith("HeadUnreachable") and "did not answer" in reason, reason
    assert world.route is not None and world.route.active != pending
