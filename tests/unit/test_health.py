"""Health and readiness as a table over real shapes of Ray Serve's status JSON."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from servekeeper.core.health import health, parse_applications, readiness, switch_allowed
from servekeeper.model.enums import SwitchGate
from servekeeper.model.observation import ClusterObservation

DECLARED = {"router": "/router", "models": "/models"}


def serve_status(**apps: tuple[str, str]) -> dict[str, Any]:
    """Shaped like GET /api/serve/applications/ on Ray 2.60 (trimmed)."""
    return {
        "controller_info": {"node_id": "n1", "node_ip": "127.0.0.1", "actor_name": "SERVE_CONTROLLER_ACTOR"},
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8001},
        "proxies": {"n1": {"status": "HEALTHY"}},
        "applications": {
            name: {
                "name": name,
                "route_prefix": DECLARED.get(name, f"/{name}"),
                "status": status,
                "message": "boom" if status in ("DEPLOY_FAILED", "UNHEALTHY") else "",
                "last_deployed_time_s": 1796027675.1,
                "source": source,
                "deployments": {},
            }
            for name, (status, source) in apps.items()
        },
        "target_capacity": None,
    }


def observed(
    status: dict[str, Any] | None, proxy: bool = True, routes: set[str] | None = None, alive: bool = True
) -> ClusterObservation:
    return ClusterObservation(
        name="c",
        processes_alive=alive,
        dashboard_ok=status is not None,
        apps=parse_applications(status) if status is not None else None,
        proxy_healthy=proxy,
        routes=frozenset(set(DECLARED.values()) if routes is None else routes),
    )


D, IMP = "declarative", "imperative"

CASES = [
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("RUNNING", D))), True, True, "Ready", id="all-running"
    ),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("DEPLOYING", D))),
        True,
        False,
        "AppNotRunning",
        id="deploying-is-healthy-not-ready",
    ),
    pytest.param(
        observed(serve_status(router=("NOT_STARTED", D), models=("RUNNING", D))),
        True,
        False,
        "AppNotRunning",
        id="not-started-is-healthy-not-ready",
    ),
    pytest.param(observed(serve_status(router=("RUNNING", D))), True, False, "AppMissing", id="declared-app-missing"),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("DEPLOY_FAILED", D))),
        False,
        False,
        "AppFailed",
        id="deploy-failed",
    ),
    pytest.param(
        observed(serve_status(router=("UNHEALTHY", D), models=("RUNNING", D))),
        False,
        False,
        "AppFailed",
        id="unhealthy",
    ),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("RUNNING", D), m1=("DEPLOY_FAILED", IMP))),
        True,
        True,
        "Ready",
        id="failed-imperative-app-ignored",
    ),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("RUNNING", D), m1=("DEPLOYING", IMP))),
        True,
        True,
        "Ready",
        id="deploying-imperative-app-ignored",
    ),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("RUNNING", IMP))),
        True,
        False,
        "AppMissing",
        id="imperative-app-with-a-declared-name-does-not-count",
    ),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("RUNNING", D)), proxy=False),
        True,
        False,
        "ProxyNotHealthy",
        id="proxy-not-healthy",
    ),
    pytest.param(
        observed(serve_status(router=("RUNNING", D), models=("RUNNING", D)), routes={"/router"}),
        True,
        False,
        "RoutesMissing",
        id="route-missing",
    ),
    pytest.param(
        replace(observed(serve_status(router=("RUNNING", D), models=("RUNNING", D))), nodes_starting=1),
        True,
        False,
        "NodesStarting",
        id="a-worker-being-started-again",
    ),
    pytest.param(observed(None), False, False, "DashboardUnreachable", id="dashboard-down"),
    pytest.param(observed(None, alive=False), False, False, "HeadDead", id="head-dead"),
]


@pytest.mark.parametrize(("observation", "healthy", "ready", "reason"), CASES)
def test_health_and_readiness(observation: ClusterObservation, healthy: bool, ready: bool, reason: str) -> None:
    assert health(observation, DECLARED).ok is healthy
    verdict = readiness(observation, DECLARED)
    assert verdict.ok is ready
    assert verdict.reason == reason


def test_imperative_apps_count_when_asked() -> None:
    status = serve_status(router=("RUNNING", D), models=("RUNNING", D), m1=("DEPLOY_FAILED", IMP))
    verdict = health(observed(status), DECLARED, include_imperative=True)
    assert not verdict.ok and "'m1'" in verdict.message


def test_unknown_status_and_source_are_tolerated() -> None:
    apps = parse_applications({"applications": {"x": {"status": "SOMETHING_NEW", "source": "martian"}}})
    assert apps["x"].status.value == "UNKNOWN" and apps["x"].source.value == "unknown"


@pytest.mark.parametrize(
    ("gate", "expected"),
    [(SwitchGate.READY, False), (SwitchGate.HEALTHY, True), (SwitchGate.NONE, True)],
)
def test_weaker_gates_allow_a_deploying_cluster(gate: SwitchGate, expected: bool) -> None:
    deploying = observed(serve_status(router=("DEPLOYING", D), models=("DEPLOYING", D)), proxy=True, routes=set())
    assert switch_allowed(gate, deploying, DECLARED).ok is expected
