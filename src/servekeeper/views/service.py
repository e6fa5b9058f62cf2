"""Pure: the JSON a user sees for a service (`get -o json`, the API)."""

from __future__ import annotations

from servekeeper.core import canary_steps
from servekeeper.core.planner.workers import expected_workers
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.observation import AppState, Observation, ProbeState
from servekeeper.model.records import AnalysisFigures, CanaryState, ClusterRecord, Condition, Event, ServiceRecord
from servekeeper.model.spec import ServiceSpec
from servekeeper.model.wire import (
    AnalysisView,
    AppView,
    CanaryView,
    ClusterView,
    ConditionView,
    EventView,
    ProbeView,
    ServiceView,
    WorkerGroupView,
)


def cluster_view(cluster: ClusterRecord, observation: Observation | None, traffic_percent: int) -> ClusterView:
    observed = observation.clusters.get(cluster.name) if observation else None
    route = observation.route if observation else None
    # Requests and open streams the ingress still has on this cluster (None: not routed or unread).
    inflight = route.inflight.get(cluster.name) if route is not None and cluster.name in route.upstreams else None
    apps: dict[str, AppView] = {}
    config = cluster_config(cluster)  # its own environment's fields; None and []: the controller's
    if observed is not None and observed.apps is not None:
        apps = {name: app_view(app) for name, app in sorted(observed.apps.items())}
    return {
        "name": cluster.name,
        "generation": cluster.generation,
        "role": cluster.role.value,
        "address": cluster.gcs_address,
        "dashboardUrl": cluster.dashboard_url,
        "hostPool": cluster.pool,  # None: on the controller's machine
        "headHost": cluster.nodes[0].host if cluster.nodes and cluster.pool else None,  # a pool host
        "rayVersion": config.rayVersion if config is not None else None,
        "pythonVersion": config.pythonVersion if config is not None else None,
        "pip": list(config.pip) if config is not None else [],
        "serveUrl": cluster.serve_url,
        "trafficPercent": traffic_percent,
        "headPid": cluster.head_pid,
        "workerPids": list(cluster.worker_pids),
        "workersExpected": _workers_expected(cluster),
        "workerGroups": worker_group_views(cluster, config),
        "appliedConfigHash": cluster.applied_config_hash,
        "goodConfigHash": cluster.good_config_hash,
        "packageHash": cluster.package_hash,
        "createdAt": cluster.created_at,
        "submittedConfigHash": cluster.submitted_config_hash,
        "configSubmittedAt": cluster.config_submitted_at,
        "readyAt": cluster.ready_at,
        "drainStartedAt": cluster.drain_started_at,
        "failureReason": cluster.failure_reason,
        "headAlive": observed.processes_alive if observed else None,
        "dashboardOk": observed.dashboard_ok if observed else None,
        "deployedConfigHash": observed.deployed_config_hash if observed else None,
        "inflightRequests": inflight,
        "applications": apps,
        "probes": [probe_view(probe) for probe in observed.probes] if observed else [],
    }


def worker_group_views(cluster: ClusterRecord, config: RayClusterConfigSpec | None) -> list[WorkerGroupView]:
    """Each worker group's running and recorded nodes against its bounds, from the record."""
    if config is None:
        return []
    # A node without a group (a pool's, or a row written before nodes kept one) is known by its
    # place: the spec's groups in order, each its replicas long, after the head.
    by_place = [group.name for group in config.workerGroups for _ in range(group.replicas)]
    workers = [node for node in cluster.nodes if node.role == "worker"]
    groups = [node.group or (by_place[i] if i < len(by_place) else None) for i, node in enumerate(workers)]
    views: list[WorkerGroupView] = []
    for group in config.workerGroups:
        recorded = [node for node, name in zip(workers, groups, strict=True) if name == group.name and not node.stopped]
        views.append(
            {
                "name": group.name,
                "nodes": sum(1 for node in recorded if node.pid is not None),
                "desired": len(recorded),
                "minNodes": group.min_nodes() if config.enableInTreeAutoscaling else group.replicas,
                "maxNodes": group.max_nodes() if config.enableInTreeAutoscaling else group.replicas,
                "autoscaled": config.enableInTreeAutoscaling,
            }
        )
    return views


def cluster_config(cluster: ClusterRecord) -> RayClusterConfigSpec | None:
    try:
        return RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
    except ValueError:  # a record stored by an older version
        return None


def _workers_expected(cluster: ClusterRecord) -> int | None:
    try:
        return expected_workers(cluster)  # with Ray's autoscaler: those recorded, not the spec's
    except ValueError:  # a record stored by an older version: the count is unknown, not an error
        return None


