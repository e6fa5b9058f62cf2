"""The daemon's HTTP API (loopback, bearer token), used by the CLI. FastAPI gives the OpenAPI
document for free, which is also what the API fuzz run reads.

Every handler is `async def`, so it runs on the event loop that uvicorn shares with the
controller (see daemon.py), never in a worker thread: `controller.wake()` sets an
`asyncio.Event`, which is only safe on its own loop, and a handler's reads and writes cannot
interleave with another handler's or with a controller tick (none of them awaits in between).
The store calls are short SQLite transactions, so running them on the loop is fine."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from servekeeper.api.hosts import add_host_routes
from servekeeper.api.rollouts import RolloutCommands, add_rollout_routes, check_ports_free
from servekeeper.controller.loop import Controller
from servekeeper.controller.metrics import CONTENT_TYPE, Metrics, record_applied
from servekeeper.core.placement import insufficient_capacity
from servekeeper.core.serve_config import package_hash_of
from servekeeper.kuberay.export import export_manifest, render_manifest
from servekeeper.kuberay.notes import SecretRef
from servekeeper.kuberay.translate import ImportResult, import_documents, is_kuberay, kuberay_path
from servekeeper.model.spec import ServiceSpec, SpecError, parse_spec
from servekeeper.providers.machine import machine_capacity
from servekeeper.providers.pool import pool_problems
from servekeeper.rayapi.package import PackageError, package_for_spec, prune_packages
from servekeeper.store.secrets import read_secrets
from servekeeper.store.store import Store
from servekeeper.views.service import event_view, service_view
from servekeeper.web.pages import Dashboard, ViewSource, dashboard_router

IMPORT_FACT = "import:{name}"  # how a service's spec was imported (KubeRay notes, secret refs)


class ApplyRequest(BaseModel):
    """A servekeeper spec (`spec`), or a KubeRay manifest: one document as `spec`, or every
    document of a multi-document file as `documents`, with `baseDir` (the file's folder) to
    resolve a relative `working_dir`."""

    spec: dict[str, Any] | None = None
    documents: list[Any] | None = None
    baseDir: str | None = None


class ShutdownRequest(BaseModel):
    stopClusters: bool = True


def packages_in_use(store: Store) -> set[str]:
    """Code packages a service wants or a cluster runs, or would get back after a failed change."""
    keep = {s.package_hash for s in store.list_services()}
    for service in store.list_services():  # what `undo` may roll back to
        keep.update(revision.package_hash for revision in store.list_revisions(service.name))
    for cluster in store.list_clusters():
        keep.add(cluster.package_hash)
        for config_hash in (cluster.good_config_hash, cluster.applied_config_hash, cluster.submitted_config_hash):
            document = store.submitted_document(cluster.name, config_hash) if config_hash else None
            keep.add(package_hash_of(document) if document else None)
    return {h for h in keep if h is not None}


def build_app(
    controller: Controller,
    store: Store,
    token: str,
    request_shutdown: Callable[[bool], Awaitable[None]],
    packages_dir: Path | None = None,
    secrets_dir: Path | None = None,
    dashboard: Dashboard | None = None,
) -> FastAPI:
    """`packages_dir`: where code packages go (the daemon's state dir); without it, a local
    workingDir is handed to Ray as a live `local://` path (unit tests of the API only).
    `secrets_dir`: `servekeeper secret`s for KubeRay's secretKeyRef (default: beside packages_dir)."""
    if secrets_dir is None and packages_dir is not None:
        secrets_dir = packages_dir.parent / "secrets"
    app = FastAPI(title="servekeeper", version="v1alpha1", docs_url=None, redoc_url=None)
    expected = f"Bearer {token}".encode()
    # Applies one at a time from packaging to pruning: a prune never removes the package of
    # an apply whose spec is not stored yet.
    packaging = asyncio.Lock()

    @app.middleware("http")
    async def authorized(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # Before routing and body validation: a caller without the token learns nothing and
        # changes nothing. Only the OpenAPI document (public knowledge) is open. The dashboard
        # (/ui) takes no token: its own router requires its session cookie (ui/auth.py).
        path = request.url.path
        if path != "/openapi.json" and not (dashboard is not None and (path == "/ui" or path.startswith("/ui/"))):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)

    def view(name: str) -> dict[str, Any]:
        service = store.get_service(name)
        if service is None:
            raise HTTPException(status_code=404, detail=f"service {name!r} not found")
        spec = ServiceSpec.model_validate_json(service.spec_json)
        result = service_view(
            service, spec.spec.ingress.port, store.list_clusters(name), controller.status_snapshot(name), time.time()
        )
        imported = store.get_fact(IMPORT_FACT.format(name=name)) or {}
        result["importedFrom"] = imported.get("source")
        result["importNotes"] = imported.get("notes", [])
        return dict(result)  # a plain dict for the routes: a TypedDict there would become FastAPI's response model

    def translate(body: ApplyRequest) -> tuple[ServiceSpec, ImportResult | None]:
        documents = body.documents if body.documents is not None else [body.spec]
        if is_kuberay(documents):
            secrets = read_secrets(secrets_dir) if secrets_dir is not None else {}
            imported = import_documents(documents, _ray_version(), secrets, body.baseDir)
            return imported.spec, imported
        if len(documents) != 1:
            raise SpecError([f"(document): expected exactly one YAML document, found {len(documents)}"])
        return parse_spec(documents[0]), None

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/api/v1/services")
    async def apply(body: ApplyRequest) -> dict[str, Any]:
        try:
            spec, imported = translate(body)
            # Refused here, before anything starts: a cluster that cannot be placed never comes up.
            if spec.spec.rayClusterConfig.hostPool is not None:
                capacity_problems = pool_problems(store, spec.spec.rayClusterConfig)
            else:
                capacity_problems = insufficient_capacity(spec, machine_capacity())
            if capacity_problems:
                raise SpecError([kuberay_path(p) if imported else p for p in capacity_problems])
        except SpecError as exc:
            raise HTTPException(status_code=422, detail={"problems": exc.problems}) from exc
        async with packaging:  # checked and stored under one lock: two applies cannot take one port
            check_ports_free(store, spec)
            result = await _store_spec(spec)
            store.set_fact(
                IMPORT_FACT.format(name=spec.name),
                {
                    "source": imported.source,
                    "notes": [note.to_json() for note in imported.notes],
                    "secretRefs": [ref.to_json() for ref in imported.secret_refs],
                }
                if imported
                else None,
            )
            return result

    async def _store_spec(spec: ServiceSpec) -> dict[str, Any]:
        package_hash = None
        if packages_dir is not None:
            try:
                # Packaged now, at apply: what runs is what was applied, whatever the files become.
                package = await asyncio.to_thread(package_for_spec, spec, packages_dir)
            except PackageError as exc:
                raise HTTPException(
                    status_code=422, detail={"problems": [f"spec.rayClusterConfig.workingDir: {exc}"]}
                ) from exc
            package_hash = package.hash if package else None
        now = time.time()
        with store.transaction():  # the spec and when it was applied (rollout durations), together
            service, changed = store.apply_spec(
                spec.name,
                spec.to_json(),
                now,
                package_hash=package_hash,
                history_limit=spec.spec.revisionHistoryLimit,
            )
            if changed:
                record_applied(store, service.name, service.generation, now)
        if packages_dir is not None and changed:
            await asyncio.to_thread(prune_packages, packages_dir, packages_in_use(store))
        controller.wake(spec.name)
        return {"name": service.name, "generation": service.generation, "changed": changed}

    @app.get("/api/v1/services")
    async def list_services() -> list[dict[str, Any]]:
        return [view(service.name) for service in store.list_services()]

    @app.get("/api/v1/services/{name}")
    async def get_service(name: str) -> dict[str, Any]:
        return view(name)

    @app.get("/api/v1/services/{name}/export")
    async def export(name: str, format: str = "kuberay") -> dict[str, Any]:
        if format != "kuberay":
            raise HTTPException(status_code=422, detail={"problems": [f"format: {format!r} is not 'kuberay'"]})
        service = store.get_service(name)
        if service is None:
            raise HTTPException(status_code=404, detail=f"service {name!r} not found")
        spec = ServiceSpec.model_validate_json(service.spec_json)
        imported = store.get_fact(IMPORT_FACT.format(name=name)) or {}
        refs = [SecretRef.from_json(ref) for ref in imported.get("secretRefs", [])]
        manifest, comments = export_manifest(spec, _ray_version(), refs)
        return {"format": "kuberay", "manifest": render_manifest(manifest, comments)}

    @app.delete("/api/v1/services/{name}")
    async def delete_service(name: str) -> dict[str, Any]:
        if store.mark_deleting(name) is None:
            raise HTTPException(status_code=404, detail=f"service {name!r} not found")
        controller.wake(name)
        return {"name": name, "deleting": True}

    commands = RolloutCommands(store, controller, packaging, packages_dir)
    add_rollout_routes(app, commands)

    @app.get("/api/v1/events")
    async def events(service: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return [dict(event_view(e)) for e in store.list_events(service, max(1, min(limit, 1000)))]

    @app.post("/api/v1/shutdown")
    async def shutdown(body: ShutdownRequest) -> dict[str, Any]:
        await request_shutdown(body.stopClusters)
        return {"ok": True}

    add_host_routes(app, store)  # /api/v1/hostpools: host pools for multi-host clusters (issue 10)

    if dashboard is not None:

        def view_or_none(name: str) -> dict[str, Any] | None:
            return view(name) if store.get_service(name) is not None else None

        source = ViewSource(
            services=lambda: [view(service.name) for service in store.list_services()],
            service=view_or_none,
            events=lambda name, limit: [dict(event_view(e)) for e in store.list_events(name, limit)],
            commands=commands,
        )
        app.include_router(dashboard_router(dashboard, source))

    return app


def _ray_version() -> str:
    """The Ray every cluster runs (`ray.__version__`), read without importing Ray."""
    return importlib.metadata.version("ray")


def add_metrics_route(app: FastAPI, metrics: Metrics) -> None:
    """`GET /metrics` (Prometheus text format). On the API app it is behind the token like every
    call there; `build_metrics_app` serves it alone without one (`up --metrics-port`, loopback)."""

    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"], include_in_schema=False)


def build_metrics_app(metrics: Metrics) -> FastAPI:
    app = FastAPI(title="servekeeper metrics", docs_url=None, redoc_url=None, openapi_url=None)
    add_metrics_route(app, metrics)
    return app
