"""What Ray's autoscaler asks of a cluster (issue 22), through the module on its head
(providers/node_provider): its nodes, more of a group, a node's tags, one node released.

A launch is only recorded (intent, one store write): the controller's next tick starts the
nodes whose pid is None, as it starts any node, so a crash between the two starts each once. A
release records the node stopped (its session kept), stops it, then forgets its session; a node
recorded stopped is never started again, and one that still holds a session (a crash mid-release,
or a start that spawned it as it was released) is stopped at the monitor's next call. Ray's own
tags beyond kind and type (its launch hash, a node's name) live here, in memory, for recorded
nodes only: with `disable_launch_config_check` the monitor reads none of them back after a restart."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from servekeeper.commands.context import CommandContext
from servekeeper.commands.errors import Conflict, NotFound
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, Event
from servekeeper.providers.autoscaling import (
    HEAD_NODE_TYPE,
    NodeRequestRefused,
    NodeRoomShort,
    node_api_token,
    releasable,
)
from servekeeper.providers.base import ProviderError, with_nodes

logger = logging.getLogger(__name__)

# The first and the longest pause after a launch refused for want of room, doubling in between.
ROOM_PAUSE_SECONDS = (2.0, 30.0)


def node_token(secret: str, cluster: str) -> str:
    """The token that opens `cluster`'s node routes (derived from the daemon's `secret`)."""
    return node_api_token(secret, cluster)


class NodeCommands:
    def __init__(self, context: CommandContext) -> None:
        self.store = context.store
        self.controller = context.controller
        self.tags: dict[tuple[str, int], dict[str, str]] = {}
        self.releasing: set[tuple[str, int]] = set()  # releases under way: not swept meanwhile
        self.refusals: dict[tuple[str, str], str] = {}  # (cluster, group) -> the refusal last told
        # (cluster, group) -> (until when a request is refused at once, the pause that set it):
        # Ray's monitor asks again at each update (every second), with no back-off of its own
        self.held_back: dict[tuple[str, str], tuple[float, float]] = {}

    def _cluster(self, name: str) -> tuple[ClusterRecord, RayClusterConfigSpec]:
        cluster = self.store.get_cluster(name)
        if cluster is None:
            self.tags = {key: tags for key, tags in self.tags.items() if key[0] != name}
            self.held_back = {key: held for key, held in self.held_back.items() if key[0] != name}
            raise NotFound(f"cluster {name!r} not found")
        config = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if not config.enableInTreeAutoscaling:
            raise Conflict(f"cluster {name!r} is not autoscaled (enableInTreeAutoscaling is not true)")
        return cluster, config

    def _record_node(self, name: str, node_id: int, **changes: Any) -> None:
        current = self.store.get_cluster(name)
        if current is None:
            return  # deleted meanwhile: its stop took every node
        nodes = (replace(node, **changes) if node.node_id == node_id else node for node in current.nodes)
        updated = with_nodes(current, nodes)
        self.store.update_cluster(name, nodes=updated.nodes, worker_pids=updated.worker_pids)

    async def nodes(self, name: str) -> dict[str, Any]:
        cluster, _ = self._cluster(name)
        await self._finish_releases(cluster)
        live = {node.node_id for node in cluster.nodes if not node.stopped}
        existing = {c.name for c in self.store.list_clusters()}  # a deleted cluster's monitor calls no more
        self.tags = {
            key: tags for key, tags in self.tags.items() if key[0] in existing and (key[0] != name or key[1] in live)
        }
        self.refusals = {key: told for key, told in self.refusals.items() if key[0] in existing}
        listed = []
        for node in cluster.nodes:
            if node.stopped or node.node_id is None:
                continue
            # kind and type become Ray's own tags in the module on the head, which knows their names
            listed.append(
                {
                    "id": node.node_id,
                    "kind": node.role,
                    "type": node.group or HEAD_NODE_TYPE,
                    "status": "running" if node.pid is not None else "pending",
                    "tags": self.tags.get((name, node.node_id), {}),
                }
            )
        return {"nodes": listed}

    async def launch(self, name: str, node_type: str, count: int, tags: dict[str, str]) -> dict[str, Any]:
        cluster, config = self._cluster(name)
        if cluster.role == ClusterRole.DELETING:
            raise Conflict(f"cluster {name!r} is being deleted: no node is started for it")
        key, now = (name, node_type), self.controller.clock()
        until, pause = self.held_back.get(key, (0.0, 0.0))
        if now < until:  # no room a moment ago: not placed again yet
            raise Conflict(f"{self.refusals.get(key, 'no room')} (asked again within {pause:g}s; refused at once)")
        try:  # placed, with their ports, and recorded unstarted in one write (intent)
            cluster, ids = await self.controller.provider.launch_nodes(cluster, config, node_type, count, self.store)
        except (NodeRequestRefused, ProviderError) as exc:
            self._tell_refusal(cluster, node_type, exc)
            if isinstance(exc, NodeRoomShort):
                pause = min(max(2 * pause, ROOM_PAUSE_SECONDS[0]), ROOM_PAUSE_SECONDS[1])
                self.held_back[key] = (self.controller.clock() + pause, pause)
            raise Conflict(str(exc)) from None
        self.refusals.pop(key, None)
        self.held_back.pop(key, None)
        if len(ids) < count:
            short = NodeRoomShort(f"{len(ids)} of {count} node(s) placed; the pool has no room for the rest now")
            self._tell_refusal(cluster, node_type, short)
        for node_id in ids:
            self.tags[(name, node_id)] = dict(tags)
        message = f"Ray's autoscaler asked for {count} {node_type} node(s) on {name}: ids {ids}"
        self.store.add_events([Event(cluster.service, self.controller.clock(), "Normal", "NodeAdded", message)])
        self.controller.wake(cluster.service)
        return {"ids": ids}

    def _tell_refusal(self, cluster: ClusterRecord, node_type: str, refusal: Exception) -> None:
        """An event naming the group and what is short, once per cause until a launch succeeds:
        Ray asks again after its own back-off, and each ask is not news."""
        if self.refusals.get((cluster.name, node_type)) == str(refusal):
            return
        self.refusals[(cluster.name, node_type)] = str(refusal)
        reason = "InsufficientCapacity" if isinstance(refusal, NodeRoomShort) else "NodeRequestRefused"
        message = f"worker group {node_type!r} of {cluster.name}: Ray's autoscaler's request refused: {refusal}"
        self.store.add_events([Event(cluster.service, self.controller.clock(), "Warning", reason, message)])

    def set_tags(self, name: str, node_id: int, tags: dict[str, str]) -> dict[str, Any]:
        cluster, _ = self._cluster(name)
        if not any(node.node_id == node_id and not node.stopped for node in cluster.nodes):
            raise NotFound(f"cluster {name!r} has no node {node_id}")
        self.tags.setdefault((name, node_id), {}).update(tags)
        return {}

    async def _finish_releases(self, cluster: ClusterRecord) -> None:
        """Stop what a release left running: a node recorded stopped that still holds a session."""
        for index, node in enumerate(cluster.nodes):
            key = (cluster.name, node.node_id or 0)
            if node.stopped and node.session_id is not None and node.node_id is not None and key not in self.releasing:
                try:
                    await self.controller.provider.stop_node(cluster, index)
                except ProviderError as exc:  # tried again at the next call; the list is still answered
                    logger.warning("[%s] released node %s not stopped yet: %s", cluster.name, node.node_id, exc)
                    continue
                self._forget_session(cluster.name, node.node_id, node.session_id)

    def _forget_session(self, name: str, node_id: int, stopped: int | None) -> None:
        """A released node's session forgotten once stopped (its place and ports free from then
        on): only the session that stop ended, never one a start recorded meanwhile (it spawned
        the node as it was released: the next call stops that one)."""
        current = self.store.get_cluster(name)
        node = next((n for n in current.nodes if n.node_id == node_id), None) if current is not None else None
        if stopped is not None and node is not None and node.session_id == stopped:
            self._record_node(name, node_id, session_id=None)

    async def release(self, name: str, node_id: int) -> dict[str, Any]:
        cluster, _ = self._cluster(name)
        recorded = {node.node_id: node for node in cluster.nodes if node.node_id is not None}
        released = recorded[node_id].stopped if node_id in recorded else 0 < node_id < max(recorded, default=0)
        if released:  # recorded stopped, or its place given to another since (Ray asks again after an error)
            return {}
        try:
            index = releasable(cluster, node_id)
        except NodeRequestRefused as exc:
            raise Conflict(str(exc)) from None
        # Intent first: recorded stopped (out of worker_pids: never started or restarted again,
        # and its exit is no worker death) with its session kept, so a crash mid-stop leaves it
        # known; then stopped (as it was read: a provider skips a node recorded stopped); then
        # its session forgotten.
        self.releasing.add((name, node_id))
        try:
            self._record_node(name, node_id, stopped=True, pid=None)
            await self.controller.provider.stop_node(cluster, index)
            self._forget_session(name, node_id, cluster.nodes[index].session_id)
        finally:
            self.releasing.discard((name, node_id))
        self.tags.pop((name, node_id), None)
        message = f"Ray's autoscaler released node {node_id} of {name} (idle)"
        self.store.add_events([Event(cluster.service, self.controller.clock(), "Normal", "NodeRemoved", message)])
        return {}
