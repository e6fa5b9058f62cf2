"""Ray's autoscaler's bounds changed in place (issue 22): a spec whose only change to a cluster
is its worker groups' `minReplicas`/`maxReplicas`/`replicas` or its `autoscalerOptions` keeps
the cluster, as KubeRay keeps it; Ray's monitor re-reads its config at each look, and scales
to the new bounds itself (up to a new minimum; an idle node above a new maximum goes).

A cluster with an environment of its own is recorded with its Ray and Python written down
(`pinned`), so its record cannot be told apart from the spec by shape alone: a change of its
bounds is a cluster change, as before."""

from __future__ import annotations

from servekeeper.core.actions import UpdateAutoscaler
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
    """Both autoscaled, on no environment of their own, and alike but for their bounds."""
    autoscaled = stored.enableInTreeAutoscaling and desired.enableInTreeAutoscaling
    own = stored.has_own_environment() or desired.has_own_environment()
    return autoscaled and not own and shape_without_bounds(stored) == shape_without_bounds(desired)


def kept_starting_counts(stored: RayClusterConfigSpec, desired: RayClusterConfigSpec) -> RayClusterConfigSpec:
    """`desired` with each group's `replicas` the count the cluster started with (its nodes are
    placed from it when started again in place), moved into the new bounds."""
    started = {group.name: group.replicas for group in stored.workerGroups}
    groups = []
    for group in desired.workerGroups:
        low, high = group.min_nodes(), group.max_nodes()  # written out: unset ones follow `replicas`
        count = min(max(started.get(group.name, group.replicas), low), high)
        groups.append(group.model_copy(update={"replicas": count, "minReplicas": low, "maxReplicas": high}))
    return desired.model_copy(update={"workerGroups": groups})


def rebound_in_place(ctx: PlanContext) -> None:
    """Each kept cluster whose spec differs from the desired one only in its bounds is given the
    new bounds, and recorded as made from the desired spec: no step after this one sees a change."""
    desired = ctx.spec.spec.rayClusterConfig
    for cluster in list(ctx.clusters.values()):
        if cluster.role not in KEPT_ROLES or cluster.cluster_spec_hash == ctx.desired_cluster_hash:
            continue
        stored = RayClusterConfigSpec.model_validate_json(cluster.cluster_spec_json)
        if not only_bounds_differ(stored, desired):
            continue
        spec_json = kept_starting_counts(stored, desired).model_dump_json()
        ctx.do(UpdateAutoscaler(cluster.name, spec_json, ctx.desired_cluster_hash))
        ctx.set_planned(cluster.with_changes(cluster_spec_json=spec_json, cluster_spec_hash=ctx.desired_cluster_hash))
        groups = ", ".join(f"{g.name} {g.min_nodes()}-{g.max_nodes()}" for g in desired.workerGroups)
        ctx.event("AutoscalerBoundsChanged", f"{cluster.name} kept, Ray's autoscaler given new bounds: {groups}")
