"""Which node a local start adopts (providers/local.py `start_nodes`), its process functions
replaced: a worker a dead controller spawned and never recorded is adopted while its head kept
running, and stopped and started afresh when the same start started the head again (its raylet
joined a GCS that is gone)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.providers import local
from servekeeper.providers.base import with_nodes
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.local_nodes import node_tag
from tests.unit.test_autoscaling_config import autoscaled_cluster

UNRECORDED = 999  # the `ray start` of worker 1 a dead controller spawned and never recorded


class SpawnRecorder(LocalProvider):
    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[int] = []
        self.pids = itertools.count(500)

    def _spawn_node(self, cluster: ClusterRecord, config: RayClusterConfigSpec, index: int) -> int:
        self.spawned.append(index)
        return next(self.pids)


@pytest.fixture
def stopped_tags(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tags whose leftovers a start stopped; no process is looked at or started."""
    stopped: list[str] = []

    async def port_open(*_: Any) -> bool:
        return True

    async def raylets_up(*_: Any) -> None:
        return None

    worker_tag = node_tag(autoscaled_cluster()[0], 1)

    def leader(tag: str, temp_dir: str) -> int | None:
        return UNRECORDED if tag == worker_tag else None

    monkeypatch.setattr(local, "check_gcs_kept", lambda cluster: None)
    monkeypatch.setattr(local, "forget_running_cluster", lambda temp_dir: None)
    monkeypatch.setattr(local, "wait_for_port", port_open)
    monkeypatch.setattr(local, "wait_for_earlier_raylets", raylets_up)
    monkeypatch.setattr(local, "unrecorded_leader", leader)
    monkeypatch.setattr(local, "stop_leftovers", stopped.append)
    return stopped


async def start(cluster: ClusterRecord, config: RayClusterConfigSpec, provider: LocalProvider) -> ClusterRecord:
    recorded: list[ClusterRecord] = []
    await provider.start_nodes(cluster, config, lambda **changes: recorded.append(cluster.with_changes(**changes)))
    return recorded[-1]


async def test_an_unrecorded_worker_is_adopted_while_its_head_kept_running(stopped_tags: list[str]) -> None:
    cluster, config = autoscaled_cluster()
    head_running = with_nodes(cluster, (replace(cluster.nodes[0], pid=50, session_id=50), cluster.nodes[1]))
    provider = SpawnRecorder()
    started = await start(head_running, config, provider)
    assert started.nodes[1].pid == UNRECORDED and provider.spawned == []
    assert stopped_tags == []


async def test_after_the_head_is_started_again_an_unrecorded_worker_is_stopped_and_started_afresh(
    stopped_tags: list[str],
) -> None:
    cluster, config = autoscaled_cluster()  # the head and worker 1 recorded, neither running
    provider = SpawnRecorder()
    started = await start(cluster, config, provider)
    assert provider.spawned == [0, 1]
    assert started.nodes[1].pid not in (None, UNRECORDED)
    assert stopped_tags[-1] == node_tag(cluster, 1)  # what it left goes before the new one starts
