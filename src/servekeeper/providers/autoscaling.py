"""Ray's own autoscaler for a cluster (issue 22): the config its monitor reads on the head.

Ray decides; servekeeper provides the nodes. The head is started with `--autoscaling-config`
naming this config, whose provider is servekeeper's node provider module (`type: external`): the
monitor asks it for nodes, and it asks the controller, which places and starts them like any node.

Every node of a cluster on one machine has the same address, so nodes are told apart as Ray on
Spark does (`use_node_id_as_ip`): each is started with a custom resource holding its node id,
which Ray's monitor reads to map a Ray node to the provider's (measured on Ray 2.60:
../shared/DESIGN.md, "Node autoscaling on one machine"). A cluster on a host pool is addressed the
same way, so one provider serves both.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from servekeeper.model.cluster_spec import AutoscalerOptionsSpec, HeadGroupSpec, RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, NodePlacement, NodePorts
from servekeeper.model.start_params import custom_resources
from servekeeper.providers.base import ClusterRecords
from servekeeper.providers.local_nodes import LOCAL_HOST, launched_log_name
from servekeeper.providers.ports import PortAllocator, PortsExhausted
from servekeeper.providers.ray_start import NODE_ID_RESOURCE, node_id_value

# Ray on Spark's name for the head's type: no worker group can take it (a group name is a DNS label).
HEAD_NODE_TYPE = "ray.head.default"
HEAD_NODE_ID = 0
# What Ray's v1 config schema requires of every cluster config, though none of it applies to
# nodes that servekeeper starts (the keys of Ray's own autoscaler/spark/defaults.yaml).
UNUSED_SECTIONS: dict[str, Any] = {
    "auth": {},
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}
# KubeRay's translation of upscalingMode (ray/autoscaler/_private/kuberay/autoscaling_config.py):
# Conservative keeps the pending nodes at most the cluster's size; the others do not limit.
UPSCALING_SPEED = {"Conservative": 1.0, "Default": 1000.0, "Aggressive": 1000.0}


def node_resources(group: HeadGroupSpec) -> dict[str, float]:
    """What a node of `group` offers Ray's scheduler, as `ray start` is told it: Ray's monitor
    launches a node of a group only for demand the group's resources can meet."""
    resources: dict[str, float] = {**custom_resources(group.rayStartParams), "CPU": group.numCpus}
    if group.numGpus is not None:
        resources["GPU"] = group.numGpus
    if group.memory is not None:
        resources["memory"] = group.memory
    return resources


def node_id_resource(node_id: int) -> dict[str, int]:
    """The custom resource a node is started with, by which the monitor knows it."""
    return {NODE_ID_RESOURCE: node_id_value(node_id)}


