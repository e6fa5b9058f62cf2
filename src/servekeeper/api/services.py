"""Service routes: apply, list, get, export, delete, events."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from servekeeper.commands.apply import ApplyCommand
from servekeeper.commands.services import ServiceCommands


class ApplyRequest(BaseModel):
    """A servekeeper spec (`spec`), or a KubeRay manifest: one document as `spec`, or every
    document of a multi-document file as `documents`, with `baseDir` (the file's folder) to
    resolve a relative `working_dir`."""

    spec: dict[str, Any] | None = None
    documents: list[Any] | None = None
    baseDir: str | None = None


def service_routes(services: ServiceCommands, applying: ApplyCommand) -> APIRouter:
    router = APIRouter()

    @router.post("/api/v1/services")
    async def apply(body: ApplyRequest) -> dict[str, Any]:
        documents = body.documents if body.documents is not None else [body.spec]
        return await applying.apply(documents, body.baseDir)

    @router.get("/api/v1/services")
    async def list_services() -> list[dict[str, Any]]:
        return services.views()

    @router.get("/api/v1/services/{name}")
    async def get_service(name: str) -> dict[str, Any]:
        return services.view(name)

    @router.get("/api/v1/services/{name}/export")
    async def export(name: str, format: str = "kuberay") -> dict[str, Any]:
        return services.export(name, format)

    @router.delete("/api/v1/services/{name}")
    async def delete_service(name: str) -> dict[str, Any]:
        return services.delete(name)

    return router


def event_routes(services: ServiceCommands) -> APIRouter:
    router = APIRouter()

    @router.get("/api/v1/events")
    async def events(service: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return services.events(service, limit)

    return router
