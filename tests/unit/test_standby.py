"""A hot standby, tick by tick (issue 20, item 2): built once the active is ready, in the route
behind the active once ready, promoted when the active's head exits, replaced when it dies, and
rebuilt with the new spec after a rollout. The real controller on a real store; Ray and Envoy faked."""

from __future__ import annotations

from typing import Any

from servekeeper.core.planner.standby import REBUILD_AFTER_TAKEOVER_SECONDS
from servekeeper.model.enums import ClusterRole, ConditionType
from servekeeper.model.records import ClusterRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.views.service import service_view
from tests.unit.test_controller import World, make_spec, world

__all__ = ["world"]


def hot(msg: str = "v1", **overrides: Any) -> ServiceSpec:
    return make_spec(msg, standby={"mode": "hot"}, **overrides)


async def settle(world: World, ticks: int = 4) -> None:
    for _ in range(ticks):
        world.clock.advance(1)
        await world.tick()
        await world.background_settled()
        world.serve.set_status("RUNNING")


async def ready_pair(world: World) -> tuple[ClusterRecord, ClusterRecord]:
    active = await world.roll_out(hot())
    await settle(world)
    standby = world.only(ClusterRole.STANDBY)
    assert standby.ready_at is not None and "StandbyReady" in world.reasons()
    return active, standby


async def test_a_standby_is_built_after_the_active_and_routed_behind_it_at_weight_0(world: World) -> None:
    active, standby = await ready_pair(world)
    route = world.dataplane.table["svc"]
    assert route.standby == standby.name
    assert dict(route.weights) == {active.name: 100, standby.name: 0}
    assert standby.cluster_spec_hash == active.cluster_spec_hash
    assert standby.applied_config_hash == active.applied_config_hash, "the apps run on the standby too"


async def test_no_standby_without_the_field_and_it_goes_when_the_field_is_unset(world: World) -> None:
    active, standby = await ready_pair(world)
    world.apply(make_spec())  # same cluster and config, no standby
    await settle(world)
    assert world.clusters(ClusterRole.STANDBY) == []
    assert world.dataplane.table["svc"].standby is None
    assert world.only(ClusterRole.ACTIVE).name == active.name, "the active is untouched"
    assert "StandbyDeleted" in world.reasons()


async def test_the_active_head_exiting_promotes_the_standby_and_a_new_one_is_built(world: World) -> None:
    active, standby = await ready_pair(world)
    world.provider.set_alive(active.name, False)
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.ACTIVE).name == standby.name
    assert world.cluster(active.name).role == ClusterRole.DELETING
    route = world.dataplane.table["svc"]
    assert route.weights[standby.name] == 100 and active.name not in route.weights
    promoted = [e for e in world.events() if e.reason == "StandbyPromoted"]
    assert len(promoted) == 1 and f"the head of {active.name} exited" in promoted[0].message
    assert not [e for e in world.events() if e.reason == "ClusterCreating" and "ActiveUnhealthy" in e.message]
    # The next standby waits: its head's start would take the cores the new active needs now.
    await settle(world, int(REBUILD_AFTER_TAKEOVER_SECONDS) - 2)
    assert world.clusters(ClusterRole.STANDBY) == []
    await settle(world, 8)
    new_standby = world.only(ClusterRole.STANDBY)
    assert new_standby.name not in (active.name, standby.name) and new_standby.ready_at is not None
    assert world.dataplane.table["svc"].standby == new_standby.name


async def test_a_standby_that_dies_is_replaced_and_the_active_never_notices(world: World) -> None:
    active, standby = await ready_pair(world)
    switches_before = len(world.dataplane.set_calls)
    world.provider.set_alive(standby.name, False)
    await settle(world, 6)
    assert world.only(ClusterRole.ACTIVE).name == active.name
    replacement = world.only(ClusterRole.STANDBY)
    assert replacement.name != standby.name and replacement.ready_at is not None
    assert "StandbyReplaced" in world.reasons()
    assert all(route.weights[active.name] == 100 for route in world.dataplane.set_calls[switches_before:])


async def test_after_a_rollout_the_standby_is_rebuilt_with_the_new_spec(world: World) -> None:
    _, old_standby = await ready_pair(world)
    world.apply(hot(cpus=2))  # a cluster-shape change: a new cluster, readiness-gated
    await settle(world, 8)
    active = world.only(ClusterRole.ACTIVE)
    standby = world.only(ClusterRole.STANDBY)
    assert standby.name != old_standby.name and standby.cluster_spec_hash == active.cluster_spec_hash
    assert (
        old_standby.name not in {c.name for c in world.clusters()}
        or world.cluster(old_standby.name).role == ClusterRole.DELETING
    )
    assert world.dataplane.table["svc"].standby == standby.name


