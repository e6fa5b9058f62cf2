"""Stop what a state dir owns when no daemon runs (it was killed): used by `servekeeper down`."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from servekeeper.client.common import LOCK_FILE_NAME
from servekeeper.dataplane import DataPlane
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.providers.environments import environments_of
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.redis_server import RedisServer, redis_dir
from servekeeper.providers.router import ProviderRouter
from servekeeper.store.store import Store


@dataclass
class OfflineStop:
    stopped: int = 0
    # Clusters kept on record, each with why: a node that did not stop (a silent host, a
    # process that resisted) stays known, so the next `down` or `up` stops it.
    kept: list[str] = field(default_factory=list)


class StateDirBusy(RuntimeError):
    """Someone holds the state dir's lock: a daemon that does not answer (starting, under load,
    or from before daemons wrote their pid in the lock). Stopping its clusters under it would
    leave it managing clusters that are gone."""

    def __init__(self, state_dir: Path, pid: int | None) -> None:
        self.pid = pid
        if pid is not None:
            who, how = f"pid {pid}", f"kill {pid}"
        else:
            who = "pid unknown: its lock file is empty, so it may be a daemon from before this version"
            how = f"find it with `fuser {state_dir / LOCK_FILE_NAME}`, then kill PID"
        super().__init__(
            f"a daemon ({who}) holds the state dir's lock but does not answer: "
            f"wait for it, or stop it ({how}); nothing was stopped"
        )


LOCK_TRIES = 10  # a client's probe holds the lock for microseconds: try again a moment later
LOCK_RETRY_S = 0.05


@contextlib.contextmanager
def _controller_lock(state_dir: Path) -> Iterator[None]:
    """Hold the state dir's lock the way a daemon does, for as long as the offline stop runs:
    a daemon starting meanwhile waits for it or refuses; StateDirBusy when a daemon holds it."""
    fd = os.open(state_dir / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        for attempt in range(LOCK_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt + 1 < LOCK_TRIES:
                    time.sleep(LOCK_RETRY_S)
                    continue
                written = os.read(fd, 32).decode(errors="replace").strip()
                raise StateDirBusy(state_dir, int(written) if written.isdigit() else None) from None
        # As a daemon taking the lock does: the dead daemon's pid and api.json go, so no client
        # pairs them (its pid may be reused) and sends the token to a port anyone may bind now.
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "api.json").unlink()
        yield  # closing the descriptor lets the lock go
    finally:
        os.close(fd)


async def stop_everything_offline(state_dir: Path) -> OfflineStop:
    """Raises StateDirBusy (stopping nothing) when a daemon holds the state dir's lock."""
    if not state_dir.is_dir():
        return OfflineStop()
    with _controller_lock(state_dir):  # even with no store yet: a starting daemon makes it next
        if not (state_dir / "store.db").exists():
            return OfflineStop()
        return await _stop_everything(state_dir)


async def _stop_everything(state_dir: Path) -> OfflineStop:
    result = OfflineStop()
    store = Store(state_dir / "store.db")
    try:
        # The same providers as the daemon's: a cluster on a host pool is stopped on its hosts too.
        local = LocalProvider(environments=environments_of(state_dir))
        provider = ProviderRouter(local, PoolProvider(store, state_dir))
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
        if not result.kept:  # no GCS needs it any more
            await asyncio.to_thread(RedisServer(redis_dir(state_dir)).stop)
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
