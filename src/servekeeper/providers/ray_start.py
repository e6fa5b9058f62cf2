"""`ray start` flags shared by every provider: a node's ports, its resources, its rayStartParams."""

from __future__ import annotations

from servekeeper.model.cluster_spec import HeadGroupSpec
from servekeeper.model.records import NodePorts


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


def group_args(group: HeadGroupSpec) -> list[str]:
    """A group's resource flags and its rayStartParams, as every node of it gets them."""
    return resource_args(group) + param_args(group.rayStartParams)
