"""Status enums. They are `str`, so that their `.value` is what the store and the API hold: no pickles."""

from __future__ import annotations

import enum


class AppStatus(str, enum.Enum):
    NOT_STARTED = "NOT_STARTED"
    DEPLOYING = "DEPLOYING"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    RUNNING = "RUNNING"
    UNHEALTHY = "UNHEALTHY"
    DELETING = "DELETING"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, value: str) -> AppStatus:
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


FAILED_APP_STATUSES = frozenset({AppStatus.DEPLOY_FAILED, AppStatus.UNHEALTHY})


class AppSource(str, enum.Enum):
    DECLARATIVE = "declarative"
    IMPERATIVE = "imperative"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: str | None) -> AppSource:
        try:
            return cls(value or "unknown")
        except ValueError:
            return cls.UNKNOWN


class ClusterRole(str, enum.Enum):
    PENDING = "pending"  # coming up beside the active cluster; gets no traffic
    ACTIVE = "active"  # receives the service's traffic
    DRAINING = "draining"  # no new traffic; deleted once idle or at the deadline
    DELETING = "deleting"  # processes being stopped
    # A second cluster of the active's spec, apps deployed, no traffic of its own; the ingress
    # sends it the active's traffic the moment the active refuses connections (spec.standby).
    STANDBY = "standby"


class ConditionType(str, enum.Enum):
    READY = "Ready"
    UPGRADE_IN_PROGRESS = "UpgradeInProgress"
    ROLLOUT_FAILED = "RolloutFailed"
    CLUSTER_SPEC_OUTDATED = "ClusterSpecOutdated"


class SwitchGate(str, enum.Enum):
    """When traffic may move to a pending cluster.

    Only READY is the product. The others reproduce the reference's failure modes so that
    tests and benchmarks can show the gate matters; they are set by an environment variable,
    never by a spec.
    """

    READY = "ready"
    HEALTHY = "healthy"
    NONE = "none"
