"""Where a pool cluster's GCS keeps its tables (`rayClusterConfig.gcsFaultTolerance`): what its
nodes are started with, the check before a head starts again in place, and the cleanup once
the cluster is gone.

RocksDB: a directory beside the head's temp dir on its host. Redis: a namespace per cluster
(its name) in the user's Redis (`redis.address`, the password from a `servekeeper secret`) or
in the one servekeeper runs (`redis_server.py`); Ray reads `RAY_REDIS_ADDRESS` and
`RAY_external_storage_namespace` from the head's environment and takes the password as
`ray start --redis-password` (Ray hands it on to its GCS process's command line: a design of
Ray's that servekeeper cannot change).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import redis

from servekeeper.model.cluster_spec import RayClusterConfigSpec, RedisSpec, SecretKeySelector
from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers.base import PermanentProviderError, ProviderError, RetryableProviderError
from servekeeper.providers.node_argv import GCS_RECONNECT_SECONDS, gcs_storage_dir
from servekeeper.providers.redis_server import (
    INSTALL_HINT,
    RedisServer,
    RedisTarget,
    address_towards,
    redis_binary,
    redis_dir,
)
from servekeeper.providers.ssh_nodes import SshNodes
from servekeeper.store.secrets import read_secrets, secrets_dir

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_SECONDS = 5.0


def uses_redis(config: RayClusterConfigSpec) -> bool:
    return config.gcsFaultTolerance is not None and config.gcsFaultTolerance.backend == "redis"


def redis_settings(config: RayClusterConfigSpec) -> RedisSpec:
    assert config.gcsFaultTolerance is not None
    return config.gcsFaultTolerance.redis or RedisSpec()


def node_env(
    config: RayClusterConfigSpec,
    role: Literal["head", "worker"],
    cluster: str,
    head_temp_dir: str,
    target: RedisTarget | None,
) -> dict[str, str]:
    """The environment a node needs for the cluster's GCS fault tolerance (none without it)."""
    if config.gcsFaultTolerance is None:
        return {}
    if role == "worker":
        # How long a worker's raylet waits for its head to come back before it exits.
        return {"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_SECONDS)}
    if target is None:
        return {"RAY_gcs_storage": "rocksdb", "RAY_gcs_storage_path": gcs_storage_dir(head_temp_dir)}
    return {"RAY_REDIS_ADDRESS": target.address, "RAY_external_storage_namespace": cluster}


def storage_problems(config: RayClusterConfigSpec, secrets: dict[str, dict[str, str]]) -> list[str]:
    """What makes a spec's Redis unusable from the start, by field (checked when applied)."""
    if not uses_redis(config):
        return []
    settings = redis_settings(config)
    path = "spec.rayClusterConfig.gcsFaultTolerance.redis"
    if settings.address is None and redis_binary() is None:
        return [f"{path}.address: unset, so servekeeper runs a Redis for it on this machine: {INSTALL_HINT}"]
    selector = settings.passwordSecret
    if selector is not None and selector.key not in secrets.get(selector.name, {}):
        return [missing_password(selector)]
    return []


def missing_password(selector: SecretKeySelector) -> str:
    return (
        f"spec.rayClusterConfig.gcsFaultTolerance.redis.passwordSecret: secret {selector.name!r} has no key "
        f"{selector.key!r} (servekeeper secret set {selector.name} {selector.key}=-)"
    )


def head_flags(target: RedisTarget | None) -> list[str]:
    if target is None:
        return []
    user = [f"--redis-username={target.username}"] if target.username else []
    return [*user, f"--redis-password={target.password}"] if target.password else user


class GcsStorage:
    """The Redis a cluster's head uses (the user's, or the one servekeeper runs), and its cleanup."""

    def __init__(
        self,
        state_dir: Path,
        server: RedisServer | None = None,
        route: Callable[[str], str] = address_towards,
        kept: Callable[[RedisTarget, str], bool] | None = None,
    ) -> None:
        self.secrets_dir = secrets_dir(state_dir)
        self.server = server or RedisServer(redis_dir(state_dir))
        self._route = route  # this machine's address towards a host (tests give one without a network)
        self._kept = kept or namespace_kept  # whether a namespace has tables (tests: without a Redis)

    def password(self, settings: RedisSpec) -> str | None:
        selector = settings.passwordSecret
        if selector is None:
            return None
        value = read_secrets(self.secrets_dir).get(selector.name, {}).get(selector.key)
        if value is None:
            raise PermanentProviderError(missing_password(selector))
        return value

    async def target(self, config: RayClusterConfigSpec, head_address: str, cluster: str) -> RedisTarget | None:
        """Where `cluster`'s head keeps its GCS tables in Redis (None: not Redis); the Redis
        servekeeper runs is started (or started again) here, reachable from `head_address`, with
        the cluster's own user."""
        if not uses_redis(config):
            return None
        settings = redis_settings(config)
        if settings.address is not None:
            return RedisTarget(settings.address, self.password(settings))
        try:
            reached_on = await asyncio.to_thread(self._route, head_address)
        except OSError as exc:  # a name that does not resolve, no route to the host
            raise RetryableProviderError(
                f"no route from this machine to the head's host {head_address}: {exc}"
            ) from exc
        return await asyncio.to_thread(self.server.ensure, reached_on, cluster)

    async def keep_up(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        """At each look of a cluster whose GCS is in the Redis servekeeper runs: that Redis is
        started again (same port, its AOF replayed) if it is gone. Ray's GCS rides out a short
        loss (measured: 1 s); after a longer one it exits and the head is started again in place."""
        if not uses_redis(config) or redis_settings(config).address is not None or not cluster.nodes:
            return
        if self.server.pid() is not None:
            return
        logger.warning("[%s] the redis-server of its GCS is gone: starting it again", cluster.name)
        try:
            await self.target(config, cluster.nodes[0].address, cluster.name)
        except (OSError, ProviderError) as exc:
            logger.warning("[%s] the redis-server of its GCS did not start: %s", cluster.name, exc)

    async def before_restart(
        self, ssh: SshNodes, head: NodePlacement, config: RayClusterConfigSpec, target: RedisTarget | None, cluster: str
    ) -> None:
        """A head started again in place needs its GCS tables: without them (its host rebooted
        and wiped its work dir; a Redis without persistence restarted, or flushed) it would come
        up as a new, empty cluster with none of the service's apps."""
        if config.gcsFaultTolerance is None or head.restarts == 0:
            return
        if target is not None:
            try:
                kept = await asyncio.to_thread(self._kept, target, cluster)
            except redis.exceptions.NoPermissionError:
                return  # a user's Redis that lets its user no SCAN: Ray finds its tables, or none
            except (redis.RedisError, OSError) as exc:
                raise RetryableProviderError(f"the Redis of the head's GCS ({target.address}): {exc}") from exc
            if not kept:
                raise PermanentProviderError(
                    f"the GCS state of the head in Redis {target.address} is gone (no key of namespace {cluster}): "
                    "it is not started again on an empty store (a head that never ran: see its log)"
                )
            return
        if not await ssh.gcs_state_kept(head.host, gcs_storage_dir(head.temp_dir)):
            raise PermanentProviderError(
                f"the GCS state of the head on host {head.host} is gone ({gcs_storage_dir(head.temp_dir)}): "
                "it is not started again on an empty store"
            )

    async def forget(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        """Once every node is stopped: the cluster's namespace goes from Redis (as KubeRay's
        cleanup job does). A Redis that cannot be reached keeps it; the warning says where."""
        if not uses_redis(config) or not cluster.nodes:
            return
        try:
            target = await self.target(config, cluster.nodes[0].address, cluster.name)
            assert target is not None
            removed = await asyncio.to_thread(delete_namespace, target, cluster.name)
        except (redis.RedisError, OSError, ProviderError) as exc:  # best effort: the cluster is gone either way
            logger.warning("[%s] its GCS tables stay in Redis (namespace %s): %s", cluster.name, cluster.name, exc)
        else:
            logger.info("[%s] %d GCS tables removed from Redis", cluster.name, removed)
        if redis_settings(config).address is None:  # the Redis servekeeper runs: the cluster's user goes
            try:
                await asyncio.to_thread(self.server.forget_user, cluster.name)
            except (redis.RedisError, OSError) as exc:  # out of its config already: gone at the next start
                logger.warning("[%s] its Redis user stays until that Redis starts again: %s", cluster.name, exc)


def _client(target: RedisTarget) -> redis.Redis:
    host, port = target.address.rsplit(":", 1)
    return redis.Redis(
        host=host.strip("[]"),
        port=int(port),
        username=target.username,
        password=target.password,
        socket_timeout=REDIS_TIMEOUT_SECONDS,
        socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
    )


def namespace_kept(target: RedisTarget, namespace: str) -> bool:
    """Whether Ray's GCS left any table of `namespace` in the Redis (it writes some at its start)."""
    client = _client(target)
    try:
        return next(iter(client.scan_iter(match=f"RAY{namespace}@*", count=1000)), None) is not None
    finally:
        client.close()


def delete_namespace(target: RedisTarget, namespace: str) -> int:
    """Delete Ray's keys of one external storage namespace (`RAY<namespace>@<table>`)."""
    client = _client(target)
    try:
        keys = list(client.scan_iter(match=f"RAY{namespace}@*", count=1000))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()
