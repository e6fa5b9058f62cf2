"""GCS fault tolerance in Redis (issue 20, item 1), without Ray: the field and its checks, what a
pool head is started with (the user's Redis, or the one servekeeper runs: faked here; the real
redis-server is tested in tests/integration/test_redis_server.py), and a rocksdb spec's hash
unchanged by the new field."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.providers import gcs_storage
from servekeeper.providers.gcs_storage import GcsStorage, storage_problems
from servekeeper.providers.node_argv import GCS_RECONNECT_SECONDS
from servekeeper.providers.redis_server import RedisTarget, render_config, user_rule
from servekeeper.store.secrets import secrets_dir, set_secret
from tests.unit.test_controller import make_spec
from tests.unit.test_pool_clusters import PoolWorld, world

__all__ = ["world"]  # the fixture, shared


def config(**fault_tolerance: Any) -> RayClusterConfigSpec:
    return RayClusterConfigSpec.model_validate({"hostPool": "fleet", "gcsFaultTolerance": fault_tolerance})


@pytest.mark.parametrize(
    ("fault_tolerance", "message"),
    [
        ({"backend": "redis", "redis": {"address": "redis"}}, "'redis' is not host:port"),
        ({"backend": "redis", "redis": {"address": "10.0.0.5:70000"}}, "the port must be 1-65535"),
        ({"backend": "redis", "redis": {"passwordSecret": {"name": "r", "key": "p"}}}, "passwordSecret is for a Redis"),
        ({"backend": "rocksdb", "redis": {"address": "10.0.0.5:6379"}}, "redis settings are for backend: redis"),
        ({"backend": "redis", "redis": {"address": "a:1", "user": "x"}}, "Extra inputs are not permitted"),
    ],
)
def test_the_field_is_checked(fault_tolerance: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config(**fault_tolerance)


def test_a_rocksdb_spec_hashes_as_before_the_redis_field_existed() -> None:
    spec = make_spec(rayClusterConfig={"hostPool": "fleet", "gcsFaultTolerance": {"backend": "rocksdb"}})
    shape = spec.spec.rayClusterConfig.model_dump(mode="json")
    shape.pop("excludes")
    # fields added after, absent while unset
    for later in ("rayVersion", "pythonVersion", "pip", "enableInTreeAutoscaling", "autoscalerOptions"):
        shape.pop(later)
    for group in [shape["head"], *shape["workerGroups"]]:
        for key in ("numGpus", "memory", "host"):
            if group.get(key) is None:
                group.pop(key, None)
    shape["gcsFaultTolerance"] = {"backend": "rocksdb"}  # as stored before: no `redis` key
    before = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    assert spec.cluster_spec_hash() == before, "a running rocksdb cluster is not replaced by an upgrade"
    redis = make_spec(rayClusterConfig={"hostPool": "fleet", "gcsFaultTolerance": {"backend": "redis"}})
    assert redis.cluster_spec_hash() != before
    # `redis: {}` (what a KubeRay import without redisAddress gives) is the same Redis as none.
    empty = make_spec(rayClusterConfig={"hostPool": "fleet", "gcsFaultTolerance": {"backend": "redis", "redis": {}}})
    assert empty.cluster_spec_hash() == redis.cluster_spec_hash()


def test_problems_at_apply_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    with_secret = config(
        backend="redis", redis={"address": "10.0.0.5:6379", "passwordSecret": {"name": "r", "key": "p"}}
    )
    assert storage_problems(with_secret, {"r": {"p": "pw"}}) == []
    assert storage_problems(with_secret, {"r": {"q": "pw"}}) == [
        "spec.rayClusterConfig.gcsFaultTolerance.redis.passwordSecret: secret 'r' has no key 'p' "
        "(servekeeper secret set r p=-)"
    ]
    monkeypatch.setattr(gcs_storage, "redis_binary", lambda: None)
    (problem,) = storage_problems(config(backend="redis"), {})
    assert problem.startswith("spec.rayClusterConfig.gcsFaultTolerance.redis.address: unset, so servekeeper runs")
    assert "apt-get install redis-server" in problem
    assert storage_problems(with_secret, {"r": {"p": "pw"}}) == [], "the user's Redis needs none here"


def test_the_servers_config_keeps_the_password_out_of_argv_and_the_aof_on(tmp_path: Path) -> None:
    text = render_config(tmp_path, 24000, ["10.0.0.1", "127.0.0.1"], "s3cret")
    # "-10.0.0.1": optional, so that an address this machine lost never keeps the server down.
    assert "bind -10.0.0.1 127.0.0.1\n" in text and "port 24000\n" in text and "requirepass s3cret\n" in text
    assert "appendonly yes\n" in text and f'dir "{tmp_path / "data"}"\n' in text and "protected-mode yes\n" in text
    rule = user_rule("svc-g1-ab", "pw")
    assert "user" not in text, "no cluster has a user yet"
    assert f"user {rule}\n" in render_config(tmp_path, 24000, ["127.0.0.1"], "s3cret", (rule,))
    assert rule.startswith("sk-svc-g1-ab reset on #") and "pw" not in rule.split()[3], "only the password's hash"
    assert " ~RAYsvc-g1-ab@* " in rule and "-@admin -@dangerous" in rule, "its own keys, no admin command"


class FakeRedisServer:
    """The one servekeeper runs, as the provider sees it (started on first use, then running)."""

    def __init__(self) -> None:
        self.ensured: list[str] = []
        self.running = False

    def ensure(self, reached_on: str, cluster: str | None = None) -> RedisTarget:
        self.ensured.append(reached_on)
        self.running = True
        return RedisTarget(f"{reached_on}:24567", f"generated-for-{cluster}", f"sk-{cluster}")

    def pid(self) -> int | None:
        return 4242 if self.running else None


def redis_pending(world: PoolWorld, redis: dict[str, Any]) -> Any:
    shape = {
        "hostPool": "fleet",
        "head": {"numCpus": 2},
        "workerGroups": [{"name": "w", "replicas": 1, "numCpus": 2}],
        "gcsFaultTolerance": {"backend": "redis", "redis": redis},
    }
    world.apply(make_spec(rayClusterConfig=shape))


async def started(world: PoolWorld) -> Any:
    await world.tick()
    await world.background_settled()
    pending = world.only(ClusterRole.PENDING)
    assert all(node.pid is not None for node in pending.nodes)
    return pending


async def test_the_head_uses_the_users_redis_with_a_namespace_of_its_own_and_the_secrets_password(
    world: PoolWorld, tmp_path: Path
) -> None:
    set_secret(secrets_dir(tmp_path), "redis", {"password": "from-the-secret"})
    redis_pending(world, {"address": "10.0.0.5:6379", "passwordSecret": {"name": "redis", "key": "password"}})
    pending = await started(world)
    head, worker = pending.nodes
    env = world.fleet.envs[head.temp_dir]
    assert env["RAY_REDIS_ADDRESS"] == "10.0.0.5:6379"
    assert env["RAY_external_storage_namespace"] == pending.name, "each cluster of an upgrade apart"
    assert "RAY_gcs_storage" not in env
    assert "--redis-password=from-the-secret" in world.fleet.argvs[head.temp_dir]
    assert not [arg for arg in world.fleet.argvs[worker.temp_dir] if "redis" in arg]
    assert world.fleet.envs[worker.temp_dir] == {"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_SECONDS)}
    assert "from-the-secret" not in json.dumps(world.service().spec_json), "never in the stored spec"


async def test_without_an_address_the_head_uses_the_redis_servekeeper_runs_started_again_when_gone(
    world: PoolWorld, tmp_path: Path
) -> None:
    server = FakeRedisServer()
    routes: list[str] = []
    world.pools.gcs_storage = GcsStorage(
        tmp_path,
        server=server,
        route=lambda host: routes.append(host) or "10.0.0.1",  # type: ignore[arg-type]
    )
    redis_pending(world, {})
    pending = await started(world)
    head = pending.nodes[0]
    assert routes == [head.address] and server.ensured == ["10.0.0.1"], "bound where the head's host reaches it"
    assert world.fleet.envs[head.temp_dir]["RAY_REDIS_ADDRESS"] == "10.0.0.1:24567"
    argv = world.fleet.argvs[head.temp_dir]
    assert f"--redis-password=generated-for-{pending.name}" in argv, "the cluster's own user and password"
    assert f"--redis-username=sk-{pending.name}" in argv
    server.running = False  # redis-server killed
    world.pools._liveness.clear()
    await world.tick()
    assert server.ensured == ["10.0.0.1", "10.0.0.1"] and server.running, "started again by the next look"


async def test_a_head_is_not_started_again_on_an_empty_redis_namespace(world: PoolWorld, tmp_path: Path) -> None:
    """A Redis without persistence that restarted (or was flushed) lost the head's tables: the
    head is refused as on a wiped RocksDB directory, not brought up as a new, empty cluster."""
    namespaces: dict[str, bool] = {}
    looked: list[tuple[str | None, str]] = []

    def kept(target: RedisTarget, namespace: str) -> bool:
        looked.append((target.username, namespace))
        return namespaces.get(namespace, False)

    world.pools.gcs_storage = GcsStorage(tmp_path, server=FakeRedisServer(), route=lambda _: "10.0.0.1", kept=kept)
    redis_pending(world, {})
    pending = await started(world)
    head = pending.nodes[0]
    assert looked == [], "a first start has no tables to find"
    namespaces[pending.name] = True
    del world.fleet.running[head.temp_dir]  # the head exited; its tables are in Redis
    world.pools._liveness.clear()
    await world.tick()
    await world.background_settled()
    again = world.cluster(pending.name).nodes[0]
    assert again.restarts == 1 and again.pid not in (None, head.pid), "started again on its tables"
    assert looked == [(f"sk-{pending.name}", pending.name)], "looked for as the cluster's own user"
    namespaces[pending.name] = False  # the Redis restarted without its data
    launches = world.fleet.calls.count(("launch", head.temp_dir))
    del world.fleet.running[head.temp_dir]
    world.pools._liveness.clear()
    await world.tick()
    await world.background_settled()
    assert world.fleet.calls.count(("launch", head.temp_dir)) == launches, "no head on an empty namespace"
    await world.tick()
    reason = world.service().failure_reason or ""
    assert "GCS state of the head in Redis 10.0.0.1:24567 is gone" in reason, reason
