"""Ray's autoscaler's bounds changed in place (issue 22): a spec whose only change is its groups'
minReplicas/maxReplicas/replicas or its autoscalerOptions keeps the cluster and rewrites the
monitor's config (core/planner/bounds.py, controller/bounds.py, the local provider's writer);
any other change of the cluster still rolls a new one."""

from __future__ import annotations

import copy
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servekeeper.controller.bounds import AutoscalerBounds
from servekeeper.controller.submit import StopTick, TickOutcome
from servekeeper.core import actions as act
from servekeeper.core.planner.bounds import kept_starting_counts, only_bounds_differ
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.providers.base import ProviderError
from servekeeper.providers.local_monitor import (
    CONFIG_FILE,
    MONITOR_DIR,
    NodeApi,
    point_monitors_at,
    write_autoscaling_config,
)
from servekeeper.store.store import Store
from servekeeper.testing.sim import SimWorld
from tests.unit.fakes import FakeClock, FakeProvider
from tests.unit.test_autoscaling_config import AUTOSCALED, autoscaled_cluster
from tests.unit.test_planner import kinds, make_spec, rolled_out


def autoscaled(**changes: Any) -> dict[str, Any]:
    """The autoscaled cluster config starting with no worker (the simulated world starts none),
    its `cpu` group changed by `changes`."""
    config = copy.deepcopy(AUTOSCALED)
    config["workerGroups"][0].update({"replicas": 0, **changes})
    return config


def test_a_change_of_bounds_only_keeps_the_cluster_and_gives_its_autoscaler_the_new_ones() -> None:
    world = rolled_out(SimWorld(make_spec(rayClusterConfig=autoscaled())))
    [active] = world.with_role(ClusterRole.ACTIVE)
    options = {"idleTimeoutSeconds": 600, "upscalingMode": "Aggressive"}
    world.apply(make_spec(rayClusterConfig={**autoscaled(maxReplicas=6), "autoscalerOptions": options}))

    decision = world.tick()
    assert kinds(decision.actions) == ["UpdateAutoscaler"]
    [update] = decision.actions
    assert isinstance(update, act.UpdateAutoscaler) and update.cluster == active.name
    kept = world.clusters[active.name]
    assert kept.role == ClusterRole.ACTIVE and kept.cluster_spec_hash == world.spec.cluster_spec_hash()
    config = RayClusterConfigSpec.model_validate_json(kept.cluster_spec_json)
    cpu = config.workerGroups[0]
    assert (cpu.replicas, cpu.minReplicas, cpu.maxReplicas) == (0, 0, 6)
    assert config.autoscalerOptions is not None and config.autoscalerOptions.idleTimeoutSeconds == 600
    [event] = [e for e in world.events if e.reason == "AutoscalerBoundsChanged"]
    assert f"{active.name} kept" in event.message and "cpu 0-6" in event.message
    world.run_for(5)
    assert world.with_role(ClusterRole.PENDING) == [] and world.service.observed_generation == 2
    assert world.condition("Ready") and not world.condition("UpgradeInProgress")
    assert world.tick().actions == []  # done once


def test_a_cluster_that_came_in_as_a_canary_is_kept_at_a_change_of_its_bounds() -> None:
    """After its promotion, the active cluster still holds the state of the canary it was."""
    canary = {"type": "Canary", "canary": {"steps": [{"setWeight": 50}], "capacityFollowsTraffic": True}}
    world = rolled_out(SimWorld(make_spec(rayClusterConfig=autoscaled(maxReplicas=3))))
    world.apply(make_spec("v2", rayClusterConfig=autoscaled(maxReplicas=3), upgradeStrategy=canary))
    world.run_for(60)
    [active] = world.with_role(ClusterRole.ACTIVE)
    assert active.canary is not None and world.service.observed_generation == 2, "promoted"
    world.apply(make_spec("v2", rayClusterConfig=autoscaled(maxReplicas=2)))
    assert kinds(world.tick().actions) == ["UpdateAutoscaler"]
    assert [c.name for c in world.with_role(ClusterRole.ACTIVE)] == [active.name]


def test_the_count_a_cluster_started_with_is_kept_and_one_outside_the_new_bounds_rolls_a_new_cluster() -> None:
    # replicas is the count a cluster started with (scaled_like: the active's); it places the
    # nodes (their order, log files, process tags), so it never changes under running nodes
    started = RayClusterConfigSpec.model_validate(autoscaled(replicas=2, maxReplicas=3))
    desired = RayClusterConfigSpec.model_validate(autoscaled(replicas=1, minReplicas=None, maxReplicas=4))
    assert only_bounds_differ(started, desired)
    cpu = kept_starting_counts(started, desired).workerGroups[0]
    # the bounds written out: an unset minReplicas follows replicas, which is not 1 here
    assert (cpu.replicas, cpu.minReplicas, cpu.maxReplicas) == (2, 1, 4)
    narrower = RayClusterConfigSpec.model_validate(autoscaled(replicas=1, minReplicas=0, maxReplicas=1))
    assert not only_bounds_differ(started, narrower)


