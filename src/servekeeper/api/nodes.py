"""The node API Ray's autoscaler calls from a cluster's head (issue 22), through
providers/node_provider. Each route takes the daemon's token or the cluster's own node token
(api/app.py: `node_route_cluster`); the commands are in commands/nodes.py."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from servekeeper.commands.nodes import NodeCommands

NODE_ROUTE = re.compile(r"/api/v1/clusters/([A-Za-z0-9.-]+)/nodes(?:/[^/]+(?:/tags)?)?")


def node_route_cluster(path: str) -> str | None:
    """The cluster a node route names (None: not a node route)."""
    match = NODE_ROUTE.fullmatch(path)  # (`$` would also let a trailing newline through)
    return match.group(1) if match else None


# Ray's own tags are a handful of short strings; these bounds keep what is held per node small.
Tags = Annotated[
    dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=1024)]], Field(max_length=32)
]


class LaunchRequest(BaseModel):
    type: str = Field(min_length=1, max_length=63)
    count: int = Field(ge=1, le=64)
    tags: Tags = Field(default_factory=dict)


class TagsRequest(BaseModel):
    tags: Tags


def node_routes(nodes: NodeCommands) -> APIRouter:
    router = APIRouter()

    @router.get("/api/v1/clusters/{cluster}/nodes")
    async def list_nodes(cluster: str) -> dict[str, Any]:
        return await nodes.nodes(cluster)

    @router.post("/api/v1/clusters/{cluster}/nodes")
    async def launch_nodes(cluster: str, body: LaunchRequest) -> dict[str, Any]:
        return await nodes.launch(cluster, body.type, body.count, body.tags)

    @router.post("/api/v1/clusters/{cluster}/nodes/{node_id}/tags")
    async def set_node_tags(cluster: str, node_id: int, body: TagsRequest) -> dict[str, Any]:
        return nodes.set_tags(cluster, node_id, body.tags)

    @router.delete("/api/v1/clusters/{cluster}/nodes/{node_id}")
    async def release_node(cluster: str, node_id: int) -> dict[str, Any]:
        return await nodes.release(cluster, node_id)

    return router
