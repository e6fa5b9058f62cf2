"""Host pool routes (issue 10), behind the API's bearer token like every route (the app's
middleware). The commands are in commands/hosts.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from servekeeper.commands.hosts import HostPoolCommands


class HostPoolRequest(BaseModel):
    spec: dict[str, Any]


def host_routes(pools: HostPoolCommands) -> APIRouter:
    router = APIRouter()

    @router.post("/api/v1/hostpools")
    async def apply_host_pool(body: HostPoolRequest) -> dict[str, Any]:
        return pools.apply(body.spec)

    @router.get("/api/v1/hostpools")
    async def list_host_pools() -> list[dict[str, Any]]:
        return pools.views()

    @router.get("/api/v1/hostpools/{name}")
    async def get_host_pool(name: str) -> dict[str, Any]:
        return pools.view(name)

    @router.delete("/api/v1/hostpools/{name}")
    async def delete_host_pool(name: str) -> dict[str, Any]:
        return pools.delete(name)

    @router.post("/api/v1/hostpools/{name}/check")
    async def check_host_pool(name: str) -> dict[str, Any]:
        return await pools.check(name)

    return router
