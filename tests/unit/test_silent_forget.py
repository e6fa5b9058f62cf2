"""What the controller remembers of a silent host goes with its service and its cluster (issue
19 follow-up): a service deleted while its head's host was silent leaves no entry behind in the
observer's `silent_hosts` (one per name ever deleted, growing without end), and a cluster gone
leaves none in its service's."""

from __future__ import annotations

import asyncio

from servekeeper.model.enums import ClusterRole
from tests.unit.test_controller import NAME
from tests.unit.test_pool_clusters import PoolWorld, pool_spec, world

__all__ = ["world"]  # the fixture, imported for pytest


async def silent_pending(world: PoolWorld) -> str:
    world.apply(pool_spec(workers=1))
    await world.tick()
    await world.background_settled()
    pending = world.only(ClusterRole.PENDING)
    world.fleet.silent.add(pending.nodes[0].host)  # the head's host stops answering
    world.pools._liveness.clear()
    world.clock.advance(1)
    await world.tick()
    assert (pending.name, "head") in world.controller.observer.silent_hosts[NAME]
    return pending.name


async def test_a_service_forgotten_while_its_host_is_silent_leaves_no_silence_behind(world: PoolWorld) -> None:
    pending = await silent_pending(world)
    # Gone between two looks, as `ForgetService` removes it in the tick after its last look
    # (a look that found the host silent).
    world.store.mark_deleting(NAME)
    world.store.remove_cluster(pending)
    assert world.store.delete_service_row(NAME)
    controller = world.controller
    # The service's loop, as `run` starts it: it ticks until the service is gone, then ends.
    task = controller._service_tasks[NAME] = asyncio.create_task(controller._guarded_service_loop(NAME))
    await asyncio.wait_for(task, 5)
    assert world.store.get_service(NAME) is None
    assert NAME not in controller.observer.silent_hosts


async def test_a_cluster_gone_while_its_host_is_silent_leaves_no_silence_behind(world: PoolWorld) -> None:
    pending = await silent_pending(world)
    world.store.remove_cluster(pending)
    world.clock.advance(1)
    await world.tick()
    assert all(cluster != pending for cluster, _ in world.controller.observer.silent_hosts.get(NAME, {}))
    await world.background_settled()
