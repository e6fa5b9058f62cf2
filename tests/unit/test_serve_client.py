"""The Serve REST client's error split, against a real HTTP server standing in for the dashboard."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from servekeeper.core.serve_config import build_serve_config
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import ClusterPorts, ClusterRecord, NodePorts
from servekeeper.model.spec import parse_spec
from servekeeper.providers.ports import PortAllocator
from servekeeper.rayapi.package import Package, build_package
from servekeeper.rayapi.serve_api import PermanentServeError, RetryableServeError, ServeClient
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


def built_package(tmp_path: Path) -> Package:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "hello.py").write_text("app = None\n")
    return build_package(tmp_path / "app", tmp_path / "packages")


async def package_dashboard(
    exists: bool, put_status: int = 200
) -> tuple[web.AppRunner, str, list[tuple[str, str, bytes]]]:
    """A dashboard's package endpoint: GET answers 200/404, PUT stores the body (as job_head.py)."""
    seen: list[tuple[str, str, bytes]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, await request.read()))
        if request.method == "GET":
            return web.Response(status=200 if exists else 404, text="" if exists else "Package does not exist")
        return web.Response(status=put_status, text="Traceback: GCS unavailable" if put_status != 200 else "")

    runner, url = await serve_everything(answer)
    return runner, url, seen


async def test_ensure_package_uploads_a_missing_package(tmp_path: Path) -> None:
    package = built_package(tmp_path)
    runner, url, seen = await package_dashboard(exists=False)
    async with aiohttp.ClientSession() as session:
        assert await ServeClient(session).ensure_package(url, package) is True
    path = f"/api/packages/gcs/_ray_pkg_{package.hash}.zip"
    assert seen == [("GET", path, b""), ("PUT", path, package.path.read_bytes())]
    await runner.cleanup()


async def test_ensure_package_skips_a_present_package(tmp_path: Path) -> None:
    package = built_package(tmp_path)
    runner, url, seen = await package_dashboard(exists=True)
    async with aiohttp.ClientSession() as session:
        assert await ServeClient(session).ensure_package(url, package) is False
    assert [method for method, _, _ in seen] == ["GET"]
    await runner.cleanup()


@pytest.mark.parametrize(
    ("put_status", "error"),
    [
        pytest.param(500, RetryableServeError, id="5xx-retryable"),
        pytest.param(413, PermanentServeError, id="413-too-large-permanent"),
        pytest.param(400, PermanentServeError, id="4xx-permanent"),
    ],
)
async def test_ensure_package_upload_errors_are_split(tmp_path: Path, put_status: int, error: type[Exception]) -> None:
    package = built_package(tmp_path)
    runner, url, _ = await package_dashboard(exists=False, put_status=put_status)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(error) as caught:
            await ServeClient(session).ensure_package(url, package)
    assert package.package_name in str(caught.value) and str(put_status) in str(caught.value)
    if isinstance(caught.value, PermanentServeError):
        assert caught.value.status == put_status and "GCS unavailable" in caught.value.body
    await runner.cleanup()


@pytest.mark.parametrize(
    ("get_status", "error"),
    [pytest.param(503, RetryableServeError, id="5xx"), pytest.param(401, PermanentServeError, id="401")],
)
async def test_ensure_package_existence_check_errors_are_split(
    tmp_path: Path, get_status: int, error: type[Exception]
) -> None:
    package = built_package(tmp_path)
    runner, url = await dashboard(get_status, "no")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(error):
            await ServeClient(session).ensure_package(url, package)
    await runner.cleanup()


async def test_ensure_package_unreachable_dashboard_is_retryable(tmp_path: Path) -> None:
    package = built_package(tmp_path)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RetryableServeError):
            await ServeClient(session).ensure_package(f"http://127.0.0.1:{PortAllocator().one()}", package)
