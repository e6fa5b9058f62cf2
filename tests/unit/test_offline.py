"""`servekeeper down` without a daemon stops what the state dir owns through the same providers
as the daemon: a cluster on a host pool is stopped on its hosts, not orphaned there."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from servekeeper import offline
from servekeeper.cli import common as cli_common
from servekeeper.cli.main import app
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.providers.pool import PoolProvider
from servekeeper.store.store import Store
from servekeeper.testing.harness import state_dir_locked
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import draft, pool_spec


async def test_an_offline_down_stops_a_pool_cluster_on_its_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    fleet = FakeFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    config = pool_spec(workers=1, cpus=4).spec.rayClusterConfig
    cluster = await pools.create(draft("c", config), config, store)

    def record(**changes: Any) -> None:
        store.update_cluster("c", **changes)

    await pools.start_nodes(cluster, config, record)
    await pools.close()
    store.close()
    assert sorted(fleet.running) == sorted(node.temp_dir for node in cluster.nodes)

    def fleet_pools(store: Store, state_dir: Path) -> PoolProvider:
        return PoolProvider(store, state_dir, ssh_nodes=fleet)

    monkeypatch.setattr(offline, "PoolProvider", fleet_pools)
    result = await offline.stop_everything_offline(tmp_path)
    assert (result.stopped, result.kept) == (1, [])
    assert fleet.running == {}  # both nodes stopped on their hosts
    assert not (tmp_path / "tokens" / "c.token").exists()
    store = Store(tmp_path / "store.db")
    assert store.list_clusters() == []
    store.close()


async def test_an_offline_down_keeps_a_cluster_whose_node_resists_and_stops_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "store.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    fleet = FakeFleet()
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    config = pool_spec(workers=0, cpus=4).spec.rayClusterConfig
    resisting = await pools.create(draft("resisting", config), config, store)
    other = await pools.create(draft("other", config), config, store)
    for cluster in (resisting, other):

        def record(name: str = cluster.name, **changes: Any) -> None:
            store.update_cluster(name, **changes)

        await pools.start_nodes(cluster, config, record)
    await pools.close()
    store.close()
    fleet.leftovers[resisting.nodes[0].temp_dir] = [4242]  # survives SIGKILL on its host

    def fleet_pools(store: Store, state_dir: Path) -> PoolProvider:
        return PoolProvider(store, state_dir, ssh_nodes=fleet)

    monkeypatch.setattr(offline, "PoolProvider", fleet_pools)
    result = await offline.stop_everything_offline(tmp_path)
    assert result.stopped == 1 and len(result.kept) == 1
    assert result.kept[0].startswith("resisting: still running after the stop: ") and "4242" in result.kept[0]
    store = Store(tmp_path / "store.db")
    assert [c.name for c in store.list_clusters()] == ["resisting"]  # known, so a later `down` stops it
    store.close()


HOLDER = """
import fcntl, os, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
handle.seek(0)
handle.truncate()
# A daemon from before the pid was written leaves it empty.
handle.write(str(os.getpid()) if sys.argv[2] == "pid" else "")
handle.flush()
print("held", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def lock_held_by_another_process(state_dir: Path, written: str) -> Iterator[subprocess.Popen[str]]:
    """A process holding controller.lock with no API, like a daemon before it announces (or a
    daemon from before this version, which never wrote its pid: `written` empty)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state_dir / "controller.lock"), written],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


async def running_pool_cluster(state_dir: Path, fleet: FakeFleet) -> None:
    store = Store(state_dir / "store.db")
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4), ("b", 4))).to_json(), 1.0)
    pools = PoolProvider(store, state_dir, ssh_nodes=fleet)
    config = pool_spec(workers=1, cpus=4).spec.rayClusterConfig
    cluster = await pools.create(draft("c", config), config, store)

    def record(**changes: Any) -> None:
        store.update_cluster("c", **changes)

    await pools.start_nodes(cluster, config, record)
    await pools.close()
    store.close()


@pytest.mark.parametrize(
    ("written", "said"),
    [
        pytest.param("HOLDER_PID", "kill HOLDER_PID", id="pid-in-lock"),
        pytest.param("", "before this version", id="daemon-from-before-this-version"),
    ],
)
def test_down_refuses_while_a_silent_daemon_holds_the_lock_and_stops_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, said: str
) -> None:
    fleet = FakeFleet()
    asyncio.run(running_pool_cluster(tmp_path, fleet))
    running_before = dict(fleet.running)

    def fleet_pools(store: Store, state_dir: Path) -> PoolProvider:
        return PoolProvider(store, state_dir, ssh_nodes=fleet)

    monkeypatch.setattr(offline, "PoolProvider", fleet_pools)
    monkeypatch.setattr(cli_common, "errors", Console(width=400, stderr=True))  # no wrapped lines
    with lock_held_by_another_process(tmp_path, "pid" if written else "") as holder:
        result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])
        expected = said.replace("HOLDER_PID", str(holder.pid))
    assert result.exit_code == 1, result.output
    assert "holds the state dir's lock but does not answer" in result.stderr
    assert expected in result.stderr
    assert fleet.running == running_before  # nothing stopped under a live daemon
    store = Store(tmp_path / "store.db")
    assert [c.name for c in store.list_clusters()] == ["c"]
    store.close()


async def test_the_offline_stop_holds_the_lock_so_a_starting_daemon_waits_or_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = FakeFleet()
    await running_pool_cluster(tmp_path, fleet)
    seen: list[bool] = []

    class ProbingPools(PoolProvider):
        async def close(self) -> None:
            seen.append(lock_is_free(tmp_path))
            await super().close()

    def fleet_pools(store: Store, state_dir: Path) -> PoolProvider:
        return ProbingPools(store, state_dir, ssh_nodes=fleet)

    monkeypatch.setattr(offline, "PoolProvider", fleet_pools)
    (tmp_path / "controller.lock").write_text("4242")  # a killed daemon's, and its api.json
    (tmp_path / "api.json").write_text('{"url": "http://127.0.0.1:9", "pid": 4242}')
    result = await offline.stop_everything_offline(tmp_path)
    assert (result.stopped, seen) == (1, [False])  # held while stopping
    assert lock_is_free(tmp_path)  # and let go after
    # Like a daemon taking the lock: no stale pair left for a client to send the token to.
    assert not (tmp_path / "api.json").exists()
    assert (tmp_path / "controller.lock").read_text() != "4242"


def lock_is_free(state_dir: Path) -> bool:
    return not state_dir_locked(state_dir)


def test_down_refuses_a_silent_daemon_that_has_not_made_its_store_yet(tmp_path: Path) -> None:
    with lock_held_by_another_process(tmp_path, "pid"):
        result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "servekeeper is down" not in result.output
