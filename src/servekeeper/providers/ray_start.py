"""`ray start` flags shared by every provider: a node's ports, its resources, its rayStartParams."""

from __future__ import annotations

import json

from servekeeper.model.cluster_spec import HeadGroupSpec
from servekeeper.model.records import NodePorts
from servekeeper.model.start_params import StartParamValue, custom_resources

# The custom resource by which Ray's autoscaler knows a node it asked for (Ray's own name: its
# monitor reads it with `use_node_id_as_ip`, every node of one machine having one address).
NODE_ID_RESOURCE = "NODE_ID_AS_RESOURCE"


def node_id_value(node_id: int) -> int:
    """The resource's quantity for node `node_id`: one more, because Ray drops a resource of 0
    at `ray start`, and the head (id 0) would go unknown to the monitor, which then counts the
    head's whole static resources as free and launches nothing for a demand they would hold.
    The node provider module maps it back (`internal_ip`)."""
    return node_id + 1


def param_args(params: dict[str, str | int | float | bool]) -> list[str]:
    args: list[str] = []
    for key, value in sorted(params.items()):
        if value is True:
            args.append(f"--{key}")
        elif value is False:
            continue
        else:
            args.append(f"--{key}={value}")
    return args


def node_port_args(ports: NodePorts) -> list[str]:
    return [
        f"--node-manager-port={ports.node_manager}",
        f"--object-manager-port={ports.object_manager}",
        f"--metrics-export-port={ports.metrics_export}",
        f"--dashboard-agent-listen-port={ports.agent_listen}",
        f"--dashboard-agent-grpc-port={ports.agent_grpc}",
        f"--runtime-env-agent-port={ports.runtime_env_agent}",
        f"--min-worker-port={ports.min_worker}",
        f"--max-worker-port={ports.max_worker}",
    ]


def resource_args(group: HeadGroupSpec) -> list[str]:
    args = [f"--num-cpus={group.numCpus:g}"]
    if group.numGpus is not None:
        args.append(f"--num-gpus={group.numGpus:g}")
    if group.memory is not None:
        args.append(f"--memory={group.memory}")
    return args


def group_args(group: HeadGroupSpec, node_id: int | None = None) -> list[str]:
    """A group's resource flags and its rayStartParams, as every node of it gets them; with
    `node_id` (Ray's autoscaler runs), the node's id among its custom resources."""
    return resource_args(group) + param_args(with_node_id(group.rayStartParams, node_id))


def with_node_id(params: dict[str, StartParamValue], node_id: int | None) -> dict[str, StartParamValue]:
    """rayStartParams with the node's id among its custom resources (None: unchanged). The
    user's own `resources` (KubeRay's shell-escaped forms accepted) are kept beside it."""
    if node_id is None:
        return params
    resources: dict[str, object] = {**custom_resources(params), NODE_ID_RESOURCE: node_id_value(node_id)}
    return {**params, "resources": json.dumps(resources, sort_keys=True, separators=(",", ":"))}
