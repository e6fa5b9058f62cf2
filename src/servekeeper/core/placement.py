"""Pure: does a service's cluster fit on the machine that would run it?

Only resources that are physical limits are judged: GPUs and memory. CPUs are not: Ray's
`--num-cpus` is a scheduling share, and a head of 2 logical CPUs runs on one core.
"""

from __future__ import annotations

from dataclasses import dataclass

from servekeeper.spec import ServiceSpec


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
