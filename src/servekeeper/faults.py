"""Deterministic fault injection for tests: a crash at a named point of the upgrade.

Inactive unless a test sets SERVEKEEPER_TEST_CRASH_AT to a point's name; the controller then
kills itself with SIGKILL (no cleanup, no flush: exactly like `kill -9`) when it gets there.
"""

from __future__ import annotations

import logging
import os
import signal

CRASH_ENV = "SERVEKEEPER_TEST_CRASH_AT"
CRASH_POINTS = (
    "cluster-intent-written",  # the pending cluster's record is stored, no process started yet
    "pending-started",  # its head process runs, its pid recorded
    "config-submitted",  # the PUT succeeded, its success not recorded yet
    "waiting-for-ready",  # the config is applied, the apps are not ready yet
    "route-switched",  # the ingress acknowledged the switch, the new roles not stored yet
    "draining",  # the old cluster drains
    "deleting-old",  # the old cluster got SIGTERM, not yet SIGKILL
)

logger = logging.getLogger(__name__)


def armed() -> bool:
    """Cheap check, so production code pays nothing to look for crash points."""
    return CRASH_ENV in os.environ


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        logger.warning("test hook %s=%s: killing this process now", CRASH_ENV, name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
