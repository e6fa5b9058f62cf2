"""Pure: a service's status (the JSON view of `get -o json`) in KubeRay's RayService shape, so
that scripts written against `kubectl get rayservice -o json` keep working.

Types and reasons are KubeRay's (ray-operator/apis/ray/v1/rayservice_types.go); servekeeper's own
reason and message are kept in the message.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

# KubeRay's RayServiceConditionType and RayServiceConditionReason values
READY = "Ready"
UPGRADE_IN_PROGRESS = "UpgradeInProgress"
INITIALIZING = "Initializing"
INITIALIZING_TIMEOUT = "InitializingTimeout"
ZERO_SERVE_ENDPOINTS = "ZeroServeEndpoints"
NON_ZERO_SERVE_ENDPOINTS = "NonZeroServeEndpoints"
BOTH_ACTIVE_PENDING_CLUSTERS_EXIST = "BothActivePendingClustersExist"
NO_PENDING_CLUSTER = "NoPendingCluster"
NO_ACTIVE_CLUSTER = "NoActiveCluster"


def kuberay_service(view: dict[str, Any]) -> dict[str, Any]:
    """The whole object, as `kubectl get rayservice NAME -o json` prints it (status only filled)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": view["name"], "generation": view["generation"]},
        "status": kuberay_status(view),
    }


def kuberay_status(view: dict[str, Any]) -> dict[str, Any]:
    conditions = {c["type"]: c for c in view.get("conditions", [])}
    ready = conditions.get("Ready", {})
    is_ready = ready.get("status") == "True"
    active, pending = view.get("activeCluster"), view.get("pendingCluster")
    observed = int(view.get("observedGeneration") or 0)

    if is_ready:
        ready_reason = NON_ZERO_SERVE_ENDPOINTS
    elif active is None:
        failure = view.get("failureReason") or ""
        ready_reason = INITIALIZING_TIMEOUT if failure.startswith("ReadinessTimeout") else INITIALIZING
    else:
        ready_reason = ZERO_SERVE_ENDPOINTS
    if active is not None and pending is not None:
        upgrade = ("True", BOTH_ACTIVE_PENDING_CLUSTERS_EXIST)
    elif active is None:
        upgrade = ("False", NO_ACTIVE_CLUSTER)
    else:
        upgrade = ("False", NO_PENDING_CLUSTER)
    upgrade_source = conditions.get("UpgradeInProgress", {})

    status: dict[str, Any] = {
        "conditions": [
            _condition(READY, "True" if is_ready else "False", ready_reason, ready, observed),
            _condition(UPGRADE_IN_PROGRESS, upgrade[0], upgrade[1], upgrade_source, observed),
        ],
        "activeServiceStatus": _service_status(active),
        "pendingServiceStatus": _service_status(pending),
        # Serve runs one proxy per cluster (HeadOnly), behind servekeeper's ingress.
        "numServeEndpoints": 1 if is_ready else 0,
        "observedGeneration": observed,
    }
    if is_ready:
        status["serviceStatus"] = "Running"  # deprecated in KubeRay; "" (omitted) when not ready
    return status


def _condition(
    condition_type: str, status: str, reason: str, source: dict[str, Any], observed_generation: int
) -> dict[str, Any]:
    detail = ": ".join(part for part in (source.get("reason"), source.get("message")) if part)
    return {
        "type": condition_type,
        "status": status,
        "reason": reason,
        "message": detail,
        "lastTransitionTime": _rfc3339(source.get("lastTransitionTime")),
        "observedGeneration": observed_generation,
    }


def _rfc3339(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _service_status(cluster: dict[str, Any] | None) -> dict[str, Any]:
    if cluster is None:
        return {}
    applications: dict[str, Any] = {}
    for name, app in cluster.get("applications", {}).items():
        entry: dict[str, Any] = {"status": app["status"]}
        if app.get("message"):
            entry["message"] = app["message"]
        deployments = app.get("deployments")
        if deployments:
            entry["serveDeploymentStatuses"] = {
                deployment: {k: v for k, v in state.items() if k in ("status", "message") and v}
                for deployment, state in deployments.items()
            }
        applications[name] = entry
    status: dict[str, Any] = {
        "rayClusterName": cluster["name"],
        "trafficRoutedPercent": cluster.get("trafficPercent", 0),
    }
    if applications:
        status["applicationStatuses"] = applications
    return status