def test_a_pending_cluster_kept_runs_the_new_generation_and_its_update_comes_last() -> None:
    world = rolled_out(SimWorld(make_spec(rayClusterConfig=autoscaled())))
    world.apply(make_spec(cpus=2, rayClusterConfig={**autoscaled(), "head": {"numCpus": 2}}))
    assert kinds(world.tick().actions) == ["CreateCluster"]
    [pending] = world.with_role(ClusterRole.PENDING)
    world.apply(make_spec(rayClusterConfig={**autoscaled(maxReplicas=5), "head": {"numCpus": 2}}))
    decision = world.tick()
    assert kinds(decision.actions)[-2:] == ["UpdateAutoscaler", "UpdateCluster"]
    assert "CreateCluster" not in kinds(decision.actions)
    kept = world.clusters[pending.name]
    assert kept.role == ClusterRole.PENDING and kept.generation == world.service.generation == 3
    world.run_for(15)
    assert world.with_role(ClusterRole.ACTIVE)[0].name == pending.name and world.condition("Ready")


@pytest.mark.parametrize(
    "changed",
    [
        autoscaled(numCpus=2),  # a node of another size
        {**autoscaled(), "rayVersion": "2.60.0"},  # an environment of its own: recorded pinned
        {**autoscaled(maxReplicas=6), "enableInTreeAutoscaling": False, "autoscalerOptions": None},
    ],
    ids=["node-size", "own-environment", "autoscaling-off"],
)
def test_any_other_change_of_the_cluster_still_rolls_a_new_one(changed: dict[str, Any]) -> None:
    if changed.get("enableInTreeAutoscaling") is False:  # without autoscaling: a fixed count
        changed["workerGroups"][0] = {"name": "cpu", "replicas": 0, "numCpus": 1}
        changed["workerGroups"][1] = {"name": "gpu", "replicas": 0, "numCpus": 4, "numGpus": 1, "memory": 2**30}
    world = rolled_out(SimWorld(make_spec(rayClusterConfig=autoscaled())))
    world.apply(make_spec(rayClusterConfig=changed))
    assert kinds(world.tick().actions) == ["CreateCluster"]
    assert not [e for e in world.events if e.reason == "AutoscalerBoundsChanged"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "store.db")
    yield store
    store.close()


def bounds_action(cluster_spec: RayClusterConfigSpec) -> act.UpdateAutoscaler:
    return act.UpdateAutoscaler("c", cluster_spec.model_dump_json(), "new-hash")


async def test_the_autoscaler_is_given_the_bounds_before_the_record_says_so(store: Store) -> None:
    cluster, config = autoscaled_cluster()
    store.put_cluster(cluster)
    provider = FakeProvider()
    bounds = AutoscalerBounds(store, provider, FakeClock())
    wider = RayClusterConfigSpec.model_validate(
        {**config.model_dump(), "workerGroups": [autoscaled(maxReplicas=5)["workerGroups"][0]]}
    )

    provider.update_autoscaler_error = ProviderError("the monitor folder is not writable")
    for _ in range(2):
        tick = TickOutcome()
        with pytest.raises(StopTick):
            await bounds.update(bounds_action(wider), tick)
    stored = store.get_cluster("c")
    assert stored is not None and stored.cluster_spec_hash == cluster.cluster_spec_hash  # as it was
    assert provider.calls == [("update_autoscaler", "c")] * 2
    told = TickOutcome()
    with pytest.raises(StopTick):
        await bounds.update(bounds_action(wider), told)
    assert told.events == []  # told once per cause, not once per tick

    provider.update_autoscaler_error = None
    await bounds.update(bounds_action(wider), TickOutcome())
    stored = store.get_cluster("c")
    assert stored is not None and stored.cluster_spec_hash == "new-hash"
    assert RayClusterConfigSpec.model_validate_json(stored.cluster_spec_json).workerGroups[0].maxReplicas == 5
    assert bounds.failures == {}


def test_the_monitor_config_is_replaced_whole_and_private(tmp_path: Path) -> None:
    cluster, config = autoscaled_cluster()
    cluster = cluster.with_changes(log_dir=str(tmp_path / "c"))
    path = write_autoscaling_config(cluster, config)
    assert path == tmp_path / "c" / MONITOR_DIR / CONFIG_FILE
    wider = config.model_copy(update={"workerGroups": [config.workerGroups[0].model_copy(update={"maxReplicas": 7})]})
    write_autoscaling_config(cluster, wider)
    written = json.loads(path.read_text())
    assert written["available_node_types"]["cpu"]["max_workers"] == 7 and written["max_workers"] == 7
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [CONFIG_FILE]  # no partial file left behind

    # `up` writes it again from the record: a crash between a change's two writes left it ahead
    path.write_text("{}")
    point_monitors_at(NodeApi("http://127.0.0.1:1", "secret"), [cluster], configs=True)
    assert json.loads(path.read_text())["available_node_types"]["cpu"]["max_workers"] == 3


async def test_bounds_recorded_while_a_start_ran_are_given_again_once_it_ends(store: Store) -> None:
    cluster, config = autoscaled_cluster()
    store.put_cluster(cluster)
    provider = FakeProvider()
    bounds = AutoscalerBounds(store, provider, FakeClock())
    await bounds.after_start(cluster)
    assert provider.calls == []  # nothing changed meanwhile
    store.update_cluster("c", cluster_spec_hash="new-hash")
    await bounds.after_start(cluster)  # the start read the record before the change
    assert provider.calls == [("update_autoscaler", "c")]
