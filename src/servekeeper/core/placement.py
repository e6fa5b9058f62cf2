"""Pure: does a service's cluster fit on the machine that would run it?

Only resources that are physical limits are judged: GPUs and memory. CPUs are not: Ray's
`--num-cpus` is a scheduling share, and a head of 2 logical CPUs runs on one core.
"""

from __future__ import annotations

from dataclasses import dataclass

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.model.spec import ServiceSpec


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
    for group in config.workerGroups:
        needs += [group_need(config, group.name)] * group.replicas
    return needs


def group_need(config: RayClusterConfigSpec, group_name: str) -> NodeNeed:
    """What one node of worker group `group_name` asks of its host (KeyError: no such group)."""
    for index, group in enumerate(config.workerGroups):
        if group.name == group_name:
            path = f"spec.rayClusterConfig.workerGroups.{index}"
            return NodeNeed(path, "worker", group.numCpus, group.numGpus or 0, group.memory or 0, group.host)
    raise KeyError(group_name)


def needs_by_place(cluster: ClusterRecord) -> dict[int, NodeNeed]:
    """What each node of a pool cluster needs, by its place in `nodes` (stopped ones too): a
    worker that knows its group, what that group asks (Ray's autoscaler's nodes are appended, or
    put in a released node's place); one that does not (older rows), what its place asks."""
    config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
    needs = node_needs(config)
    found = {}
    for index, node in enumerate(cluster.nodes):
        if node.role == "worker" and node.group is not None:
            found[index] = group_need(config, node.group)
        elif index < len(needs):
            found[index] = needs[index]
    return found


def nodes_taking_room(cluster: ClusterRecord) -> list[tuple[NodePlacement, NodeNeed]]:
    """A pool cluster's nodes that take room on their hosts, each with what it needs: every node
    placed (pending, running, draining, being deleted) until it is stopped for sure."""
    if not cluster.nodes:
        return []
    needs = needs_by_place(cluster)
    return [(node, needs[i]) for i, node in enumerate(cluster.nodes) if not node.stopped and i in needs]


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


# Tries of a node on a host before the search gives up (far more than a pool of a few hosts and
# a cluster of a few dozen nodes needs); past it, the greedy pass's shortfall is the answer.
SEARCH_TRIES = 2_000
# The search recurses once per node; a cluster larger than this keeps the greedy pass only.
SEARCH_MAX_NODES = 256
_SLACK = 1e-9  # float sums: the room kept for later pinned nodes is never judged short by a rounding


def place(
    needs: list[NodeNeed], room: dict[str, HostRoom], avoid: frozenset[str] = frozenset(), one_per_host: bool = False
) -> list[str] | str:
    """A host per node, spread (each node goes where this cluster has the fewest nodes so far,
    then where most CPU is free), or what is short, for `InsufficientCapacity`. Among hosts where
    this cluster has as many nodes, those in `avoid` (the service's other clusters run there) come
    last: a standby's head, or an upgrade's, goes where the active is not, and the nodes still
    spread (an upgrade's cluster becomes the long-lived active).

    When the greedy pass in the nodes' order places every node, that is the answer. When it
    does not (a node took the room a later one needed: an unpinned head on the host a worker is
    pinned to), a search over hosts finds a placement whenever one exists (within SEARCH_TRIES),
    still preferring hosts the same way; the shortfall named is still the greedy pass's.

    With `one_per_host`, no two of the nodes share a host (an autoscaled pool cluster: each node
    runs Serve's proxy on the cluster's ports)."""
    greedy = _place_greedily(needs, room, avoid, one_per_host)
    if not isinstance(greedy, str) or len(needs) > SEARCH_MAX_NODES:
        return greedy
    found = _Search(needs, room, avoid, one_per_host).run()
    return greedy if found is None else found


def _place_greedily(
    needs: list[NodeNeed], room: dict[str, HostRoom], avoid: frozenset[str], one_per_host: bool
) -> list[str] | str:
    room = dict(room)
    mine: dict[str, int] = dict.fromkeys(room, 0)
    chosen = []
    for index, need in enumerate(needs):
        candidates = [need.pinned] if need.pinned is not None else sorted(room)
        fitting = [name for name in candidates if name in room and _fits(room[name], need)]
        taken = [name for name in fitting if one_per_host and mine[name]]
        fitting = [name for name in fitting if name not in taken]
        if not fitting:
            used = f" ({', '.join(taken)} run a node of it already: one per host)" if taken else ""
            return _shortfall(index, need, room) + used
        best = min(fitting, key=lambda name: (mine[name], name in avoid, -room[name].cpus, name))
        room[best] = _minus(room[best], need)
        mine[best] += 1
        chosen.append(best)
    return chosen


_Amounts = tuple[float, float, int]  # cpus, gpus, memory bytes
# the next node, then each host's room and whether this cluster has a node there already
_SearchState = tuple[int, tuple[tuple[_Amounts, bool], ...], tuple[tuple[_Amounts, bool], ...]]


