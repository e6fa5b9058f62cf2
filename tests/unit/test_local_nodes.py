"""A local cluster's nodes as records (issue 20: GCS fault tolerance on this machine): placed on
the cluster's ports, read back from the pids of a record stored before they existed, cleared
for a restart in place; and what an exited node left behind, found by its tag and stopped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import PermanentProviderError, nodes_restarting
from servekeeper.providers.local import process_liveness
from servekeeper.providers.local_nodes import (
    LOCAL_HOST,
    NODE_TAG_ENV,
    check_gcs_kept,
    forget_running_cluster,
    log_names,
    node_tag,
    nodes_of,
    placed_nodes,
    stop_leftovers,
)
from servekeeper.providers.node_argv import gcs_storage_dir
from tests.unit.test_planner import make_spec
from tests.unit.test_pool_clusters import draft


def local_cluster(workers: int = 2, **changes: object) -> ClusterRecord:
    shape = {"head": {"numCpus": 1}, "workerGroups": [{"name": "cpu", "replicas": workers, "numCpus": 1}]}
    config = make_spec(rayClusterConfig=shape).spec.rayClusterConfig
    cluster = draft("c", config)
    return cluster.with_changes(**{"nodes": placed_nodes(cluster, config), **changes})


def test_nodes_are_placed_on_this_machine_on_the_clusters_own_ports_head_first() -> None:
    cluster = local_cluster()
    assert [(n.role, n.host, n.address, n.pid) for n in cluster.nodes] == [
        ("head", LOCAL_HOST, "127.0.0.1", None),
        ("worker", LOCAL_HOST, "127.0.0.1", None),
        ("worker", LOCAL_HOST, "127.0.0.1", None),
    ]
    assert [n.ports for n in cluster.nodes] == list(cluster.ports.node_ports)
    groups = make_spec(rayClusterConfig={"workerGroups": [{"name": "g", "replicas": 2}]}).spec.rayClusterConfig
    assert log_names(groups) == ["head.log", "worker-g-0.log", "worker-g-1.log"]
    assert node_tag(cluster, 2) == os.path.join(cluster.log_dir, "worker-cpu-1.log")


def test_a_record_stored_before_nodes_had_records_gets_them_from_its_pids_in_start_order() -> None:
    legacy = local_cluster(nodes=(), head_pid=100, worker_pids=(101,))
    assert [(n.role, n.pid, n.session_id) for n in nodes_of(legacy)] == [
        ("head", 100, 100),
        ("worker", 101, 101),
        ("worker", None, None),
    ]


def test_a_restart_clears_the_exited_nodes_only_and_counts_it() -> None:
    running = local_cluster(head_pid=100, worker_pids=(101, 102))
    running = running.with_changes(nodes=nodes_of(running.with_changes(nodes=())))
    worker_gone = nodes_restarting(running, [102])
    assert (worker_gone.head_pid, worker_gone.worker_pids) == (100, (101,))
    assert [(n.pid, n.restarts) for n in worker_gone.nodes] == [(100, 0), (101, 0), (None, 1)]
    head_gone = nodes_restarting(worker_gone, [100])
    assert head_gone.head_pid is None and head_gone.worker_pids == (101,)
    assert [(n.pid, n.restarts) for n in head_gone.nodes] == [(None, 1), (101, 0), (None, 1)]


class Checks:
    def __init__(self, dead: list[int]) -> None:
        self.dead = dead

    def processes_alive(self, cluster: ClusterRecord) -> bool:
        return True

    def dead_workers(self, cluster: ClusterRecord) -> list[int]:
        return self.dead

    def exit_reason(self, cluster: ClusterRecord, worker_pid: int | None = None) -> str:
        return f"pid {worker_pid} said goodbye"


def test_a_local_worker_gone_has_exited_for_sure_with_its_cause() -> None:
    liveness = process_liveness(Checks([102]), local_cluster(head_pid=100, worker_pids=(101, 102)))
    assert liveness.head_alive and not liveness.head_silent
    assert liveness.dead_workers == [102] and liveness.exited_workers == (102,)
    assert liveness.exit_causes == ((102, "pid 102 said goodbye"),)


def test_a_head_is_not_started_again_on_an_empty_store(tmp_path: Path) -> None:
    cluster = local_cluster(temp_dir=str(tmp_path / "c"))
    with pytest.raises(PermanentProviderError, match="GCS state of the head of c is gone"):
        check_gcs_kept(cluster)
    storage = Path(gcs_storage_dir(cluster.temp_dir))
    storage.mkdir()
    (storage / "session_name").write_text("session_2026")
    check_gcs_kept(cluster)


def test_what_an_exited_node_left_is_found_by_its_tag_and_stopped(tmp_path: Path) -> None:
    tag = str(tmp_path / "worker-cpu-0.log")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    left = subprocess.Popen(sleep, env={**os.environ, NODE_TAG_ENV: tag}, start_new_session=True)
    other = subprocess.Popen(sleep, env={**os.environ, NODE_TAG_ENV: tag + ".other"}, start_new_session=True)
    try:
        stop_leftovers(tag)
        assert left.wait(5) == -9
        assert other.poll() is None, "another node's process is never touched"
        stop_leftovers(tag)  # nothing left: returns at once
    finally:
        other.kill()
        other.wait()
        left.kill()
        left.wait()


def test_the_note_of_the_running_cluster_goes_before_a_head_starts_again(tmp_path: Path) -> None:
    note = tmp_path / "ray_current_cluster"
    note.write_text("127.0.0.1:6379")
    forget_running_cluster(str(tmp_path))
    assert not note.exists()
    forget_running_cluster(str(tmp_path))  # none: nothing to do
