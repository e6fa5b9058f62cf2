"""One tick's reconcile context: what the planner knows and what it has decided so far.

The step modules (pending, canary, active, traffic, serve, workers, conditions) read the state
here and record their decisions through its public methods; the context knows none of them.
Every method changes the plan's own view of the clusters and the service as it records an
action, so a later step of the same tick sees what an earlier one decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servekeeper.core.actions import Action, CreateCluster, DeleteCluster, UpdateCluster
from servekeeper.core.health import Verdict, judged_apps, switch_allowed
from servekeeper.core.serve_config import desired_config_hash
from servekeeper.model.enums import AppStatus, ClusterRole, SwitchGate
from servekeeper.model.observation import AppState, ClusterObservation, Observation
from servekeeper.model.records import ClusterRecord, Event, ServiceRecord
from servekeeper.model.spec import ServiceSpec


@dataclass
class Plan:
    service: ServiceRecord
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def unobserved(name: str) -> ClusterObservation:
    return ClusterObservation(name=name, processes_alive=False, error="not observed")


class PlanContext:
    """The inputs of one `plan()` call (spec, stored records, observation, now) and the plan
    being built from them. `service` is the record as stored; `plan.service` is what this tick
    has made of it so far."""

    def __init__(
        self,
        spec: ServiceSpec,
        service: ServiceRecord,
        clusters: list[ClusterRecord],
        observation: Observation,
        now: float,
        gate: SwitchGate = SwitchGate.READY,
    ) -> None:
        self.spec = spec
        self.service = service
        self.clusters = {cluster.name: cluster for cluster in clusters}
        self.observation = observation
        self.now = now
        self.gate = gate
        self.plan = Plan(service=service)
        self.declared = spec.declared_apps()
        self.all_apps = spec.judges_imperative_apps
        self.desired_cluster_hash = spec.cluster_spec_hash()
        self.desired_config_hash = desired_config_hash(spec, service.package_hash)

    # -- what is known -------------------------------------------------------------------

    def clusters_with_role(self, role: ClusterRole) -> list[ClusterRecord]:
        """The clusters in `role` as planned so far, oldest first."""
        return sorted((c for c in self.clusters.values() if c.role == role), key=lambda c: (c.created_at, c.name))

    def newest(self, role: ClusterRole) -> ClusterRecord | None:
        found = self.clusters_with_role(role)
        return found[-1] if found else None

    def observed(self, cluster: ClusterRecord) -> ClusterObservation:
        return self.observation.clusters.get(cluster.name) or unobserved(cluster.name)

    def judged_apps(self, observed: ClusterObservation) -> dict[str, AppState]:
        """The apps whose state counts for this service: the declared ones, or all on request."""
        return judged_apps(observed.apps or {}, self.declared, self.all_apps)

    def switch_verdict(self, observed: ClusterObservation) -> Verdict:
        """May traffic go to this cluster, under the service's switch gate?"""
        return switch_allowed(self.gate, observed, self.declared, self.all_apps)

    def settled_at(self, cluster: ClusterRecord, capacity: float) -> bool:
        """Ray runs `cluster` at `capacity`, every judged deployment HEALTHY (none still scaling)."""
        observed = self.observed(cluster)
        shown = observed.target_capacity if observed.target_capacity is not None else 100.0
        judged = self.judged_apps(observed)
        settled = all(app.settled and app.status == AppStatus.RUNNING for app in judged.values())
        return shown == capacity and bool(judged) and settled

    @property
    def rollout_failed(self) -> bool:
        """The current generation's rollout failed (as planned so far)."""
        return self.plan.service.failed_generation == self.plan.service.generation

    def planned(self, kind: type[Action]) -> list[Action]:
        """The actions of this kind already in the plan."""
        return [action for action in self.plan.actions if isinstance(action, kind)]

    # -- what is decided -----------------------------------------------------------------

    def do(self, action: Action) -> None:
        self.plan.actions.append(action)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.plan.events.append(
            Event(
                service=self.service.name,
                time=self.now,
                type="Warning" if warning else "Normal",
                reason=reason,
                message=message,
            )
        )

    def set_planned(self, cluster: ClusterRecord) -> ClusterRecord:
        """The plan's view of a cluster changes with no UpdateCluster of its own: another action
        writes the change (the controller derives it), or a later step records it."""
        self.clusters[cluster.name] = cluster
        return cluster

    def update_cluster(self, cluster: ClusterRecord, **changes: object) -> ClusterRecord:
        self.do(UpdateCluster(cluster.name, dict(changes)))
        return self.set_planned(cluster.with_changes(**changes))

    def update_service(self, **changes: object) -> None:
        self.plan.service = self.plan.service.with_changes(**changes)

    def create_cluster(self, role: ClusterRole, reason: str) -> None:
        self.do(CreateCluster(role=role, reason=reason))
        self.event("ClusterCreating", f"creating a {role.value} cluster ({reason})")

    def delete_cluster(self, cluster: ClusterRecord, reason: str) -> None:
        self.do(DeleteCluster(cluster.name, reason))
        self.set_planned(cluster.with_changes(role=ClusterRole.DELETING))
