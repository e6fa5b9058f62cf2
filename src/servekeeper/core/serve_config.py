"""Pure: the Serve config document servekeeper submits to one cluster, and whether Ray runs it."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

from servekeeper.model.enums import AppSource, AppStatus
from servekeeper.model.observation import AppState
from servekeeper.model.records import ClusterRecord
from servekeeper.model.spec import ServiceSpec


def desired_config_hash(spec: ServiceSpec, package_hash: str | None) -> str:
    """What a cluster's Serve config must be: the spec's Serve config and the code package.

    A code-only change (a new package hash) is a new config, rolled out like any other."""
    if package_hash is None:
        return spec.serve_config_hash()
    joined = json.dumps([spec.serve_config_hash(), package_hash])
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


def build_serve_config(spec: ServiceSpec, cluster: ClusterRecord, package_uri: str | None = None) -> dict[str, Any]:
    """The user's serveConfig plus what servekeeper owns: the ports, the proxy location, the code.

    `proxy_location: HeadOnly` because several raylets on one machine would otherwise each
    start a proxy on the same port. The code is the immutable package uploaded to the cluster
    (`gcs://_ray_pkg_<hash>.zip`), so editing files on disk never reaches a running cluster; a
    remote workingDir URI is handed to Ray as it is.
    """
    document = copy.deepcopy(spec.spec.serveConfig.model_dump(mode="json", exclude_unset=True))
    on_pool = cluster.pool is not None
    http_options = dict(document.get("http_options") or {})
    # On a host pool each node is a machine of its own: a proxy on every node, reached on its address.
    http_options.update({"host": "0.0.0.0" if on_pool else "127.0.0.1", "port": cluster.ports.serve_http})
    document["http_options"] = http_options
    grpc_options = dict(document.get("grpc_options") or {})
    grpc_options["port"] = cluster.ports.serve_grpc
    document["grpc_options"] = grpc_options
    document["proxy_location"] = "EveryNode" if on_pool else "HeadOnly"
    working_dir = spec.spec.rayClusterConfig.workingDir
    uri = package_uri
    if uri is None and working_dir:
        uri = working_dir if "://" in working_dir else f"local://{working_dir}"
    if uri is not None:
        for app in document["applications"]:
            runtime_env = dict(app.get("runtime_env") or {})
            runtime_env.setdefault("working_dir", uri)
            app["runtime_env"] = runtime_env
    return document


PACKAGE_URI = re.compile(r"^gcs://_ray_pkg_([0-9a-f]{64})\.zip$")


def package_hash_of(document: dict[str, Any]) -> str | None:
    """The servekeeper code package a submitted document runs, if any."""
    for app in document.get("applications", []):
        match = PACKAGE_URI.match(str((app.get("runtime_env") or {}).get("working_dir", "")))
        if match:
            return match.group(1)
    return None


# What Ray adds to an app's deployed_app_config on its own: a top-level logging_config is copied
# into every app. Anything else in Ray's answer that servekeeper did not send means the answer
# is of another config.
RAY_ADDED_APP_KEYS = frozenset({"logging_config"})


def _same(expected: Any, observed: Any) -> bool:
    if isinstance(expected, dict):
        return (
            isinstance(observed, dict)
            and set(expected) == set(observed)
            and all(_same(value, observed[key]) for key, value in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(observed, list)
            and len(expected) == len(observed)
            and all(_same(e, o) for e, o in zip(expected, observed, strict=True))
        )
    return bool(expected == observed)


def _same_app(expected: dict[str, Any], observed: dict[str, Any]) -> bool:
    added = {key for key in observed if key not in expected and key in RAY_ADDED_APP_KEYS}
    return _same(expected, {key: value for key, value in observed.items() if key not in added})


def config_deployed(document: dict[str, Any], apps: dict[str, AppState]) -> bool:
    """Does Ray run exactly this document? Judged app by app from `deployed_app_config`, both
    ways (a key or an app removed is a change too), never by names: on an active cluster the
    declared names always exist (they are the old apps)."""
    sent = {app.get("name", "default"): app for app in document["applications"]}
    for name, expected in sent.items():
        observed = apps.get(name)
        if observed is None or observed.source == AppSource.IMPERATIVE or observed.deployed_config is None:
            return False
        if not _same_app(expected, observed.deployed_config):
            return False
    # A declarative app this document does not hold is one Ray has not deleted yet.
    return not any(
        app.source == AppSource.DECLARATIVE and name not in sent and app.status != AppStatus.DELETING
        for name, app in apps.items()
    )
