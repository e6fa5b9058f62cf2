"""Pure: does a service's cluster fit on the machine that would run it?

Only resources that are physical limits are judged: GPUs and memory. CPUs are not: Ray's
`--num-cpus` is a scheduling share, and a head of 2 logical CPUs runs on one core.
"""

from __future__ import annotations

from dataclasses import dataclass

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.spec import ServiceSpec
from servekeeper.model.status import ClusterRecord, NodePlacement


@dataclass(frozen=True)
class Capacity:
    gpus: float
    memory_bytes: int


@dataclass(frozen=True)
class Request:
    path: str  # the spec field that asks for it
    gpus: float
    memory_bytes: int


def requested(spec: ServiceSpec) -> list[Request]:
    """Each node group's total request (a group of N replicas asks N times)."""
    config = spec.spec.rayClusterConfig
    groups = [("spec.rayClusterConfig.head", config.head, 1)]
    groups += [(f"spec.rayClusterConfig.workerGroups.{i}", g, g.replicas) for i, g in enumerate(config.workerGroups)]
    return [Request(path, (group.numGpus or 0) * count, (group.memory or 0) * count) for path, group, count in groups]


def insufficient_capacity(spec: ServiceSpec, capacity: Capacity) -> list[str]:
    """Problems as 'field.path: InsufficientCapacity: ...', naming the resource; [] when it fits."""
    requests = requested(spec)
    problems = []
    gpus = sum(r.gpus for r in requests)
    if gpus > capacity.gpus:
        for request in requests:
            if request.gpus:
                problems.append(
                    f"{request.path}.numGpus: InsufficientCapacity: the cluster needs {gpus:g} GPU in all, "
                    f"this machine has {capacity.gpus:g} GPU"
                )
    memory = sum(r.memory_bytes for r in requests)
    if memory > capacity.memory_bytes:
        for request in requests:
            if request.memory_bytes:
                problems.append(
                    f"{request.path}.memory: InsufficientCapacity: the cluster needs {_gib(memory)} of memory in "
                    f"all, this machine has {_gib(capacity.memory_bytes)}"
                )
    return problems


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


# -- host pools --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeNeed:
    """What one node asks of the host it runs on."""

    path: str  # the spec field of its group
    role: str  # "head" | "worker"
    cpus: float
    gpus: float
    memory_bytes: int
    pinned: str | None  # the group's `host`


@dataclass(frozen=True)
class HostRoom:
    """A pool host's capacity, and what the clusters placed on it already take."""

    name: str
    cpus: float
    gpus: float
    memory_bytes: int


def node_needs(config: RayClusterConfigSpec) -> list[NodeNeed]:
    """Head first, then each replica of each worker group, in order (the order of `nodes`)."""
    head = config.head
    needs = [
        NodeNeed("spec.rayClusterConfig.head", "head", head.numCpus, head.numGpus or 0, head.memory or 0, head.host)
    ]
    for index, group in enumerate(config.workerGroups):
        path = f"spec.rayClusterConfig.workerGroups.{index}"
        need = NodeNeed(path, "worker", group.numCpus, group.numGpus or 0, group.memory or 0, group.host)
        needs += [need] * group.replicas
    return needs


def nodes_taking_room(cluster: ClusterRecord) -> list[tuple[NodePlacement, NodeNeed]]:
    """A pool cluster's nodes that take room on their hosts, each with what it needs: every node
    placed (pending, running, draining, being deleted) until it is stopped for sure."""
    if not cluster.nodes:
        return []
    needs = node_needs(RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json))
    return [(node, need) for node, need in zip(cluster.nodes, needs, strict=False) if not node.stopped]


def free_room(hosts: list[HostRoom], placed: list[tuple[str, NodeNeed]]) -> dict[str, HostRoom]:
    """Each host's room left once the nodes already placed there (every cluster's) are counted."""
    room = {host.name: host for host in hosts}
    for host_name, need in placed:
        if host_name in room:
            left = room[host_name]
            room[host_name] = HostRoom(
                left.name, left.cpus - need.cpus, left.gpus - need.gpus, left.memory_bytes - need.memory_bytes
            )
    return room


def place(needs: list[NodeNeed], room: dict[str, HostRoom]) -> list[str] | str:
    """A host per node, spread (each node goes where this cluster has the fewest nodes so far,
    then where most CPU is free), or what is short, for `InsufficientCapacity`."""
    room = dict(room)
    mine: dict[str, int] = dict.fromkeys(room, 0)
    chosen = []
    for index, need in enumerate(needs):
        candidates = [need.pinned] if need.pinned is not None else sorted(room)
        fitting = [name for name in candidates if name in room and _fits(room[name], need)]
        if not fitting:
            return _shortfall(index, need, room)
        best = min(fitting, key=lambda name: (mine[name], -room[name].cpus, name))
        left = room[best]
        room[best] = HostRoom(best, left.cpus - need.cpus, left.gpus - need.gpus, left.memory_bytes - need.memory_bytes)
        mine[best] += 1
        chosen.append(best)
    return chosen


def _fits(room: HostRoom, need: NodeNeed) -> bool:
    return room.cpus >= need.cpus and room.gpus >= need.gpus and room.memory_bytes >= need.memory_bytes


def _shortfall(index: int, need: NodeNeed, room: dict[str, HostRoom]) -> str:
    what = f"{need.role} node {index} ({need.path}: {need.cpus:g} CPU, {need.gpus:g} GPU, {_gib(need.memory_bytes)})"
    if need.pinned is not None and need.pinned not in room:
        return f"{what} is pinned to host {need.pinned!r}, which is not in the pool"
    hosts = [need.pinned] if need.pinned is not None else sorted(room)
    free = ", ".join(
        f"{name} {room[name].cpus:g} CPU/{room[name].gpus:g} GPU/{_gib(max(room[name].memory_bytes, 0))}"
        for name in hosts
    )
    return f"no host has room for the {what}; free: {free}"