async def test_no_standby_is_built_while_a_rollout_is_under_way(world: World) -> None:
    await world.roll_out(make_spec())
    world.apply(hot(cpus=2))
    world.clock.advance(1)
    await world.tick()
    assert world.clusters(ClusterRole.PENDING) and not world.clusters(ClusterRole.STANDBY)


async def test_a_route_that_fails_mid_failover_changes_no_role_and_the_next_tick_finishes(world: World) -> None:
    active, standby = await ready_pair(world)
    world.provider.set_alive(active.name, False)
    world.dataplane.fail("set_route")
    world.clock.advance(1)
    await world.tick()
    assert world.cluster(active.name).role == ClusterRole.ACTIVE, "roles change only once the ingress acknowledged"
    assert world.cluster(standby.name).role == ClusterRole.STANDBY
    world.dataplane.recover()
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.ACTIVE).name == standby.name
    assert world.cluster(active.name).role == ClusterRole.DELETING


def warm(msg: str = "v1") -> ServiceSpec:
    return make_spec(msg, standby={"mode": "warm"})


async def test_a_warm_standby_is_deployed_with_no_replicas_and_stays_out_of_the_route(world: World) -> None:
    active = await world.roll_out(warm())
    await settle(world)
    standby = world.only(ClusterRole.STANDBY)
    assert standby.ready_at is not None and standby.target_capacity == 0.0
    puts = [document for url, document in world.serve.puts if url == standby.dashboard_url]
    assert puts and all(document.get("target_capacity") == 0.0 for document in puts), "born with no replicas"
    route = world.dataplane.table["svc"]
    assert route.standby is None and set(route.weights) == {active.name}, "no replica: no failover in Envoy"
    view = service_view(world.service(), 8000, world.clusters(), None)
    assert view["standby"] == "ready" and view["standbyCluster"] is not None


async def test_a_warm_standby_is_scaled_up_then_takes_the_traffic_when_the_active_dies(world: World) -> None:
    active = await world.roll_out(warm())
    await settle(world)
    standby = world.only(ClusterRole.STANDBY)
    world.serve.status_after_put = "DEPLOYING"
    world.provider.set_alive(active.name, False)
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.ACTIVE).name == active.name, "not before its replicas run"
    assert world.cluster(standby.name).target_capacity == 100.0
    assert "StandbyScalingUp" in world.reasons()
    assert world.serve.puts[-1][1].get("target_capacity") == 100.0
    world.serve.set_status("RUNNING", dashboard_url=standby.dashboard_url)
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.ACTIVE).name == standby.name
    assert world.dataplane.table["svc"].weights[standby.name] == 100
    assert "StandbyPromoted" in world.reasons()


async def test_changing_the_mode_rebuilds_the_standby(world: World) -> None:
    await world.roll_out(hot())
    await settle(world)
    hot_one = world.only(ClusterRole.STANDBY)
    world.apply(warm())
    await settle(world, 6)
    warm_one = world.only(ClusterRole.STANDBY)
    assert warm_one.name != hot_one.name and warm_one.target_capacity == 0.0 and warm_one.ready_at is not None


async def test_building_a_standby_is_not_an_upgrade(world: World) -> None:
    await world.roll_out(hot())
    world.clock.advance(1)
    await world.tick()  # the standby's cluster is created in this tick
    assert world.clusters(ClusterRole.STANDBY)
    condition = world.service().condition(ConditionType.UPGRADE_IN_PROGRESS)
    assert condition is not None and not condition.status, condition


async def test_a_standby_that_keeps_dying_is_built_again_after_a_growing_pause(world: World) -> None:
    _, standby = await ready_pair(world)
    world.provider.set_alive(standby.name, False)
    world.clock.advance(1)
    await world.tick()  # dropped, and (the last one was ready) built again at once
    await world.background_settled()
    [second] = world.clusters(ClusterRole.STANDBY)
    assert world.service().standby_failures == 1
    world.provider.set_alive(second.name, False)
    world.clock.advance(1)
    await world.tick()  # dropped; the next try waits
    assert world.clusters(ClusterRole.STANDBY) == []
    retry_at = world.service().standby_retry_at
    assert retry_at is not None and retry_at > world.clock()
    world.clock.advance(retry_at - world.clock())
    await world.tick()
    assert world.clusters(ClusterRole.STANDBY) and world.service().standby_failures == 2
    assert world.service().standby_retry_at == world.clock() + 10, "5 s, then 10 s, ..."


