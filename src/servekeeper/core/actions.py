"""What the planner asks the controller to do. Plain data; the controller executes them in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servekeeper.status import ClusterRole


@dataclass(frozen=True)
class CreateCluster:
    role: ClusterRole
    reason: str


@dataclass(frozen=True)
class StartCluster:
    """The intent was recorded but the processes were never started (a crash in between)."""

    cluster: str


@dataclass(frozen=True)
class SubmitConfig:
    cluster: str
    config_hash: str
    restore: bool = False  # the cluster's last good config, after a failed in-place change


@dataclass(frozen=True)
class UpdateCluster:
    cluster: str
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SetRoute:
    """Point the service's ingress port at `active`; `upstreams` also lists clusters still
    draining, so the ingress keeps counting their in-flight requests."""

    active: str
    upstreams: tuple[str, ...]


@dataclass(frozen=True)
class RemoveRoute:
    pass


@dataclass(frozen=True)
class DeleteCluster:
    cluster: str
    reason: str


@dataclass(frozen=True)
class ForgetService:
    pass


Action = (
    CreateCluster | StartCluster | SubmitConfig | UpdateCluster | SetRoute | RemoveRoute | DeleteCluster | ForgetService
)
