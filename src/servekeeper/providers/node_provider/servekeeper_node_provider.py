"""Ray's autoscaler asks servekeeper for nodes through this module (issue 22).

It runs inside Ray's monitor on a cluster's head, in that cluster's own environment (any Ray
from 2.46, Python 3.10+), so it imports nothing of servekeeper: only Ray and the standard
library. Ray loads it from the autoscaling config (`provider: {type: external, module:
servekeeper_node_provider.NodeProvider}`); the head is started with its folder on PYTHONPATH.

Every decision stays with Ray's autoscaler, and every node with the controller: this class only
relays. The controller records a node before starting it, places it like any node and stops it
when released, so a monitor that restarts, or a controller that crashes mid-launch, loses no
node and starts none twice. Its API (its address and a token scoped to this cluster's nodes,
each read from a file on the head at every call, never from argv or the config):

    GET    /api/v1/clusters/<cluster>/nodes            -> {"nodes": [{"id", "kind", "type", "status", "tags"}]}
    POST   /api/v1/clusters/<cluster>/nodes            {"type", "count", "tags"} -> {"ids": [...]}
    POST   /api/v1/clusters/<cluster>/nodes/<id>/tags  {"tags"}
    DELETE /api/v1/clusters/<cluster>/nodes/<id>

A node's id is one less than the integer its Ray node carries as its NODE_ID_AS_RESOURCE
resource (Ray drops a resource of 0, and the head's id is 0): Ray's monitor maps the two
through it (`use_node_id_as_ip`), every node of one machine having the same address."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request
from typing import Any

from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.node_provider import NodeProvider as RayNodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    STATUS_SETTING_UP,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

REQUEST_TIMEOUT_SECONDS = 10
UNIX_PREFIX = "unix:"  # an address that names a socket file


class _SocketConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the standard library has none)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=REQUEST_TIMEOUT_SECONDS)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(REQUEST_TIMEOUT_SECONDS)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _over_socket(path: str, method: str, route: str, data: bytes | None, headers: dict[str, str]) -> Any:
    """One call over the socket at `path`; an OSError for any failure, as urllib raises them."""
    connection = _SocketConnection(path)
    try:
        connection.request(method, route, body=data, headers=headers)
        response = connection.getresponse()
        payload = response.read()
    except http.client.HTTPException as exc:
        raise OSError(f"{method} {route}: {exc!r}") from exc
    finally:
        connection.close()
    if response.status >= 400:
        raise OSError(f"HTTP Error {response.status}: {payload[:300].decode(errors='replace')}")
    return json.loads(payload) if payload else None


class NodeProvider(RayNodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._lock = threading.RLock()
        self._cluster = str(provider_config["cluster"])
        # Read at each call: the controller rewrites them when it comes back (its port may change).
        self._url_file = str(provider_config["url_file"])
        self._token_file = str(provider_config["token_file"])
        self._nodes: dict[str, dict[str, Any]] = {}

    def _call(self, method: str, path: str = "", body: dict[str, Any] | None = None) -> Any:
        with open(self._token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
        with open(self._url_file, encoding="utf-8") as handle:
            address = handle.read().strip().rstrip("/")
        route = f"/api/v1/clusters/{self._cluster}/nodes{path}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        if address.startswith(UNIX_PREFIX):  # a pool head: the controller's SSH forward, a socket file
            return _over_socket(address[len(UNIX_PREFIX) :], method, route, data, headers)
        request = urllib.request.Request(address + route, method=method, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def _refresh(self) -> None:
        nodes = {}
        for node in self._call("GET")["nodes"]:
            tags = dict(node["tags"])
            tags[TAG_RAY_NODE_KIND] = NODE_KIND_HEAD if node["kind"] == "head" else NODE_KIND_WORKER
            tags[TAG_RAY_USER_NODE_TYPE] = node["type"]
            tags[TAG_RAY_NODE_STATUS] = STATUS_UP_TO_DATE if node["status"] == "running" else STATUS_SETTING_UP
            nodes[str(node["id"])] = {"status": node["status"], "tags": tags}
        self._nodes = nodes

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self._lock:
            self._refresh()
            return [
                node_id
                for node_id, node in self._nodes.items()
                if all(node["tags"].get(key) == value for key, value in tag_filters.items())
            ]

    def is_running(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._nodes and self._nodes[node_id]["status"] == "running"

    def is_terminated(self, node_id: str) -> bool:
        with self._lock:
            return node_id not in self._nodes

    def node_tags(self, node_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._nodes[node_id]["tags"])

    def internal_ip(self, node_id: str) -> str:
        # use_node_id_as_ip: the monitor matches it to the node's id resource, the id plus one
        return str(int(node_id) + 1)

    def external_ip(self, node_id: str) -> str:
        return self.internal_ip(node_id)

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self._lock:
            self._call("POST", f"/{node_id}/tags", {"tags": tags})
            if node_id in self._nodes:
                self._nodes[node_id]["tags"].update(tags)

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> None:
        raise AssertionError("Ray's launcher calls create_node_with_resources_and_labels")

    def create_node_with_resources_and_labels(
        self,
        node_config: dict[str, Any],
        tags: dict[str, str],
        count: int,
        resources: dict[str, float],
        labels: dict[str, str],
    ) -> None:
        with self._lock:
            try:
                answer = self._call("POST", body={"type": tags[TAG_RAY_USER_NODE_TYPE], "count": count, "tags": tags})
            except OSError as exc:  # urllib's errors, timeouts included
                # Ray's event summarizer uses the description as a format template: a brace in
                # it (the answer's JSON) would fail every later look of the monitor.
                description = f"{count} node(s): {exc}".replace("{", "(").replace("}", ")")
                raise NodeLaunchException(
                    "servekeeper did not take the request", description, src_exc_info=None
                ) from exc
            for node_id in answer["ids"]:
                self._nodes[str(node_id)] = {
                    "status": "pending",
                    "tags": {**tags, TAG_RAY_NODE_STATUS: STATUS_SETTING_UP},
                }

    def terminate_node(self, node_id: str) -> None:
        with self._lock:
            self._call("DELETE", f"/{node_id}")
            self._nodes.pop(node_id, None)

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config
