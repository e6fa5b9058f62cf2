"""Stop what a state dir owns when no daemon runs (it was killed): used by `servekeeper down`."""

from __future__ import annotations

from pathlib import Path

from servekeeper.dataplane import DataPlane
from servekeeper.providers.local import LocalProvider
from servekeeper.store.store import Store


async def stop_everything_offline(state_dir: Path) -> int:
    if not (state_dir / "store.db").exists():
        return 0
    store = Store(state_dir / "store.db")
    try:
        provider = LocalProvider()
        clusters = store.list_clusters()
        for cluster in clusters:
            await provider.stop(cluster)
            store.remove_cluster(cluster.name)
        if (state_dir / "dataplane").is_dir():
            dataplane = DataPlane(state_dir)
            await dataplane.stop()  # the recorded Envoy processes, without starting any
            dataplane.forget_routes()  # the next `up` starts with no route to a stopped cluster
        return len(clusters)
    finally:
        store.close()
