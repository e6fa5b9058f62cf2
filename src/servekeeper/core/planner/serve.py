"""What Ray Serve runs on a cluster: the config submitted (once per acknowledgement, never
over an app servekeeper did not declare), the config recorded as applied once Ray is seen
running it, and Serve's target_capacity."""

from __future__ import annotations

from servekeeper.core.actions import SetTargetCapacity, SubmitConfig
from servekeeper.core.planner.context import PlanContext
from servekeeper.core.planner.failure import fail_rollout
from servekeeper.model.enums import AppSource, AppStatus, ClusterRole
from servekeeper.model.observation import ClusterObservation
from servekeeper.model.records import ClusterRecord

# Ray acknowledged a PUT but does not show the config yet: wait this long before sending it
# again (a PUT is idempotent for Ray, so a retry can only cost a little time).
CONFIG_VERIFY_SECONDS = 10.0


def record_deployed_configs(ctx: PlanContext) -> None:
    """Applied means observed: record which config Ray runs, and the last one that ran well."""
    for cluster in list(ctx.clusters.values()):
        if cluster.role == ClusterRole.DELETING:
            continue
        observed = ctx.observed(cluster)
        deployed = observed.deployed_config_hash
        if deployed is None or observed.apps is None:
            continue
        if deployed != cluster.applied_config_hash:
            cluster = ctx.update_cluster(cluster, applied_config_hash=deployed)
        judged = ctx.judged_apps(observed)
        running = all(name in judged for name in ctx.declared) and all(
            app.status == AppStatus.RUNNING for app in judged.values()
        )
        if running and cluster.good_config_hash != deployed:
            ctx.update_cluster(cluster, good_config_hash=deployed)


def name_conflicts(ctx: PlanContext, observed: ClusterObservation) -> list[str]:
    """Declared names already taken by apps created at run time: a PUT would replace them."""
    apps = observed.apps or {}
    return sorted(n for n in ctx.declared if n in apps and apps[n].source == AppSource.IMPERATIVE)


def apply_config(ctx: PlanContext, cluster: ClusterRecord, observed: ClusterObservation) -> None:
    """The desired config onto `cluster`, unless that would overwrite an imperative app."""
    conflicts = name_conflicts(ctx, observed)
    if conflicts:
        # Never overwrite an app servekeeper did not declare.
        reason = f"NameConflict: declared applications {conflicts} exist on {cluster.name} as imperative apps"
        if cluster.role == ClusterRole.PENDING:
            fail_rollout(ctx, cluster, reason)
        elif not ctx.rollout_failed:
            ctx.update_service(failed_generation=ctx.service.generation, failure_reason=reason)
            ctx.event("RolloutFailed", reason, warning=True)
        return
    submit(ctx, cluster, ctx.desired_config_hash)


def submit(ctx: PlanContext, cluster: ClusterRecord, config_hash: str, restore: bool = False) -> None:
    """PUT a config unless Ray acknowledged that very PUT a moment ago.

    A config Ray already runs was recorded as applied before we get here, so a PUT that
    went through before a crash is never sent twice; one that failed, timed out or never
    happened is sent again (Ray treats the same config as a no-op)."""
    acknowledged = (
        cluster.submitted_config_hash == config_hash
        and cluster.config_submitted_at is not None
        and ctx.now - cluster.config_submitted_at < CONFIG_VERIFY_SECONDS
    )
    if acknowledged:
        return
    ctx.do(SubmitConfig(cluster.name, config_hash, restore=restore))
    ctx.set_planned(cluster.with_changes(submitted_config_hash=config_hash, config_submitted_at=None))
    verb = "restoring the last good" if restore else "submitted"
    ctx.event("ConfigSubmitted", f"Serve config {config_hash} {verb} to {cluster.name}")


def scale(ctx: PlanContext, cluster: ClusterRecord, capacity: float) -> ClusterRecord:
    """Want Serve's target_capacity at `capacity` on `cluster`; PUT it while Ray shows another."""
    if cluster.target_capacity != capacity:
        cluster = ctx.update_cluster(cluster, target_capacity=capacity)
    observed = ctx.observed(cluster)
    shown = observed.target_capacity if observed.target_capacity is not None else 100.0
    if observed.dashboard_ok and cluster.applied_config_hash is not None and shown != capacity:
        if not any(isinstance(a, SetTargetCapacity) and a.cluster == cluster.name for a in ctx.plan.actions):
            ctx.do(SetTargetCapacity(cluster.name, capacity))
    return cluster
