"""Serve configs sent to a cluster: audited in the store before each PUT, the code package
uploaded first, and Ray's refusal turned into the rollout's failure (or a retry)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servekeeper.controller.documents import Packages, SubmittedDocuments
from servekeeper.controller.metrics import ControllerMetrics
from servekeeper.core import actions as act
from servekeeper.core.hooks import Hooks
from servekeeper.core.serve_config import build_serve_config, package_hash_of
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, Event, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.providers.base import ClusterProvider, headers_kwargs
from servekeeper.rayapi.package import Package
from servekeeper.rayapi.serve_api import PermanentServeError, RetryableServeError, ServeClient
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)

MAX_PUTS_PER_CONFIG = 5  # PUTs of one config to one cluster that Ray acknowledged but never showed


@dataclass
class TickOutcome:
    """What one tick's actions found out, beyond the plan: events, and a rollout Ray rejected."""

    events: list[Event] = field(default_factory=list)
    rejected: str | None = None


class StopTick(Exception):
    """The rest of this tick's actions must not run (their precondition failed)."""


class ConfigSubmissions:
    def __init__(
        self,
        store: Store,
        provider: ClusterProvider,
        serve: ServeClient,
        documents: SubmittedDocuments,
        packages: Packages,
        clock: Callable[[], float],
        hooks: Hooks,
        metrics: ControllerMetrics,
    ) -> None:
        self.store = store
        self.provider = provider
        self.serve = serve
        self.documents = documents
        self.packages = packages
        self.clock = clock
        self.hooks = hooks
        self.metrics = metrics

    async def submit_config(
        self, action: act.SubmitConfig, service: ServiceRecord, spec: ServiceSpec, tick: TickOutcome
    ) -> None:
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None:
            return
        document = await self._document_for(action, cluster, service, spec, tick)
        cluster = self.store.update_cluster(
            cluster.name, submitted_config_hash=action.config_hash, config_submitted_at=None
        )
        # Audited before the PUT: a second attempt on the same cluster can never go unseen, and
        # the document is kept to recognise it in Ray's answers and to restore it later.
        self.store.record_submission(cluster.name, action.config_hash, self.clock(), json.dumps(document))
        self.documents.put(cluster.name, action.config_hash, document)
        self.hooks.reached("config-audited", cluster, service.generation)
        self.metrics.config_submitted(service.name)
        try:
            await self.hooks.before_config_put(cluster, service.generation)
            await self.serve.put_config(cluster.dashboard_url, document, **headers_kwargs(self.provider, cluster))
        except RetryableServeError as exc:
            logger.info("[%s/%s] config PUT will be retried: %s", service.name, cluster.name, exc)
            tick.events.append(Event(service.name, self.clock(), "Warning", "ConfigSubmitRetry", str(exc)))
            raise StopTick from exc
        except PermanentServeError as exc:
            self._rejected(cluster, service, f"ConfigRejected: {exc.body}", tick)
            raise StopTick from exc
        self.hooks.reached("config-submitted", cluster, service.generation)
        self.store.update_cluster(cluster.name, config_submitted_at=self.clock())

    async def set_target_capacity(
        self, action: act.SetTargetCapacity, service: ServiceRecord, tick: TickOutcome
    ) -> None:
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None or cluster.applied_config_hash is None:
            return
        document = self.documents.get(cluster.name, cluster.applied_config_hash)
        if document is None:
            return
        try:
            targeted = {**document, "target_capacity": action.capacity}
            await self.serve.put_config(cluster.dashboard_url, targeted, **headers_kwargs(self.provider, cluster))
        except (RetryableServeError, PermanentServeError) as exc:
            # Level-triggered: the planner asks again while Ray shows another capacity.
            tick.events.append(Event(service.name, self.clock(), "Warning", "TargetCapacityRetry", str(exc)))
            raise StopTick from exc
        logger.info("[%s/%s] target_capacity %g%%", service.name, cluster.name, action.capacity)

    async def _document_for(
        self,
        action: act.SubmitConfig,
        cluster: ClusterRecord,
        service: ServiceRecord,
        spec: ServiceSpec,
        tick: TickOutcome,
    ) -> dict[str, Any]:
        document = await self._untargeted_document_for(action, cluster, service, spec, tick)
        if cluster.target_capacity is not None:
            document = {**document, "target_capacity": cluster.target_capacity}
        return document

    async def _untargeted_document_for(
        self,
        action: act.SubmitConfig,
        cluster: ClusterRecord,
        service: ServiceRecord,
        spec: ServiceSpec,
        tick: TickOutcome,
    ) -> dict[str, Any]:
        if self.store.count_submissions(cluster.name, action.config_hash) >= MAX_PUTS_PER_CONFIG:
            # Ray keeps acknowledging the PUT but never reports the config as sent: something
            # rewrites it. Failing the rollout beats re-sending it forever.
            reason = (
                f"ConfigNotObserved: Ray acknowledged config {action.config_hash} {MAX_PUTS_PER_CONFIG} times "
                f"on {cluster.name} but never reports it deployed as sent"
            )
            self._rejected(cluster, service, reason, tick)
            raise StopTick
        if action.restore:
            document = self.documents.get(cluster.name, action.config_hash)
            if document is None:
                # Not restorable (a store from before documents were kept): forget it, so that
                # the cluster is judged by its health again instead of retrying this every tick.
                self.store.update_cluster(cluster.name, good_config_hash=None)
                message = f"the last good config {action.config_hash} of {cluster.name} is not stored"
                tick.events.append(Event(service.name, self.clock(), "Warning", "RestoreImpossible", message))
                raise StopTick
            restored = package_hash_of(document)
            if restored is not None:  # Ray may have let go of the old package: upload it again
                await self._ensure_package(cluster, service, self.packages.by_hash(restored), tick)
            return document
        package = self.packages.of(service)
        if package is not None:
            await self._ensure_package(cluster, service, package, tick)
        return build_serve_config(spec, cluster, package.uri if package else None)

    async def _ensure_package(
        self, cluster: ClusterRecord, service: ServiceRecord, package: Package, tick: TickOutcome
    ) -> None:
        try:
            if await self.serve.ensure_package(
                cluster.dashboard_url, package, **headers_kwargs(self.provider, cluster)
            ):
                logger.info("[%s/%s] code package %s uploaded", service.name, cluster.name, package.hash[:12])
        except (RetryableServeError, FileNotFoundError) as exc:
            # FileNotFoundError: a newer apply pruned the package this (stale) tick wanted.
            logger.info("[%s/%s] package upload will be retried: %s", service.name, cluster.name, exc)
            raise StopTick from exc
        except (PermanentServeError, OSError) as exc:
            self._rejected(cluster, service, f"PackageUploadFailed: {exc}", tick)
            raise StopTick from exc

    def _rejected(self, cluster: ClusterRecord, service: ServiceRecord, reason: str, tick: TickOutcome) -> None:
        """Ray refused the change: a pending cluster fails its rollout; on the active cluster the
        generation is failed (not retried blindly) and the active keeps what it runs."""
        tick.events.append(Event(service.name, self.clock(), "Warning", reason.partition(":")[0], reason))
        if cluster.role in (ClusterRole.PENDING, ClusterRole.STANDBY):  # the standby is built again
            self.store.update_cluster(cluster.name, failure_reason=reason)
        else:
            tick.rejected = reason
