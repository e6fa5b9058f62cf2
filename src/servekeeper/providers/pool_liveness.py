"""One look at a pool cluster's nodes over SSH: which run, which exited (their host answered:
they can be started again there, and their log's last lines say why), and which are unknown
(their host is silent: the node may still run there)."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.base import Liveness, ProviderError
from servekeeper.providers.node_argv import remote_node
from servekeeper.providers.node_log import hidden_values
from servekeeper.providers.ssh import SshError
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes
from servekeeper.store.store import Store

# A host that does not answer a look within this is silent: a host cut off the network does
# not refuse, it stays silent, and SSH would wait for its own timeouts and retries. The time is
# the host's only: a look takes a channel kept for looks (`ssh.QUICK_CHANNELS`), never waiting
# behind the slow commands of a busy host (stops, port probes), and its timeout starts once it
# holds one. The whole look, a wait behind the other looks at that host included, is bounded by
# LOOK_BOUND_FACTOR times it: a silent host holds a tick no longer than that.
LIVENESS_TIMEOUT_SECONDS = 4.0
LOOK_BOUND_FACTOR = 2


class NodeAnswer(NamedTuple):
    running: bool
    why: str  # why not running
    exited: bool  # for sure: its host answered (else unknown: it may still run)
    cause: str = ""  # its log's last lines, when it exited


async def look(ssh: SshNodes, cluster: ClusterRecord, store: Store | None = None) -> Liveness:
    """The cluster's liveness from one look at each started node (at once, each bounded). With
    `store`, its facts say which env values came from secrets (`node_log.hidden_values`)."""
    if not cluster.nodes:  # failed at placement: nothing was ever started
        return Liveness(False, [], None)
    started = [node for node in cluster.nodes if node.pid is not None]
    hide = hidden_values(cluster, store)  # none of it in an event
    answers = await asyncio.gather(*(_node(ssh, node, hide) for node in started))
    if cluster.nodes[0].pid is None:
        return Liveness(False, [], None)
    head = answers[0]
    if not head.running:
        # Exited only if its host said so; a silent host's head may still run (unknown).
        return Liveness(False, [], f"head node {head.why}", head_silent=not head.exited)
    dead = {
        node.pid: answer
        for node, answer in zip(started[1:], answers[1:], strict=True)
        if not answer.running and node.pid is not None
    }
    first = next(iter(dead.items()), None)
    return Liveness(
        True,
        list(dead),
        f"worker node pid {first[0]} {first[1].why}" if first else None,
        tuple(pid for pid, answer in dead.items() if answer.exited),
        silent_workers=tuple(pid for pid, answer in dead.items() if not answer.exited),
        exit_causes=tuple((pid, answer.cause) for pid, answer in dead.items() if answer.exited),
    )


async def _node(ssh: SshNodes, node: NodePlacement, hide: frozenset[str]) -> NodeAnswer:
    bound = LIVENESS_TIMEOUT_SECONDS * LOOK_BOUND_FACTOR
    try:
        running = await asyncio.wait_for(ssh.alive(remote_node(node), LIVENESS_TIMEOUT_SECONDS), bound)
    except asyncio.TimeoutError:
        return NodeAnswer(False, f"host {node.host} did not answer within {LIVENESS_TIMEOUT_SECONDS:g}s", False)
    except (NodeUnreachable, SshError, ProviderError) as exc:  # ProviderError: host gone from the pool
        return NodeAnswer(False, f"host {node.host} unreachable: {exc}", False)
    if running:
        return NodeAnswer(True, "", False)
    try:  # what the node said last: the cause an operator needs
        cause = await asyncio.wait_for(ssh.last_lines(remote_node(node), hide, LIVENESS_TIMEOUT_SECONDS), bound)
    except asyncio.TimeoutError:
        cause = "its log not read (the host did not answer in time)"
    except (NodeUnreachable, SshError, ProviderError) as exc:
        cause = f"its log not read: {exc}"
    return NodeAnswer(False, f"exited on host {node.host}: {cause}", True, cause)
