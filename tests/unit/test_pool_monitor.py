"""Ray's autoscaler on a pool cluster's head (providers/pool_monitor.py), with the SSH side
faked: the monitor's files reach the head's host (the token 0600, never in argv or env), the head
starts with them, the node API is reached through the forward this controller holds (a new one
is written to the head at the next look; a restarted controller writes everything again), new
bounds are written in place, and a cluster without a node API is refused at its start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekeeper.model.hostpool import parse_host_pool
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.autoscaling import node_api_token
from servekeeper.providers.base import PermanentProviderError
from servekeeper.providers.local_monitor import NodeApi
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.pool_monitor import monitor_dir
from servekeeper.store.store import Store
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import pool_spec, started

API = NodeApi("http://127.0.0.1:8765", "daemon-secret")
CONFIG = pool_spec(workers=1, cpus=1, enableInTreeAutoscaling=True).spec.rayClusterConfig


def provider(tmp_path: Path, store: Store, fleet: FakeFleet, api: NodeApi | None = API) -> PoolProvider:
    if store.get_host_pool("fleet") is None:
        hosts = pool_document(("a", 4), ("b", 4), ("c", 4))
        store.apply_host_pool("fleet", parse_host_pool(hosts).to_json(), 1.0)
    return PoolProvider(store, tmp_path, ssh_nodes=fleet, node_api=api)


def files_of(fleet: FakeFleet, cluster: ClusterRecord) -> tuple[str, dict[str, tuple[bytes, int]]]:
    record = cluster.nodes[0]
    directory = monitor_dir(fleet.made[-1].host(record.host), cluster.name)
    return directory, {path.rsplit("/", 1)[1]: held for path, held in fleet.files.items() if path.startswith(directory)}


async def test_the_head_starts_with_its_monitor_and_the_files_it_reads(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools = provider(tmp_path, store, fleet)
    cluster = await started(pools, store, "mine", CONFIG)
    head, worker = cluster.nodes
    directory, files = files_of(fleet, cluster)
    assert ("make_dirs", directory) in fleet.calls
    names = {"servekeeper_node_provider.py", "autoscaling.json", "node-api-url", "node-token", "node-api.sock"}
    assert set(files) == names and all(mode == 0o600 for _, mode in files.values())
    assert files["node-token"][0].decode() == node_api_token(API.secret, "mine")
    # the node API through the controller's SSH forward: a socket file in the head's own folder
    assert files["node-api-url"][0].decode() == f"unix:{directory}/node-api.sock"
    assert fleet.forwards == {("a", f"{directory}/node-api.sock"): "127.0.0.1:8765"}
    provider_section = json.loads(files["autoscaling.json"][0])["provider"]
    assert provider_section["url_file"] == f"{directory}/node-api-url" and provider_section["cluster"] == "mine"
    assert f"--autoscaling-config={directory}/autoscaling.json" in fleet.argvs[head.temp_dir]
    assert fleet.envs[head.temp_dir]["PYTHONPATH"] == directory
    assert fleet.envs[head.temp_dir]["AUTOSCALER_UPDATE_INTERVAL_S"] == "1"
    assert fleet.envs[head.temp_dir]["AUTOSCALER_HEARTBEAT_TIMEOUT_S"] == "60"  # a slow raylet is no lost node
    # a node API out of reach for a while (a controller restarted) must not end Ray's monitor
    assert int(fleet.envs[head.temp_dir]["AUTOSCALER_MAX_NUM_FAILURES"]) >= 10**6
    secret = node_api_token(API.secret, "mine")
    assert not any(secret in arg for arg in fleet.argvs[head.temp_dir])
    assert secret not in fleet.envs[head.temp_dir].values()
    assert not any("autoscaling" in arg for arg in fleet.argvs[worker.temp_dir])
    assert "AUTOSCALER_UPDATE_INTERVAL_S" not in fleet.envs[worker.temp_dir]
    await pools.close()


async def test_a_new_forward_is_written_at_the_next_look_and_a_restart_writes_all(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools = provider(tmp_path, store, fleet)
    cluster = await started(pools, store, "mine", CONFIG)
    directory, _ = files_of(fleet, cluster)
    writes = len([call for call in fleet.calls if call[0] == "write"])
    await pools.liveness(cluster)
    assert len([call for call in fleet.calls if call[0] == "write"]) == writes  # the same forward: nothing written

    del fleet.connections["a"]  # the connection to the head's host was opened again
    await pools.monitors.keep_reachable(fleet.made[-1], cluster)
    socket = f"{directory}/node-api.sock"
    # the old socket file removed (sshd binds over no file), forwarded again, the files rewritten
    assert [(call, path.rsplit("/", 1)[1]) for call, path in fleet.calls[-4:]] == [
        ("remove", "node-api.sock"),
        ("forward", "node-api.sock"),
        ("write", "node-token"),
        ("write", "node-api-url"),
    ]
    assert fleet.forwards == {("a", socket): "127.0.0.1:8765"}

    fleet.files.clear()  # a controller started anew writes the token and the config from the record too
    again = provider(tmp_path, store, fleet)
    await again.liveness(cluster)
    rewritten = {path.rsplit("/", 1)[1] for path in fleet.files}
    assert rewritten == {"node-api.sock", "node-token", "autoscaling.json", "node-api-url"}
    await pools.close()
    await again.close()


async def test_a_silent_head_host_leaves_the_look_to_tell_it(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools = provider(tmp_path, store, fleet)
    cluster = await started(pools, store, "mine", CONFIG)
    directory, _ = files_of(fleet, cluster)
    fleet.silent.add("a")
    await pools.monitors.keep_reachable(fleet.made[-1], cluster)  # no error: the liveness look tells it
    fleet.silent.clear()
    fleet.files.clear()
    await pools.monitors.keep_reachable(fleet.made[-1], cluster)  # not written since: all again
    assert f"{directory}/autoscaling.json" in fleet.files and f"{directory}/node-api-url" in fleet.files
    await pools.close()


async def test_a_deleted_cluster_is_no_longer_forwarded(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools = provider(tmp_path, store, fleet)
    cluster = await started(pools, store, "mine", CONFIG)
    assert len(fleet.forwards) == 1 and {n.host for n in cluster.nodes} == {"a", "b"}
    assert await pools.stop(cluster) == []
    assert fleet.forwards == {}
    # its dir (the socket, the tokens) on every host: a launched node may have run where none is recorded now
    assert [host for call, host in fleet.calls if call == "forget"] == ["a", "b", "c"]
    await pools.close()


async def test_new_bounds_are_written_in_place(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools = provider(tmp_path, store, fleet)
    cluster = await started(pools, store, "mine", CONFIG)
    directory, _ = files_of(fleet, cluster)
    wider = CONFIG.model_copy(
        update={"workerGroups": [CONFIG.workerGroups[0].model_copy(update={"minReplicas": 0, "maxReplicas": 3})]}
    )
    await pools.update_autoscaler(cluster, wider)
    written = json.loads(fleet.files[f"{directory}/autoscaling.json"][0])
    assert written["available_node_types"]["w"]["max_workers"] == 3 and written["max_workers"] == 3
    assert written["available_node_types"]["w"]["min_workers"] == 0
    await pools.close()


async def test_an_autoscaled_cluster_without_a_node_api_is_refused_at_its_start(tmp_path: Path, store: Store) -> None:
    fleet = FakeFleet()
    pools = provider(tmp_path, store, fleet, api=None)
    with pytest.raises(PermanentProviderError, match="needs the node API"):
        await started(pools, store, "mine", CONFIG)
    assert fleet.running == {}  # not the head either
    await pools.close()