class _Search:
    """Depth first over the nodes, pinned ones first, then the largest first (the hardest to
    fit, so a dead end shows early), each tried on the hosts it fits in the greedy pass's order
    of preference, and only where it leaves the room that later nodes pinned to that host need.
    Hosts that no later node is pinned to are interchangeable when their room is the same: one
    of them is tried, and a state (next node, the rooms) found to lead nowhere is not explored
    again in another order or on another such host. The answer is in the nodes' own order."""

    def __init__(
        self, needs: list[NodeNeed], room: dict[str, HostRoom], avoid: frozenset[str], one_per_host: bool
    ) -> None:
        self.avoid = avoid
        self.one_per_host = one_per_host
        self.order = sorted(
            range(len(needs)),
            key=lambda i: (needs[i].pinned is None, -needs[i].gpus, -needs[i].cpus, -needs[i].memory_bytes, i),
        )
        self.needs = [needs[i] for i in self.order]
        self.room = {name: (left.cpus, left.gpus, left.memory_bytes) for name, left in room.items()}
        self.mine: dict[str, int] = dict.fromkeys(room, 0)
        self.hosts = sorted(room)
        self.tries_left = SEARCH_TRIES
        self.dead_ends: set[_SearchState] = set()
        # kept[index][host]: what the nodes from `index` on that are pinned to the host need
        self.kept: list[dict[str, _Amounts]] = [{}]
        for need in reversed(self.needs):
            later = dict(self.kept[0])
            if need.pinned is not None:
                later[need.pinned] = _plus(later.get(need.pinned, (0, 0, 0)), need)
            self.kept.insert(0, later)

    def run(self) -> list[str] | None:
        if self._surely_short():
            return None
        chosen: list[str] = []
        if not self._extend(0, chosen):
            return None
        hosts = [""] * len(chosen)
        for position, index in enumerate(self.order):
            hosts[index] = chosen[position]
        return hosts

    def _surely_short(self) -> bool:
        """Cheap proofs that nothing fits (a full pool is the usual case, and a rollout waiting
        for room asks again every tick): more asked in all than the hosts have free, more pinned
        to a host than it has, or a node that fits on no host it may go to."""
        asked: _Amounts = (0, 0, 0)
        for need in self.needs:
            asked = _plus(asked, need)
        for amount in range(3):  # cpus, gpus, memory
            if asked[amount] > sum(max(left[amount], 0) for left in self.room.values()) + _SLACK:
                return True
        for name, kept in self.kept[0].items():
            if name not in self.room or any(k > r + _SLACK for k, r in zip(kept, self.room[name], strict=True)):
                return True
        if self.one_per_host and len(self.needs) > len(self.room):
            return True
        return any(not any(_leaves(self.room[name], need, None) for name in self._allowed(need)) for need in self.needs)

    def _allowed(self, need: NodeNeed) -> list[str]:
        return [name for name in ([need.pinned] if need.pinned is not None else self.hosts) if name in self.room]

    def _extend(self, index: int, chosen: list[str]) -> bool:
        if index == len(self.needs):
            return True
        state = self._state(index)
        if state in self.dead_ends:
            return False
        need = self.needs[index]
        for name in self._candidates(index, need):
            if self.tries_left <= 0:
                return False
            self.tries_left -= 1
            before = self.room[name]
            self.room[name] = (before[0] - need.cpus, before[1] - need.gpus, before[2] - need.memory_bytes)
            self.mine[name] += 1
            chosen.append(name)
            if self._extend(index + 1, chosen):
                return True
            chosen.pop()
            self.mine[name] -= 1
            self.room[name] = before
        self.dead_ends.add(state)
        return False

    def _state(self, index: int) -> _SearchState:
        """What decides whether the nodes from `index` on fit: the room of each host a later
        node is pinned to, and the rooms of the others as a multiset (with one node per host,
        each room with whether a node took that host already)."""
        pinned = self.kept[index]

        def held(name: str) -> tuple[_Amounts, bool]:
            return self.room[name], self.one_per_host and self.mine[name] > 0

        return (
            index,
            tuple(held(name) for name in self.hosts if name in pinned),
            tuple(sorted(held(name) for name in self.hosts if name not in pinned)),
        )

    def _candidates(self, index: int, need: NodeNeed) -> list[str]:
        kept = self.kept[index + 1]
        fitting = [name for name in self._allowed(need) if _leaves(self.room[name], need, kept.get(name))]
        fitting = [name for name in fitting if not (self.one_per_host and self.mine[name])]
        fitting.sort(key=lambda name: (self.mine[name], name in self.avoid, -self.room[name][0], name))
        alike: set[_Amounts] = set()  # rooms of interchangeable hosts already among the candidates
        candidates = []
        for name in fitting:
            if name not in kept:
                if self.room[name] in alike:
                    continue
                alike.add(self.room[name])
            candidates.append(name)
        return candidates


def _plus(amounts: _Amounts, need: NodeNeed) -> _Amounts:
    return (amounts[0] + need.cpus, amounts[1] + need.gpus, amounts[2] + need.memory_bytes)


def _leaves(room: _Amounts, need: NodeNeed, kept: _Amounts | None) -> bool:
    """Whether `need` fits in `room` and leaves what the later nodes pinned to that host need."""
    cpus, gpus, memory = room[0] - need.cpus, room[1] - need.gpus, room[2] - need.memory_bytes
    if cpus < 0 or gpus < 0 or memory < 0:
        return False
    return kept is None or (cpus >= kept[0] - _SLACK and gpus >= kept[1] - _SLACK and memory >= kept[2])


def _minus(room: HostRoom, need: NodeNeed) -> HostRoom:
    return HostRoom(room.name, room.cpus - need.cpus, room.gpus - need.gpus, room.memory_bytes - need.memory_bytes)


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
