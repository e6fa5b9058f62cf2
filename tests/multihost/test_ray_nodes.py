"""A Ray cluster over SSH across the fleet, with Ray's token authentication: head on host 1,
workers on hosts 2 and 3. One cluster for the module; nodes are stopped exactly (never `ray
stop`) and nothing of the cluster is left in any namespace."""

from __future__ import annotations

import asyncio
import shlex
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from servekeeper.model.hostpool import HostSpec, parse_host_pool
from servekeeper.providers.cluster_token import auth_headers, new_cluster_token, read_cluster_token, save_cluster_token
from servekeeper.providers.node_argv import HeadPorts, RemoteNode, cluster_dir, head_argv, worker_argv
from servekeeper.providers.ssh_nodes import NodeUnreachable, SshNodes
from tests.fleet import Fleet

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(240)]

CLUSTER = "mh-c1"


@dataclass
class Cluster:
    nodes: list[RemoteNode]
    dashboard_url: str
    token: str
    token_file: Path
    start_seconds: float  # from the first SSH call to three nodes ALIVE in Ray's view
    summary: list[dict]


async def _alive_nodes(url: str, token: str, want: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    alive: list[dict] = []
    async with httpx.AsyncClient(trust_env=False, timeout=3) as client:
        while time.monotonic() < deadline:
            try:
                answer = await client.get(f"{url}/nodes?view=summary", headers=auth_headers(token))
                if answer.status_code == 200:
                    summary = answer.json()["data"]["summary"]
                    alive = [node for node in summary if node["raylet"]["state"] == "ALIVE"]
                    if len(alive) >= want:
                        return alive
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise AssertionError(f"only {len(alive)} of {want} nodes alive after {timeout}s")


async def _start(hosts: list[HostSpec], nodes_api: SshNodes, token_dir: Path) -> Cluster:
    started = time.monotonic()
    token = new_cluster_token()
    token_file = save_cluster_token(token_dir, CLUSTER, token)
    token_paths = await asyncio.gather(*(nodes_api.install_token(h.name, CLUSTER, token) for h in hosts))
    head_host = hosts[0]
    ports, (gcs, dashboard, client_server) = await nodes_api.node_ports(head_host.name, extra=3)
    head_ports = HeadPorts(gcs=gcs, dashboard=dashboard, client_server=client_server)
    temp_dir = f"{cluster_dir(head_host, CLUSTER)}/head"
    argv = head_argv(head_host, temp_dir, head_ports, ports, ["--num-cpus=1"])
    nodes = [await nodes_api.start_node(head_host.name, "head", argv, temp_dir, ports, token_paths[0])]

    async def worker(index: int) -> RemoteNode:
        host = hosts[index]
        worker_ports, _ = await nodes_api.node_ports(host.name)
        worker_dir = f"{cluster_dir(host, CLUSTER)}/worker-{index}"
        gcs_address = f"{head_host.address}:{head_ports.gcs}"
        argv = worker_argv(host, worker_dir, gcs_address, worker_ports, ["--num-cpus=1"])
        return await nodes_api.start_node(host.name, "worker", argv, worker_dir, worker_ports, token_paths[index])

    nodes += await asyncio.gather(worker(1), worker(2))
    url = f"http://{head_host.address}:{head_ports.dashboard}"
    summary = await _alive_nodes(url, token, want=3, timeout=90)
    return Cluster(nodes, url, token, token_file, time.monotonic() - started, summary)


async def _stop_all(nodes_api: SshNodes, nodes: list[RemoteNode]) -> list[list[int]]:
    return list(await asyncio.gather(*(nodes_api.stop(node) for node in nodes)))


@pytest.fixture(scope="module")
def cluster(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    hosts = list(parse_host_pool(fleet.host_pool_document()).spec.hosts)
    nodes_api = SshNodes(hosts)
    loop = asyncio.new_event_loop()
    started: Cluster | None = None
    try:
        started = loop.run_until_complete(_start(hosts, nodes_api, tmp_path_factory.mktemp("tokens")))
        print(f"\nfleet setup {fleet.setup_seconds:.2f}s; 3 nodes alive over SSH in {started.start_seconds:.1f}s")
        yield started
    finally:
        # Whatever the tests did: stop every node we know of (test_stop may have done it already).
        if started is not None:
            loop.run_until_complete(_stop_all(nodes_api, started.nodes))
        loop.run_until_complete(nodes_api.close())
        loop.close()


def test_three_nodes_on_three_addresses(cluster: Cluster, fleet: Fleet) -> None:
    addresses = sorted(node["raylet"]["nodeManagerAddress"] for node in cluster.summary)
    assert addresses == sorted(host.address for host in fleet.hosts)
    assert cluster.start_seconds < 60


def test_token_is_required_by_the_dashboard_and_job_api(cluster: Cluster) -> None:
    with httpx.Client(trust_env=False, timeout=5) as client:
        for path in ("/api/jobs/", "/api/serve/applications/", "/nodes?view=summary"):
            assert client.get(cluster.dashboard_url + path).status_code == 401, path
            wrong = client.get(cluster.dashboard_url + path, headers=auth_headers("0" * 64))
            assert wrong.status_code == 403, path
        submit = {"entrypoint": "echo hi"}
        assert client.post(cluster.dashboard_url + "/api/jobs/", json=submit).status_code == 401
        assert client.get(cluster.dashboard_url + "/api/jobs/", headers=auth_headers(cluster.token)).status_code == 200


# A job that leaves one detached actor on each node: worker processes that a stop must take too.
ACTORS_JOB = """
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()

@ray.remote(num_cpus=0)
class Resident:
    def node(self):
        return ray.get_runtime_context().get_node_id()

nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
residents = [
    Resident.options(
        name=f"resident-{index}",
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote()
    for index, node in enumerate(nodes)
]
print("nodes with a resident:", len(set(ray.get([r.node.remote() for r in residents]))))
"""


def test_a_job_with_the_token_runs_actors_on_every_node(cluster: Cluster) -> None:
    import sys

    submit = {"entrypoint": shlex.join([sys.executable, "-c", ACTORS_JOB])}
    with httpx.Client(trust_env=False, timeout=10) as client:
        assert client.post(cluster.dashboard_url + "/api/jobs/", json=submit).status_code == 401
        answer = client.post(cluster.dashboard_url + "/api/jobs/", json=submit, headers=auth_headers(cluster.token))
        assert answer.status_code == 200, answer.text
        job = answer.json()["submission_id"]
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline:
            status = client.get(f"{cluster.dashboard_url}/api/jobs/{job}", headers=auth_headers(cluster.token)).json()
            if status["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(0.5)
        logs = client.get(f"{cluster.dashboard_url}/api/jobs/{job}/logs", headers=auth_headers(cluster.token))
    assert status is not None and status["status"] == "SUCCEEDED", (status, logs.text[-2000:])
    assert "nodes with a resident: 3" in logs.json()["logs"], logs.json()["logs"][-1500:]


def test_token_is_in_no_argv_and_stored_0600(cluster: Cluster) -> None:
    assert stat.S_IMODE(cluster.token_file.stat().st_mode) == 0o600
    assert read_cluster_token(cluster.token_file.parent, CLUSTER) == cluster.token
    seen = 0
    for process in psutil.process_iter(["cmdline", "environ"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        seen += 1
        assert cluster.token not in cmdline, f"pid {process.pid}: {cmdline[:200]}"
        assert cluster.token not in "\0".join(f"{k}={v}" for k, v in (process.info["environ"] or {}).items())
    assert seen > 20
    for node in cluster.nodes:
        token_path = Path(cluster_dir_of(node)) / "auth_token"
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600  # the hosts share this machine's files
        assert stat.S_IMODE(token_path.parent.stat().st_mode) == 0o700


def cluster_dir_of(node: RemoteNode) -> str:
    return str(Path(node.temp_dir).parent)


def test_stop_on_a_cut_off_host_is_a_retryable_error(cluster: Cluster, fleet: Fleet) -> None:
    document = fleet.host_pool_document()
    for host in document["spec"]["hosts"]:
        host["ssh"]["connectTimeoutSeconds"] = 1
    nodes_api = SshNodes(list(parse_host_pool(document).spec.hosts))
    worker = cluster.nodes[2]
    cut_off = next(host for host in fleet.hosts if host.name == worker.host)
    cut_off.run("ip", "link", "set", "eth0", "down")
    try:
        started = time.monotonic()
        with pytest.raises(NodeUnreachable) as caught:
            asyncio.run(_stop_then_close(nodes_api, worker))
        assert caught.value.retryable
        assert f"host {worker.host} ({worker.address}:22)" in str(caught.value)
        assert f"could not stop the worker node (pid {worker.pid}" in str(caught.value)
        assert time.monotonic() - started < 20
    finally:
        cut_off.run("ip", "link", "set", "eth0", "up")
    assert psutil.pid_exists(worker.pid)  # not forgotten, not stopped: the next stop finds it


async def _stop_then_close(nodes_api: SshNodes, node: RemoteNode) -> list[int]:
    try:
        return await nodes_api.stop(node)
    finally:
        await nodes_api.close()


def test_stop_leaves_nothing_in_any_namespace(cluster: Cluster, fleet: Fleet) -> None:
    hosts = list(parse_host_pool(fleet.host_pool_document()).spec.hosts)
    nodes_api = SshNodes(hosts)

    async def stop_all() -> tuple[list[bool], list[list[int]], list[bool]]:
        try:
            before = [await nodes_api.alive(node) for node in cluster.nodes]
            left = await _stop_all(nodes_api, cluster.nodes)
            after = [await nodes_api.alive(node) for node in cluster.nodes]
            return before, left, after
        finally:
            await nodes_api.close()

    before, left, after = asyncio.run(stop_all())
    assert before == [True, True, True]
    assert left == [[], [], []]
    assert after == [False, False, False]
    for node in cluster.nodes:
        assert not Path(node.temp_dir).exists() and Path(node.log_path).exists()
    deadline = time.monotonic() + 10
    while fleet.leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.2)  # sshd's per-connection processes close after our connections
    assert fleet.leftover_processes() == {}
    ours = [p.pid for p in psutil.process_iter(["cmdline"]) if CLUSTER in " ".join(p.info["cmdline"] or [])]
    assert ours == []

    async def forget_all() -> None:
        forgetting = SshNodes(hosts)
        try:
            await asyncio.gather(*(forgetting.forget_cluster(host.name, CLUSTER) for host in hosts))
        finally:
            await forgetting.close()

    asyncio.run(forget_all())
    for host in hosts:
        assert not Path(cluster_dir(host, CLUSTER)).exists()  # token file and logs gone
        assert Path(host.workDir).is_dir()
