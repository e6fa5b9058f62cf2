"""Pure health and readiness verdicts over Ray Serve's status JSON.

Healthy is not ready: an app that is NOT_STARTED or DEPLOYING has failed nothing, but it
cannot serve yet. Traffic moves only on `ready`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servekeeper.model.enums import FAILED_APP_STATUSES, AppSource, AppStatus, SwitchGate
from servekeeper.model.observation import AppState, ClusterObservation


def parse_applications(serve_status: dict[str, Any]) -> dict[str, AppState]:
    """`GET /api/serve/applications/` answer -> app name -> AppState."""
    apps: dict[str, AppState] = {}
    for name, details in (serve_status.get("applications") or {}).items():
        apps[name] = AppState(
            name=name,
            status=AppStatus.parse(str(details.get("status", ""))),
            source=AppSource.parse(details.get("source")),
            message=_message(details),
            route_prefix=details.get("route_prefix"),
            last_deployed_time_s=details.get("last_deployed_time_s"),
            deployed_config=details.get("deployed_app_config"),
            running_replicas=_running_replicas(details),
            settled=all(d.get("status") == "HEALTHY" for d in (details.get("deployments") or {}).values()),
        )
    return apps


def _running_replicas(details: dict[str, Any]) -> int:
    return sum(
        1
        for deployment in (details.get("deployments") or {}).values()
        for replica in deployment.get("replicas") or []
        if replica.get("state") == "RUNNING"
    )


def _message(details: dict[str, Any]) -> str:
    """The app's message, with the cause of each failed deployment: Ray's app-level text alone
    ("Failed to update the deployments ['X']") does not say why."""
    message = str(details.get("message") or "")
    for name, deployment in sorted((details.get("deployments") or {}).items()):
        if deployment.get("status") in ("DEPLOY_FAILED", "UNHEALTHY") and deployment.get("message"):
            message += f" {name}: {str(deployment['message'])[-600:]}"
    return message.strip()


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # a short CamelCase cause when not ok
    message: str = ""


def judged_apps(
    apps: dict[str, AppState], declared: dict[str, str | None], include_imperative: bool = False
) -> dict[str, AppState]:
    """The apps whose state decides the verdict: the declared ones, unless asked for all.

    An app Ray reports as imperative (created at run time with `serve.run`) is never judged by
    default, even if it happens to share a declared name's status slot.
    """
    if include_imperative:
        return dict(apps)
    return {name: app for name, app in apps.items() if name in declared and app.source != AppSource.IMPERATIVE}


def health(
    observation: ClusterObservation, declared: dict[str, str | None], include_imperative: bool = False
) -> Verdict:
    if not observation.processes_alive:
        detail = f": {observation.error}" if observation.error else ""
        if observation.head_silent_since is not None:  # unknown, not dead: it may still run
            return Verdict(False, "HeadUnreachable", f"the head's host does not answer{detail}")
        return Verdict(False, "HeadDead", f"the cluster's head processes are not running{detail}")
    if observation.dead_workers:
        return Verdict(False, "WorkerDied", observation.error or f"{observation.dead_workers} worker node(s) exited")
    if not observation.dashboard_ok or observation.apps is None:
        return Verdict(False, "DashboardUnreachable", observation.error or "the Ray dashboard does not answer")
    for name, app in sorted(judged_apps(observation.apps, declared, include_imperative).items()):
        if app.status in FAILED_APP_STATUSES:
            detail = f": {app.message}" if app.message else ""
            return Verdict(False, "AppFailed", f"application {name!r} is {app.status.value}{detail}")
    return Verdict(True, "Healthy")


def readiness(
    observation: ClusterObservation, declared: dict[str, str | None], include_imperative: bool = False
) -> Verdict:
    healthy = health(observation, declared, include_imperative)
    if not healthy.ok:
        return healthy
    assert observation.apps is not None  # health() checked it
    if observation.nodes_starting:
        count = observation.nodes_starting
        return Verdict(False, "NodesStarting", f"{count} worker node(s) not running yet (being started)")
    judged = judged_apps(observation.apps, declared, include_imperative)
    for name in sorted(declared):
        if name not in judged:
            return Verdict(False, "AppMissing", f"application {name!r} is not deployed yet")
    for name, app in sorted(judged.items()):
        if app.status != AppStatus.RUNNING:
            return Verdict(False, "AppNotRunning", f"application {name!r} is {app.status.value}")
    if not observation.proxy_healthy:
        return Verdict(False, "ProxyNotHealthy", "the Serve proxy does not answer /-/healthz with 200")
    missing_routes = sorted(
        prefix for prefix in declared.values() if prefix is not None and prefix not in observation.routes
    )
    if missing_routes:
        return Verdict(False, "RoutesMissing", f"the Serve proxy does not route {missing_routes} yet")
    for probe in observation.probes:
        if not probe.passing:
            last = probe.last_message or "not run yet"
            return Verdict(
                False,
                "ProbeFailing",
                f"probe {probe.path}: {probe.consecutive_successes}/{probe.success_threshold} "
                f"consecutive passes; last: {last}",
            )
    return Verdict(True, "Ready")


def probe_result(status: int, body: str, expect_status: int, body_contains: str | None) -> tuple[bool, str]:
    """Judge one probe answer: (passed, what was seen)."""
    if status != expect_status:
        return False, f"HTTP {status}, expected {expect_status}"
    if body_contains is not None and body_contains not in body:
        return False, f"HTTP {status}, body lacks {body_contains!r}"
    return True, f"HTTP {status}"


def switch_allowed(
    gate: SwitchGate,
    observation: ClusterObservation,
    declared: dict[str, str | None],
    include_imperative: bool = False,
) -> Verdict:
    """May traffic move to this cluster? Only `SwitchGate.READY` is the product."""
    if gate == SwitchGate.READY:
        return readiness(observation, declared, include_imperative)
    if gate == SwitchGate.HEALTHY:
        # The reference before its fix: no failed app counts as good enough.
        return health(observation, declared, include_imperative)
    if observation.processes_alive and observation.dashboard_ok:
        return Verdict(True, "HeadUp")
    return Verdict(False, "HeadNotUp", "the head has not started yet")
