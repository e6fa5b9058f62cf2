"""A pool cluster's nodes over SSH: one stopped (for a whole cluster's stop, and for a worker
Ray's autoscaler released, issue 22), each node's group, and the waits of a start."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from servekeeper.model.cluster_spec import HeadGroupSpec, RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.base import ProviderError, RetryableProviderError
from servekeeper.providers.node_argv import remote_node
from servekeeper.providers.ssh import SshError
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes

logger = logging.getLogger(__name__)

HEAD_GCS_WAIT_SECONDS = 60.0  # a head's GCS answers in a few seconds; on loaded hosts in tens
T = TypeVar("T")


async def stop_pool_node(ssh: SshNodes, node: NodePlacement) -> list[str]:
    """What could not be stopped of `node`, described (empty: it is gone for sure, or was)."""
    if node.stopped:
        return []
    try:
        left = await ssh.stop(remote_node(node))
    except (NodeUnreachable, SshError, ProviderError) as exc:
        return [f"{node.role} node on {node.host}: {exc}"]
    return [f"{node.host}:{pid}" for pid in left]


async def adopt_or_clear(ssh: SshNodes, node: NodePlacement, adopt: bool) -> NodePlacement | None:
    """Before `node` is started: with `adopt`, a worker that a dead controller launched and never
    recorded is adopted (returned with its pid): Ray knows it already, and stopping it would make
    Ray ask for another. Otherwise what a start cut short left of it is stopped by its tag: never
    a second node beside the first (for a head: its ports, its GCS store). None: start it."""
    if adopt:
        pid = await ssh.unrecorded_leader(node.host, node.temp_dir)
        if pid is not None:
            logger.info("[%s] worker node on %s runs unrecorded (pid %d): adopted", node.temp_dir, node.host, pid)
            return replace(node, pid=pid, session_id=pid)
    left = await ssh.stop(remote_node(node, pid=-1, session_id=-1))
    if left:
        raise RetryableProviderError(
            f"processes {left} of the {node.role} node on host {node.host} did not stop; not starting it again"
        )
    return None


async def head_gcs_answers(ssh: SshNodes, cluster: ClusterRecord) -> None:
    """Workers are launched once the head's GCS answers: one started before waits for it inside
    `ray start`, and on loaded hosts Ray's fixed 30 s wait for its raylet to register then runs
    out while the head is still starting (the node exits, is restarted, and starves again)."""
    head = cluster.nodes[0]
    if not await ssh.gcs_answers(head.host, cluster.ports.gcs, HEAD_GCS_WAIT_SECONDS):
        raise RetryableProviderError(
            f"the head's GCS on host {head.host} did not answer on port {cluster.ports.gcs} within "
            f"{HEAD_GCS_WAIT_SECONDS:g}s; its workers are started once it does"
        )


async def to_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end even when the caller is cancelled meanwhile; then the cancel goes on
    (unless `work` failed: its error is the one raised)."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # never cancels `task`
        except asyncio.CancelledError:
            cancelled = True
    if cancelled and not task.cancelled() and task.exception() is None:
        raise asyncio.CancelledError
    return task.result()


def groups_per_node(config: RayClusterConfigSpec, nodes: Sequence[NodePlacement]) -> list[HeadGroupSpec]:
    """Each node's group: as recorded (a node Ray's autoscaler asked for, appended or in a
    released node's place), else by its place in the spec (older rows)."""
    by_place: list[HeadGroupSpec] = [config.head]
    for group in config.workerGroups:
        by_place += [group] * group.replicas
    named = {group.name: group for group in config.workerGroups}
    return [
        named[node.group] if node.role == "worker" and node.group in named else by_place[min(i, len(by_place) - 1)]
        for i, node in enumerate(nodes)
    ]
