"""Host pools as the API shows them (pure): each host with what every cluster's nodes take of it,
and what a check of the host found."""

from __future__ import annotations

from collections.abc import Iterable

from servekeeper.core.placement import nodes_taking_room
from servekeeper.model.hostpool import HostPoolRecord, HostSpec
from servekeeper.model.records import ClusterRecord
from servekeeper.model.wire import HostCheckView, HostPoolView, HostUseView, HostView

Usage = dict[str, list[HostUseView]]  # host name -> the nodes of clusters placed there


def usage(clusters: Iterable[ClusterRecord], pool: str) -> Usage:
    """What each cluster's nodes take of each host of `pool` (pending and draining ones too; a
    node of a deleted cluster until it is stopped)."""
    used: Usage = {}
    for cluster in clusters:
        if cluster.pool != pool:
            continue
        for node, need in nodes_taking_room(cluster):
            used.setdefault(node.host, []).append(
                {
                    "cluster": cluster.name,
                    "service": cluster.service,
                    "role": node.role,
                    "cpus": need.cpus,
                    "gpus": need.gpus,
                    "memoryBytes": need.memory_bytes,
                }
            )
    return used


def host_view(host: HostSpec, used: Usage | None = None) -> HostView:
    resources = host.resources.model_dump(mode="json")
    return {
        "name": host.name,
        "address": host.address,
        "sshUser": host.ssh.user,
        "sshPort": host.ssh.port,
        "python": host.python,
        "resources": {"cpus": resources["cpus"], "gpus": resources["gpus"], "memoryGiB": resources["memoryGiB"]},
        "used": (used or {}).get(host.name, []),
    }


def pool_view(record: HostPoolRecord, used: Usage | None = None) -> HostPoolView:
    return {
        "name": record.name,
        "createdAt": record.created_at,
        "updatedAt": record.updated_at,
        "hosts": [host_view(host, used) for host in record.spec().spec.hosts],
    }


def host_check_view(
    host: HostSpec,
    used: Usage | None,
    *,
    state: str,
    problem: str | None,
    python: str | None = None,
    ray: str | None = None,
    interpreters: dict[str, str] | None = None,
) -> HostCheckView:
    """state: ok | mismatch (versions differ) | refused (host key or login refused) |
    unreachable (no answer; may pass later) | error (the version command failed)."""
    view = host_view(host, used)
    return {
        "name": view["name"],
        "address": view["address"],
        "sshUser": view["sshUser"],
        "sshPort": view["sshPort"],
        "python": python,
        "resources": view["resources"],
        "used": view["used"],
        "ray": ray,
        "pythonPath": host.python,
        "interpreters": interpreters or {},
        "state": state,
        "reachable": state not in ("unreachable", "refused", "error"),
        "ok": state == "ok",
        "problem": problem,
    }
