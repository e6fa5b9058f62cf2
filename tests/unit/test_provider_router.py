"""The provider seam: `ProviderRouter` sends each cluster to the provider its record (or, for a
new one, its spec) names, and lets errors through with their kind; the pool provider's own
errors are retryable or permanent as they should be."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.endpoint import Endpoint
from servekeeper.model.enums import ClusterRole
from servekeeper.model.hostpool import parse_host_pool
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import (
    ClusterProvider,
    ClusterRecords,
    Liveness,
    PermanentProviderError,
    ProviderError,
    RecordChanges,
    RetryableProviderError,
)
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.pool_placement import HostRefused, Shortfall
from servekeeper.providers.router import ProviderRouter
from servekeeper.providers.ssh import HostKeyRefused
from servekeeper.store.store import Store
from tests.unit.fakes import FakeProvider
from tests.unit.ssh_fakes import FakeFleet, pool_document
from tests.unit.test_pool_clusters import draft, pool_spec


class NoRecords:
    """The store part a provider is handed, holding nothing (the recording providers read none)."""

    def list_clusters(self) -> list[ClusterRecord]:
        return []

    def put_cluster(self, cluster: ClusterRecord) -> None:
        raise AssertionError("nothing is stored")

    def update_cluster(self, name: str, **changes: Any) -> ClusterRecord:
        raise AssertionError("nothing is stored")

    def declared_ports(self) -> set[int]:
        return set()


class RecordingProvider:
    """Answers every call with its own name; `error` is raised by every call instead."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, str]] = []  # (method, cluster)
        self.error: Exception | None = None

    def _called(self, method: str, cluster: ClusterRecord) -> None:
        self.calls.append((method, cluster.name))
        if self.error is not None:
            raise self.error

    async def create(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        self._called("create", draft)
        return draft

    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        self._called("start_head", cluster)
        return cluster

    def needs_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> bool:
        self._called("needs_nodes", cluster)
        return True

    async def start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        self._called("start_nodes", cluster)

    def restarted(self, cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
        self._called("restarted", cluster)
        return cluster

    async def move_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        self._called("move_head", cluster)
        return cluster

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        self._called("liveness", cluster)
        return Liveness(True, [], self.name)

    def endpoints(self, cluster: ClusterRecord, grpc: bool) -> tuple[Endpoint, ...]:
        self._called("endpoints", cluster)
        return (Endpoint(self.name, 1),)

    def headers(self, cluster: ClusterRecord) -> dict[str, str]:
        self._called("headers", cluster)
        return {"provider": self.name}

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        self._called("launch_nodes", cluster)
        return cluster, [count]

    async def update_autoscaler(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        self._called("update_autoscaler", cluster)

    async def stop(self, cluster: ClusterRecord, record: RecordChanges | None = None) -> list[str]:
        self._called("stop", cluster)
        return [self.name]

    async def close(self) -> None:
        self.calls.append(("close", ""))


LOCAL_CONFIG = RayClusterConfigSpec.model_validate({"head": {"numCpus": 1}})
POOL_CONFIG = pool_spec(workers=0, cpus=1).spec.rayClusterConfig


@pytest.fixture
def providers() -> tuple[RecordingProvider, RecordingProvider, ProviderRouter]:
    local, pool = RecordingProvider("local"), RecordingProvider("pool")
    return local, pool, ProviderRouter(local, pool)


async def _every_call(router: ClusterProvider, cluster: ClusterRecord, config: RayClusterConfigSpec) -> list[Any]:
    def record(**changes: Any) -> None:
        pass

    answers = [
        router.start_head(cluster, config).name,
        router.needs_nodes(cluster, config),
        await router.start_nodes(cluster, config, record),
        router.restarted(cluster, [1]).name,
        (await router.move_head(cluster, config)).name,
        (await router.liveness(cluster)).reason,
        router.endpoints(cluster, grpc=False),
        router.headers(cluster),
    ]
    await router.update_autoscaler(cluster, config)
    launched = await router.launch_nodes(cluster, config, "w", 2, NoRecords())
    return [*answers, launched[1], await router.stop(cluster, record)]


METHODS = [
    "start_head",
    "needs_nodes",
    "start_nodes",
    "restarted",
    "move_head",
    "liveness",
    "endpoints",
    "headers",
    "update_autoscaler",
    "launch_nodes",
    "stop",
]


async def test_a_local_record_goes_to_the_local_provider(
    providers: tuple[RecordingProvider, RecordingProvider, ProviderRouter],
) -> None:
    local, pool, router = providers
    cluster = draft("here", LOCAL_CONFIG)
    answers = await _every_call(router, cluster, LOCAL_CONFIG)
    assert answers[5:] == ["local", (Endpoint("local", 1),), {"provider": "local"}, [2], ["local"]]
    assert local.calls == [(method, "here") for method in METHODS]
    assert pool.calls == []


async def test_a_pool_record_goes_to_the_pool_provider(
    providers: tuple[RecordingProvider, RecordingProvider, ProviderRouter],
) -> None:
    local, pool, router = providers
    cluster = draft("there", POOL_CONFIG).with_changes(pool="fleet")
    answers = await _every_call(router, cluster, POOL_CONFIG)
    assert answers[5:] == ["pool", (Endpoint("pool", 1),), {"provider": "pool"}, [2], ["pool"]]
    assert pool.calls == [(method, "there") for method in METHODS]
    assert local.calls == []


async def test_a_new_cluster_goes_where_its_spec_says(
    providers: tuple[RecordingProvider, RecordingProvider, ProviderRouter], store: Store
) -> None:
    local, pool, router = providers
    await router.create(draft("here", LOCAL_CONFIG), LOCAL_CONFIG, store)
    await router.create(draft("there", POOL_CONFIG), POOL_CONFIG, store)
    assert local.calls == [("create", "here")] and pool.calls == [("create", "there")]
    await router.close()
    assert local.calls[-1] == pool.calls[-1] == ("close", "")


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        pytest.param(Shortfall("host pool 'fleet': no room"), RetryableProviderError, id="shortfall-retryable"),
        pytest.param(HostRefused("host b: its host key changed"), PermanentProviderError, id="refused-permanent"),
        pytest.param(ProviderError("the head's GCS did not open"), ProviderError, id="plain"),
    ],
)
async def test_errors_keep_their_kind_through_the_router(
    providers: tuple[RecordingProvider, RecordingProvider, ProviderRouter],
    store: Store,
    error: ProviderError,
    kind: type[ProviderError],
) -> None:
    local, pool, router = providers
    local.error = pool.error = error
    for config in (LOCAL_CONFIG, POOL_CONFIG):
        with pytest.raises(kind) as raised:
            await router.create(draft("c", config), config, store)
        assert raised.value is error  # not wrapped: each provider translated it at its own edge
    other = PermanentProviderError if kind is RetryableProviderError else RetryableProviderError
    assert not isinstance(error, other)


async def test_the_router_routes_to_the_fake_local_provider_and_the_real_pool_one(tmp_path: Path, store: Store) -> None:
    """The controller's wiring in tests, as in the daemon: both real protocol implementations."""
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=FakeFleet())
    router = ProviderRouter(FakeProvider(), pools)
    here = await router.create(draft("here", LOCAL_CONFIG), LOCAL_CONFIG, store)
    there = await router.create(draft("there", POOL_CONFIG), POOL_CONFIG, store)
    assert here.pool is None and here.nodes == ()
    assert there.pool == "fleet" and [node.host for node in there.nodes] == ["a"]
    assert {c.name for c in store.list_clusters()} == {"here", "there"}  # both stored before any start
    assert router.headers(here) == {} and router.headers(there)["Authorization"].startswith("Bearer ")
    # Each provider allocated the ports of its own machines (they may coincide: other hosts):
    # the pool's come from host a's fake, the local ones from this machine's allocator.
    assert there.ports.node_ports == tuple(node.ports for node in there.nodes)
    assert there.ports.serve_http >= 20000
    assert here.ports.gcs > 0 and len(set(here.ports.all_ports())) == len(here.ports.all_ports())
    await router.close()


