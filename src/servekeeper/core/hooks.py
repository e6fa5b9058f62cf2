"""The named points of a rollout where fault hooks are called, and the hooks that do nothing there.

The controller and the providers are given a `Hooks` at construction and call
`hooks.reached(point, ...)` at the points below and `await hooks.before_config_put(...)` before each
Serve config PUT; production runs this no-op `Hooks`. The faults that tests and benchmarks inject
through it are in `controller/faults.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from servekeeper.core import actions as act
from servekeeper.model.records import ClusterRecord

CRASH_POINTS = (
    "cluster-intent-written",  # the pending cluster's record is stored, no process started yet
    "pending-started",  # its head process runs, its pid recorded
    "config-audited",  # the PUT is audited (intent stored), not sent yet
    "config-submitted",  # the PUT succeeded, its success not recorded yet
    "waiting-for-ready",  # the config is applied, the apps are not ready yet
    "route-switched",  # the ingress acknowledged the switch, the new roles not stored yet
    "draining",  # the old cluster drains
    "deleting-old",  # the old cluster got SIGTERM, not yet SIGKILL
)
# Outside an upgrade: a node added to a running cluster (Ray's autoscaler asked for it, or it
# is started again in place) runs, its pid not recorded yet.
NODE_CRASH_POINTS = ("node-spawned",)


class Hooks:
    """No faults: what production runs."""

    def reached(self, point: str, cluster: ClusterRecord | None = None, service_generation: int = 0) -> None:
        return None

    async def before_config_put(self, cluster: ClusterRecord, service_generation: int = 0) -> None:
        return None

    def after_tick(self, clusters: Sequence[ClusterRecord], actions: Sequence[act.Action]) -> None:
        return None
