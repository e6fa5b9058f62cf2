"""Where the worker nodes Ray's autoscaler asks for on a pool cluster go (issue 22): on the
pool's hosts with room once every cluster's nodes are counted (this cluster's too), away from
the hosts this cluster already runs on while others have room (spread), on hosts that answer,
with ports free there and held by no cluster, and the cluster's Serve proxy ports free there (a
proxy runs on every node, on the same ports), one node of the cluster per host for that reason.
As many of the nodes asked for as fit are placed."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from servekeeper.core.placement import HostRoom, NodeNeed, free_room, group_need, nodes_taking_room, place
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.hostpool import HostPoolSpec
from servekeeper.model.records import ClusterRecord, NodePlacement, NodePorts
from servekeeper.providers.autoscaling import (
    NodeRequestRefused,
    NodeRoomShort,
    check_launch,
    in_free_slots,
    next_node_id,
)
from servekeeper.providers.base import ClusterRecords, RetryableProviderError
from servekeeper.providers.node_argv import cluster_dir
from servekeeper.providers.pool_placement import (
    ALLOCATE_TIMEOUT_SECONDS,
    HostRefused,
    host_errors,
    host_rooms,
    node_ports_on,
    unreachable_hosts,
)
from servekeeper.providers.ssh import SshError
from servekeeper.providers.ssh_nodes import SshNodes


async def launch_on_pool(
    pool: HostPoolSpec,
    ssh: SshNodes,
    name: str,
    config: RayClusterConfigSpec,
    group: str,
    count: int,
    records: ClusterRecords,
) -> tuple[ClusterRecord, list[int]]:
    """`count` nodes of `group` for cluster `name`, placed and stored in one write. The caller
    holds the pool's placement lock (no other launch or creation takes the room meanwhile); the
    record is read again after the placement's SSH calls (a release may have come meanwhile)."""
    cluster = _stored(records, name)
    check_launch(cluster, config, group, count)
    first = next_node_id(cluster)
    ids = list(range(first, first + count))
    added = await place_launched(pool, ssh, records.list_clusters(), cluster, config, group, ids)
    latest = _stored(records, name)
    held = replace(latest.ports, node_ports=(*latest.ports.node_ports, *(node.ports for node in added)))
    return records.update_cluster(name, nodes=in_free_slots(latest.nodes, added), ports=held), ids[: len(added)]


def _stored(records: ClusterRecords, name: str) -> ClusterRecord:
    found = next((c for c in records.list_clusters() if c.name == name), None)
    if found is None:
        raise NodeRequestRefused(f"cluster {name!r} is gone: no node is started for it")
    return found


async def place_launched(
    pool: HostPoolSpec,
    ssh: SshNodes,
    clusters: list[ClusterRecord],
    cluster: ClusterRecord,
    config: RayClusterConfigSpec,
    group: str,
    node_ids: list[int],
) -> list[NodePlacement]:
    """A node of `group` for each of `node_ids` that fits (the first ids; at least one), placed
    beside every cluster in `clusters` (all stored, `cluster` among them). Raises NodeRoomShort
    naming what is short when none fits (Ray asks again later), HostRefused when a host picked
    refuses for good, RetryableProviderError when ports could not be had in time."""
    assert cluster.pool is not None
    need = group_need(config, group)
    placed: list[tuple[str, NodeNeed]] = []
    for other in clusters:
        if other.pool == cluster.pool:
            placed += [(node.host, taking) for node, taking in nodes_taking_room(other)]
    mine = frozenset(node.host for node in cluster.nodes if not node.stopped)
    rooms = host_rooms(pool)
    # host -> why no node goes there now. One node of a cluster per host: each node runs Serve's
    # proxy on the cluster's ports (EveryNode), and a second on the same host could not bind them.
    left_out = {host: f"runs a node of {cluster.name} already (one per host)" for host in mine}
    while True:
        usable = [room for room in rooms if room.name not in left_out]
        chosen = _most_placed(need, len(node_ids), free_room(usable, placed), mine)
        if isinstance(chosen, str):
            why = "".join(f"; {host} {reason}" for host, reason in sorted(left_out.items()))
            raise NodeRoomShort(f"host pool {cluster.pool!r}: {chosen}{why}")
        hosts = sorted(set(chosen))
        excluded = await _unfit_hosts(ssh, cluster, hosts)
        if not excluded:
            break
        left_out.update(excluded)
    try:
        ports = await asyncio.wait_for(_node_ports(ssh, clusters, chosen), ALLOCATE_TIMEOUT_SECONDS)
    except asyncio.TimeoutError as exc:
        raise RetryableProviderError(f"allocating ports took more than {ALLOCATE_TIMEOUT_SECONDS:g}s") from exc
    return [
        NodePlacement(
            host=host,
            address=ssh.host(host).address,
            role="worker",
            ports=node_ports,
            temp_dir=f"{cluster_dir(ssh.host(host), cluster.name)}/id{node_id}",
            group=group,
            node_id=node_id,
        )
        for host, node_ports, node_id in zip(chosen, ports, node_ids[: len(chosen)], strict=True)
    ]


def _most_placed(need: NodeNeed, count: int, room: dict[str, HostRoom], mine: frozenset[str]) -> list[str] | str:
    """Hosts, each a different one, for as many of `count` nodes as fit (Ray asks again for the
    rest: refusing them all would leave the room that exists unused), or what is short."""
    short = place([need], room, avoid=mine)
    for fitting in range(min(count, len(room)), 0, -1):
        chosen = place([need] * fitting, room, avoid=mine, one_per_host=True)
        if not isinstance(chosen, str):
            return chosen
    return short if isinstance(short, str) else f"no host without a node of the cluster has room for {need.path}"


async def _unfit_hosts(ssh: SshNodes, cluster: ClusterRecord, hosts: list[str]) -> dict[str, str]:
    """Of the hosts picked, those that get no node now, and why: silent ones (they may come
    back), and those where the cluster's Serve proxy ports are taken."""
    unfit = dict.fromkeys(await unreachable_hosts(ssh, hosts), "does not answer")
    serve = [cluster.ports.serve_http, cluster.ports.serve_grpc]
    for host in hosts:
        if host in unfit:
            continue
        try:
            free = await ssh.ports_free(host, serve)
        except SshError as exc:
            if not exc.retryable:
                raise HostRefused(str(exc)) from exc
            unfit[host] = "does not answer"
            continue
        if sorted(free) != sorted(serve):
            unfit[host] = f"has the Serve proxy ports {serve} taken"
    return unfit


async def _node_ports(ssh: SshNodes, clusters: list[ClusterRecord], hosts: list[str]) -> list[NodePorts]:
    reserved = {port for other in clusters for port in other.ports.all_ports()}
    with host_errors("allocating ports"):
        return await node_ports_on(ssh, hosts, reserved)
