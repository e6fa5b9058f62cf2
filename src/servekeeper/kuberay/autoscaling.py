"""Pure: KubeRay's autoscaling fields on import (issue 22), under the same names:
`enableInTreeAutoscaling` and `autoscalerOptions` on the cluster, `minReplicas`/`maxReplicas`
on each worker group. Ray's autoscaler runs on the head in the cluster's own environment, so
the options that shape KubeRay's autoscaler container do not apply."""

from __future__ import annotations

from typing import Any

from servekeeper.kuberay.fields import as_mapping
from servekeeper.kuberay.notes import Findings, NoteKind

AUTOSCALER_OPTIONS = ("idleTimeoutSeconds", "upscalingMode")
UPSCALING_MODES = ("Default", "Aggressive", "Conservative")


def autoscaling_fields(findings: Findings, path: str, cluster: dict[str, Any]) -> dict[str, Any]:
    """The cluster's autoscaling fields, servekeeper's; the rest of autoscalerOptions noted."""
    options = as_mapping(cluster.get("autoscalerOptions"))
    if not cluster.get("enableInTreeAutoscaling"):
        if options:
            findings.note(NoteKind.IGNORED, f"{path}.autoscalerOptions", "enableInTreeAutoscaling is not true")
        return {}
    for key in sorted(set(options) - set(AUTOSCALER_OPTIONS)):
        findings.note(
            NoteKind.IGNORED,
            f"{path}.autoscalerOptions.{key}",
            "Ray's autoscaler runs on the head, in the cluster's own environment: no container of its own",
        )
    kept = {key: options[key] for key in AUTOSCALER_OPTIONS if key in options}
    mode = kept.get("upscalingMode")
    if mode is not None and mode not in UPSCALING_MODES:
        findings.refuse(f"{path}.autoscalerOptions.upscalingMode", f"must be one of {', '.join(UPSCALING_MODES)}")
    fields: dict[str, Any] = {"enableInTreeAutoscaling": True}
    if kept:
        fields["autoscalerOptions"] = kept
    return fields


def worker_nodes(findings: Findings, path: str, worker: dict[str, Any], autoscaling: bool) -> dict[str, Any]:
    """A worker group's node counts. Without autoscaling: its replicas, at least minReplicas
    (maxReplicas noted); with it: replicas kept within the bounds (as KubeRay keeps it) and the
    bounds themselves. A multi-host replica (`numOfHosts`) is that many nodes."""
    replicas, minimum, maximum = (worker.get(key) for key in ("replicas", "minReplicas", "maxReplicas"))
    if not all(isinstance(value, int) or value is None for value in (replicas, minimum, maximum)):
        findings.refuse(f"{path}.replicas", "replicas, minReplicas and maxReplicas must be integers")
        return {"replicas": 0}
    if worker.get("suspend"):
        findings.refuse(f"{path}.suspend", "suspending a worker group is not available; set replicas: 0")
    hosts = worker.get("numOfHosts")
    per_replica = hosts if isinstance(hosts, int) and hosts > 1 else 1
    if not autoscaling:
        count = max(replicas or 0, minimum or 0)
        if maximum is not None and maximum != count:
            findings.note(
                NoteKind.IGNORED, f"{path}.maxReplicas", f"enableInTreeAutoscaling is not true: {count} node(s)"
            )
        nodes = {"replicas": count * per_replica}
    else:
        low = minimum or 0
        high = maximum if maximum is not None else max(replicas or 0, low)
        if maximum is None:
            # KubeRay reads an absent maxReplicas as unbounded; a group here always has a bound.
            findings.note(
                NoteKind.CHANGED, f"{path}.maxReplicas", f"absent (unbounded in KubeRay): {high} node(s) at most"
            )
        count = min(max(replicas if replicas is not None else low, low), high)
        if replicas is not None and count != replicas:
            findings.note(NoteKind.CHANGED, f"{path}.replicas", f"kept within minReplicas and maxReplicas: {count}")
        nodes = {"replicas": count * per_replica, "minReplicas": low * per_replica, "maxReplicas": high * per_replica}
    if per_replica > 1:
        findings.note(NoteKind.CHANGED, f"{path}.numOfHosts", f"{hosts} hosts per replica: {nodes['replicas']} nodes")
    return nodes
