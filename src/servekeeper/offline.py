"""Stop what a state dir owns when no daemon runs (it was killed): used by `servekeeper down`."""

from __future__ import annotations

from pathlib import Path

from servekeeper.dataplane import DataPlane
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.pool import PoolClusters
from servekeeper.providers.router import ProviderRouter
from servekeeper.store.store import Store


async def stop_everything_offline(state_dir: Path) -> int:
    if not (state_dir / "store.db").exists():
        return 0
    store = Store(state_dir / "store.db")
    try:
        # The same providers as the daemon's: a cluster on a host pool is stopped on its hosts too.
        provider = ProviderRouter(LocalProvider(), PoolClusters(store, state_dir))
        clusters = store.list_clusters()
        try:
            for cluster in clusters:
                await provider.stop(cluster)
                store.remove_cluster(cluster.name)
        finally:
            await provider.close()
        if (state_dir / "dataplane").is_dir():
            dataplane = DataPlane(state_dir)
            await dataplane.stop()  # the recorded Envoy processes, without starting any
            dataplane.forget_routes()  # the next `up` starts with no route to a stopped cluster
        return len(clusters)
    finally:
        store.close()
