"""The interface every cluster provider implements (local processes today, Kubernetes later)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.status import ClusterRecord


class ProviderError(RuntimeError):
    """A cluster could not be started or stopped; the message says why."""


class ClusterProvider(Protocol):
    def start_head(self, cluster: ClusterRecord, config: RayClusterConfigSpec) -> ClusterRecord:
        """Spawn the head without waiting; return the record with `head_pid` set."""
        ...

    async def start_workers(
        self, cluster: ClusterRecord, config: RayClusterConfigSpec, on_spawn: Callable[[ClusterRecord], None]
    ) -> ClusterRecord:
        """Start the worker nodes not running yet; idempotent after a crash."""
        ...

    def processes_alive(self, cluster: ClusterRecord) -> bool:
        """Is the cluster's head running (the cluster was started and has not died)?"""
        ...

    async def stop(self, cluster: ClusterRecord) -> list[int]:
        """Stop every process of the cluster and remove its temp dir.

        Returns the pids still alive afterwards (empty when all went well).
        """
        ...

    def dead_workers(self, cluster: ClusterRecord) -> list[int]:
        """Worker nodes that were started and are gone."""
        ...

    def exit_reason(self, cluster: ClusterRecord, worker_pid: int | None = None) -> str:
        """Why a node exited, from its log."""
        ...

    def leftover_pids(self, cluster: ClusterRecord) -> list[int]:
        """Processes of the cluster still alive (for leak checks)."""
        ...
