"""Rollout routes: promote, abort, history, undo (the commands are in commands/rollouts.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from servekeeper.commands.rollouts import RolloutCommands


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    full: bool = False  # skip every remaining step and analysis


class UndoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    toRevision: int | None = None  # None: the last revision that rolled out before the current one


def rollout_routes(commands: RolloutCommands) -> APIRouter:
    router = APIRouter()

    @router.post("/api/v1/services/{name}/promote")
    async def promote(name: str, body: PromoteRequest) -> dict[str, Any]:
        return await commands.promote(name, body.full)

    @router.post("/api/v1/services/{name}/abort")
    async def abort(name: str) -> dict[str, Any]:
        return await commands.abort(name)

    @router.get("/api/v1/services/{name}/history")
    async def history(name: str) -> dict[str, Any]:
        return commands.history(name)

    @router.post("/api/v1/services/{name}/undo")
    async def undo(name: str, body: UndoRequest) -> dict[str, Any]:
        return await commands.undo(name, body.toRevision)

    return router
