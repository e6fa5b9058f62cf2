"""Node autoscaling (issue 22), its pure part: the spec's bounds under KubeRay's names, refused
by field when they cannot hold, hashed as absent while unset; and the config Ray's monitor reads,
in the shape the spike ran on Ray 2.60 (../shared/DESIGN.md)."""

from __future__ import annotations

import copy
import itertools
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from servekeeper.commands.nodes import node_token
from servekeeper.core.planner.workers import expected_workers, released_between
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, NodePorts
from servekeeper.model.spec import SpecError, parse_spec
from servekeeper.providers.autoscaling import (
    NODE_ID_RESOURCE,
    NodeRequestRefused,
    autoscaling_config,
    launched,
    node_id_resource,
    releasable,
    scaled_like,
)
from servekeeper.providers.base import launched_into
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.local_monitor import NodeApi, monitor_files, point_monitors_at
from servekeeper.providers.local_nodes import (
    NODE_TAG_ENV,
    head_command,
    log_name,
    log_names,
    node_tag,
    placed_nodes,
    worker_command,
    worker_group_of,
)
from servekeeper.providers.local_processes import OWNER_ENV, unrecorded_leader
from servekeeper.providers.ports import PortAllocator, PortsExhausted
from servekeeper.providers.ray_start import with_node_id
from servekeeper.testing.harness import wait_until
from servekeeper.views.service import worker_group_views
from tests.unit.test_kuberay_export import roundtrip
from tests.unit.test_kuberay_import import head, minimal, notes, run_import
from tests.unit.test_pool_clusters import draft
from tests.unit.test_spec import VALID


