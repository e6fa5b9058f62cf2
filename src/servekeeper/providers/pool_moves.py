"""A pool cluster's head moved off its silent host (GCS tables in Redis): the head, and every node
of the cluster on that host, placed on the pool's other hosts, the workers elsewhere cleared to
be started again against the new head (Ray's raylets cannot follow a head to a new address),
and the nodes left on the silent host stopped once it answers again.

Nothing here starts a process: the record this returns is stored first (intent), and the
cluster's ordinary start runs the nodes it lists, head first. Until a staying worker is started
again its old process keeps serving on the same Serve port (kept when the new hosts have it
free), so the ingress keeps sending it requests while the new head comes up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from servekeeper.core.placement import free_room, needs_by_place, nodes_taking_room, place
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.hostpool import HostPoolSpec
from servekeeper.model.records import ClusterPorts, ClusterRecord, NodePlacement, NodePorts
from servekeeper.providers.base import ProviderError, RetryableProviderError
from servekeeper.providers.node_argv import cluster_dir, remote_node
from servekeeper.providers.pool_placement import Shortfall, host_rooms, unreachable_hosts
from servekeeper.providers.ssh import SshError
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)

STOP_LEFT_BEHIND_SECONDS = 8.0
MOVED_FIELDS = (
    "nodes",
    "ports",
    "head_pid",
    "worker_pids",
    "left_behind",
)  # what a move changes in a record  # one try at stopping a left-behind node; its host may still be silent


async def place_move(
    pool: HostPoolSpec, ssh: SshNodes, others: list[ClusterRecord], cluster: ClusterRecord, config: RayClusterConfigSpec
) -> ClusterRecord:
    """`cluster` with the nodes on its head's host placed on other hosts of `pool` (beside
    `others`, every other cluster stored) and their ports allocated there; raises Shortfall when
    no host can take them now (a head pinned to its host never moves)."""
    silent = cluster.nodes[0].host
    # Only a host that does not answer at all: one that answers (again) runs its head, and one
    # that refuses us (a rotated key, a full disk) may still run it, connected to the same tables.
    if silent not in await unreachable_hosts(ssh, [silent]):
        raise RetryableProviderError(f"host {silent} answers again: the head is not moved")
    moving = [i for i, node in enumerate(cluster.nodes) if node.host == silent and not node.stopped]
    needs = needs_by_place(cluster)  # a node Ray's autoscaler asked for needs its group's
    placed = [
        (node.host, need)
        for other in others
        if other.pool == cluster.pool and other.name != cluster.name
        for node, need in nodes_taking_room(other)
    ]
    staying = [(node.host, needs[i]) for i, node in enumerate(cluster.nodes) if i not in moving and not node.stopped]
    placed += staying
    rooms = [room for room in host_rooms(pool) if room.name != silent]
    if config.enableInTreeAutoscaling:  # one node of it per host (each runs Serve's proxy on its ports)
        rooms = [room for room in rooms if room.name not in {host for host, _ in staying}]
    wanted = [needs[i] for i in moving]
    # Away from the service's other clusters (a hot standby) where there is a choice.
    avoid = frozenset(
        node.host
        for other in others
        if other.pool == cluster.pool and other.service == cluster.service and other.name != cluster.name
        for node in other.nodes
    )
    chosen = place(wanted, free_room(rooms, placed), avoid, config.enableInTreeAutoscaling)
    unreachable: set[str] = set()
    if not isinstance(chosen, str):
        unreachable = await unreachable_hosts(ssh, sorted(set(chosen)))
        if unreachable:
            rooms = [room for room in rooms if room.name not in unreachable]
            chosen = place(wanted, free_room(rooms, placed), avoid, config.enableInTreeAutoscaling)
    if isinstance(chosen, str):
        lost = f", unreachable: {sorted(unreachable)}" if unreachable else ""
        raise Shortfall(f"no host of pool {cluster.pool!r} can take the nodes on silent host {silent}: {chosen}{lost}")
    hosts = [node.host for node in cluster.nodes]
    for index, host in zip(moving, chosen, strict=True):
        hosts[index] = host
    reserved = {port for other in others for port in other.ports.all_ports()} | set(cluster.ports.all_ports())
    try:
        return await _allocate(ssh, cluster, hosts, moving, reserved)
    except SshError as exc:
        raise RetryableProviderError(f"allocating ports for the moved head: {exc}") from exc


async def _allocate(
    ssh: SshNodes, cluster: ClusterRecord, hosts: list[str], moving: list[int], reserved: set[int]
) -> ClusterRecord:
    ports = cluster.ports
    serve = [ports.serve_http, ports.serve_grpc]
    staying_hosts = {node.host for i, node in enumerate(cluster.nodes) if i not in moving}
    new_hosts = sorted({hosts[i] for i in moving} - staying_hosts)
    kept = True
    for host in new_hosts:
        free = await ssh.ports_free(host, serve)
        kept = kept and all(port in free for port in serve)
    if not kept:  # Serve listens on one port on every node: new ones, free on all the cluster's hosts
        serve = await ssh.ports_free_on_all(sorted(set(hosts)), 2, sorted(reserved))
    reserved.update(serve)
    head_ports, singles = await ssh.node_ports(hosts[0], sorted(reserved), extra=3)
    reserved.update(head_ports.all_ports() + singles)
    node_ports: list[NodePorts] = list(ports.node_ports)
    node_ports[0] = head_ports
    for index in moving[1:]:
        node_ports[index], _ = await ssh.node_ports(hosts[index], sorted(reserved))
        reserved.update(node_ports[index].all_ports())
    moves = cluster.nodes[0].restarts + 1  # a move counts against the head's restart budget
    nodes = []
    for index, node in enumerate(cluster.nodes):
        if index in moving:
            spec = ssh.host(hosts[index])
            # A dir of its own: the node left behind on the silent host is stopped by its dir's tag.
            temp_dir = f"{cluster_dir(spec, cluster.name)}/n{index}.{moves}"
            restarts = moves if index == 0 else node.restarts
            node = NodePlacement(
                hosts[index],
                spec.address,
                node.role,
                node_ports[index],
                temp_dir,
                restarts=restarts,
                group=node.group,
                node_id=node.node_id,
            )
        elif not node.stopped:
            node = replace(node, pid=None, session_id=None)  # started again against the new head
        nodes.append(node)
    gcs, dashboard, client_server = singles
    moved_ports = ClusterPorts(gcs, dashboard, client_server, serve[0], serve[1], tuple(node_ports))
    left = tuple(cluster.nodes[i] for i in moving)  # one never recorded running is stopped by its tag
    return cluster.with_changes(
        nodes=tuple(nodes),
        ports=moved_ports,
        head_pid=None,
        worker_pids=(),
        left_behind=cluster.left_behind + left,
    )


async def stop_left_behind(ssh: SshNodes, store: Store, cluster: ClusterRecord) -> tuple[NodePlacement, ...]:
    """One try at stopping each node a head move left on a silent host (each bounded: the host
    may still be silent; an old head running on would write the same GCS tables as the new one).
    Those stopped for sure leave the stored record; those not are returned."""
    if not cluster.left_behind:
        return ()

    async def stopped(node: NodePlacement) -> bool:
        try:
            left = await asyncio.wait_for(ssh.stop(remote_node(node)), STOP_LEFT_BEHIND_SECONDS)
        except (asyncio.TimeoutError, NodeUnreachable, SshError, ProviderError):
            return False
        return not left

    results = await asyncio.gather(*(stopped(node) for node in cluster.left_behind))
    done = [node for node, ok in zip(cluster.left_behind, results, strict=True) if ok]
    if done:
        logger.info("[%s] stopped what a head move left on %s", cluster.name, ", ".join(sorted({n.host for n in done})))
        with store.transaction():  # a move stored meanwhile may have left more behind
            current = store.get_cluster(cluster.name)
            if current is not None:
                store.update_cluster(cluster.name, left_behind=tuple(n for n in current.left_behind if n not in done))
    return tuple(node for node, ok in zip(cluster.left_behind, results, strict=True) if not ok)
