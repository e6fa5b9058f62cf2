"""Ray's autoscaler's bounds changed in place (issue 22): a spec whose only change to a cluster
is its worker groups' `minReplicas`/`maxReplicas`/`replicas` or its `autoscalerOptions` keeps
the cluster, as KubeRay keeps it; Ray's monitor re-reads its config at each look, and scales
to the new bounds itself (up to a new minimum; an idle node above a new maximum goes).

A cluster with an environment of its own is recorded with its Ray and Python written down
(`pinned`), so its record cannot be told apart from the spec by shape alone: a change of its
bounds is a cluster change, as before."""

from __future__ import annotations

from servekeeper.core.actions import Action, UpdateAutoscaler, UpdateCluster
from servekeeper.core.planner.context import PlanContext
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole

# The bounds, and what a group starts with (a cluster started from the active's node count
# records that count: `scaled_like`).
GROUP_BOUNDS = ("replicas", "minReplicas", "maxReplicas")
KEPT_ROLES = (ClusterRole.ACTIVE, ClusterRole.PENDING, ClusterRole.STANDBY)


def shape_without_bounds(config: RayClusterConfigSpec) -> dict[str, object]:
    shape = config.model_dump(mode="json", exclude={"autoscalerOptions", "excludes"})
    groups = shape["workerGroups"]
    shape["workerGroups"] = [{k: v for k, v in group.items() if k not in GROUP_BOUNDS} for group in groups]
    return shape


def only_bounds_differ(stored: RayClusterConfigSpec, desired: RayClusterConfigSpec) -> bool:
    """Both autoscaled, on no environment of their own, alike but for their bounds, and each
    group's starting count within its new bounds: that count places the cluster's nodes (their
    order, their log files and process tags), so it is never changed under running nodes."""
    autoscaled = stored.enableInTreeAutoscaling and desired.enableInTreeAutoscaling
    own = stored.has_own_environment() or desired.has_own_environment()
    if not autoscaled or own or shape_without_bounds(stored) != shape_without_bounds(desired):
        return False
    started = {group.name: group.replicas for group in stored.workerGroups}
    return all(group.min_nodes() <= started[group.name] <= group.max_nodes() for group in desired.workerGroups)


def kept_starting_counts(stored: RayClusterConfigSpec, desired: RayClusterConfigSpec) -> RayClusterConfigSpec:
    """`desired` with each group's `replicas` the count the cluster started with (within the new
    bounds: `only_bounds_differ`), its bounds written out (unset ones follow `replicas`)."""
    started = {group.name: group.replicas for group in stored.workerGroups}
    groups = [
        group.model_copy(
            update={"replicas": started[group.name], "minReplicas": group.min_nodes(), "maxReplicas": group.max_nodes()}
        )
        for group in desired.workerGroups
    ]
    return desired.model_copy(update={"workerGroups": groups})


def rebound_in_place(ctx: PlanContext) -> list[Action]:
    """Each kept cluster whose spec differs from the desired one only in its bounds is recorded,
    in this plan, as made from the desired spec: no step after this one sees a change. The
    actions that make it so are returned for the end of the plan, so that a write that fails
    (it stops the tick) holds back nothing else, a failover least of all."""
    desired = ctx.spec.spec.rayClusterConfig
    actions: list[Action] = []
    for cluster in list(ctx.clusters.values()):
        if cluster.role not in KEPT_ROLES or cluster.cluster_spec_hash == ctx.desired_cluster_hash:
            continue
        # A failed cluster, or a canary under way, is replaced, not kept; an active cluster keeps
        # the state of the canary it was (its history), which is no reason to replace it.
        if cluster.failure_reason is not None or (cluster.role == ClusterRole.PENDING and cluster.canary is not None):
            continue
        stored = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if not only_bounds_differ(stored, desired):
            continue
        spec_json = kept_starting_counts(stored, desired).model_dump_json()
        actions.append(UpdateAutoscaler(cluster.name, spec_json, ctx.desired_cluster_hash))
        kept = cluster.with_changes(cluster_spec_json=spec_json, cluster_spec_hash=ctx.desired_cluster_hash)
        if cluster.role == ClusterRole.PENDING:  # it now runs this generation's spec: a failure is this one's
            kept = kept.with_changes(generation=ctx.service.generation)
            actions.append(UpdateCluster(cluster.name, {"generation": ctx.service.generation}))
        ctx.set_planned(kept)
        groups = ", ".join(f"{g.name} {g.min_nodes()}-{g.max_nodes()}" for g in desired.workerGroups)
        ctx.event("AutoscalerBoundsChanged", f"{cluster.name} kept, Ray's autoscaler given new bounds: {groups}")
    return actions
