"""One provider in front of the others: each cluster goes to the provider its record names (a
host pool's, or this machine's), chosen here once, so that the controller never asks which one
it holds. Errors pass through unchanged: each provider translated them at its own edge."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.endpoint import Endpoint
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.base import ClusterProvider, ClusterRecords, Liveness, RecordChanges


class ProviderRouter:
    """`local` for clusters on this machine, `pool` for clusters on a host pool."""

    def __init__(self, local: ClusterProvider, pool: ClusterProvider) -> None:
        self.local = local
        self.pool = pool

    def _for_config(self, config: RayClusterConfigSpec) -> ClusterProvider:
        return self.pool if config.hostPool is not None else self.local

    def _for(self, cluster: ClusterRecord) -> ClusterProvider:
        return self.pool if cluster.pool is not None else self.local

    async def create(
        self, draft: ClusterRecord, config: RayClusterConfigSpec, records: ClusterRecords
    ) -> ClusterRecord:
        return await self._for_config(config).create(draft, config, records)

    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        return self._for(cluster).start_head(cluster, config)

    def needs_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> bool:
        return self._for(cluster).needs_nodes(cluster, config)

    async def start_nodes(self, cluster: ClusterRecord, config: RayClusterConfigSpec, record: RecordChanges) -> None:
        await self._for(cluster).start_nodes(cluster, config, record)

    def restarted(self, cluster: ClusterRecord, pids: Sequence[int]) -> ClusterRecord:
        return self._for(cluster).restarted(cluster, pids)

    async def move_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        return await self._for(cluster).move_head(cluster, config)

    async def liveness(self, cluster: ClusterRecord) -> Liveness:
        return await self._for(cluster).liveness(cluster)

    def endpoints(self, cluster: ClusterRecord, grpc: bool) -> tuple[Endpoint, ...]:
        return self._for(cluster).endpoints(cluster, grpc)

    def headers(self, cluster: ClusterRecord) -> dict[str, str]:
        return self._for(cluster).headers(cluster)

    async def stop_node(self, cluster: ClusterRecord, index: int) -> None:
        await self._for(cluster).stop_node(cluster, index)

    async def launch_nodes(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, group: str, count: int, records: ClusterRecords
    ) -> tuple[ClusterRecord, list[int]]:
        return await self._for(cluster).launch_nodes(cluster, config, group, count, records)

    async def update_autoscaler(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> None:
        await self._for(cluster).update_autoscaler(cluster, config)

    async def stop(self, cluster: ClusterRecord, record: RecordChanges | None = None) -> Sequence[int | str]:
        return await self._for(cluster).stop(cluster, record)

    async def close(self) -> None:
        await self.local.close()
        await self.pool.close()

    async def prune_environments(self, keep: Collection[str], read_at: float) -> None:
        await self.local.prune_environments(keep, read_at)
        await self.pool.prune_environments(keep, read_at)
