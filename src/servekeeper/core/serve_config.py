"""Pure: the Serve config document servekeeper submits to one cluster."""

from __future__ import annotations

import copy
from typing import Any

from servekeeper.spec import ServiceSpec
from servekeeper.status import ClusterRecord


def build_serve_config(spec: ServiceSpec, cluster: ClusterRecord) -> dict[str, Any]:
    """The user's serveConfig plus what servekeeper owns: the ports and the proxy location.

    `proxy_location: HeadOnly` because several raylets on one machine would otherwise each
    start a proxy on the same port. The app code directory is handed to Serve as a
    `local://` working_dir, which Serve accepts for directories present on every node.
    """
    document = copy.deepcopy(spec.spec.serveConfig.model_dump(mode="json", exclude_unset=True))
    http_options = dict(document.get("http_options") or {})
    http_options.update({"host": "127.0.0.1", "port": cluster.ports.serve_http})
    document["http_options"] = http_options
    grpc_options = dict(document.get("grpc_options") or {})
    grpc_options["port"] = cluster.ports.serve_grpc
    document["grpc_options"] = grpc_options
    document["proxy_location"] = "HeadOnly"
    working_dir = spec.spec.rayClusterConfig.workingDir
    if working_dir:
        uri = working_dir if "://" in working_dir else f"local://{working_dir}"
        for app in document["applications"]:
            runtime_env = dict(app.get("runtime_env") or {})
            runtime_env.setdefault("working_dir", uri)
            app["runtime_env"] = runtime_env
    return document
