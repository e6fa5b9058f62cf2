"""The node API Ray's autoscaler calls from a cluster's head (issue 22), against the real API app
in-process and a real store: a launch is recorded (unstarted) and told, a release stops the node
through the provider and records it stopped, bounds and the head are refused; and the cluster's
node token opens that cluster's node routes and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.api.nodes import node_route_cluster
from servekeeper.commands.nodes import node_token
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, NodePorts
from servekeeper.providers.autoscaling import launch_here
from servekeeper.providers.base import ClusterRecords, RetryableProviderError
from servekeeper.providers.ports import PortAllocator, PortsExhausted
from servekeeper.store.store import Store
from tests.unit.test_autoscaling_config import autoscaled_cluster
from tests.unit.test_client import TOKEN, FakeController

URL = "/api/v1/clusters/c/nodes"


class StopRecorder:
    def __init__(self) -> None:
        self.stopped: list[tuple[str, int]] = []
        self.store: Store | None = None
        self.stored_while_stopping: list[Any] = []
        self.refuse = 0  # the next N stops fail as a node that resists its SIGKILL does

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        return launch_here(cluster, config, group, count, records)  # the local provider's own

    async def stop_node(self, cluster: ClusterRecord, index: int) -> None:
        if self.refuse:
            self.refuse -= 1
            raise RetryableProviderError(f"node {index} of {cluster.name} did not stop")
        self.stopped.append((cluster.name, index))
        if self.store is not None:  # what a crash at this point would leave
            stored = self.store.get_cluster(cluster.name)
            assert stored is not None
            self.stored_while_stopping.append(stored.nodes[index])


class NodeController(FakeController):
    def __init__(self) -> None:
        self.provider = StopRecorder()
        self.woken: list[str] = []
        self.now = 1000.0

    def wake(self, name: str) -> None:
        self.woken.append(name)

    def clock(self) -> float:
        return self.now


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[TestClient, Store, NodeController]]:
    store = Store(tmp_path / "store.db")
    cluster, _ = autoscaled_cluster()
    store.put_cluster(cluster)
    controller = NodeController()
    controller.provider.store = store

    async def shutdown(stop_clusters: bool) -> None:
        return None

    with TestClient(build_app(controller, store, TOKEN, shutdown)) as client:  # type: ignore[arg-type]
        yield client, store, controller
    store.close()


def as_node(cluster: str = "c") -> dict[str, str]:
    return {"Authorization": f"Bearer {node_token(TOKEN, cluster)}"}


def test_a_launch_is_recorded_unstarted_and_listed_then_a_release_stops_and_records_it(world: Any) -> None:
    client, store, controller = world
    listed = client.get(URL, headers=as_node()).json()["nodes"]
    assert [(n["id"], n["kind"], n["type"], n["status"]) for n in listed] == [
        (0, "head", "ray.head.default", "pending"),
        (1, "worker", "cpu", "pending"),
    ]
    assert listed[1]["tags"] == {}

    answer = client.post(URL, json={"type": "cpu", "count": 2, "tags": {"ray-launch-config": "h"}}, headers=as_node())
    assert answer.status_code == 200 and answer.json() == {"ids": [2, 3]}
    stored = store.get_cluster("c")
    assert stored is not None and [n.node_id for n in stored.nodes if n.pid is None] == [0, 1, 2, 3]
    # Ports for the two, held by the cluster from now on, recorded with them; none of them taken before
    assert stored.ports.node_ports[2:] == tuple(n.ports for n in stored.nodes[2:])
    before = {port for node in stored.ports.node_ports[:2] for port in node.all_ports()}
    assert not before & {port for node in stored.ports.node_ports[2:] for port in node.all_ports()}
    assert controller.woken == [stored.service]
    tags = client.get(URL, headers=as_node()).json()["nodes"][2]["tags"]
    assert tags["ray-launch-config"] == "h"  # Ray's own tags are kept and given back
    assert client.post(f"{URL}/2/tags", json={"tags": {"ray-node-name": "w2"}}, headers=as_node()).status_code == 200

    for _ in range(2):  # Ray asks again after its back-off: told once
        refused = client.post(URL, json={"type": "cpu", "count": 1}, headers=as_node())
        assert refused.status_code == 409 and "maxReplicas (3)" in refused.json()["detail"]
    [told] = [e for e in store.list_events(stored.service) if e.reason == "NodeRequestRefused"]
    assert told.type == "Warning" and "worker group 'cpu' of c" in told.message and "maxReplicas (3)" in told.message
    assert client.delete(f"{URL}/0", headers=as_node()).status_code == 409  # the head is not released

    stored = store.get_cluster("c")
    assert stored is not None
    running = replace(stored.nodes[2], pid=77, session_id=77)  # the node Ray asked for, started
    store.update_cluster("c", nodes=(*stored.nodes[:2], running, *stored.nodes[3:]), worker_pids=(77,))
    assert client.delete(f"{URL}/2", headers=as_node()).status_code == 200
    assert controller.provider.stopped == [("c", 2)]
    # intent first: while it was being stopped, the record already said stopped (no restart, no
    # worker death) and still held its session (a crash mid-stop leaves it known)
    (during,) = controller.provider.stored_while_stopping
    assert (during.stopped, during.pid, during.session_id) == (True, None, 77)
    assert client.delete(f"{URL}/2", headers=as_node()).status_code == 200  # again: done already
    assert controller.provider.stopped == [("c", 2)]
    stored = store.get_cluster("c")
    assert stored is not None and stored.nodes[2].stopped and stored.nodes[2].pid is None
    assert stored.nodes[2].session_id is None and stored.worker_pids == ()
    assert [n["id"] for n in client.get(URL, headers=as_node()).json()["nodes"]] == [0, 1, 3]
    reasons = [event.reason for event in store.list_events(stored.service)]
    assert reasons.count("NodeAdded") == 1 and reasons.count("NodeRemoved") == 1


def test_a_node_token_opens_its_own_clusters_node_routes_only(world: Any) -> None:
    client, _, _ = world
    assert client.get(URL, headers=as_node()).status_code == 200
    assert client.get(URL, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200  # the admin's too
    assert client.get("/api/v1/clusters/other/nodes", headers=as_node()).status_code == 401
    assert client.get("/api/v1/services", headers=as_node()).status_code == 401
    assert client.post("/api/v1/shutdown", json={}, headers=as_node()).status_code == 401
    assert client.get(URL, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/api/v1/clusters/missing/nodes").status_code == 401
    assert client.get("/api/v1/clusters/missing/nodes", headers=as_node("missing")).status_code == 404


@pytest.mark.parametrize(
    "path",
    [URL + "\n", URL + "/1/tags/more", "/api/v1/clusters/c/nodesx", "/api/v1/clusters/c/../services", "/x" + URL],
)
def test_only_a_whole_node_route_names_a_cluster(path: str) -> None:
    assert node_route_cluster(URL) == node_route_cluster(URL + "/3") == node_route_cluster(URL + "/3/tags") == "c"
    assert node_route_cluster(path) is None


def test_a_release_a_crash_cut_short_is_finished_at_the_monitors_next_call(world: Any) -> None:
    client, store, controller = world
    stored = store.get_cluster("c")
    assert stored is not None
    # what a crash between the release's record and its stop leaves: stopped, its session held
    left = replace(stored.nodes[1], stopped=True, pid=None, session_id=91)
    store.update_cluster("c", nodes=(stored.nodes[0], left, *stored.nodes[2:]))
    assert [n["id"] for n in client.get(URL, headers=as_node()).json()["nodes"]] == [0]
    assert controller.provider.stopped == [("c", 1)]
    stored = store.get_cluster("c")
    assert stored is not None and stored.nodes[1].session_id is None and stored.nodes[1].stopped
    client.get(URL, headers=as_node())
    assert controller.provider.stopped == [("c", 1)], "stopped once"


def test_a_release_left_behind_that_resists_does_not_stop_the_monitors_calls(world: Any) -> None:
    client, store, controller = world
    stored = store.get_cluster("c")
    assert stored is not None
    left = replace(stored.nodes[1], stopped=True, pid=None, session_id=91)
    store.update_cluster("c", nodes=(stored.nodes[0], left, *stored.nodes[2:]))
    controller.provider.refuse = 1
    assert client.get(URL, headers=as_node()).status_code == 200  # the list is answered all the same
    stored = store.get_cluster("c")
    assert stored is not None and stored.nodes[1].session_id == 91, "kept: tried again at the next call"
    assert client.get(URL, headers=as_node()).status_code == 200
    assert controller.provider.stopped == [("c", 1)]


def test_tags_are_bounded_and_a_cluster_being_deleted_gets_no_node(world: Any) -> None:
    client, store, _ = world
    too_many = {f"k{i}": "v" for i in range(33)}
    assert client.post(f"{URL}/1/tags", json={"tags": too_many}, headers=as_node()).status_code == 422
    assert client.post(f"{URL}/1/tags", json={"tags": {"k": "v" * 1025}}, headers=as_node()).status_code == 422
    store.update_cluster("c", role=ClusterRole.DELETING)
    refused = client.post(URL, json={"type": "cpu", "count": 1}, headers=as_node())
    assert refused.status_code == 409 and "being deleted" in refused.json()["detail"]


def test_tags_are_kept_for_recorded_nodes_only(world: Any) -> None:
    client, store, _ = world
    assert client.post(f"{URL}/1/tags", json={"tags": {"ray-node-name": "w1"}}, headers=as_node()).status_code == 200
    assert client.post(f"{URL}/9/tags", json={"tags": {"a": "b"}}, headers=as_node()).status_code == 404
    stored = store.get_cluster("c")
    assert stored is not None
    store.update_cluster("c", nodes=(stored.nodes[0], replace(stored.nodes[1], stopped=True), *stored.nodes[2:]))
    assert [n["id"] for n in client.get(URL, headers=as_node()).json()["nodes"]] == [0]
    assert client.post(f"{URL}/1/tags", json={"tags": {"a": "b"}}, headers=as_node()).status_code == 404


def test_a_node_no_ports_are_left_for_is_reported_as_the_groups_shortfall(world: Any, monkeypatch: Any) -> None:
    client, store, controller = world
    tries: list[int] = []

    def exhausted(self: Any) -> NodePorts:
        tries.append(1)
        raise PortsExhausted("no free block of 90 ports found in 20000-32767")

    monkeypatch.setattr(PortAllocator, "node", exhausted)
    for _ in range(3):  # Ray's monitor asks again at every update: placed again only after a pause
        refused = client.post(URL, json={"type": "gpu", "count": 1}, headers=as_node())
        assert refused.status_code == 409 and "no ports for 1 more node(s) of c" in refused.json()["detail"]
    assert len(tries) == 1 and "refused at once" in refused.json()["detail"]
    [short] = [e for e in store.list_events("c") if e.reason == "InsufficientCapacity"]
    assert short.type == "Warning" and "worker group 'gpu' of c" in short.message and "20000-32767" in short.message
    pauses = []
    for _ in range(6):  # the pause doubles, up to 30 s
        controller.now += 31
        client.post(URL, json={"type": "gpu", "count": 1}, headers=as_node())
        at_once = client.post(URL, json={"type": "gpu", "count": 1}, headers=as_node()).json()["detail"]
        pauses.append(at_once.split("asked again within ")[1].split("s;")[0])
    assert len(tries) == 7 and pauses == ["4", "8", "16", "30", "30", "30"]
    monkeypatch.undo()
    controller.now += 31
    assert client.post(URL, json={"type": "gpu", "count": 1}, headers=as_node()).status_code == 200
    monkeypatch.setattr(PortAllocator, "node", exhausted)
    client.post(URL, json={"type": "gpu", "count": 1}, headers=as_node())  # short again after a success: news
    assert [e.reason for e in store.list_events("c")].count("InsufficientCapacity") == 2
    controller.now += 2.5  # and the pause starts again from its first length (2 s)
    client.post(URL, json={"type": "gpu", "count": 1}, headers=as_node())
    assert len(tries) == 9


def test_a_node_spawned_as_it_was_released_keeps_its_session_until_stopped(world: Any) -> None:
    """A start spawns a node while its release stops it (it had no process yet): the release must
    not forget the session the start recorded meanwhile, or the node's place and ports would be
    given away under a running process."""
    client, store, controller = world
    assert client.post(URL, json={"type": "cpu", "count": 1}, headers=as_node()).json() == {"ids": [2]}

    spawned = StopRecorder()

    async def start_records_a_session(cluster: ClusterRecord, index: int) -> None:
        current = store.get_cluster("c")
        assert current is not None
        nodes = tuple(replace(n, session_id=555) if n.node_id == 2 else n for n in current.nodes)
        store.update_cluster("c", nodes=nodes)
        await spawned.stop_node(cluster, index)

    controller.provider.stop_node = start_records_a_session  # type: ignore[method-assign]
    assert client.delete(f"{URL}/2", headers=as_node()).status_code == 200
    stored = store.get_cluster("c")
    assert stored is not None and (stored.nodes[2].stopped, stored.nodes[2].session_id) == (True, 555)

    controller.provider.stop_node = spawned.stop_node  # type: ignore[method-assign]
    client.get(URL, headers=as_node())  # the monitor's next call stops it, then forgets it
    stored = store.get_cluster("c")
    assert stored is not None and stored.nodes[2].session_id is None and spawned.stopped[-1] == ("c", 2)
    # its place given to the next node Ray asks for: a release of the old id again is done already
    assert client.post(URL, json={"type": "cpu", "count": 1}, headers=as_node()).json() == {"ids": [3]}
    stored = store.get_cluster("c")
    assert stored is not None and [n.node_id for n in stored.nodes] == [0, 1, 3]
    assert client.delete(f"{URL}/2", headers=as_node()).status_code == 200
    assert client.delete(f"{URL}/9", headers=as_node()).status_code == 409  # never given


def test_fewer_nodes_placed_than_asked_for_are_told_as_the_groups_shortfall(world: Any, monkeypatch: Any) -> None:
    client, store, controller = world

    async def one_fits(
        cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        return launch_here(cluster, config, group, 1, records)  # a pool places as many as fit

    monkeypatch.setattr(controller.provider, "launch_nodes", one_fits)
    answer = client.post(URL, json={"type": "gpu", "count": 2}, headers=as_node())
    assert answer.status_code == 200 and len(answer.json()["ids"]) == 1
    [short] = [e for e in store.list_events("c") if e.reason == "InsufficientCapacity"]
    assert "1 of 2 node(s) placed; the pool has no room for the rest now" in short.message
