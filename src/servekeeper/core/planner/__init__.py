"""The pure reconcile decision: plan(spec, record, clusters, observation, now) -> Plan.

No I/O and no clock: everything the decision depends on comes in as an argument, so every
flow can be tested tick by tick on a fake clock. Running a plan twice is harmless: each tick
re-derives what to do from the stored record and a fresh observation.

The steps work on one `PlanContext` (context.py), each in a module by concern: `pending`
(start, readiness gate, switch), `canary` (the canary beside the active cluster), `active`
(health, replacement, config in place, undo), `traffic` (route, switch, drain, delete),
`serve` (config and capacity on a cluster), `workers` (restarts), `standby` (a hot standby and
its failover), `bounds` (Ray's autoscaler's bounds in place), `conditions` (status).
Their order is here.
"""

from __future__ import annotations

from servekeeper.core.planner.active import maintain_active
from servekeeper.core.planner.bounds import rebound_in_place
from servekeeper.core.planner.conditions import set_conditions
from servekeeper.core.planner.context import Plan, PlanContext
from servekeeper.core.planner.pending import advance_pending
from servekeeper.core.planner.serve import record_deployed_configs
from servekeeper.core.planner.standby import fail_over_to_standby, maintain_standby
from servekeeper.core.planner.traffic import delete_service, drain, finish_acknowledged_switch, maintain_route
from servekeeper.core.planner.workers import (
    MAX_WORKER_RESTARTS,
    move_silent_heads,
    restart_exited_heads,
    restart_interrupted_work,
)
from servekeeper.model.enums import ClusterRole, SwitchGate
from servekeeper.model.observation import Observation
from servekeeper.model.records import ClusterRecord, ServiceRecord
from servekeeper.model.spec import ServiceSpec

__all__ = ["MAX_WORKER_RESTARTS", "Plan", "PlanContext", "plan", "run"]


def plan(
    spec: ServiceSpec,
    service: ServiceRecord,
    clusters: list[ClusterRecord],
    observation: Observation,
    now: float,
    gate: SwitchGate = SwitchGate.READY,
) -> Plan:
    """Decide the next actions for one service. Pure: no I/O, no clock."""
    return run(PlanContext(spec, service, clusters, observation, now, gate))


def run(ctx: PlanContext) -> Plan:
    """One tick's steps, in order, on `ctx`."""
    if ctx.service.deleting:
        delete_service(ctx)
        return ctx.plan
    rebounds = rebound_in_place(ctx)  # before any step compares a cluster's spec with the desired one
    restart_interrupted_work(ctx)
    fail_over_to_standby(ctx)  # before a restart in place: the standby already has the traffic
    restart_exited_heads(ctx)
    move_silent_heads(ctx)
    record_deployed_configs(ctx)
    finish_acknowledged_switch(ctx)
    pending = ctx.newest(ClusterRole.PENDING)
    if pending is not None:
        advance_pending(ctx, pending)
    if ctx.newest(ClusterRole.PENDING) is None:
        maintain_active(ctx)
    maintain_standby(ctx)
    maintain_route(ctx)
    drain(ctx)
    set_conditions(ctx)
    ctx.plan.actions.extend(rebounds)  # last: a write that fails holds back none of the above
    return ctx.plan
