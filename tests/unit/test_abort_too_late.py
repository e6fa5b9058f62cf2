"""Issue 19 item 15: `abort` that comes after the point of no return. A tick reads the clusters,
plans, then writes; an abort stored in between flags a pending cluster that this very tick
promotes. The promotion stands (traffic already moved), and the next tick says so with a
warning `AbortTooLate` that names `servekeeper undo` as the way back, once. An abort that comes
after the promotion is stored finds no rollout and is refused (409) with nothing changed."""

from __future__ import annotations

from typing import Any

import pytest

from servekeeper.commands.context import CommandContext
from servekeeper.commands.errors import Conflict
from servekeeper.commands.rollouts import RolloutCommands
from servekeeper.core import actions as act
from servekeeper.core.planner import plan as real_plan
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord
from servekeeper.testing import sim as sim_module
from servekeeper.testing.sim import SimWorld
from tests.unit.test_canary import canary_spec, canary_started, ready_world, reasons, weights
from tests.unit.test_controller import NAME, World, make_spec, world
from tests.unit.test_planner import make_spec as planner_spec

__all__ = ["world"]  # the fixture, imported for pytest


def promoted_pending(world_clusters: dict[str, ClusterRecord], actions: Any) -> str | None:
    """The pending cluster that these actions make active, if any."""
    for action in actions:
        updates = list(action.changes) if isinstance(action, act.UpdateClusters) else []
        if isinstance(action, act.UpdateCluster):
            updates = [(action.cluster, action.changes)]
        for name, changes in updates:
            if changes.get("role") == ClusterRole.ACTIVE and world_clusters[name].role == ClusterRole.PENDING:
                return name
    return None


def abort_between_plan_and_writes(monkeypatch: pytest.MonkeyPatch, world: SimWorld) -> list[str]:
    """`abort` lands after the tick that promotes a pending cluster has read the clusters and
    before its writes: the planner's decision is made, then the stored pending record gets
    abort_requested (as `store.request_abort` would set it)."""
    aborted: list[str] = []

    def plan_then_abort(*args: Any, **kwargs: Any) -> Any:
        decision = real_plan(*args, **kwargs)
        promoted = promoted_pending(world.clusters, decision.actions)
        if promoted is not None and not aborted:
            aborted.append(promoted)
            world.clusters[promoted] = world.clusters[promoted].with_changes(abort_requested=True)
        return decision

    monkeypatch.setattr(sim_module, "plan", plan_then_abort)
    return aborted


def test_an_abort_during_the_promoting_tick_is_too_late_and_says_undo(monkeypatch: pytest.MonkeyPatch) -> None:
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.clusters[canary.name] = world.clusters[canary.name].with_changes(promote_full=True)
    aborted = abort_between_plan_and_writes(monkeypatch, world)

    world.tick()  # promotes: the abort arrived after this tick decided
    assert aborted == [canary.name]
    promoted = world.clusters[canary.name]
    assert promoted.role == ClusterRole.ACTIVE and promoted.abort_requested, "the flag survives the promotion"
    assert weights(world)[canary.name] == 100
    assert "AbortTooLate" not in reasons(world)

    world.advance(0.5)
    world.tick()  # the active cluster carries an abort: too late, said once
    [too_late] = [event for event in world.events if event.reason == "AbortTooLate"]
    assert too_late.type == "Warning"
    assert canary.name in too_late.message and "`servekeeper undo` rolls back" in too_late.message
    assert not world.clusters[canary.name].abort_requested
    assert world.clusters[canary.name].role == ClusterRole.ACTIVE, "no rollback: traffic already moved"
    assert world.clusters[stable.name].role == ClusterRole.DRAINING
    assert not world.condition("RolloutFailed") and "RolloutAborted" not in reasons(world)

    world.run_for(5)
    assert reasons(world).count("AbortTooLate") == 1
    assert weights(world)[canary.name] == 100


def test_an_abort_read_by_the_tick_still_aborts() -> None:
    """The boundary: the same abort stored before the tick reads wins over promote_full, and
    nothing is too late."""
    world = ready_world(canary_spec())
    stable, canary = canary_started(world, canary_spec(msg="v2"))
    world.clusters[canary.name] = world.clusters[canary.name].with_changes(promote_full=True, abort_requested=True)
    world.tick()
    assert world.clusters[stable.name].role == ClusterRole.ACTIVE
    assert world.clusters[canary.name].role == ClusterRole.DRAINING
    assert "RolloutAborted" in reasons(world) and "AbortTooLate" not in reasons(world)


def test_a_rollout_without_canary_is_past_return_at_its_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a canary the point of no return is the switch: the tick that finds the new
    cluster ready moves all traffic to it."""
    world = SimWorld(planner_spec())
    world.run_for(15)
    [old] = world.with_role(ClusterRole.ACTIVE)
    aborted = abort_between_plan_and_writes(monkeypatch, world)
    world.apply(planner_spec(msg="v2", cpus=2))  # a new cluster
    for _ in range(60):
        world.tick()
        world.advance(0.5)
        if aborted:
            break
    [new] = aborted
    assert world.clusters[new].role == ClusterRole.ACTIVE and world.clusters[new].abort_requested
    assert world.clusters[old.name].role == ClusterRole.DRAINING
    assert world.route is not None and world.route.weight_of(new) == 100
    world.tick()
    assert reasons(world).count("AbortTooLate") == 1 and "RolloutAborted" not in reasons(world)
    assert world.clusters[new].role == ClusterRole.ACTIVE and not world.condition("RolloutFailed")


# -- what the user sees: the command's answer, then the events --------------------------------


async def test_abort_accepted_during_the_switch_then_too_late_in_events_and_refused_after(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    rollouts = RolloutCommands(CommandContext(world.store, world.controller))
    old = await world.roll_out()
    answers: list[dict[str, Any]] = []
    execute = world.controller.executor.execute

    async def abort_then_execute(action: act.Action, *args: Any) -> Any:
        stored = {cluster.name: cluster for cluster in world.clusters()}
        if not answers and promoted_pending(stored, [action]) is not None:
            answers.append(await rollouts.abort(NAME))  # the user's `abort`, between plan and writes
        return await execute(action, *args)

    monkeypatch.setattr(world.controller.executor, "execute", abort_then_execute)
    world.apply(make_spec(msg="v2", cpus=2))
    for _ in range(10):
        world.clock.advance(1)
        await world.tick()
        await world.background_settled()
        world.serve.set_status("RUNNING")
        if answers:
            break
    [answer] = answers
    new = world.only(ClusterRole.ACTIVE)
    assert answer == {"name": NAME, "cluster": new.name, "aborting": True}, "accepted: it was still pending"
    assert world.cluster(old.name).role == ClusterRole.DRAINING

    world.clock.advance(1)
    await world.tick()
    too_late = [event for event in world.events() if event.reason == "AbortTooLate"]
    assert [(e.type, e.message) for e in too_late] == [
        ("Warning", f"{new.name} was promoted before the abort arrived; `servekeeper undo` rolls back")
    ]
    assert world.only(ClusterRole.ACTIVE).name == new.name and world.service().failed_generation is None

    with pytest.raises(Conflict, match="no rollout in progress to abort"):  # later: nothing to abort
        await rollouts.abort(NAME)
    assert world.only(ClusterRole.ACTIVE).name == new.name
