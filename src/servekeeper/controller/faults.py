"""The faults a test or benchmark injects into a running daemon through its hooks (core/hooks.py).

The daemon's hooks are chosen from the environment by `hooks_from_environment`, the only place
that reads it: they kill the process with SIGKILL at one named point (no cleanup, no flush:
exactly like `kill -9`) or fail a config PUT. No spec field reaches them.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence

from servekeeper.core import actions as act
from servekeeper.core.hooks import CRASH_POINTS, NODE_CRASH_POINTS, Hooks
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterRecord
from servekeeper.rayapi.serve_api import RetryableServeError

CRASH_ENV = "SERVEKEEPER_TEST_CRASH_AT"
FAIL_PUTS_ENV = "SERVEKEEPER_TEST_FAIL_CONFIG_PUTS"  # the first N config PUTs fail as a 503 would

logger = logging.getLogger(__name__)


class InjectedFaults(Hooks):
    """Crash at one named point of a rollout (never of the first one: the test needs a service
    to upgrade), and/or fail the first `fail_puts` config PUTs with a retryable error."""

    def __init__(self, crash_at: str | None, fail_puts: int = 0, kill: Callable[[], None] | None = None) -> None:
        known = (*CRASH_POINTS, *NODE_CRASH_POINTS)
        if crash_at is not None and crash_at not in known:
            raise ValueError(f"unknown crash point {crash_at!r}; known: {', '.join(known)}")
        self.crash_at = crash_at
        self.fail_puts = fail_puts
        self._kill = kill or _kill_self

    def _crash(self, point: str) -> None:
        if point == self.crash_at:
            logger.warning("test hook %s=%s: killing this process now", CRASH_ENV, point)
            self._kill()

    def reached(self, point: str, cluster: ClusterRecord | None = None, service_generation: int = 0) -> None:
        # The old cluster's deletion concerns generation 1 by nature, as a node added to a running
        # cluster may; every other point must belong to a later generation (a rollout, not the
        # service's first start).
        by_nature = ("deleting-old", *NODE_CRASH_POINTS)
        if point in by_nature or max(service_generation, cluster.generation if cluster else 0) >= 2:
            self._crash(point)

    async def before_config_put(self, cluster: ClusterRecord, service_generation: int = 0) -> None:
        if self.fail_puts > 0 and service_generation >= 2:
            self.fail_puts -= 1
            raise RetryableServeError(f"PUT applications answered 503: injected by {FAIL_PUTS_ENV}")

    def after_tick(self, clusters: Sequence[ClusterRecord], actions: Sequence[act.Action]) -> None:
        roles = {c.role: c for c in clusters}
        pending = roles.get(ClusterRole.PENDING)
        if (
            pending is not None
            and pending.generation >= 2
            and pending.applied_config_hash
            and not any(isinstance(a, act.SetRoute) for a in actions)
        ):
            self._crash("waiting-for-ready")
        if ClusterRole.DRAINING in roles and not any(isinstance(a, act.DeleteCluster) for a in actions):
            self._crash("draining")


def _kill_self() -> None:
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def hooks_from_environment(environ: Mapping[str, str] = os.environ) -> Hooks:
    """The daemon's hooks: none unless a test or benchmark asked for faults."""
    crash_at = environ.get(CRASH_ENV) or None
    fail_puts = int(environ.get(FAIL_PUTS_ENV, "0") or 0)
    if crash_at is None and fail_puts == 0:
        return Hooks()
    return InjectedFaults(crash_at, fail_puts)
