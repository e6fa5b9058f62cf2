"""Apply a service spec or a KubeRay manifest: translate, validate, check capacity and ports,
package the code, store the spec as a new generation, prune packages no longer in use.

Everything that can refuse does so before anything is stored: a cluster that cannot be placed
never comes up, and a refused apply leaves the service as it was."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from servekeeper.commands.context import CommandContext
from servekeeper.commands.errors import InvalidSpec
from servekeeper.commands.services import ray_version
from servekeeper.controller.metrics import record_applied
from servekeeper.core.placement import insufficient_capacity
from servekeeper.core.serve_config import package_hash_of
from servekeeper.kuberay.translate import ImportResult, import_documents, kuberay_path
from servekeeper.model.documents import is_kuberay
from servekeeper.model.records import ServiceRecord
from servekeeper.model.spec import ServiceSpec, SpecError, parse_spec
from servekeeper.providers.environments import own_python
from servekeeper.providers.gcs_storage import storage_problems
from servekeeper.providers.machine import machine_capacity
from servekeeper.providers.pool_placement import pool_problems
from servekeeper.rayapi.package import PackageError, package_for_spec, prune_packages
from servekeeper.store.facts import import_fact_key
from servekeeper.store.secrets import read_secrets
from servekeeper.store.store import Store


class ApplyCommand:
    def __init__(self, context: CommandContext) -> None:
        self.context = context

    async def apply(self, documents: list[Any], base_dir: str | None) -> dict[str, Any]:
        """Apply one servekeeper spec document, or the documents of a KubeRay manifest
        (`base_dir`: the manifest's folder, for a relative `working_dir`). InvalidSpec names
        each field at fault, as the user wrote it (KubeRay paths for a manifest)."""
        try:
            spec, imported = self.translate(documents, base_dir)
        except SpecError as exc:
            raise InvalidSpec(exc.problems) from exc
        problems = self.capacity_problems(spec)
        if problems:
            raise InvalidSpec([kuberay_path(p) if imported else p for p in problems])
        async with self.context.packaging:  # checked and stored under one lock: two applies cannot take one port
            check_ports_free(self.context.store, spec)
            return await self._store_spec(spec, _import_fact(imported))

    def translate(self, documents: list[Any], base_dir: str | None) -> tuple[ServiceSpec, ImportResult | None]:
        """The spec to store, and how it was imported (None for a servekeeper spec); SpecError."""
        if is_kuberay(documents):
            secrets_dir = self.context.secrets_dir
            secrets = read_secrets(secrets_dir) if secrets_dir is not None else {}
            imported = import_documents(documents, ray_version(), secrets, base_dir, python_version=own_python())
            return imported.spec, imported
        if len(documents) != 1:
            raise SpecError([f"(document): expected exactly one YAML document, found {len(documents)}"])
        return parse_spec(documents[0]), None

    def capacity_problems(self, spec: ServiceSpec) -> list[str]:
        """Why the spec's cluster can never be placed (on its host pool, or on this machine)."""
        if spec.spec.rayClusterConfig.hostPool is not None:
            secrets_dir = self.context.secrets_dir
            secrets = read_secrets(secrets_dir) if secrets_dir is not None else {}
            return pool_problems(self.context.store, spec.spec.rayClusterConfig) + storage_problems(
                spec.spec.rayClusterConfig, secrets
            )
        return insufficient_capacity(spec, machine_capacity())

    async def _store_spec(self, spec: ServiceSpec, imported: dict[str, Any] | None) -> dict[str, Any]:
        packages_dir = self.context.packages_dir
        package_hash = None
        if packages_dir is not None:
            try:
                # Packaged now, at apply: what runs is what was applied, whatever the files become.
                package = await asyncio.to_thread(package_for_spec, spec, packages_dir)
            except PackageError as exc:
                raise InvalidSpec([f"spec.rayClusterConfig.workingDir: {exc}"]) from exc
            package_hash = package.hash if package else None
        store = self.context.store
        service, changed = store_spec(
            store, spec.name, spec.to_json(), package_hash, imported, history_limit=spec.spec.revisionHistoryLimit
        )
        if packages_dir is not None and changed:
            await asyncio.to_thread(prune_packages, packages_dir, packages_in_use(store))
        self.context.controller.wake(spec.name)
        return {"name": service.name, "generation": service.generation, "changed": changed}


def store_spec(
    store: Store,
    name: str,
    spec_json: str,
    package_hash: str | None,
    imported: dict[str, Any] | None,
    *,
    history_limit: int,
    cause: str = "apply",
) -> tuple[ServiceRecord, bool]:
    """Store the spec, how it was imported (`imported`: its secret references, for the service
    and for this revision, so that `undo` brings them back) and when it was applied (rollout
    durations), in one transaction: an export never sees a spec without its secret references.
    Returns (record, changed)."""
    now = time.time()
    with store.transaction():
        service, changed = store.apply_spec(
            name, spec_json, now, package_hash=package_hash, cause=cause, history_limit=history_limit
        )
        store.set_fact(import_fact_key(name), imported)
        store.set_fact(import_fact_key(name, service.generation), imported)
        if changed:
            record_applied(store, service.name, service.generation, now)
    return service, changed


def check_ports_free(store: Store, spec: ServiceSpec) -> None:
    """InvalidSpec when another service's ingress holds one of the spec's ports (apply and undo)."""
    wanted = {spec.spec.ingress.port, spec.spec.ingress.grpcPort, spec.spec.ingress.previewPort} - {None}
    for other in store.list_services():
        if other.name == spec.name or other.deleting:
            continue
        ingress = ServiceSpec.model_validate_json(other.spec_json).spec.ingress
        taken = sorted(p for p in wanted & {ingress.port, ingress.grpcPort, ingress.previewPort} if p is not None)
        if taken:
            raise InvalidSpec([f"spec.ingress.port: port {taken[0]} is used by service {other.name!r}"])


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


def _import_fact(imported: ImportResult | None) -> dict[str, Any] | None:
    if imported is None:
        return None
    return {
        "source": imported.source,
        "notes": [note.to_json() for note in imported.notes],
        "secretRefs": [ref.to_json() for ref in imported.secret_refs],
    }
