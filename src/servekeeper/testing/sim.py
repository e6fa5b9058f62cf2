"""A simulated world on a fake clock: clusters that start, deploy and fail on schedule.

It executes the planner's actions the way the controller would, and makes observations the
way Ray would answer, with no process and no socket. Used by the planner's tick-by-tick tests
and by the scale benchmark; never instead of real Ray in integration tests.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from servekeeper.core import actions as act
from servekeeper.core.planner import Plan, plan
from servekeeper.model.enums import AppSource, AppStatus, ClusterRole, SwitchGate
from servekeeper.model.observation import (
    AppState,
    BackendCounters,
    ClusterObservation,
    IngressRouteObservation,
    Observation,
    ProbeState,
)
from servekeeper.model.records import ClusterPorts, ClusterRecord, Event, NodePorts, ServiceRecord
from servekeeper.model.spec import ServiceSpec

_BUCKETS_MS = (0.5, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)  # Envoy's defaults
_NODE = NodePorts(1, 2, 3, 4, 5, 6, 7, 8)
_PORTS = ClusterPorts(gcs=1, dashboard=2, client_server=3, serve_http=4, serve_grpc=5, node_ports=(_NODE,))


@dataclass
class SimCluster:
    """How a simulated cluster behaves: seconds from start to dashboard, from config to RUNNING."""

    head_start_s: float = 6.0
    deploy_s: float = 3.0
    app_status_after_deploy: AppStatus = AppStatus.RUNNING
    started_at: float | None = None
    config_at: float | None = None
    head_alive: bool = True
    extra_apps: dict[str, AppState] = field(default_factory=dict)
    probe_pass_after_deploy_s: float = 0.0  # declared probes start passing this long after RUNNING
    deployed_hash: str | None = None  # the config Ray runs (what deployed_app_config would match)
    failing_configs: frozenset[str] = frozenset()  # configs whose apps end DEPLOY_FAILED
    lost_puts: int = 0  # the next PUTs fail (timeout, 503): Ray never gets them
    replicas: int = 4  # of the one deployment, at target_capacity 100
    target_capacity: float | None = None  # Serve's, as the last PUT set it
    capacity_at: float | None = None  # when it changed: the deployment scales for `scale_s`
    scale_s: float = 2.0
    exited_workers: tuple[int, ...] = ()  # worker nodes (pids) whose process exited, until started again
    silent_workers: int = 0  # worker nodes on hosts that do not answer (dead, maybe still running)
    workers_keep_exiting: bool = False  # a restarted worker exits again at once
    head_silent: bool = False  # the head's host does not answer (unknown: the head may still run)
    head_keeps_exiting: bool = False  # a head started again in place exits again at once


@dataclass
class SimWorld:
    spec: ServiceSpec
    now: float = 1000.0
    gate: SwitchGate = SwitchGate.READY
    behaviours: list[SimCluster] = field(default_factory=list)  # used in creation order
    default_behaviour: SimCluster = field(default_factory=SimCluster)

    def __post_init__(self) -> None:
        self.service = ServiceRecord(
            name=self.spec.name, spec_json=self.spec.to_json(), generation=1, created_at=self.now
        )
        self.clusters: dict[str, ClusterRecord] = {}
        self.sim: dict[str, SimCluster] = {}
        self.route: IngressRouteObservation | None = None
        self.inflight: dict[str, int] = {}
        self.events: list[Event] = []
        self.actions: list[act.Action] = []
        self.submissions: list[str] = []
        self._ids = itertools.count(1)
        self._pids = itertools.count(5000)
        self.forgotten = False
        # The ingress's per-backend counters (None: unreadable); grown by `serve_traffic`.
        self.counters: dict[str, BackendCounters] | None = {}
        self.ingress_epoch = "1"
        # (cluster, "head" or "workers") -> since when that host (a worker's: any) is silent
        self.silent_since: dict[tuple[str, str], float] = {}

    # -- inputs --------------------------------------------------------------------------

    def apply(self, spec: ServiceSpec) -> None:
        if spec.to_json() != self.service.spec_json:
            self.spec = spec
            self.service = self.service.with_changes(spec_json=spec.to_json(), generation=self.service.generation + 1)

    def delete(self) -> None:
        self.service = self.service.with_changes(deleting=True)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def serve_traffic(
        self,
        requests: int,
        error_rate: dict[str, float] | None = None,
        latency_ms: dict[str, float] | None = None,
        with_header: int = 0,
    ) -> None:
        """`requests` answered through the ingress, split by the route's weights, and `with_header`
        more that match its header route (to that route's backend; by the weights without one);
        each backend fails its `error_rate` share with a 5xx and answers in `latency_ms` (5 ms)."""
        if self.route is None or self.counters is None:
            return
        mirror = self.route.mirror
        header_backend = self.route.header_backend if self.route.header_route is not None else None
        if header_backend is None:
            requests, with_header = requests + with_header, 0
        for name in self.route.upstreams:
            share = round(requests * self.route.weight_of(name) / 100)
            if mirror is not None and mirror.backend == name:
                share += round(requests * mirror.percent / 100)  # the copies (every request's method copied)
            if name == header_backend:
                share += with_header
            if share <= 0:
                continue
            before = self.counters.get(name, BackendCounters())
            latency = (latency_ms or {}).get(name, 5.0)
            buckets = dict(before.latency_ms_buckets) or dict.fromkeys(map(float, _BUCKETS_MS), 0)
            grown = {bound: count + (share if latency <= bound else 0) for bound, count in buckets.items()}
            if before.epoch != self.ingress_epoch:
                before = BackendCounters(epoch=self.ingress_epoch)
            self.counters[name] = BackendCounters(
                epoch=self.ingress_epoch,
                requests=before.requests + share,
                errors_5xx=before.errors_5xx + round(share * (error_rate or {}).get(name, 0.0)),
                latency_ms_buckets=tuple(sorted(grown.items())),
            )

    # -- observation ---------------------------------------------------------------------

    def observe_cluster(self, cluster: ClusterRecord) -> ClusterObservation:
        behaviour = self.sim[cluster.name]
        if behaviour.started_at is None or not behaviour.head_alive:
            return ClusterObservation(name=cluster.name, processes_alive=False)
        if behaviour.head_silent:  # as the controller reports it: since when, on every look since
            since = self.silent_since.setdefault((cluster.name, "head"), self.now)
            error = "head node host h0 did not answer within 4s"
            return ClusterObservation(name=cluster.name, processes_alive=False, head_silent_since=since, error=error)
        self.silent_since.pop((cluster.name, "head"), None)
        workers_silent_since = None
        if behaviour.silent_workers:
            workers_silent_since = self.silent_since.setdefault((cluster.name, "workers"), self.now)
        else:
            self.silent_since.pop((cluster.name, "workers"), None)
        if behaviour.exited_workers or behaviour.silent_workers:
            return ClusterObservation(
                name=cluster.name,
                processes_alive=True,
                dead_workers=len(behaviour.exited_workers) + behaviour.silent_workers,
                exited_workers=behaviour.exited_workers,
                silent_workers=behaviour.silent_workers,
                workers_silent_since=workers_silent_since,
                error="a worker node exited" if behaviour.exited_workers else "a worker's host is silent",
            )
        if self.now - behaviour.started_at < behaviour.head_start_s:
            return ClusterObservation(name=cluster.name, processes_alive=True, error="starting")
        apps, routes = self._apps(behaviour)
        probes_pass = (
            behaviour.config_at is not None
            and self.now - behaviour.config_at >= behaviour.deploy_s + behaviour.probe_pass_after_deploy_s
        )
        probes = tuple(
            ProbeState(
                path=probe.path,
                passing=probes_pass,
                consecutive_successes=probe.successThreshold if probes_pass else 0,
                success_threshold=probe.successThreshold,
                last_ok=probes_pass,
            )
            for probe in self.spec.spec.readiness.probes
        )
        return ClusterObservation(
            name=cluster.name,
            processes_alive=True,
            dashboard_ok=True,
            apps=apps,
            proxy_healthy=True,
            routes=frozenset(routes),
            probes=probes,
            deployed_config_hash=behaviour.deployed_hash,
            target_capacity=behaviour.target_capacity if cluster.target_capacity is not None else None,
        )

    def _apps(self, behaviour: SimCluster) -> tuple[dict[str, AppState], set[str]]:
        """The apps Ray would report now, and the routes its proxy would serve."""
        apps: dict[str, AppState] = dict(behaviour.extra_apps)
        routes: set[str] = set()
        if behaviour.config_at is not None:
            deployed = self.now - behaviour.config_at >= behaviour.deploy_s
            status = behaviour.app_status_after_deploy if deployed else AppStatus.DEPLOYING
            if deployed and behaviour.deployed_hash in behaviour.failing_configs:
                status = AppStatus.DEPLOY_FAILED
            capacity = behaviour.target_capacity if behaviour.target_capacity is not None else 100.0
            scaling = behaviour.capacity_at is not None and self.now - behaviour.capacity_at < behaviour.scale_s
            running = math.ceil(behaviour.replicas * capacity / 100) if status == AppStatus.RUNNING else 0
            for name, prefix in self.spec.declared_apps().items():
                apps[name] = AppState(
                    name=name,
                    status=status,
                    source=AppSource.DECLARATIVE,
                    route_prefix=prefix,
                    running_replicas=running,
                    settled=not scaling,
                )
                if status == AppStatus.RUNNING and prefix is not None:
                    routes.add(prefix)
        return apps, routes

    def observe(self) -> Observation:
        route = None
        if self.route is not None:
            route = IngressRouteObservation(
                active=self.route.active,
                upstreams=self.route.upstreams,
                inflight={name: self.inflight.get(name, 0) for name in self.route.upstreams},
                weights=dict(self.route.weights),
                preview=self.route.preview,
            )
        clusters = {
            name: self.observe_cluster(cluster)
            for name, cluster in self.clusters.items()
            if cluster.role != ClusterRole.DELETING
        }
        return Observation(
            clusters=clusters, route=route, backend_counters=dict(self.counters) if self.counters is not None else None
        )

    # -- one tick ------------------------------------------------------------------------

    def tick(self) -> Plan:
        decision = plan(self.spec, self.service, list(self.clusters.values()), self.observe(), self.now, self.gate)
        for action in decision.actions:
            self._execute(action)
        self.service = decision.service
        self.events.extend(decision.events)
        self.actions.extend(decision.actions)
        return decision

    def run_for(self, seconds: float, step: float = 0.5) -> None:
        end = self.now + seconds
        while self.now < end:
            self.tick()
            self.advance(step)

    def _execute(self, action: act.Action) -> None:
        if isinstance(action, act.CreateCluster):
            self._create(action)
        elif isinstance(action, act.StartCluster):
            self.clusters[action.cluster] = self.clusters[action.cluster].with_changes(head_pid=99)
            self.sim[action.cluster].started_at = self.now
        elif isinstance(action, act.RestartNodes):  # started again at once, under new pids
            self._restart_nodes(action)
        elif isinstance(action, act.SubmitConfig):
            self._submit(action)
        elif isinstance(action, act.UpdateClusters):
            for name, changes in action.changes:
                self.clusters[name] = self.clusters[name].with_changes(**changes)
        elif isinstance(action, act.SetTargetCapacity):
            behaviour = self.sim[action.cluster]
            behaviour.target_capacity = action.capacity
            behaviour.capacity_at = self.now
        elif isinstance(action, act.UpdateCluster):
            self.clusters[action.cluster] = self.clusters[action.cluster].with_changes(**action.changes)
        elif isinstance(action, act.UpdateAutoscaler):
            changes = {"cluster_spec_json": action.spec_json, "cluster_spec_hash": action.spec_hash}
            self.clusters[action.cluster] = self.clusters[action.cluster].with_changes(**changes)
        elif isinstance(action, act.SetRoute):
            weights = action.weights()
            active = max((weight, name) for name, weight in weights.items())[1]
            self.route = IngressRouteObservation(
                active=active,
                upstreams=frozenset(action.upstreams),
                weights=weights,
                preview=action.preview,
                failover=action.standby is not None,
                header_route=action.header_route,
                header_backend=action.header_backend,
                mirror=action.mirror,
            )
        elif isinstance(action, act.RemoveRoute):
            self.route = None
        elif isinstance(action, act.DeleteCluster):
            self.clusters.pop(action.cluster, None)
            self.sim.pop(action.cluster, None)
        elif isinstance(action, act.ForgetService):
            self.forgotten = True

    def _create(self, action: act.CreateCluster) -> None:
        number = next(self._ids)
        name = f"{self.service.name}-g{self.service.generation}-{number}"
        self.clusters[name] = ClusterRecord(
            name=name,
            service=self.service.name,
            generation=self.service.generation,
            cluster_spec_hash=self.spec.cluster_spec_hash(),
            cluster_spec_json=self.spec.spec.rayClusterConfig.model_dump_json(),
            role=action.role,
            ports=_PORTS,
            temp_dir=f"/sim/{name}",
            log_dir=f"/sim/{name}",
            created_at=self.now,
            head_pid=number,
        )
        index = number - 1
        template = self.behaviours[index] if index < len(self.behaviours) else self.default_behaviour
        self.sim[name] = SimCluster(**{**template.__dict__, "started_at": self.now, "config_at": None})

    def _restart_nodes(self, action: act.RestartNodes) -> None:
        cluster = self.clusters[action.cluster]
        nodes = tuple(
            replace(n, pid=next(self._pids), restarts=n.restarts + 1) if n.pid in action.pids else n
            for n in cluster.nodes
        )
        workers = tuple(n.pid for n in nodes[1:] if n.pid is not None)
        head_pid = nodes[0].pid if nodes and cluster.head_pid in action.pids else cluster.head_pid
        self.clusters[action.cluster] = cluster.with_changes(nodes=nodes, worker_pids=workers, head_pid=head_pid)
        behaviour = self.sim[action.cluster]
        if cluster.head_pid in action.pids:  # started again in place: its GCS state (and the apps) kept
            behaviour.head_alive = not behaviour.head_keeps_exiting
        pairs = zip(nodes, cluster.nodes, strict=True)
        restarted = tuple(n.pid for n, old in pairs if old.pid in action.pids and n.pid is not None)
        behaviour.exited_workers = restarted if behaviour.workers_keep_exiting else ()

    def _submit(self, action: act.SubmitConfig) -> None:
        cluster = self.clusters[action.cluster]
        behaviour = self.sim[action.cluster]
        self.submissions.append(action.cluster)
        if behaviour.lost_puts > 0:
            behaviour.lost_puts -= 1
            self.clusters[action.cluster] = cluster.with_changes(
                submitted_config_hash=action.config_hash, config_submitted_at=None
            )
            return
        # Like the controller: the PUT is acknowledged, never recorded as applied (only
        # an observation of Ray running it does that).
        self.clusters[action.cluster] = cluster.with_changes(
            submitted_config_hash=action.config_hash, config_submitted_at=self.now
        )
        behaviour.config_at = self.now
        behaviour.deployed_hash = action.config_hash
        behaviour.target_capacity = cluster.target_capacity

    # -- views for assertions ------------------------------------------------------------

    def with_role(self, role: ClusterRole) -> list[ClusterRecord]:
        return [c for c in self.clusters.values() if c.role == role]

    def condition(self, condition_type: str) -> bool:
        for condition in self.service.conditions:
            if condition.type.value == condition_type:
                return condition.status
        raise KeyError(condition_type)
