"""The module Ray's monitor loads on a head to ask servekeeper for nodes (issue 22), against a
real HTTP server on loopback standing in for the controller's API: it relays Ray's launches,
tags and terminations, reads the node list afresh each time Ray asks, sends the token of its
file (read at each call: a rotated token is used at once), and reports a refused launch the way
Ray's launcher expects; over HTTP on a port and over a socket file alike."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_SETTING_UP,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from tests.unit.http_stub import serve_everything

MODULE_DIR = Path(__file__).resolve().parents[2] / "src" / "servekeeper" / "providers" / "node_provider"
sys.path.insert(0, str(MODULE_DIR))  # as the head's PYTHONPATH names it: no servekeeper import
from servekeeper_node_provider import NodeProvider  # noqa: E402


class FakeNodesApi:
    """The controller's node API for one cluster, in memory."""

    def __init__(self) -> None:
        self.nodes: dict[int, dict[str, Any]] = {}
        self.next_id = 1
        self.tokens_seen: list[str] = []
        self.refuse = False

    async def handle(self, request: web.Request) -> web.Response:
        self.tokens_seen.append(request.headers.get("Authorization", ""))
        parts = request.path.removeprefix("/api/v1/clusters/svc-g1/nodes").strip("/").split("/")
        if request.method == "GET":
            return web.json_response({"nodes": [{"id": i, **node} for i, node in self.nodes.items()]})
        if request.method == "POST" and parts == [""]:
            if self.refuse:
                return web.json_response({"detail": "no room"}, status=409)
            body = await request.json()
            ids = []
            for _ in range(body["count"]):
                self.nodes[self.next_id] = {"kind": "worker", "type": body["type"], "status": "pending", "tags": {}}
                ids.append(self.next_id)
                self.next_id += 1
            return web.json_response({"ids": ids})
        if request.method == "POST" and parts[1:] == ["tags"]:
            self.nodes[int(parts[0])]["tags"].update((await request.json())["tags"])
            return web.json_response({})
        if request.method == "DELETE":
            del self.nodes[int(parts[0])]
            return web.Response(status=204)
        return web.Response(status=404)


@pytest.fixture(params=["http", "unix"])
async def api_and_provider(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """The API on a loopback port (this machine's heads) or a socket file (a pool head's SSH forward)."""
    api = FakeNodesApi()
    if request.param == "http":
        runner, url = await serve_everything(api.handle)
    else:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", api.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.UnixSite(runner, str(tmp_path / "api.sock")).start()
        url = f"unix:{tmp_path / 'api.sock'}"
    token_file = tmp_path / "node-token"
    token_file.write_text("first\n")
    (tmp_path / "node-api-url").write_text(url + "\n")
    config = {"url_file": str(tmp_path / "node-api-url"), "cluster": "svc-g1", "token_file": str(token_file)}
    provider = NodeProvider(config, "svc-g1")
    yield api, provider, token_file
    await runner.cleanup()


async def test_launches_tags_and_terminations_are_relayed_and_read_back(api_and_provider: Any) -> None:
    api, provider, token_file = api_and_provider
    tags = {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: "cpu"}
    # Ray's launcher runs in threads of its own: the provider is synchronous
    await asyncio.to_thread(provider.create_node_with_resources_and_labels, {}, tags, 2, {"CPU": 1}, {})
    assert {i: n["type"] for i, n in api.nodes.items()} == {1: "cpu", 2: "cpu"}
    ids = await asyncio.to_thread(provider.non_terminated_nodes, {TAG_RAY_USER_NODE_TYPE: "cpu"})
    assert ids == ["1", "2"]
    assert not provider.is_running("1") and provider.node_tags("1")[TAG_RAY_NODE_STATUS] == STATUS_SETTING_UP
    # Ray's monitor filters by these two, named by Ray: set here from the API's kind and type
    assert provider.node_tags("1")[TAG_RAY_NODE_KIND] == NODE_KIND_WORKER
    assert provider.node_tags("1")[TAG_RAY_USER_NODE_TYPE] == "cpu"
    # use_node_id_as_ip: node 1 carries NODE_ID_AS_RESOURCE 2 (Ray drops a 0, the head's id)
    assert provider.internal_ip("1") == "2" and provider.internal_ip("0") == "1"

    api.nodes[1]["status"] = "running"
    token_file.write_text("rotated\n")
    assert await asyncio.to_thread(provider.non_terminated_nodes, {TAG_RAY_USER_NODE_TYPE: "gpu"}) == []
    assert provider.is_running("1") and provider.node_tags("1")[TAG_RAY_NODE_STATUS] == STATUS_UP_TO_DATE
    await asyncio.to_thread(provider.set_node_tags, "1", {"ray-node-name": "worker-1"})
    assert api.nodes[1]["tags"]["ray-node-name"] == "worker-1"

    await asyncio.to_thread(provider.terminate_node, "2")
    assert list(api.nodes) == [1] and provider.is_terminated("2")
    assert await asyncio.to_thread(provider.non_terminated_nodes, {}) == ["1"]
    assert api.tokens_seen[0] == "Bearer first" and api.tokens_seen[-1] == "Bearer rotated"


async def test_a_refused_launch_is_a_node_launch_exception_for_rays_launcher(api_and_provider: Any) -> None:
    api, provider, _ = api_and_provider
    api.refuse = True
    tags = {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: "cpu"}
    with pytest.raises(NodeLaunchException) as raised:
        await asyncio.to_thread(provider.create_node_with_resources_and_labels, {}, tags, 1, {"CPU": 1}, {})
    assert "409" in raised.value.description
    # Ray's monitor formats it as a template (event_summarizer): braces would fail each look
    assert "{" not in raised.value.description and "}" not in raised.value.description
    assert ("Failed to launch {} node(s): " + raised.value.description).format(1)
    assert api.nodes == {} and await asyncio.to_thread(provider.non_terminated_nodes, {}) == []
    assert provider.bootstrap_config({"a": 1}) == {"a": 1}  # the config passes through unchanged