async def test_a_host_refusing_for_good_is_stored_failed_by_the_pool_provider(tmp_path: Path, store: Store) -> None:
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4))).to_json(), 1.0)
    fleet = FakeFleet()
    fleet.refuse["a"] = HostKeyRefused("a (10.0.0.11:22)", "its host key is not the one known")
    pools = PoolProvider(store, tmp_path, ssh_nodes=fleet)
    failed = await pools.create(draft("c", POOL_CONFIG), POOL_CONFIG, store)
    assert failed.failure_reason is not None and failed.failure_reason.startswith("StartFailed: ")
    assert "a (10.0.0.11:22)" in failed.failure_reason and failed.nodes == () and failed.pool == "fleet"
    assert store.get_cluster("c") == failed
    await pools.close()


async def test_a_pool_without_room_raises_a_retryable_shortfall(tmp_path: Path, store: Store) -> None:
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 1))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=FakeFleet())
    too_big = pool_spec(workers=0, cpus=4).spec.rayClusterConfig
    with pytest.raises(RetryableProviderError, match="host pool 'fleet'"):
        await pools.create(draft("c", too_big), too_big, store)
    assert store.list_clusters() == []  # nothing stored: the rollout waits
    await pools.close()


@pytest.mark.parametrize("role", [ClusterRole.PENDING, ClusterRole.ACTIVE])
async def test_a_failed_node_start_raises_its_cause_whatever_the_role(
    tmp_path: Path, store: Store, role: ClusterRole
) -> None:
    # What a failed start means for the rollout (fail it, or retry a serving cluster's node) is the
    # executor's decision (test_controller); the provider reports the cause as it is.
    store.apply_host_pool("fleet", parse_host_pool(pool_document(("a", 4))).to_json(), 1.0)
    pools = PoolProvider(store, tmp_path, ssh_nodes=FakeFleet())
    cluster = await pools.new_record(draft("c", POOL_CONFIG), POOL_CONFIG, store)
    store.put_cluster(cluster.with_changes(role=role))  # stored without its token: the start cannot read it

    def record(**changes: Any) -> None:
        raise AssertionError("nothing started")

    with pytest.raises(FileNotFoundError):
        await pools.start_nodes(cluster, POOL_CONFIG, record)
    await pools.close()


async def test_the_local_provider_refuses_a_pool_spec(store: Store) -> None:
    # A controller wired with a bare LocalProvider must not start a pool spec on this machine.
    with pytest.raises(PermanentProviderError, match="host pool 'fleet'"):
        await LocalProvider().create(draft("c", POOL_CONFIG), POOL_CONFIG, store)
    assert store.list_clusters() == []
