"""Host pool routes and client methods against the real API app in-process: apply dispatch on
`kind`, listing, deletion, the token, and checks that fail fast and clearly (no host answers
here: reachability against real sshd hosts is in tests/multihost)."""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from servekeeper.api.app import build_app
from servekeeper.client import AsyncClient, Client, Conflict, ServiceNotFound, SpecInvalid
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterPorts, ClusterRecord, NodePlacement, NodePorts
from servekeeper.store.store import Store
from tests.unit.test_client import TOKEN, URL, FakeController, through
from tests.unit.test_hostpool import VALID


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "store.db")
    yield opened
    opened.close()


@pytest.fixture
def app_client(store: Store) -> Iterator[TestClient]:
    async def shutdown(stop_clusters: bool) -> None:
        return None

    with TestClient(build_app(FakeController(), store, TOKEN, shutdown)) as test_client:  # type: ignore[arg-type]
        yield test_client


@pytest.fixture
def client(app_client: TestClient) -> Iterator[Client]:
    with Client(url=URL, token=TOKEN, transport=through(app_client)) as sync_client:
        yield sync_client


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again once we return: nothing listens


def local_pool(tmp_path: Path, name: str = "fleet") -> dict[str, Any]:
    """Two hosts on loopback where no sshd listens: one with a known_hosts file, one without."""
    (tmp_path / "known_hosts").write_text("")
    key = tmp_path / "id_ed25519"
    if not key.exists():
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(key))
    document = copy.deepcopy(VALID)
    document["metadata"]["name"] = name
    for host, known in zip(document["spec"]["hosts"], ("known_hosts", "missing"), strict=True):
        host["ssh"].update(
            port=closed_port(), identityFile=str(key), knownHostsFile=str(tmp_path / known), connectTimeoutSeconds=2
        )
    document["spec"]["hosts"][0]["address"] = "127.0.0.1"
    document["spec"]["hosts"][1]["address"] = "127.0.0.2"
    return document


def test_apply_list_check_delete(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(local_pool(tmp_path)))
    assert client.apply(path) == {"name": "fleet", "generation": 0, "changed": True, "kind": "HostPool"}
    assert client.apply(path)["changed"] is False
    pools = client.host_pools()
    assert [pool["name"] for pool in pools] == ["fleet"]
    assert [host["name"] for host in pools[0]["hosts"]] == ["gpu-a", "gpu-b"]
    assert client.host_pools("fleet") == pools
    with pytest.raises(ServiceNotFound, match="host pool 'nope' not found"):
        client.host_pools("nope")

    answer = client.check_hosts("fleet")
    assert answer["ok"] is False and answer["controller"]["ray"] == "2.60.0"
    unreachable, refused = answer["hosts"]
    assert unreachable["state"] == "unreachable" and "host gpu-a (127.0.0.1:" in unreachable["problem"]
    assert refused["state"] == "refused" and "known_hosts file" in refused["problem"]
    assert "does not exist" in refused["problem"]

    client.delete_host_pool("fleet")
    assert client.host_pools() == []
    with pytest.raises(ServiceNotFound):
        client.check_hosts("fleet")


def test_a_bad_pool_file_is_refused_before_the_daemon(tmp_path: Path) -> None:
    document = local_pool(tmp_path)
    document["spec"]["hosts"][0]["python"] = "python3"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    with Client(url="http://127.0.0.1:9", token="x") as nowhere, pytest.raises(SpecInvalid) as caught:
        nowhere.apply(path)
    assert caught.value.source == str(path)
    assert caught.value.problems[0].startswith("spec.hosts.0.python")


def test_a_bad_pool_mapping_is_refused_by_the_daemon(client: Client, tmp_path: Path) -> None:
    document = local_pool(tmp_path)
    document["spec"]["hosts"][1]["name"] = document["spec"]["hosts"][0]["name"]
    with pytest.raises(SpecInvalid) as caught:
        client.apply(document)
    assert "host names must be unique" in caught.value.problems[0]
    assert client.host_pools() == []


def test_pool_routes_need_the_token(app_client: TestClient) -> None:
    for method, path in (("GET", "/api/v1/hostpools"), ("POST", "/api/v1/hostpools/fleet/check")):
        assert app_client.request(method, path).status_code == 401
        assert app_client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401