def document(config: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(VALID)
    changed["spec"]["rayClusterConfig"].update(config)
    return changed


AUTOSCALED = {
    "enableInTreeAutoscaling": True,
    "autoscalerOptions": {"idleTimeoutSeconds": 30, "upscalingMode": "Conservative"},
    "head": {"numCpus": 0},
    "workerGroups": [
        {"name": "cpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 3, "numCpus": 1},
        {"name": "gpu", "replicas": 0, "maxReplicas": 2, "numCpus": 4, "numGpus": 1, "memory": 2**30},
    ],
}


def problems_of(config: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as raised:
        parse_spec(document(config))
    return "\n".join(raised.value.problems)


def test_bounds_are_kuberays_names_and_default_to_replicas() -> None:
    config = parse_spec(document(AUTOSCALED)).spec.rayClusterConfig
    cpu, gpu = config.workerGroups
    assert (cpu.min_nodes(), cpu.replicas, cpu.max_nodes()) == (0, 1, 3)
    assert (gpu.min_nodes(), gpu.replicas, gpu.max_nodes()) == (0, 0, 2)  # minReplicas unset: replicas
    fixed = parse_spec(VALID).spec.rayClusterConfig.workerGroups[0]
    assert (fixed.min_nodes(), fixed.max_nodes()) == (1, 1)


def test_replicas_outside_the_bounds_are_refused_naming_the_group() -> None:
    group = {"name": "cpu", "replicas": 4, "minReplicas": 0, "maxReplicas": 3}
    problem = problems_of({"enableInTreeAutoscaling": True, "workerGroups": [group]})
    assert "workerGroups.0" in problem and "replicas (4) must lie within minReplicas (0) and maxReplicas (3)" in problem


def test_autoscaling_on_a_host_pool_is_accepted() -> None:
    group = {"name": "cpu", "replicas": 0, "minReplicas": 0, "maxReplicas": 3}
    spec = {"enableInTreeAutoscaling": True, "hostPool": "fleet", "workerGroups": [group]}
    config = RayClusterConfigSpec.model_validate({"head": {"numCpus": 1}, **spec})
    assert config.hostPool == "fleet" and config.workerGroups[0].max_nodes() == 3


def test_bounds_or_options_without_the_autoscaler_are_refused() -> None:
    group = {"name": "cpu", "replicas": 1, "maxReplicas": 3}
    assert "needs enableInTreeAutoscaling: true" in problems_of({"workerGroups": [group]})
    options = {"autoscalerOptions": {"idleTimeoutSeconds": 5}}
    assert "autoscalerOptions needs enableInTreeAutoscaling: true" in problems_of(options)
    assert "minReplicas (3) exceeds maxReplicas (2)" in problems_of(
        {**AUTOSCALED, "workerGroups": [{"name": "cpu", "minReplicas": 3, "maxReplicas": 2}]}
    )
    # bounds without a starting count start at minReplicas, as KubeRay does
    for bounds, start in (({"minReplicas": 2, "maxReplicas": 4}, 2), ({"maxReplicas": 3}, 1), ({"minReplicas": 0}, 0)):
        group = {"name": "cpu", **bounds}
        if "maxReplicas" not in bounds:
            group["maxReplicas"] = 5
        parsed = parse_spec(document({**AUTOSCALED, "workerGroups": [group]})).spec.rayClusterConfig
        assert parsed.workerGroups[0].replicas == start, bounds
    # equal bounds say what replicas says: KubeRay's export writes them so
    pinned = {"name": "cpu", "replicas": 2, "minReplicas": 2, "maxReplicas": 2}
    assert parse_spec(document({"workerGroups": [pinned]})).spec.rayClusterConfig.worker_count() == 2


def test_unset_autoscaling_fields_keep_a_stored_specs_hash() -> None:
    # the value main computes for VALID, before these fields existed (test_pool_placement pins another)
    before = "666c10800a9e85e5"
    assert parse_spec(VALID).cluster_spec_hash() == before
    explicit = {"enableInTreeAutoscaling": False, "autoscalerOptions": None}
    explicit["workerGroups"] = [{"name": "cpu", "replicas": 1, "numCpus": 1, "minReplicas": None, "maxReplicas": None}]
    assert parse_spec(document(explicit)).cluster_spec_hash() == before, "explicit defaults are the defaults"
    on = parse_spec(document({"enableInTreeAutoscaling": True})).cluster_spec_hash()
    assert on != before


def test_the_monitors_config_has_each_group_as_a_node_type_within_its_bounds() -> None:
    config = parse_spec(document(AUTOSCALED)).spec.rayClusterConfig
    rendered = autoscaling_config("svc-g1-abc", config, {"module": "servekeeper_node_provider.NodeProvider"})
    assert rendered["cluster_name"] == "svc-g1-abc"
    assert rendered["max_workers"] == 5
    assert rendered["idle_timeout_minutes"] == 0.5
    assert rendered["upscaling_speed"] == 1.0  # Conservative, as KubeRay translates it
    assert rendered["provider"] == {
        "module": "servekeeper_node_provider.NodeProvider",
        "type": "external",
        "use_node_id_as_ip": True,  # every node of one machine has the same address
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    }
    types = rendered["available_node_types"]
    assert rendered["head_node_type"] == "ray.head.default"  # no worker group (a DNS label) can take it
    assert types["ray.head.default"] == {
        "resources": {"CPU": 0, NODE_ID_RESOURCE: 1},  # the id plus one: Ray drops a resource of 0
        "node_config": {},
        "max_workers": 0,
    }
    assert types["cpu"] == {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 3}
    assert types["gpu"]["resources"] == {"CPU": 4, "GPU": 1, "memory": 2**30}
    assert (types["gpu"]["min_workers"], types["gpu"]["max_workers"]) == (0, 2)
    assert rendered["setup_commands"] == [] and rendered["auth"] == {}  # the schema's, unused


def test_default_options_are_kuberays() -> None:
    config = parse_spec(document({"enableInTreeAutoscaling": True})).spec.rayClusterConfig
    rendered = autoscaling_config("c", config, {})
    assert rendered["idle_timeout_minutes"] == 1.0 and rendered["upscaling_speed"] == 1000.0
    assert node_id_resource(7) == {NODE_ID_RESOURCE: 8}  # never 0, which Ray drops (the head's id is 0)


# -- KubeRay's names, imported unchanged --------------------------------------------------------

WORKER_PATH = "spec.rayClusterConfig.workerGroupSpecs[0]"


def kuberay_with_workers(**fields: Any) -> dict[str, Any]:
    manifest = minimal()
    worker = copy.deepcopy(head(manifest))
    worker.update({"groupName": "cpu", **fields})
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"] = [worker]
    return manifest


def test_kuberay_autoscaling_is_imported_with_its_bounds_and_options() -> None:
    manifest = kuberay_with_workers(replicas=1, minReplicas=0, maxReplicas=4)
    options = {"idleTimeoutSeconds": 30, "upscalingMode": "Conservative", "image": "rayproject/ray:2.52.0"}
    manifest["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling=True, autoscalerOptions=options)
    result = run_import([manifest])
    config = result.spec.spec.rayClusterConfig
    assert config.enableInTreeAutoscaling is True
    assert config.autoscalerOptions is not None
    assert (config.autoscalerOptions.idleTimeoutSeconds, config.autoscalerOptions.upscalingMode) == (30, "Conservative")
    (group,) = config.workerGroups
    assert (group.minReplicas, group.replicas, group.maxReplicas) == (0, 1, 4)
    # the autoscaler's container options do not apply: it runs on the head
    assert notes(result) == {("ignored", "spec.rayClusterConfig.autoscalerOptions.image")}


def test_kuberay_replicas_outside_the_bounds_are_kept_within_them_as_kuberay_does() -> None:
    manifest = kuberay_with_workers(replicas=9, minReplicas=1, maxReplicas=3)
    manifest["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = True
    result = run_import([manifest])
    (group,) = result.spec.spec.rayClusterConfig.workerGroups
    assert (group.minReplicas, group.replicas, group.maxReplicas) == (1, 3, 3)
    assert ("changed", f"{WORKER_PATH}.replicas") in notes(result)


def test_an_absent_kuberay_max_is_bounded_by_the_starting_count_and_noted() -> None:
    manifest = kuberay_with_workers(replicas=2, minReplicas=1)
    manifest["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = True
    result = run_import([manifest])
    (group,) = result.spec.spec.rayClusterConfig.workerGroups
    assert (group.minReplicas, group.replicas, group.maxReplicas) == (1, 2, 2)
    assert ("changed", f"{WORKER_PATH}.maxReplicas") in notes(result)


def test_kuberay_bounds_without_autoscaling_give_fixed_nodes_as_before() -> None:
    result = run_import([kuberay_with_workers(replicas=1, minReplicas=2, maxReplicas=5)])
    (group,) = result.spec.spec.rayClusterConfig.workerGroups
    assert (group.replicas, group.minReplicas, group.maxReplicas) == (2, None, None)
    assert ("ignored", f"{WORKER_PATH}.maxReplicas") in notes(result)


def test_autoscaling_round_trips_through_a_kuberay_manifest_valid_for_its_crd() -> None:
    spec = parse_spec(document(AUTOSCALED))  # the gpu group's minReplicas unset: stored as its count, 0
    assert [g.minReplicas for g in spec.spec.rayClusterConfig.workerGroups] == [0, 0]
    text, back = roundtrip(spec)  # validated against KubeRay's CRD on the way
    assert back == spec and back.cluster_spec_hash() == spec.cluster_spec_hash(), "no new cluster for a round trip"
    cluster = yaml.safe_load(text)["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"] == {"idleTimeoutSeconds": 30, "upscalingMode": "Conservative"}
    bounds = [(g["minReplicas"], g["replicas"], g["maxReplicas"]) for g in cluster["workerGroupSpecs"]]
    assert bounds == [(0, 1, 3), (0, 0, 2)]


# -- nodes asked for and released by Ray's autoscaler, as records ------------------------------


_PORT_BLOCKS = itertools.count(40_000, 100)


def new_ports() -> NodePorts:
    """Node ports no other call gave (the allocator's stand-in: no port is probed)."""
    base = next(_PORT_BLOCKS)
    return NodePorts(base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 10, base + 99)


def autoscaled_cluster() -> tuple[ClusterRecord, RayClusterConfigSpec]:
    config = parse_spec(document(AUTOSCALED)).spec.rayClusterConfig
    cluster = draft("c", config).with_changes(ports=PortAllocator().cluster(worker_nodes=config.worker_count()))
    return cluster.with_changes(nodes=placed_nodes(cluster, config)), config


def test_a_cluster_holds_ports_for_the_nodes_it_starts_with_not_its_maximum() -> None:
    cluster, config = autoscaled_cluster()
    assert len(cluster.ports.node_ports) == 1 + 1  # the head and its one cpu replica; maxReplicas 3 + 2
    assert [(n.role, n.group, n.node_id) for n in cluster.nodes] == [("head", None, 0), ("worker", "cpu", 1)]


def test_launched_nodes_are_recorded_unstarted_on_new_ports_it_then_holds_with_fresh_ids() -> None:
    cluster, config = autoscaled_cluster()
    cluster, ids = launched(cluster, config, "cpu", 2, new_ports)
    assert ids == [2, 3]
    added = cluster.nodes[-2:]
    assert all(n.pid is None and n.group == "cpu" and n.role == "worker" for n in added)
    assert len({n.ports for n in cluster.nodes}) == 4  # no two nodes on the same ports
    assert cluster.ports.node_ports[2:] == tuple(n.ports for n in added)  # held: no other cluster takes them

    def exhausted() -> NodePorts:
        raise PortsExhausted("no free block of 90 ports found in 20000-32767")

    with pytest.raises(NodeRequestRefused, match="no ports for 1 more node"):
        launched(cluster, config, "gpu", 1, exhausted)
    with pytest.raises(NodeRequestRefused, match=r"3 node\(s\) and 1 more exceed its maxReplicas \(3\)"):
        launched(cluster, config, "cpu", 1, new_ports)
    with pytest.raises(NodeRequestRefused, match="no worker group 'tpu'"):
        launched(cluster, config, "tpu", 1, new_ports)

    # a released node's id is never given again; its ports and its place in the record are, once
    # its process is gone (no session left): the record does not grow with every launch
    index = releasable(cluster, 2)
    nodes = list(cluster.nodes)
    released = nodes[index] = replace(nodes[index], stopped=True, session_id=77)  # its stop under way
    cluster = cluster.with_changes(nodes=tuple(nodes))
    cluster, ids = launched(cluster, config, "cpu", 1, new_ports)  # its ports still held by its process
    assert ids == [4] and cluster.nodes[-1].ports != released.ports
    assert cluster.nodes[index] == released and len(cluster.nodes) == 5  # its place still taken
    nodes = list(cluster.nodes)
    nodes[index] = replace(released, session_id=None)  # stopped for good
    nodes[-1] = replace(nodes[-1], stopped=True)  # id 4 released before it ever started
    cluster = cluster.with_changes(nodes=tuple(nodes))
    held = cluster.ports
    cluster, ids = launched(cluster, config, "cpu", 1, exhausted)  # no new port needed
    assert ids == [5] and [n.node_id for n in cluster.nodes] == [0, 1, 5, 3, 4]
    assert cluster.nodes[2].log == "worker-cpu-id5.log" and cluster.nodes[2].ports == released.ports
    cluster, ids = launched(cluster, config, "gpu", 1, exhausted)  # id 4's ports
    assert ids == [6] and [n.node_id for n in cluster.nodes] == [0, 1, 5, 3, 6], "both places reused"
    assert cluster.ports == held
    cluster = cluster.with_changes(nodes=(*cluster.nodes[:4], replace(cluster.nodes[4], stopped=True)))
    cluster, ids = launched(cluster, config, "gpu", 1, exhausted)
    assert ids == [7] and len(cluster.nodes) == 5, "above every id recorded, even when the highest's place is reused"


def test_only_a_running_worker_of_the_cluster_is_released() -> None:
    cluster, _ = autoscaled_cluster()
    with pytest.raises(NodeRequestRefused, match="is the head"):
        releasable(cluster, 0)
    with pytest.raises(NodeRequestRefused, match="has no running node 9"):
        releasable(cluster, 9)
    assert releasable(cluster, 1) == 1


def test_a_launched_node_starts_on_its_own_ports_in_its_group_with_a_log_named_by_its_id() -> None:
    cluster, config = autoscaled_cluster()
    cluster, (node_id,) = launched(cluster, config, "cpu", 1, new_ports)
    index = len(cluster.nodes) - 1
    node = cluster.nodes[index]
    assert worker_group_of(config, node, index).name == "cpu"
    assert log_name(config, node, index) == f"worker-cpu-id{node_id}.log"
    assert node_tag(cluster, index).endswith(f"worker-cpu-id{node_id}.log")
    assert log_name(config, cluster.nodes[1], 1) == "worker-cpu-0.log"  # a listed node keeps its name
    argv = worker_command(cluster, node, worker_group_of(config, node, index), "ray")
    assert f"--node-manager-port={node.ports.node_manager}" in argv
    # a row written before nodes kept their group: its group by its place in the spec
    legacy = replace(cluster.nodes[1], group=None, node_id=None)
    assert worker_group_of(config, legacy, 1).name == "cpu"


def test_an_autoscaled_clusters_nodes_carry_their_id_beside_the_users_resources() -> None:
    assert with_node_id({"resources": '{"custom": 2}'}, 3) == {"resources": '{"NODE_ID_AS_RESOURCE":4,"custom":2}'}
    assert with_node_id({"resources": '{\\"custom\\": 2}'}, 3)["resources"] == '{"NODE_ID_AS_RESOURCE":4,"custom":2}'
    assert with_node_id({"num-cpus": 1}, None) == {"num-cpus": 1}  # not autoscaled: unchanged
    kuberay_quoted = '"{\\"custom\\": 2}"'  # a JSON string holding the object, as a shell would see it
    assert with_node_id({"resources": kuberay_quoted}, 3)["resources"] == '{"NODE_ID_AS_RESOURCE":4,"custom":2}'
    with pytest.raises(ValueError, match="must be a JSON object of names to numbers"):
        with_node_id({"resources": "lots"}, 1)
    cluster, config = autoscaled_cluster()
    head_argv = head_command(cluster, config.head, "ray", autoscaled=True)
    assert '--resources={"NODE_ID_AS_RESOURCE":1}' in head_argv
    worker = cluster.nodes[1]
    argv = worker_command(cluster, worker, worker_group_of(config, worker, 1), "ray", autoscaled=True)
    assert '--resources={"NODE_ID_AS_RESOURCE":2}' in argv
    assert not any(arg.startswith("--resources") for arg in head_command(cluster, config.head, "ray"))


def test_nodes_asked_for_during_a_start_survive_it_and_count_as_expected() -> None:
    cluster, config = autoscaled_cluster()
    start_began = cluster
    started = [replace(node, pid=100 + i, session_id=100 + i) for i, node in enumerate(cluster.nodes)]
    asked, _ = launched(cluster, config, "cpu", 1, new_ports)  # recorded while that start ran
    merged = launched_into(asked, start_began, started)
    assert [node.pid for node in merged.nodes] == [100, 101, None]  # the asked-for node kept, unstarted
    assert merged.worker_pids == (101,)
    assert expected_workers(merged) == 2  # so the next tick starts it (StartCluster)
    released = merged.with_changes(nodes=(*merged.nodes[:2], replace(merged.nodes[2], stopped=True)))
    assert expected_workers(released) == 1
    # a node released while a start spawned it stays released, holding what was spawned (its
    # session, stopped by the node API's next call), never running unrecorded
    relaunched = [*merged.nodes[:2], replace(merged.nodes[2], pid=300, session_id=300)]
    kept = launched_into(released, merged, relaunched).nodes[2]
    assert (kept.stopped, kept.pid, kept.session_id) == (True, None, 300)
    # released before its process ever ran, its place given to a node Ray asked for since: what
    # the start spawned for it is recorded again at the end, stopped, holding its session
    gone = released.with_changes(nodes=(*released.nodes[:2], replace(released.nodes[2], session_id=None)))
    reused, (new_id,) = launched(gone, config, "cpu", 1, new_ports)
    after = launched_into(reused, merged, relaunched)
    assert [(n.node_id, n.pid, n.stopped, n.session_id) for n in after.nodes[2:]] == [
        (new_id, None, False, None),
        (merged.nodes[2].node_id, None, True, 300),
    ]
    assert launched_into(after, merged, relaunched).nodes == after.nodes, "the same start's next record adds none"


async def test_a_released_local_node_gets_sigterm_and_its_leftovers_go_the_other_nodes_stay(tmp_path: Path) -> None:
    cluster, config = autoscaled_cluster()
    cluster, _ = launched(cluster, config, "cpu", 1, new_ports)
    cluster = cluster.with_changes(log_dir=str(tmp_path), temp_dir=str(tmp_path / "temp"))
    # a node's `ray start` leads its session and carries the cluster's owner tag and its own node tag
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]

    def node(index: int) -> subprocess.Popen[bytes]:
        tags = {OWNER_ENV: cluster.log_dir, NODE_TAG_ENV: node_tag(cluster, index)}
        return subprocess.Popen(sleep, env={**os.environ, **tags}, start_new_session=True)

    kept, released = node(1), node(2)
    nodes = list(cluster.nodes)
    for index, process in ((1, kept), (2, released)):
        nodes[index] = replace(nodes[index], pid=process.pid, session_id=process.pid)
    cluster = cluster.with_changes(nodes=tuple(nodes))
    try:
        await LocalProvider().stop_node(cluster, 2)
        assert released.wait(5) == -signal.SIGTERM  # asked first: it exits on its own
        assert kept.poll() is None, "another node is never touched"
    finally:
        for process in (kept, released):
            process.kill()
            process.wait()


def test_a_new_cluster_starts_at_the_node_count_the_active_has_now_within_bounds() -> None:
    active, config = autoscaled_cluster()
    active, _ = launched(active, config, "cpu", 2, new_ports)  # scaled out to 3 cpu nodes
    active = active.with_changes(role=ClusterRole.ACTIVE)
    other_service = active.with_changes(name="x", service="other")
    scaled = scaled_like(config, active.service, [other_service, active])
    assert [(g.name, g.replicas) for g in scaled.workerGroups] == [("cpu", 3), ("gpu", 0)]
    assert scaled_like(config, "other-service", [active]) is config  # no active of its own
    fixed = parse_spec(VALID).spec.rayClusterConfig
    assert scaled_like(fixed, active.service, [active]) is fixed  # not autoscaled: as declared
    legacy = active.with_changes(nodes=tuple(replace(n, group=None) for n in active.nodes))
    assert scaled_like(config, active.service, [legacy]) is config


def test_the_heads_monitor_gets_the_module_its_config_and_a_private_token(tmp_path: Path) -> None:
    cluster, config = autoscaled_cluster()
    cluster = cluster.with_changes(log_dir=str(tmp_path / "c"))
    head = config.head.model_copy(update={"env": {"PYTHONPATH": "/srv/mine"}})
    config = config.model_copy(update={"head": head})
    flags, env = monitor_files(cluster, config, NodeApi("http://127.0.0.1:9999", "daemon-secret"))
    folder = tmp_path / "c" / "autoscaler"
    assert flags == [f"--autoscaling-config={folder / 'autoscaling.json'}"]
    assert env["PYTHONPATH"] == f"{folder}:/srv/mine"  # ahead of the user's own, not instead
    token = folder / "node-token"
    assert token.read_text() == node_token("daemon-secret", cluster.name) and token.stat().st_mode & 0o077 == 0
    provider = json.loads((folder / "autoscaling.json").read_text())["provider"]
    assert provider["token_file"] == str(token) and "daemon-secret" not in json.dumps(provider)
    assert (folder / "servekeeper_node_provider.py").exists()
    assert (folder / "node-api-url").read_text() == "http://127.0.0.1:9999"
    # the daemon comes back on another port: every monitor is pointed at it (read at each call)
    point_monitors_at(NodeApi("http://127.0.0.1:8888", "daemon-secret"), [cluster])
    assert (folder / "node-api-url").read_text() == "http://127.0.0.1:8888"


def test_each_group_shows_running_and_asked_for_nodes_within_its_bounds() -> None:
    cluster, config = autoscaled_cluster()
    cluster, _ = launched(cluster, config, "cpu", 2, new_ports)  # asked for, not started yet
    nodes = list(cluster.nodes)
    nodes[1] = replace(nodes[1], pid=4242)  # the starting worker runs
    nodes[2] = replace(nodes[2], stopped=True)  # one launched node released again
    cluster = cluster.with_changes(nodes=tuple(nodes))
    groups = {group["name"]: group for group in worker_group_views(cluster, config)}
    assert groups["cpu"] == {"name": "cpu", "nodes": 1, "desired": 2, "minNodes": 0, "maxNodes": 3, "autoscaled": True}
    assert (groups["gpu"]["nodes"], groups["gpu"]["desired"], groups["gpu"]["maxNodes"]) == (0, 0, 2)
    fixed = config.model_copy(update={"enableInTreeAutoscaling": False})
    assert [(g["minNodes"], g["maxNodes"], g["autoscaled"]) for g in worker_group_views(cluster, fixed)] == [
        (1, 1, False),
        (0, 0, False),
    ]
    assert worker_group_views(cluster, None) == []
    # nodes without a group (a pool's, or rows written before nodes kept one): by their place
    fixed_two = fixed.model_copy(update={"workerGroups": [fixed.workerGroups[0].model_copy(update={"replicas": 2})]})
    ungrouped = cluster.with_changes(nodes=tuple(replace(node, group=None) for node in cluster.nodes[:3]))
    (cpu,) = worker_group_views(ungrouped, fixed_two)
    assert (cpu["nodes"], cpu["desired"]) == (1, 1)  # node 2 is stopped


def test_a_groups_custom_resources_are_offered_to_rays_monitor_and_bad_ones_refused_at_apply() -> None:
    """Ray launches a node of a group only for demand its resources meet: a group's own custom
    resources must be in its node type, or a replica needing them waits forever."""
    groups = [
        {"name": "acc", "replicas": 0, "maxReplicas": 2, "numCpus": 1, "rayStartParams": {"resources": '{"acc": 1}'}}
    ]
    config = parse_spec(document({**AUTOSCALED, "workerGroups": groups})).spec.rayClusterConfig
    node_types = autoscaling_config("c", config, {})["available_node_types"]
    assert node_types["acc"]["resources"] == {"acc": 1, "CPU": 1}
    bad = {**AUTOSCALED, "workerGroups": [{**groups[0], "rayStartParams": {"resources": "lots"}}]}
    problem = problems_of(bad)
    assert "workerGroups.0.rayStartParams" in problem and "JSON object of names to numbers" in problem, problem
    assert "head.rayStartParams" in problems_of({"head": {"rayStartParams": {"resources": '{"a": -1}'}}})


def test_a_release_between_two_reads_is_told_apart_from_a_worker_death() -> None:
    cluster, config = autoscaled_cluster()
    cluster, _ = launched(cluster, config, "cpu", 1, new_ports)
    released = cluster.with_changes(nodes=(*cluster.nodes[:2], replace(cluster.nodes[2], stopped=True, pid=None)))
    assert released_between([cluster], [released])  # the tick's observation is stale: look again
    assert not released_between([released], [released])
    assert not released_between([released, released.with_changes(name="old")], [released])  # a cluster gone
    grown, _ = launched(cluster, config, "cpu", 1, new_ports)
    assert not released_between([cluster], [grown]), "a launch is no release"
    # released, then its place given to a node Ray asked for since, between the two reads
    gone = released.with_changes(nodes=(*released.nodes[:2], replace(released.nodes[2], session_id=None)))
    reused, _ = launched(gone, config, "cpu", 1, new_ports)
    assert len(reused.nodes) == len(cluster.nodes) and released_between([cluster], [reused])


def test_an_unrecorded_ray_start_of_a_node_is_found_by_its_tag_and_nothing_else_is(tmp_path: Path) -> None:
    """What a controller killed between a node's spawn and its record leaves: its `ray start`,
    leading its session, tagged with the node. A tagged process that leads no session (a raylet
    left behind) or names another temp dir is no node to adopt; nor are two of them."""
    tag, temp_dir = str(tmp_path / "worker-cpu-id3.log"), str(tmp_path / "temp")
    script = "import time; time.sleep(60)"

    def spawn(argv_temp_dir: str, leader: bool) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", script, "start", f"--temp-dir={argv_temp_dir}"]
        return subprocess.Popen(argv, env={**os.environ, NODE_TAG_ENV: tag}, start_new_session=leader)

    left_behind, elsewhere = spawn(temp_dir, leader=False), spawn("/tmp/other", leader=True)
    try:
        assert unrecorded_leader(tag, temp_dir) is None
        node = spawn(temp_dir, leader=True)
        try:
            assert unrecorded_leader(tag, temp_dir) == node.pid
            assert unrecorded_leader(tag + ".other", temp_dir) is None
            twin = spawn(temp_dir, leader=True)  # two: neither is adopted, the start stops both by the tag
            wait_until(lambda: unrecorded_leader(tag, temp_dir) is None, 10, "the twin seen")
            twin.kill()
            twin.wait()
        finally:
            node.kill()
            node.wait()
    finally:
        for process in (left_behind, elsewhere):
            process.kill()
            process.wait()


def test_a_node_keeps_the_log_name_it_was_placed_with_whatever_the_spec_says_later() -> None:
    cluster, config = autoscaled_cluster()
    assert [n.log for n in cluster.nodes] == ["head.log", "worker-cpu-0.log"]
    gpu_first = [config.workerGroups[1].model_copy(update={"replicas": 1}), config.workerGroups[0]]
    more = config.model_copy(update={"workerGroups": gpu_first})
    assert log_names(more)[1] == "worker-gpu-0.log"  # by place, it would be gpu's now
    assert log_name(more, cluster.nodes[1], 1) == "worker-cpu-0.log"
    older = replace(cluster.nodes[1], log=None)  # a row written before names were kept: by place
    assert log_name(config, older, 1) == "worker-cpu-0.log"
