"""One node of a pool cluster stopped over SSH: for a whole cluster's stop, and for a worker
Ray's autoscaler released (issue 22)."""

from __future__ import annotations

from servekeeper.model.records import NodePlacement
from servekeeper.providers.base import ProviderError
from servekeeper.providers.node_argv import remote_node
from servekeeper.providers.ssh import SshError
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes


async def stop_pool_node(ssh: SshNodes, node: NodePlacement) -> list[str]:
    """What could not be stopped of `node`, described (empty: it is gone for sure, or was)."""
    if node.stopped:
        return []
    try:
        left = await ssh.stop(remote_node(node))
    except (NodeUnreachable, SshError, ProviderError) as exc:
        return [f"{node.role} node on {node.host}: {exc}"]
    return [f"{node.host}:{pid}" for pid in left]
