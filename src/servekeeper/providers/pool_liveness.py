"""One look at a pool cluster's nodes over SSH: which run, which exited (their host answered:
they can be started again there, and their log's last lines say why), and which are unknown
(their host is silent: the node may still run there)."""

from __future__ import annotations

import asyncio

from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.base import Liveness, ProviderError
from servekeeper.providers.node_argv import remote_node
from servekeeper.providers.ssh import SshError
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes

# A look at a node never holds a tick longer than this: a host cut off the network does not
# refuse, it stays silent, and SSH would wait for its own timeouts and retries.
LIVENESS_TIMEOUT_SECONDS = 4.0


async def look(ssh: SshNodes, cluster: ClusterRecord) -> Liveness:
    """The cluster's liveness from one look at each started node (at once, each bounded)."""
    if not cluster.nodes:  # failed at placement: nothing was ever started
        return Liveness(False, [], None)
    started = [node for node in cluster.nodes if node.pid is not None]
    answers = await asyncio.gather(*(_node(ssh, node) for node in started))
    if cluster.nodes[0].pid is None:
        return Liveness(False, [], None)
    running, why, exited, _ = answers[0]
    if not running:
        # Exited only if its host said so; a silent host's head may still run (unknown).
        return Liveness(False, [], f"head node {why}", head_silent=not exited)
    dead = [(node, answer) for node, answer in zip(started[1:], answers[1:], strict=True) if not answer[0]]
    return Liveness(
        True,
        [node.pid for node, _ in dead if node.pid is not None],
        f"worker node pid {dead[0][0].pid} {dead[0][1][1]}" if dead else None,
        tuple(node.pid for node, answer in dead if answer[2] and node.pid is not None),
        silent_workers=tuple(node.pid for node, answer in dead if not answer[2] and node.pid is not None),
        exit_causes=tuple((node.pid, answer[3]) for node, answer in dead if answer[2] and node.pid is not None),
    )


async def _node(ssh: SshNodes, node: NodePlacement) -> tuple[bool, str, bool, str]:
    """(running, why not, exited for sure: its host answered, its log's last lines if it exited)"""
    try:
        running = await asyncio.wait_for(ssh.alive(remote_node(node)), LIVENESS_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        return False, f"host {node.host} did not answer within {LIVENESS_TIMEOUT_SECONDS:g}s", False, ""
    except (NodeUnreachable, SshError, ProviderError) as exc:  # ProviderError: host gone from the pool
        return False, f"host {node.host} unreachable: {exc}", False, ""
    if running:
        return True, "", False, ""
    try:  # what the node said last: the cause an operator needs
        cause = await asyncio.wait_for(ssh.last_lines(remote_node(node)), LIVENESS_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        cause = "its log not read (the host did not answer in time)"
    except (NodeUnreachable, SshError, ProviderError) as exc:
        cause = f"its log not read: {exc}"
    return False, f"exited on host {node.host}: {cause}", True, cause
