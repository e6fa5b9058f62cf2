"""Placement of a cluster's nodes on a host pool: pure, table-driven."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekeeper.core.placement import HostRoom, NodeNeed, free_room, node_needs, place
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.spec import SpecError, parse_spec

GIB = 2**30


def config(**body: Any) -> RayClusterConfigSpec:
    return RayClusterConfigSpec.model_validate({"hostPool": "fleet", **body})


def rooms(*hosts: tuple[str, float, float, float]) -> dict[str, HostRoom]:
    return {name: HostRoom(name, cpus, gpus, int(memory * GIB)) for name, cpus, gpus, memory in hosts}


FLEET = rooms(("a", 4, 0, 8), ("b", 4, 0, 8), ("c", 4, 0, 8))


def test_head_first_then_workers_spread_one_per_host() -> None:
    shape = config(head={"numCpus": 1}, workerGroups=[{"name": "w", "replicas": 2, "numCpus": 1}])
    assert place(node_needs(shape), FLEET) == ["a", "b", "c"]


def test_a_pinned_head_and_the_room_other_clusters_take() -> None:
    shape = config(head={"numCpus": 2, "host": "c"}, workerGroups=[{"name": "w", "replicas": 2, "numCpus": 2}])
    taken = free_room(list(FLEET.values()), [("a", node_needs(shape)[0])])  # another cluster's 2-CPU node on a
    assert place(node_needs(shape), taken) == ["c", "b", "a"]


def test_what_does_not_fit_is_named_with_what_each_host_has_free() -> None:
    shape = config(head={"numCpus": 1}, workerGroups=[{"name": "gpu", "replicas": 1, "numCpus": 1, "numGpus": 1}])
    shortfall = place(node_needs(shape), FLEET)
    assert isinstance(shortfall, str)
    assert "worker node 1 (spec.rayClusterConfig.workerGroups.0: 1 CPU, 1 GPU" in shortfall
    assert "free: a 3 CPU/0 GPU/8.0 GiB, b 4 CPU" in shortfall  # the head already took one on a


def test_the_hosts_of_the_services_other_clusters_are_taken_last() -> None:
    """A standby (or an upgrade's new cluster) goes where the active is not, while room allows and
    its own nodes still spread: the loss of the active's host leaves its head standing."""
    shape = config(head={"numCpus": 1}, workerGroups=[{"name": "w", "replicas": 1, "numCpus": 1}])
    # Host a has the most room, yet the active runs there.
    pool = rooms(("a", 8, 0, 8), ("b", 2, 0, 8), ("c", 2, 0, 8))
    assert place(node_needs(shape), pool) == ["a", "b"]
    assert place(node_needs(shape), pool, avoid=frozenset({"a"})) == ["b", "c"]
    assert place(node_needs(shape), pool, avoid=frozenset({"a", "b"})) == ["c", "a"], "spread still comes first"
    assert place(node_needs(shape), rooms(("a", 8, 0, 8), ("b", 1, 0, 8)), avoid=frozenset({"a"})) == ["b", "a"]
    # A pin outranks the preference; the search (a pinned worker) keeps it too.
    pinned = config(head={"numCpus": 1, "host": "a"}, workerGroups=[{"name": "w", "replicas": 1, "numCpus": 1}])
    assert place(node_needs(pinned), pool, avoid=frozenset({"a", "b"})) == ["a", "c"]
    even = rooms(("a", 4, 0, 8), ("b", 4, 0, 8), ("c", 4, 0, 8))
    searched = config(head={"numCpus": 2}, workerGroups=[{"name": "w", "replicas": 1, "numCpus": 4, "host": "a"}])
    assert place(node_needs(searched), even) == ["b", "a"]
    assert place(node_needs(searched), even, avoid=frozenset({"b"})) == ["c", "a"]


def test_pinned_to_a_host_outside_the_pool() -> None:
    shortfall = place(node_needs(config(head={"host": "z"})), FLEET)
    assert isinstance(shortfall, str) and "pinned to host 'z', which is not in the pool" in shortfall


def test_an_unpinned_head_leaves_the_room_a_pinned_worker_needs() -> None:
    """Issue 19, defect 10: greedily the head took host a (most CPU free), then the worker pinned
    to a found no room, and apply refused a spec that fits (head on b, worker on a)."""
    pool = rooms(("a", 4, 0, 8), ("b", 2, 0, 8))
    shape = config(head={"numCpus": 2}, workerGroups=[{"name": "w", "replicas": 1, "numCpus": 4, "host": "a"}])
    assert place(node_needs(shape), pool) == ["b", "a"]


def test_a_placement_that_only_a_search_finds() -> None:
    """No pin at all: the head goes where most CPU is free (a), which leaves the GPU worker no
    host; the other way round fits."""
    pool = rooms(("a", 2, 1, 8), ("b", 2, 0, 8))
    shape = config(head={"numCpus": 1}, workerGroups=[{"name": "gpu", "replicas": 1, "numCpus": 2, "numGpus": 1}])
    assert place(node_needs(shape), pool) == ["b", "a"]


def test_when_nothing_fits_the_shortfall_still_names_what_is_short() -> None:
    pool = rooms(("a", 4, 0, 8), ("b", 2, 0, 8))
    shape = config(head={"numCpus": 2}, workerGroups=[{"name": "w", "replicas": 1, "numCpus": 5, "host": "a"}])
    shortfall = place(node_needs(shape), pool)
    assert isinstance(shortfall, str)
    assert "worker node 1 (spec.rayClusterConfig.workerGroups.0: 5 CPU, 0 GPU" in shortfall
    assert "free: a 2 CPU/0 GPU/8.0 GiB" in shortfall


# -- a property: a placement is found whenever one exists, and never overfills a host -----------

HOST_NAMES = ["h0", "h1", "h2", "h3"]


@st.composite
def pools_and_needs(draw: st.DrawFn) -> tuple[dict[str, HostRoom], list[NodeNeed]]:
    """1-4 hosts, 1-5 nodes, small whole resources: small enough to try every placement. Half
    the pools are cut to fit a placement drawn first (the hosts' room is what it puts there, plus
    a little): tight, so the order of placement matters often; the others are drawn freely."""
    count = draw(st.integers(1, 4))
    names = HOST_NAMES[:count]
    sizes = [
        (draw(st.integers(0, 4)), draw(st.sampled_from([0, 0, 1])), draw(st.integers(0, 3)))
        for _ in range(draw(st.integers(1, 5)))
    ]
    if draw(st.booleans()):
        planted = [draw(st.sampled_from(names)) for _ in sizes]
        pins = [draw(st.sampled_from([None, None, host])) for host in planted]
        pool = {}
        for name in names:
            here = [size for size, host in zip(sizes, planted, strict=True) if host == name]
            cpus, gpus, memory = (
                sum(column) + draw(st.integers(0, 1)) for column in zip((0, 0, 0), *here, strict=True)
            )
            pool[name] = HostRoom(name, cpus, gpus, memory * GIB)
    else:
        pins = [draw(st.sampled_from([None, None, None, *names, "elsewhere"])) for _ in sizes]
        pool = {
            name: HostRoom(name, draw(st.integers(0, 6)), draw(st.integers(0, 2)), draw(st.integers(0, 6)) * GIB)
            for name in names
        }
    needs = [
        NodeNeed(
            "spec.rayClusterConfig.head" if index == 0 else f"spec.rayClusterConfig.workerGroups.{index - 1}",
            "head" if index == 0 else "worker",
            cpus,
            gpus,
            memory * GIB,
            pin,
        )
        for index, ((cpus, gpus, memory), pin) in enumerate(zip(sizes, pins, strict=True))
    ]
    return pool, needs


def fits(pool: dict[str, HostRoom], needs: list[NodeNeed], hosts: list[str] | tuple[str, ...]) -> bool:
    """Every pin kept and no host given more than it has."""
    if any(need.pinned is not None and need.pinned != host for need, host in zip(needs, hosts, strict=True)):
        return False
    for name, room in pool.items():
        mine = [need for need, host in zip(needs, hosts, strict=True) if host == name]
        if (
            sum(need.cpus for need in mine) > room.cpus
            or sum(need.gpus for need in mine) > room.gpus
            or sum(need.memory_bytes for need in mine) > room.memory_bytes
        ):
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(pools_and_needs())
def test_a_placement_is_found_whenever_one_exists_and_never_overfills(
    case: tuple[dict[str, HostRoom], list[NodeNeed]],
) -> None:
    pool, needs = case
    exists = any(fits(pool, needs, hosts) for hosts in itertools.product(sorted(pool), repeat=len(needs)))
    placed = place(needs, pool)
    if isinstance(placed, str):
        assert not exists, f"a placement exists, place() said: {placed}"
    else:
        assert len(placed) == len(needs) and fits(pool, needs, placed)


@settings(max_examples=200, deadline=None)
@given(pools_and_needs())
def test_one_node_per_host_is_found_whenever_it_exists(case: tuple[dict[str, HostRoom], list[NodeNeed]]) -> None:
    pool, needs = case
    exists = any(
        len(set(hosts)) == len(hosts) and fits(pool, needs, hosts)
        for hosts in itertools.permutations(sorted(pool), len(needs))
    )
    placed = place(needs, pool, one_per_host=True)
    if isinstance(placed, str):
        assert not exists, f"a placement exists, place() said: {placed}"
    else:
        assert len(set(placed)) == len(needs) and fits(pool, needs, placed)


def test_an_autoscaled_pool_cluster_gets_a_host_per_node() -> None:
    """Each node runs Serve's proxy on the cluster's ports: two on one host could not both bind them."""
    shape = config(
        head={"numCpus": 1},
        enableInTreeAutoscaling=True,
        workerGroups=[{"name": "w", "replicas": 3, "minReplicas": 0, "maxReplicas": 4, "numCpus": 1}],
    )
    short = place(node_needs(shape), FLEET, one_per_host=True)
    assert isinstance(short, str) and "(a, b, c run a node of it already: one per host)" in short
    assert place(node_needs(shape), FLEET) == ["a", "b", "c", "a"]  # without the rule: two on a
    # the greedy pass takes the roomiest host first; only the search finds the 2-CPU node a host
    big_small = rooms(("a", 2, 0, 8), ("b", 1, 0, 8))
    needs = [NodeNeed("x", "worker", 1, 0, 0, None), NodeNeed("y", "worker", 2, 0, 0, None)]
    assert place(needs, big_small, one_per_host=True) == ["b", "a"]


def test_a_host_without_a_pool_is_refused_by_field() -> None:
    document = {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": "svc"},
        "spec": {
            "ingress": {"port": 8000},
            "rayClusterConfig": {"head": {"host": "a"}},
            "serveConfig": {"applications": [{"import_path": "a:b"}]},
        },
    }
    with pytest.raises(SpecError) as raised:
        parse_spec(document)
    assert any("set hostPool too" in problem for problem in raised.value.problems)


def test_the_pool_fields_keep_a_local_cluster_hash_unchanged() -> None:
    """A stored local spec must hash as before hostPool/host existed: an upgrade of servekeeper
    never replaces a running cluster. The value is the one computed by the code before them."""
    spec = parse_spec(
        {
            "apiVersion": "servekeeper/v1alpha1",
            "kind": "RayService",
            "metadata": {"name": "svc"},
            "spec": {
                "ingress": {"port": 8000},
                "rayClusterConfig": {"head": {"numCpus": 1}, "workerGroups": [{"name": "w", "replicas": 2}]},
                "serveConfig": {"applications": [{"import_path": "a:b"}]},
            },
        }
    )
    assert spec.cluster_spec_hash() == "3d18af51aef7cac4"