async def test_the_standby_never_takes_a_config_the_active_has_not_run_well(world: World) -> None:
    active, standby = await ready_pair(world)
    good = world.cluster(standby.name).applied_config_hash
    world.apply(hot("v2"))  # a Serve-config change: in place on the active
    world.clock.advance(1)
    await world.tick()
    world.serve.set_status("DEPLOY_FAILED", "boom", dashboard_url=active.dashboard_url)
    for _ in range(3):
        world.clock.advance(1)
        await world.tick()
    assert "RolloutFailed" in world.reasons()
    assert world.cluster(standby.name).applied_config_hash == good
    to_standby = [document for url, document in world.serve.puts if url == standby.dashboard_url]
    assert to_standby and all(d["applications"][0]["args"]["msg"] == "v1" for d in to_standby), "no PUT of v2 to it"


async def test_an_unhealthy_but_running_active_replaced_by_the_standby_drains(world: World) -> None:
    active, standby = await ready_pair(world)
    world.serve.set_status("UNHEALTHY", "replica crashed", dashboard_url=active.dashboard_url)
    for _ in range(35):  # past serviceUnhealthySecondThreshold (30 s)
        world.clock.advance(1)
        await world.tick()
        if world.cluster(standby.name).role == ClusterRole.ACTIVE:
            break
    assert world.cluster(standby.name).role == ClusterRole.ACTIVE
    assert world.cluster(active.name).role == ClusterRole.DRAINING, "its in-flight requests finish"
    assert not [e for e in world.events() if e.reason == "ClusterCreating" and "ActiveUnhealthy" in e.message]


async def test_a_config_change_reaches_the_standby_once_the_active_runs_it_well(world: World) -> None:
    active, standby = await ready_pair(world)
    world.apply(hot("v2"))
    await settle(world, 5)
    assert world.only(ClusterRole.ACTIVE).name == active.name, "in place: no new cluster"
    assert world.cluster(standby.name).applied_config_hash == world.cluster(active.name).applied_config_hash
    to_standby = [document for url, document in world.serve.puts if url == standby.dashboard_url]
    assert to_standby[-1]["applications"][0]["args"]["msg"] == "v2"


# -- item 3: a Serve config rolled on a new cluster takes the standby --------------------------


def spare_spec(msg: str = "v1", mode: str = "warm", **overrides: Any) -> ServiceSpec:
    return make_spec(msg, standby={"mode": mode}, serveConfigUpdate="NewCluster", **overrides)


async def ready_spare(world: World, mode: str = "warm") -> tuple[ClusterRecord, ClusterRecord]:
    active = await world.roll_out(spare_spec(mode=mode))
    await settle(world)
    standby = world.only(ClusterRole.STANDBY)
    assert standby.ready_at is not None
    return active, standby


def puts_to(world: World, cluster: ClusterRecord) -> list[dict[str, Any]]:
    return [document for url, document in world.serve.puts if url == cluster.dashboard_url]


async def test_a_config_rolled_on_a_new_cluster_takes_the_warm_standby(world: World) -> None:
    active, spare = await ready_spare(world)
    assert spare.target_capacity == 0.0
    creating_before = world.reasons().count("ClusterCreating")
    world.apply(spare_spec("v2"))
    world.clock.advance(1)
    await world.tick()
    taken = world.only(ClusterRole.PENDING)
    assert taken.name == spare.name and world.clusters(ClusterRole.STANDBY) == []
    assert taken.generation == world.service().generation and taken.ready_at is None
    assert taken.created_at == world.clock(), "its readiness timeout counts from the take"
    assert taken.target_capacity == 100.0, "every replica, and the switch waits until Serve runs them"
    assert world.reasons().count("ClusterCreating") == creating_before, "no cluster started for the rollout"
    assert "StandbyTaken" in world.reasons()
    world.serve.status_after_put = "DEPLOYING"
    world.clock.advance(1)
    await world.tick()  # the next tick advances it as the pending cluster
    put = puts_to(world, spare)[-1]
    assert put["applications"][0]["args"]["msg"] == "v2" and put["target_capacity"] == 100.0
    world.serve.set_status("RUNNING", dashboard_url=spare.dashboard_url)
    await settle(world, 4)
    assert world.only(ClusterRole.ACTIVE).name == spare.name
    old = world.store.get_cluster(active.name)
    assert old is None or old.role in (ClusterRole.DRAINING, ClusterRole.DELETING), "the old active drained"
    assert world.dataplane.table["svc"].weights[spare.name] == 100
    await settle(world, 8)
    next_standby = world.only(ClusterRole.STANDBY)
    assert next_standby.name not in (active.name, spare.name), "a new standby follows the rollout"
    assert next_standby.target_capacity == 0.0 and next_standby.ready_at is not None


