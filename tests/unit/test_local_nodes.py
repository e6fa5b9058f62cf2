"""A local cluster's nodes as records (issue 20: GCS fault tolerance on this machine): placed on
the cluster's ports, read back from the pids of a record stored before they existed, cleared
for a restart in place; and what an exited node left behind, found by its tag and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import PermanentProviderError, nodes_restarting
from servekeeper.providers.local import LocalProvider, process_liveness, store_with_local_ports
from servekeeper.providers.local_nodes import (
    LOCAL_HOST,
    NODE_TAG_ENV,
    check_gcs_kept,
    forget_running_cluster,
    log_names,
    node_tag,
    nodes_of,
    placed_nodes,
    raylet_socket_paths,
    stop_leftovers,
    wait_for_raylet_sockets,
)
from servekeeper.providers.node_argv import gcs_storage_dir
from servekeeper.providers.ports import PortAllocator
from servekeeper.store.store import Store
from servekeeper.testing.harness import wait_until
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


def _node_with_raylet(sockets: Path) -> subprocess.Popen[bytes]:
    """A stand-in for `ray start`: a parent whose child has a raylet's socket flags."""
    raylet = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
        f"'--raylet_socket_name={sockets}/raylet', '--store_socket_name={sockets}/plasma_store']); time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", raylet], start_new_session=True)


async def test_a_node_waits_until_the_earlier_nodes_bound_their_socket_names(tmp_path: Path) -> None:
    """Ray 2.52 on one machine: `ray start` names its sockets after the first free name on
    disk, seconds before binding them; a worker started meanwhile takes the head's names."""
    node = _node_with_raylet(tmp_path)
    try:
        wait_until(lambda: raylet_socket_paths(node.pid) is not None, 10, "the raylet child")
        assert raylet_socket_paths(node.pid) == [f"{tmp_path}/raylet", f"{tmp_path}/plasma_store"]
        assert not await wait_for_raylet_sockets(node.pid, 0.5), "names picked, not bound yet"
        (tmp_path / "raylet").touch()
        assert not await wait_for_raylet_sockets(node.pid, 0.5), "the plasma store's is not bound yet"
        (tmp_path / "plasma_store").touch()
        assert await wait_for_raylet_sockets(node.pid, 0.5)
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
    started = time.monotonic()
    assert not await wait_for_raylet_sockets(node.pid, 30), "a node gone is not waited for"
    assert time.monotonic() - started < 5


def test_a_new_cluster_never_takes_a_port_a_service_declares_for_its_ingress(store: Store) -> None:
    # A first rollout binds its ingress only once its cluster is ready: until then its port is
    # free on the machine, and Ray holding it would keep that ingress from ever listening.
    spec = make_spec(ingress={"port": 25674, "grpcPort": 25675, "previewPort": 25676})
    store.apply_spec("svc", spec.model_dump_json(), now=0)
    other = make_spec(ingress={"port": 25677})
    store.apply_spec("other", other.model_dump_json(), now=0)
    reserved_by_allocation: list[set[int]] = []

    def allocator(reserved: Iterable[int]) -> PortAllocator:
        reserved_by_allocation.append(set(reserved))
        return PortAllocator(reserved)

    config = spec.spec.rayClusterConfig
    first = store_with_local_ports(draft("a", config), config, store, allocator=allocator)
    store_with_local_ports(draft("b", config), config, store, allocator=allocator)
    assert all({25674, 25675, 25676, 25677} <= reserved for reserved in reserved_by_allocation)
    assert set(first.ports.all_ports()) <= reserved_by_allocation[1]  # and the clusters' own


def test_a_child_another_look_reaped_meanwhile_reads_as_exited_not_as_an_error() -> None:
    """Liveness looks run in worker threads, several clusters at once: both may reap one child."""
    provider = LocalProvider()

    class ReapedByAnotherLook:
        def poll(self) -> int:
            provider._children.pop(4242, None)  # the other thread, between our copy and our look
            return 0

    provider._children[4242] = ReapedByAnotherLook()  # type: ignore[assignment]
    assert provider.dead_workers(local_cluster(head_pid=100, worker_pids=(4242,))) == [4242]