def _declared_apps(service: ServiceRecord) -> list[str]:
    try:
        return sorted(ServiceSpec.model_validate_json(service.spec_json).declared_apps())
    except ValueError:
        return []


def service_view(
    service: ServiceRecord,
    ingress_port: int,
    clusters: list[ClusterRecord],
    observation: Observation | None,
    now: float | None = None,
) -> ServiceView:
    def pick(role: ClusterRole) -> ClusterRecord | None:
        found = [c for c in clusters if c.role == role]
        return max(found, key=lambda c: c.created_at) if found else None

    active = pick(ClusterRole.ACTIVE)
    pending = pick(ClusterRole.PENDING)
    standby = pick(ClusterRole.STANDBY)
    route = observation.route if observation else None
    routed = route.active if route else None

    def traffic(cluster: ClusterRecord) -> int:
        return route.weight_of(cluster.name) if route is not None else 0

    pending_view = cluster_view(pending, observation, traffic(pending)) if pending else None
    if pending is not None and pending_view is not None and pending.canary is not None:
        pending_view["canary"] = canary_view(service, pending.canary, now)
    return {
        "name": service.name,
        "generation": service.generation,
        "observedGeneration": service.observed_generation,
        "deleting": service.deleting,
        "conditions": [condition_view(c) for c in service.conditions],
        "ingress": {"url": f"http://127.0.0.1:{ingress_port}", "port": ingress_port, "routedTo": routed},
        "activeCluster": cluster_view(active, observation, traffic(active)) if active else None,
        "pendingCluster": pending_view,
        "standbyCluster": cluster_view(standby, observation, traffic(standby)) if standby else None,
        "standby": "none" if standby is None else "ready" if standby.ready_at is not None else "building",
        "otherClusters": [
            cluster_view(c, observation, traffic(c))
            for c in clusters
            if c.role in (ClusterRole.DRAINING, ClusterRole.DELETING)
        ],
        "failureReason": service.failure_reason if service.failed_generation == service.generation else None,
        "declaredApplications": _declared_apps(service),
    }


def canary_view(service: ServiceRecord, state: CanaryState, now: float | None) -> CanaryView:
    """Where a canary is: weight, step, the pause left, and the analysis so far."""
    view: CanaryView = {
        "weight": state.weight,
        "step": state.step,
        "stepStartedAt": state.step_started_at,
        "passedIntervals": state.passed_intervals,
        "failedIntervals": state.failed_intervals,
        "inconclusiveIntervals": state.inconclusive_intervals,
        "lastAnalysis": analysis_view(state.last_analysis) if state.last_analysis else None,
    }
    try:
        strategy = ServiceSpec.model_validate_json(service.spec_json).spec.upgradeStrategy.canary
    except ValueError:
        strategy = None
    if strategy is not None:
        view["steps"] = len(strategy.steps)
        view["stepDescription"] = canary_steps.describe_step(strategy, state)
        view["pauseRemainingSeconds"] = canary_steps.pause_remaining(strategy, state, now) if now is not None else None
        header = canary_steps.header_route(strategy, state)
        view["headerRoute"] = header.describe() if header is not None else None
        mirror = canary_steps.mirror(strategy, state)
        view["mirror"] = f"{mirror.percent}% of {', '.join(mirror.methods)} copied" if mirror is not None else None
    return view


def event_view(event: Event) -> EventView:
    return {
        "service": event.service,
        "time": event.time,
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
    }


def condition_view(condition: Condition) -> ConditionView:
    return {
        "type": condition.type.value,
        "status": "True" if condition.status else "False",
        "reason": condition.reason,
        "message": condition.message,
        "lastTransitionTime": condition.last_transition_time,
    }


def app_view(app: AppState) -> AppView:
    return {"status": app.status.value, "source": app.source.value, "message": app.message}


def probe_view(probe: ProbeState) -> ProbeView:
    return {
        "path": probe.path,
        "passing": probe.passing,
        "consecutiveSuccesses": probe.consecutive_successes,
        "successThreshold": probe.success_threshold,
        "lastOk": probe.last_ok,
        "lastMessage": probe.last_message,
        "lastTime": probe.last_time,
    }


def analysis_view(figures: AnalysisFigures) -> AnalysisView:
    return {
        "started_at": figures.started_at,
        "ended_at": figures.ended_at,
        "requests": figures.requests,
        "success_rate": figures.success_rate,
        "p99_ms": figures.p99_ms,
        "stable_requests": figures.stable_requests,
        "stable_success_rate": figures.stable_success_rate,
        "stable_p99_ms": figures.stable_p99_ms,
        "verdict": figures.verdict,
        "message": figures.message,
    }
