"""Host pool commands (issue 10): apply, list, get, delete, check.

A check connects to every host of a pool at once, from the daemon: the controller's own Ray and
Python are what every node must match, and its known_hosts files are what host keys are checked
against. A host that runs a node keeps its entry unchanged: a node is stopped through it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from servekeeper.commands.errors import Conflict, HostPoolNotFound, InvalidSpec
from servekeeper.model.hostpool import HostPoolRecord, HostPoolSpec, HostSpec, keep_stored_work_dirs, parse_host_pool
from servekeeper.model.spec import SpecError
from servekeeper.model.wire import HostCheckView, PoolCheckView
from servekeeper.providers.ssh import (
    AuthenticationRefused,
    HostKeyRefused,
    SshError,
    Versions,
    check_host,
    controller_versions,
    version_mismatch,
)
from servekeeper.store.store import Store
from servekeeper.views.hosts import Usage, host_check_view, pool_view, usage


async def check_one(host: HostSpec, controller: Versions, used: Usage | None = None) -> HostCheckView:
    """Connect to `host` and compare its Python and Ray with the controller's."""
    try:
        versions = await check_host(host)
    except SshError as exc:
        if exc.retryable:
            state = "unreachable"
        elif isinstance(exc, (HostKeyRefused, AuthenticationRefused)):
            state = "refused"
        else:
            state = "error"
        return host_check_view(host, used, state=state, problem=str(exc))
    problem = version_mismatch(host.name, versions, controller)
    state = "mismatch" if problem else "ok"
    return host_check_view(
        host,
        used,
        state=state,
        problem=problem,
        python=versions.python,
        ray=versions.ray,
        interpreters=versions.interpreters,
    )


def hosts_in_use(store: Store, pool: str) -> dict[str, set[str]]:
    """Host name -> the clusters with a node on it (any role, until the cluster is removed)."""
    in_use: dict[str, set[str]] = {}
    for cluster in store.list_clusters():
        if cluster.pool == pool:
            for node in (*cluster.nodes, *cluster.left_behind):  # a node a head move left may still run
                in_use.setdefault(node.host, set()).add(cluster.name)
    return in_use


class HostPoolCommands:
    def __init__(self, store: Store) -> None:
        self.store = store

    def record(self, name: str) -> HostPoolRecord:
        record = self.store.get_host_pool(name)
        if record is None:
            raise HostPoolNotFound(name)
        return record

    def apply(self, document: dict[str, Any]) -> dict[str, Any]:
        """Store a `kind: HostPool` document; InvalidSpec, or Conflict if it changes a host in use."""
        try:
            pool = parse_host_pool(document)
        except SpecError as exc:
            raise InvalidSpec(exc.problems) from exc
        # The check and the write in one transaction: a cluster stored meanwhile (its placement
        # compares the pool in the transaction that stores it) is seen, or sees this change.
        with self.store.transaction():
            previous = self.store.get_host_pool(pool.name)
            pool = keep_stored_work_dirs(pool, document, previous.spec() if previous else None)
            self._check_hosts_in_use_kept(pool)
            record, changed = self.store.apply_host_pool(pool.name, pool.to_json(), time.time())
        # Shaped like a service's apply answer; a pool has no generations.
        return {"name": record.name, "generation": 0, "changed": changed, "kind": "HostPool"}

    def _check_hosts_in_use_kept(self, pool: HostPoolSpec) -> None:
        in_use = hosts_in_use(self.store, pool.name)
        previous = self.store.get_host_pool(pool.name)
        if previous is None or not in_use:
            return
        before = {host.name: host for host in previous.spec().spec.hosts}
        after = {host.name: host for host in pool.spec.hosts}
        changed_hosts = sorted(h for h in in_use if before.get(h) is not None and after.get(h) != before.get(h))
        if changed_hosts:
            clusters = sorted({c for h in changed_hosts for c in in_use[h]})
            raise Conflict(
                f"hosts {changed_hosts} of pool {pool.name!r} run nodes of clusters {clusters}: "
                "they cannot be removed or changed until those clusters are gone"
            )

    def views(self) -> list[dict[str, Any]]:
        clusters = self.store.list_clusters()
        return [dict(pool_view(record, usage(clusters, record.name))) for record in self.store.list_host_pools()]

    def view(self, name: str) -> dict[str, Any]:
        return dict(pool_view(self.record(name), usage(self.store.list_clusters(), name)))

    def delete(self, name: str) -> dict[str, Any]:
        """Forget the pool; Conflict while any cluster has a node on one of its hosts."""
        with self.store.transaction():  # see `apply`
            self.record(name)
            in_use = hosts_in_use(self.store, name)
            if in_use:
                clusters = sorted({c for names in in_use.values() for c in names})
                raise Conflict(f"host pool {name!r} runs clusters {clusters}; delete them first")
            self.store.delete_host_pool(name)
        return {"name": name, "deleted": True}

    async def check(self, name: str) -> dict[str, Any]:
        """Every host of the pool checked at once against the controller's Ray and Python."""
        hosts = self.record(name).spec().spec.hosts
        controller = controller_versions()
        used = usage(self.store.list_clusters(), name)
        results = await asyncio.gather(*(check_one(host, controller, used) for host in hosts))
        check: PoolCheckView = {
            "name": name,
            "controller": {"python": controller.python, "ray": controller.ray},
            "ok": all(result["ok"] for result in results),
            "hosts": list(results),
        }
        return dict(check)  # plain for the routes: a TypedDict there would become FastAPI's response model
