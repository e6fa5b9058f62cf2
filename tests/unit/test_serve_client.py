"""The Serve REST client's error split, against a real HTTP server standing in for the dashboard."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from servekeeper.core.serve_config import build_serve_config
from servekeeper.ports import PortAllocator
from servekeeper.serve_api import PermanentServeError, RetryableServeError, ServeClient
from servekeeper.spec import parse_spec
from servekeeper.status import ClusterPorts, ClusterRecord, ClusterRole, NodePorts
from tests.unit.http_stub import serve_everything


async def dashboard(status: int, body: str) -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    return await serve_everything(answer)


@pytest.mark.parametrize(
    ("status", "error"),
    [pytest.param(500, RetryableServeError, id="5xx-retryable"), pytest.param(400, PermanentServeError, id="400")],
)
async def test_put_errors_are_split(status: int, error: type[Exception]) -> None:
    runner, url = await dashboard(status, '{"error": "import_path hello_missing not found"}')
    async with aiohttp.ClientSession() as session:
        with pytest.raises(error) as caught:
            await ServeClient(session).put_config(url, {"applications": []})
    if isinstance(caught.value, PermanentServeError):
        assert "hello_missing" in caught.value.body  # kept verbatim for the status
    await runner.cleanup()


async def test_connection_refused_is_retryable() -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RetryableServeError):
            await ServeClient(session).applications(f"http://127.0.0.1:{PortAllocator().one()}")


async def test_applications_are_parsed() -> None:
    runner, url = await dashboard(
        200, '{"applications": {"a": {"status": "RUNNING", "source": "imperative", "message": ""}}}'
    )
    async with aiohttp.ClientSession() as session:
        apps = await ServeClient(session).applications(url)
    assert apps["a"].status.value == "RUNNING" and apps["a"].source.value == "imperative"
    await runner.cleanup()


def test_serve_config_gets_owned_ports_head_only_proxy_and_local_working_dir() -> None:
    spec = parse_spec(
        {
            "apiVersion": "servekeeper/v1alpha1",
            "kind": "RayService",
            "metadata": {"name": "s"},
            "spec": {
                "ingress": {"port": 8000},
                "rayClusterConfig": {"workingDir": "/srv/app"},
                "serveConfig": {
                    "http_options": {"request_timeout_s": 5},
                    "applications": [
                        {"name": "a", "import_path": "m:app"},
                        {
                            "name": "b",
                            "route_prefix": "/b",
                            "import_path": "m:b",
                            "runtime_env": {"working_dir": "s3://bucket/b.zip", "pip": ["x"]},
                        },
                    ],
                },
            },
        }
    )
    ports = ClusterPorts(1, 2, 3, 4321, 4322, (NodePorts(6, 7, 8, 9, 10, 11, 12, 13),))
    cluster = ClusterRecord(
        name="c",
        service="s",
        generation=1,
        cluster_spec_hash="h",
        cluster_spec_json="{}",
        role=ClusterRole.PENDING,
        ports=ports,
        temp_dir="/t",
        log_dir="/l",
        created_at=0,
    )
    document = build_serve_config(spec, cluster)
    assert document["http_options"] == {"request_timeout_s": 5, "host": "127.0.0.1", "port": 4321}
    assert document["grpc_options"]["port"] == 4322
    assert document["proxy_location"] == "HeadOnly"
    assert document["applications"][0]["runtime_env"] == {"working_dir": "local:///srv/app"}
    assert document["applications"][1]["runtime_env"] == {"working_dir": "s3://bucket/b.zip", "pip": ["x"]}
