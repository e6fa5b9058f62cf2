"""Stop what a state dir owns when no daemon runs (it was killed): used by `servekeeper down`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from servekeeper.dataplane import DataPlane
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.router import ProviderRouter
from servekeeper.store.store import Store


@dataclass
class OfflineStop:
    stopped: int = 0
    # Clusters kept on record, each with why: a node that did not stop (a silent host, a
    # process that resisted) stays known, so the next `down` or `up` stops it.
    kept: list[str] = field(default_factory=list)


async def stop_everything_offline(state_dir: Path) -> OfflineStop:
    result = OfflineStop()
    if not (state_dir / "store.db").exists():
        return result
    store = Store(state_dir / "store.db")
    try:
        # The same providers as the daemon's: a cluster on a host pool is stopped on its hosts too.
        provider = ProviderRouter(LocalProvider(), PoolProvider(store, state_dir))
        try:
            # All at once: a silent host costs its timeouts once, not once per cluster.
            clusters = store.list_clusters()
            outcomes = await asyncio.gather(*(_stop_one(provider, store, cluster) for cluster in clusters))
        finally:
            await provider.close()
        for cluster, problem in zip(clusters, outcomes, strict=True):
            if problem is None:
                result.stopped += 1
            else:
                result.kept.append(f"{cluster.name}: {problem}")
        if (state_dir / "dataplane").is_dir():
            dataplane = DataPlane(state_dir)
            await dataplane.stop()  # the recorded Envoy processes, without starting any
            dataplane.forget_routes()  # the next `up` starts with no route to a stopped cluster
        return result
    finally:
        store.close()


async def _stop_one(provider: ClusterProvider, store: Store, cluster: ClusterRecord) -> str | None:
    """None when every process of the cluster is gone (its record removed); else why it is kept."""
    def record(**changes: object) -> None:  # a node stopped for sure is never stopped again
        store.update_cluster(cluster.name, **changes)

    try:
        left = await provider.stop(cluster, record)
    except (ProviderError, OSError) as exc:
        return f"not stopped: {exc}"
    if left:
        return f"still running after the stop: pids {', '.join(map(str, left))}"
    store.remove_cluster(cluster.name)
    return None