async def test_the_async_client(app_client: TestClient, tmp_path: Path) -> None:
    async with AsyncClient(url=URL, token=TOKEN, transport=through(app_client)) as async_client:
        assert (await async_client.apply(local_pool(tmp_path, "pool-a")))["kind"] == "HostPool"
        assert [pool["name"] for pool in await async_client.host_pools()] == ["pool-a"]
        assert (await async_client.check_hosts("pool-a"))["ok"] is False
        await async_client.delete_host_pool("pool-a")
        assert await async_client.host_pools() == []
    assert isinstance(through(app_client), httpx.MockTransport)


def test_capacity_used_by_each_cluster_is_shown_per_host(client: Client, store: Store, tmp_path: Path) -> None:
    client.apply(local_pool(tmp_path))
    config = RayClusterConfigSpec.model_validate(
        {"hostPool": "fleet", "head": {"numCpus": 2}, "workerGroups": [{"name": "w", "replicas": 1, "numGpus": 1}]}
    )
    ports = NodePorts(1, 2, 3, 4, 5, 6, 100, 147)
    nodes = (
        NodePlacement("gpu-a", "127.0.0.1", "head", ports, "/tmp/x/n0", pid=10, session_id=10),
        NodePlacement("gpu-b", "127.0.0.2", "worker", ports, "/tmp/x/n1"),
    )
    record = ClusterRecord(
        name="svc-g1-abc",
        service="svc",
        generation=1,
        cluster_spec_hash="h",
        cluster_spec_json=config.model_dump_json(),
        role=ClusterRole.ACTIVE,
        ports=ClusterPorts(7, 8, 9, 11, 12, (ports, ports)),
        temp_dir="/tmp/x",
        log_dir="/tmp/x/logs",
        created_at=1.0,
        pool="fleet",
        nodes=nodes,
    )
    store.put_cluster(record)
    store.put_cluster(record.with_changes(name="elsewhere", pool="other-pool"))
    hosts = {host["name"]: host for host in client.host_pools("fleet")[0]["hosts"]}
    assert [(n["cluster"], n["role"], n["cpus"]) for n in hosts["gpu-a"]["used"]] == [("svc-g1-abc", "head", 2)]
    assert [(n["role"], n["gpus"]) for n in hosts["gpu-b"]["used"]] == [("worker", 1)]
    checked = {host["name"]: host for host in client.check_hosts("fleet")["hosts"]}
    assert checked["gpu-a"]["used"] == hosts["gpu-a"]["used"]


def test_a_pool_host_that_runs_nodes_cannot_be_removed_changed_or_deleted(
    client: Client, store: Store, tmp_path: Path
) -> None:
    pool = local_pool(tmp_path)
    client.apply(pool)
    ports = NodePorts(1, 2, 3, 4, 5, 6, 100, 147)
    node = NodePlacement("gpu-a", "127.0.0.1", "head", ports, "/tmp/x/n0", pid=10, session_id=10)
    store.put_cluster(
        ClusterRecord(
            name="svc-g1-abc",
            service="svc",
            generation=1,
            cluster_spec_hash="h",
            cluster_spec_json=RayClusterConfigSpec.model_validate({"hostPool": "fleet"}).model_dump_json(),
            role=ClusterRole.ACTIVE,
            ports=ClusterPorts(7, 8, 9, 11, 12, (ports,)),
            temp_dir="/tmp/x",
            log_dir="/tmp/x/logs",
            created_at=1.0,
            pool="fleet",
            nodes=(node,),
        )
    )
    without_a = copy.deepcopy(pool)
    without_a["spec"]["hosts"] = [h for h in pool["spec"]["hosts"] if h["name"] != "gpu-a"]
    changed_a = copy.deepcopy(pool)
    changed_a["spec"]["hosts"][0]["address"] = "127.0.0.9"
    for document in (without_a, changed_a):
        with pytest.raises(Conflict, match=r"\['gpu-a'\].*svc-g1-abc"):
            client.apply(document)
    with pytest.raises(Conflict, match="runs clusters"):
        client.delete_host_pool("fleet")
    other = copy.deepcopy(pool)
    other["spec"]["hosts"][1]["address"] = "127.0.0.8"  # a host without nodes may change
    client.apply(other)