def autoscaling_config(cluster: str, config: RayClusterConfigSpec, provider: dict[str, Any]) -> dict[str, Any]:
    """Ray's autoscaling config for `cluster`. `provider` is what the node provider module needs
    to reach the controller (its address, the cluster, where its token is); the keys Ray reads
    are set here."""
    options = config.autoscalerOptions or AutoscalerOptionsSpec()
    node_types: dict[str, Any] = {
        HEAD_NODE_TYPE: {
            "resources": {**node_resources(config.head), **node_id_resource(HEAD_NODE_ID)},
            "node_config": {},
            "max_workers": 0,
        }
    }
    for group in config.workerGroups:
        node_types[group.name] = {
            "resources": node_resources(group),
            "node_config": {},
            "min_workers": group.min_nodes(),
            "max_workers": group.max_nodes(),
        }
    return {
        "cluster_name": cluster,
        "max_workers": sum(group.max_nodes() for group in config.workerGroups),
        "upscaling_speed": UPSCALING_SPEED[options.upscalingMode],
        "idle_timeout_minutes": options.idleTimeoutSeconds / 60,
        "provider": {
            **provider,
            "type": "external",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": node_types,
        "head_node_type": HEAD_NODE_TYPE,
        **UNUSED_SECTIONS,
    }


class NodeRequestRefused(ValueError):
    """A node request of Ray's autoscaler that cannot be met as asked (the API answers 409)."""


class NodeRoomShort(NodeRequestRefused):
    """A node request refused for want of room (no free ports here), not for asking wrongly."""


def check_launch(cluster: ClusterRecord, config: RayClusterConfigSpec, group_name: str, count: int) -> None:
    """Refuse a launch of a group the cluster does not have, or past the group's maxReplicas."""
    group = next((g for g in config.workerGroups if g.name == group_name), None)
    if group is None:
        raise NodeRequestRefused(f"cluster {cluster.name} has no worker group {group_name!r}")
    in_group = sum(1 for node in cluster.nodes if not node.stopped and node.group == group_name)
    if in_group + count > group.max_nodes():
        raise NodeRequestRefused(
            f"worker group {group_name!r} of {cluster.name}: {in_group} node(s) and {count} more "
            f"exceed its maxReplicas ({group.max_nodes()})"
        )


def next_node_id(cluster: ClusterRecord) -> int:
    """Above every id recorded: the highest is only ever replaced by a higher one, so none recurs."""
    return max((node.node_id or 0 for node in cluster.nodes), default=0) + 1


def launch_here(
    cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
) -> tuple[ClusterRecord, list[int]]:
    """`launched` on this machine, stored in one write: new ports free here, held by no cluster,
    declared by no ingress (as a cluster's own are chosen when it is created)."""
    held = [port for other in records.list_clusters() for port in other.ports.all_ports()]
    grown, ids = launched(cluster, config, group, count, PortAllocator([*held, *records.declared_ports()]).node)
    return records.update_cluster(cluster.name, nodes=grown.nodes, ports=grown.ports), ids


def launched(
    cluster: ClusterRecord,
    config: RayClusterConfigSpec,
    group_name: str,
    count: int,
    new_ports: Callable[[], NodePorts],
) -> tuple[ClusterRecord, list[int]]:
    """`cluster` (on this machine) with `count` more worker nodes of `group_name` recorded, not
    started (intent: the provider starts the nodes whose pid is None), on node ports the cluster
    holds and no live node uses (a released node's), else on `new_ports`, then held by the
    cluster too; and their ids, never used before in this cluster. A cluster holds ports for the
    nodes it starts with, not for its maximum: a group of 64 would hold some 3,500 ports idle."""
    if cluster.pool is not None:
        raise NodeRequestRefused(f"cluster {cluster.name} runs on pool {cluster.pool}: its nodes are placed there")
    check_launch(cluster, config, group_name, count)
    # A released node's ports are free once its process is gone (no session left), not before.
    taken = {node.ports for node in cluster.nodes if not node.stopped or node.session_id is not None}
    spare = [ports for ports in cluster.ports.node_ports if ports not in taken][:count]
    try:
        added_ports = tuple(new_ports() for _ in range(count - len(spare)))
    except PortsExhausted as exc:
        raise NodeRoomShort(f"no ports for {count} more node(s) of {cluster.name}: {exc}") from None
    spare += added_ports
    held = replace(cluster.ports, node_ports=(*cluster.ports.node_ports, *added_ports))
    first_id = next_node_id(cluster)
    added = [
        NodePlacement(
            host=LOCAL_HOST,
            address="127.0.0.1",
            role="worker",
            ports=spare[offset],
            temp_dir=cluster.temp_dir,
            group=group_name,
            node_id=first_id + offset,
            log=launched_log_name(group_name, first_id + offset),
        )
        for offset in range(count)
    ]
    return cluster.with_changes(nodes=in_free_slots(cluster.nodes, added), ports=held), [n.node_id or 0 for n in added]


def in_free_slots(nodes: tuple[NodePlacement, ...], added: list[NodePlacement]) -> tuple[NodePlacement, ...]:
    """`nodes` with `added` in the places of workers released for good (recorded stopped, their
    process gone), the rest appended: a record as long as the most nodes it held at once, not as
    every node Ray ever asked for."""
    slots = [i for i, node in enumerate(nodes) if node.role == "worker" and node.stopped and node.session_id is None]
    placed = list(nodes)
    for slot, node in zip(slots, added, strict=False):
        placed[slot] = node
    return (*placed, *added[len(slots) :])


def releasable(cluster: ClusterRecord, node_id: int) -> int:
    """The index in `cluster.nodes` of the worker node Ray's autoscaler releases: never the head,
    never a node of another cluster (an id it does not hold)."""
    for index, node in enumerate(cluster.nodes):
        if node.node_id == node_id and not node.stopped:
            if node.role == "head":
                raise NodeRequestRefused(f"node {node_id} is the head of {cluster.name}: it is not released")
            return index
    raise NodeRequestRefused(f"cluster {cluster.name} has no running node {node_id}")


def node_api_token(secret: str, cluster: str) -> str:
    """The token the module on `cluster`'s head calls the node API with: derived from the
    daemon's own (`secret`), so nothing more is stored, and one-way, so a head holding it can
    neither act as the admin nor reach another cluster's nodes."""
    return hmac.new(secret.encode(), f"servekeeper-nodes:{cluster}".encode(), hashlib.sha256).hexdigest()


def scaled_like(config: RayClusterConfigSpec, service: str, clusters: list[ClusterRecord]) -> RayClusterConfigSpec:
    """The config a new cluster of `service` starts with: with Ray's autoscaler, each group at
    the node count the service's active cluster has now (within the group's bounds), so that
    an upgrade at peak does not start small and wait for Ray to scale it up again under load."""
    active = next((c for c in clusters if c.service == service and c.role == ClusterRole.ACTIVE), None)
    if not config.enableInTreeAutoscaling or active is None:
        return config
    running = [node.group for node in active.nodes if node.role == "worker" and not node.stopped]
    if not running or None in running:  # not autoscaled, or recorded before nodes kept a group
        return config
    groups = [
        group.model_copy(update={"replicas": min(max(running.count(group.name), group.min_nodes()), group.max_nodes())})
        for group in config.workerGroups
    ]
    return config.model_copy(update={"workerGroups": groups})
