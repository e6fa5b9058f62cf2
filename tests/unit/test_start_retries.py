"""Node starts that failed on a serving cluster (controller/start_retries.py), on a real store: tried
again after a doubling pause until the node's budget is spent; then a node Ray's autoscaler
manages is released (so Ray asks for another), any other node stays down."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from servekeeper.controller.start_retries import StartRetries, down_nodes
from servekeeper.core.planner import MAX_WORKER_RESTARTS
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import launched
from servekeeper.providers.base import PermanentProviderError, RetryableProviderError, with_nodes
from servekeeper.store.store import Store
from tests.unit.fakes import FakeClock
from tests.unit.test_autoscaling_config import autoscaled_cluster, new_ports


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "store.db")
    yield store
    store.close()


def serving(cluster: ClusterRecord, running: int) -> ClusterRecord:
    """`cluster` with its first `running` nodes started."""
    nodes = (
        replace(node, pid=100 + i, session_id=100 + i) if i < running else node for i, node in enumerate(cluster.nodes)
    )
    return with_nodes(cluster, nodes)


def spend_every_try(retries: StartRetries, store: Store, clock: FakeClock, name: str) -> list[str]:
    """Fail the start of `name` at each due try until none is left; what each failure said."""
    said = []
    for _ in range(MAX_WORKER_RESTARTS + 1):
        cluster = store.get_cluster(name)
        assert cluster is not None
        due = retries.due(cluster)
        if due is None:
            clock.advance(1000)
            due = retries.due(cluster)
        assert due is not None
        said.append(retries.failed(due, RetryableProviderError("the raylet did not register")))
    return said


def test_a_launched_node_whose_start_is_given_up_is_released_for_ray_to_ask_again(store: Store) -> None:
    cluster, config = autoscaled_cluster()
    cluster, [launched_id] = launched(serving(cluster, running=2), config, "cpu", 1, new_ports)
    store.put_cluster(cluster)
    clock = FakeClock()
    retries = StartRetries(store, clock)

    said = spend_every_try(retries, store, clock, "c")
    assert all("trying again" in message for message in said[:-1])
    assert said[-1] == (
        f"no tries left (restart {MAX_WORKER_RESTARTS} of at most {MAX_WORKER_RESTARTS}): "
        f"node(s) {launched_id} released for Ray's autoscaler to ask again"
    )
    stored = store.get_cluster("c")
    assert stored is not None
    node = next(n for n in stored.nodes if n.node_id == launched_id)
    assert node.stopped and node.pid is None  # listed to Ray no more: neither pending nor running
    assert down_nodes(stored) == [] and stored.worker_pids == (101,)  # the running worker untouched
    [event] = [e for e in store.list_events(cluster.service) if e.reason == "NodeRemoved"]
    assert event.type == "Warning" and f"node(s) {launched_id} of c released" in event.message
    # Nothing left to try: a node Ray asks for next is started at once, not after a pause.
    again, _ = launched(stored, config, "cpu", 1, new_ports)
    assert retries.due(again) is again


def test_a_permanent_error_releases_at_once_and_the_session_a_start_left_is_kept_for_its_stop(store: Store) -> None:
    cluster, config = autoscaled_cluster()
    cluster, [launched_id] = launched(serving(cluster, running=2), config, "cpu", 1, new_ports)
    spawned = replace(cluster.nodes[-1], session_id=4321)  # a start that spawned it, then failed
    cluster = cluster.with_changes(nodes=(*cluster.nodes[:-1], spawned))
    store.put_cluster(cluster)
    retries = StartRetries(store, FakeClock())
    said = retries.failed(cluster, PermanentProviderError("no such Ray on the host"))
    assert said.startswith("not tried again (waiting will not mend it): node(s)")
    stored = store.get_cluster("c")
    assert stored is not None
    node = stored.nodes[-1]
    assert (node.node_id, node.stopped, node.pid, node.session_id) == (launched_id, True, None, 4321)


def test_without_rays_autoscaler_a_node_given_up_stays_down(store: Store) -> None:
    cluster, _ = autoscaled_cluster()
    spec = {**json.loads(cluster.cluster_spec_json), "enableInTreeAutoscaling": False, "autoscalerOptions": None}
    spec["workerGroups"] = [{**group, "minReplicas": None, "maxReplicas": None} for group in spec["workerGroups"]]
    fixed = cluster.with_changes(cluster_spec_json=json.dumps(spec))
    store.put_cluster(serving(fixed, running=1))
    clock = FakeClock()
    said = spend_every_try(StartRetries(store, clock), store, clock, "c")
    assert said[-1].endswith(": the node stays down")
    stored = store.get_cluster("c")
    assert stored is not None and [n.node_id for n in down_nodes(stored)] == [1]
    assert not any(e.reason == "NodeRemoved" for e in store.list_events(cluster.service))
