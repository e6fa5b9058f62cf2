"""Reading services (one view, every view, events), exporting one as KubeRay, deleting one."""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

from servekeeper.commands.context import CommandContext
from servekeeper.commands.errors import Conflict, Invalid, ServiceNotFound
from servekeeper.kuberay.export import SecretInExport, export_manifest, render_manifest
from servekeeper.kuberay.notes import SecretRef
from servekeeper.model.spec import ServiceSpec
from servekeeper.store.facts import import_fact_key
from servekeeper.store.secrets import read_secrets
from servekeeper.views.service import event_view, service_view

MAX_EVENTS = 1000


def ray_version() -> str:
    """The Ray every cluster runs (`ray.__version__`), read without importing Ray."""
    return importlib.metadata.version("ray")


class ServiceCommands:
    def __init__(self, context: CommandContext) -> None:
        self.context = context

    def view(self, name: str) -> dict[str, Any]:
        """The service as `get` shows it, with how it was imported; ServiceNotFound if unknown."""
        store = self.context.store
        service = store.get_service(name)
        if service is None:
            raise ServiceNotFound(name)
        spec = ServiceSpec.model_validate_json(service.spec_json)
        snapshot = self.context.controller.status_snapshot(name)
        result = service_view(service, spec.spec.ingress.port, store.list_clusters(name), snapshot, time.time())
        imported = store.get_fact(import_fact_key(name)) or {}
        result["importedFrom"] = imported.get("source")
        result["importNotes"] = imported.get("notes", [])
        return dict(result)  # plain for the routes: a TypedDict there would become FastAPI's response model

    def find(self, name: str) -> dict[str, Any] | None:
        """The view, or None for an unknown service."""
        return self.view(name) if self.context.store.get_service(name) is not None else None

    def views(self) -> list[dict[str, Any]]:
        return [self.view(service.name) for service in self.context.store.list_services()]

    def events(self, service: str | None, limit: int) -> list[dict[str, Any]]:
        """The latest `limit` events (1 to MAX_EVENTS) of one service, or of all."""
        return [dict(event_view(e)) for e in self.context.store.list_events(service, max(1, min(limit, MAX_EVENTS)))]

    def export(self, name: str, output_format: str) -> dict[str, Any]:
        """The service as a KubeRay RayService manifest, with the secret references it was imported with;
        an env value equal to a stored secret's is a reference too, and Conflict (naming the secret,
        not its value) when a secret's value would still be in the text."""
        if output_format != "kuberay":
            raise Invalid([f"format: {output_format!r} is not 'kuberay'"])
        store = self.context.store
        service = store.get_service(name)
        if service is None:
            raise ServiceNotFound(name)
        spec = ServiceSpec.model_validate_json(service.spec_json)
        imported = store.get_fact(import_fact_key(name)) or {}
        refs = [SecretRef.from_json(ref) for ref in imported.get("secretRefs", [])]
        secrets_dir = self.context.secrets_dir
        try:
            manifest, comments = export_manifest(
                spec, ray_version(), refs, read_secrets(secrets_dir) if secrets_dir is not None else {}
            )
        except SecretInExport as exc:
            raise Conflict(f"service {name!r}: {exc}") from exc
        return {"format": "kuberay", "manifest": render_manifest(manifest, comments)}

    def delete(self, name: str) -> dict[str, Any]:
        """Mark the service deleting; the controller stops its clusters and removes its route."""
        if self.context.store.mark_deleting(name) is None:
            raise ServiceNotFound(name)
        self.context.controller.wake(name)
        return {"name": name, "deleting": True}
