"""Stop what a state dir owns when no daemon runs (it was killed): used by `servekeeper down`."""

from __future__ import annotations

import contextlib
from pathlib import Path

from servekeeper.ingress.client import stop_ingress
from servekeeper.providers.local import LocalProvider
from servekeeper.store import Store


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
        known = store.get_fact("ingress")
        if known:
            await stop_ingress(known["pid"])
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "ingress-routes.json").unlink()
        return len(clusters)
    finally:
        store.close()
