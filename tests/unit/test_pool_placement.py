"""Placement of a cluster's nodes on a host pool: pure, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from servekeeper.core.placement import HostRoom, free_room, node_needs, place
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


def test_pinned_to_a_host_outside_the_pool() -> None:
    shortfall = place(node_needs(config(head={"host": "z"})), FLEET)
    assert isinstance(shortfall, str) and "pinned to host 'z', which is not in the pool" in shortfall


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