async def test_a_hot_standby_taken_leaves_the_failover_route_first(world: World) -> None:
    active, spare = await ready_spare(world, "hot")
    assert world.dataplane.table["svc"].standby == spare.name
    world.apply(spare_spec("v2", "hot"))
    world.clock.advance(1)
    await world.tick()
    taken = world.only(ClusterRole.PENDING)
    assert taken.name == spare.name and taken.target_capacity is None, "its replicas already run"
    route = world.dataplane.table["svc"]
    assert route.standby is None and set(route.weights) == {active.name}, "no longer the failover target"


async def test_a_failed_rollout_gives_the_standby_back_with_the_actives_config(world: World) -> None:
    active, spare = await ready_spare(world)
    good = world.cluster(active.name).good_config_hash
    world.apply(spare_spec("v2"))
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.PENDING).name == spare.name
    world.clock.advance(1)
    await world.tick()  # v2 PUT to it
    assert puts_to(world, spare)[-1]["applications"][0]["args"]["msg"] == "v2"
    world.serve.set_status("DEPLOY_FAILED", "boom", dashboard_url=spare.dashboard_url)
    for _ in range(3):
        world.clock.advance(1)
        await world.tick()
    assert "RolloutFailed" in world.reasons() and "StandbyGivenBack" in world.reasons()
    back = world.cluster(spare.name)
    assert back.role == ClusterRole.STANDBY and back.target_capacity == 0.0 and back.failure_reason is None
    restore = puts_to(world, spare)[-1]
    assert restore["applications"][0]["args"]["msg"] == "v1" and restore["target_capacity"] == 0.0
    world.serve.set_status("RUNNING", dashboard_url=spare.dashboard_url)
    await settle(world, 3)
    assert world.cluster(spare.name).ready_at is not None, "ready again behind the untouched active"
    assert world.cluster(spare.name).applied_config_hash == good
    assert world.only(ClusterRole.ACTIVE).name == active.name
    assert world.service().failure_reason is not None, "the failure stays recorded"


async def test_the_standby_is_not_taken_while_it_may_be_needed_or_is_unfit(world: World) -> None:
    active, spare = await ready_spare(world)
    # The active is unhealthy (under the threshold): the standby stays where it may be needed.
    world.serve.set_status("UNHEALTHY", "replica crashed", dashboard_url=active.dashboard_url)
    world.clock.advance(1)
    await world.tick()
    world.apply(spare_spec("v2"))
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.STANDBY).name == spare.name and "StandbyTaken" not in world.reasons()


async def test_the_standby_is_not_taken_while_the_route_cannot_be_read(world: World) -> None:
    _, spare = await ready_spare(world, "hot")
    world.dataplane.fail("routes")
    world.apply(spare_spec("v2", "hot"))
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.STANDBY).name == spare.name and "StandbyTaken" not in world.reasons()


async def test_a_cluster_shape_change_never_takes_the_standby(world: World) -> None:
    _, spare = await ready_pair(world)
    world.apply(hot(cpus=2))
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.PENDING).name != spare.name and "StandbyTaken" not in world.reasons()
    assert world.only(ClusterRole.STANDBY).name == spare.name, "it still guards the active meanwhile"


async def test_a_standby_not_ready_is_not_taken(world: World) -> None:
    await world.roll_out(spare_spec(mode="hot"))
    world.clock.advance(1)
    await world.tick()  # the standby is being built
    building = world.only(ClusterRole.STANDBY)
    assert building.ready_at is None
    world.apply(spare_spec("v2", "hot"))
    world.clock.advance(1)
    await world.tick()
    assert world.only(ClusterRole.PENDING).name != building.name and "StandbyTaken" not in world.reasons()
