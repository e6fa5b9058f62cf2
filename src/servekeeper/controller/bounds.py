"""Ray's autoscaler given new bounds in place (`core.planner.bounds` asks for it): the head's
monitor config is rewritten first, then the cluster is recorded as made from the new spec. A
crash between the two leaves the old spec recorded, so the next tick writes the same config
again (and `up` rewrites every monitor's config from its record). A failed write stops the tick
(it is the plan's last action: the status it planned is not stored) and is told once per cause.
A start running beside the ticks spawns a head with the spec it read when it began: once it
ends, bounds given meanwhile are given again."""

from __future__ import annotations

import logging
from collections.abc import Callable

from servekeeper.controller.submit import StopTick, TickOutcome
from servekeeper.core import actions as act
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord, Event
from servekeeper.providers.base import ClusterProvider, ProviderError
from servekeeper.store.store import Store

logger = logging.getLogger(__name__)


class AutoscalerBounds:
    def __init__(self, store: Store, provider: ClusterProvider, clock: Callable[[], float]) -> None:
        self.store = store
        self.provider = provider
        self.clock = clock
        self.failures: dict[str, str] = {}  # cluster -> why its last update failed, told once

    async def update(self, action: act.UpdateAutoscaler, tick: TickOutcome) -> None:
        cluster = self.store.get_cluster(action.cluster)
        if cluster is None or cluster.role == ClusterRole.DELETING:
            return
        config = RayClusterConfigSpec.model_validate_json(action.spec_json)
        try:
            await self.provider.update_autoscaler(cluster, config)
        except (OSError, ProviderError) as exc:
            message = f"Ray's autoscaler of {cluster.name} could not be given its new bounds: {exc}"
            logger.warning("[%s/%s] %s", cluster.service, cluster.name, message)
            if self.failures.get(cluster.name) != message:
                tick.events.append(Event(cluster.service, self.clock(), "Warning", "AutoscalerUpdateFailed", message))
            self.failures[cluster.name] = message
            raise StopTick from exc
        self.failures.pop(cluster.name, None)
        self.store.update_cluster(cluster.name, cluster_spec_json=action.spec_json, cluster_spec_hash=action.spec_hash)

    async def after_start(self, started: ClusterRecord) -> None:
        """The bounds recorded since `started` was read, given again: the start's head spawn may
        have written its monitor's config from the older spec."""
        current = self.store.get_cluster(started.name)
        if current is None or current.cluster_spec_hash == started.cluster_spec_hash:
            return
        config = RayClusterConfigSpec.model_validate_json(current.cluster_spec_json)
        if not config.enableInTreeAutoscaling:
            return
        try:
            await self.provider.update_autoscaler(current, config)
        except (OSError, ProviderError) as exc:
            logger.warning("[%s/%s] the autoscaler's bounds not given again: %s", current.service, current.name, exc)
