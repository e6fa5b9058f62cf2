"""The KubeRay fields the translation knows by name: API versions, servekeeper's annotations,
and for each field that has no effect here (or is refused) the reason told to the user; plus the
two readers that take a manifest's values as they come (anything may be missing or mistyped)."""

from __future__ import annotations

from typing import Any

INGRESS_PORT_ANNOTATION = "servekeeper.io/ingress-port"
EXTENSIONS_ANNOTATION = "servekeeper.io/extensions"
INITIALIZING_TIMEOUT_ANNOTATION = "ray.io/initializing-timeout"
DEFAULT_SERVE_PORT = 8000  # Serve's default http_options.port, which KubeRay's serve service targets
EXTENSION_KEYS = frozenset(
    {
        "ingress",
        "readiness",
        "serveConfigUpdate",
        "serviceUnhealthySecondThreshold",
        "excludes",
        "pip",  # what an image would hold: KubeRay has no field for it
        "rayClusterDeletionDelaySeconds",
        "readinessTimeoutSeconds",
        "upgradeStrategy",  # a canary's steps and analysis (KubeRay's incremental upgrade has neither)
        "rollbackWindowSeconds",
        "revisionHistoryLimit",
        "hostPool",  # the HostPool whose machines run the nodes (KubeRay schedules pods instead)
        "hostPins",  # group name ("head" for the head) -> the pool host its nodes run on
        "standby",  # a hot standby cluster failed over to by the ingress
        "headMoveAfterSeconds",  # gcsFaultTolerance with Redis: when a head on a silent host moves
    }
)

_SCHEDULING = "pod scheduling does not apply: every node is a process on this machine"
POD_FIELD_REASONS = {
    "tolerations": _SCHEDULING,
    "affinity": _SCHEDULING,
    "nodeSelector": _SCHEDULING,
    "nodeName": _SCHEDULING,
    "topologySpreadConstraints": _SCHEDULING,
    "priorityClassName": _SCHEDULING,
    "schedulerName": _SCHEDULING,
    "volumes": "volumes do not apply: the nodes share this machine's filesystem",
    "initContainers": "init containers do not run on this provider",
    "serviceAccountName": "Kubernetes service accounts do not apply",
}
CONTAINER_FIELD_REASONS = {
    "lifecycle": "container lifecycle hooks do not apply: servekeeper stops its nodes itself",
    "readinessProbe": "Kubernetes probes do not apply: servekeeper checks the nodes, the Serve proxy and the apps",
    "livenessProbe": "Kubernetes probes do not apply: servekeeper checks the nodes, the Serve proxy and the apps",
    "startupProbe": "Kubernetes probes do not apply: servekeeper checks the nodes, the Serve proxy and the apps",
    "volumeMounts": "volumes do not apply: the nodes share this machine's filesystem",
    "ports": "servekeeper allocates every port of a cluster",
    "name": None,  # a container's name means nothing off Kubernetes; not worth a note
}
IGNORED_SPEC_FIELDS = {
    "serviceUnhealthySecondThreshold": "deprecated in KubeRay and unused there; servekeeper's own threshold "
    "is set with the servekeeper.io/extensions annotation",
    "deploymentUnhealthySecondThreshold": "deprecated in KubeRay and unused there",
    "serveService": "the Serve endpoint is servekeeper's ingress on 127.0.0.1",
    "excludeHeadPodFromServeSvc": "the Serve endpoint is servekeeper's ingress on 127.0.0.1",
}
IGNORED_CLUSTER_FIELDS = {
    "headServiceAnnotations": "there is no Kubernetes head service",
    "historyServerOptions": "not available on this provider",
    "upgradeStrategy": "RayCluster upgrades are driven by the RayService's upgradeStrategy here",
}
REFUSED_CLUSTER_FIELDS = {
    "authOptions": "authentication of managed clusters is servekeeper's (they bind to 127.0.0.1); remove it",
    "networkPolicy": "there are no Kubernetes network policies here: managed clusters bind to 127.0.0.1; remove it",
    "managedBy": "servekeeper manages this service; remove managedBy",
    "tlsOptions": "TLS between Ray nodes is not set up by this provider; remove it",
}
IGNORED_HEAD_FIELDS = {
    "serviceType": "there is no Kubernetes head service",
    "enableIngress": "there is no Kubernetes ingress: servekeeper's ingress serves 127.0.0.1",
    "ingressOptions": "there is no Kubernetes ingress: servekeeper's ingress serves 127.0.0.1",
    "headService": "there is no Kubernetes head service",
    "labels": "Ray node labels are not set by this provider",
}
IGNORED_WORKER_FIELDS = {
    "idleTimeoutSeconds": "no autoscaling on this provider",
    "scaleStrategy": "no autoscaling on this provider",
    "priority": "no scheduling priorities on this provider",
    "labels": "Ray node labels are not set by this provider",
    "workersToDelete": "no autoscaling on this provider",
}
GCS_FT_OPTIONS = "gcsFaultToleranceOptions"
FT_ENABLED_ANNOTATION = "ray.io/ft-enabled"  # KubeRay's older switch for Redis-backed GCS fault tolerance
FT_ENABLED_REASON = (
    "KubeRay's older switch (Redis named by the head container's RAY_REDIS_ADDRESS) is not read; say it with "
    "spec.rayClusterConfig.gcsFaultToleranceOptions: {redisAddress, redisPassword: {valueFrom: {secretKeyRef}}} "
    "(or backend: rocksdb)"
)
GCS_NEEDS_POOL_REASON = (
    'a Redis-backed head is restarted in place on a host pool only: add "hostPool": "NAME" to the '
    "servekeeper.io/extensions annotation, or use KubeRay 1.7's embedded backend (rocksdb), which a head on "
    "this machine restarts in place with"
)


def as_mapping(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []
