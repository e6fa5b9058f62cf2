"""The Python client against the real API app (real store, fake controller), in-process: every
method, sync and async, and the errors the CLI shows. The real daemon: tests/integration/test_observe.py."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from servekeeper import (
    AsyncClient,
    Client,
    DaemonNotRunning,
    RolloutFailed,
    ServiceNotFound,
    SpecInvalid,
    Unauthorized,
    WaitTimeout,
)
from servekeeper.api.app import build_app
from servekeeper.client.common import LOCK_FILE_NAME
from servekeeper.model.spec import parse_spec
from servekeeper.store.store import Store

TOKEN = "client-test-token"
URL = "http://sk.test"


def document(name: str = "hello", msg: str = "v1") -> dict[str, Any]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "ingress": {"port": 8000},
            "serveConfig": {"applications": [{"name": "hello", "import_path": "hello:app", "args": {"msg": msg}}]},
        },
    }


class FakeController:
    def wake(self, name: str) -> None:
        return None

    def status_snapshot(self, name: str) -> None:
        return None


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[TestClient]:
    store = Store(tmp_path / "store.db")

    async def shutdown(stop_clusters: bool) -> None:
        return None

    with TestClient(build_app(FakeController(), store, TOKEN, shutdown)) as client:  # type: ignore[arg-type]
        yield client
    store.close()


def through(app_client: TestClient) -> httpx.MockTransport:
    """A transport that hands each request to the in-process API app."""

    def handle(request: httpx.Request) -> httpx.Response:
        answer = app_client.request(
            request.method, request.url.raw_path.decode(), content=request.content, headers=dict(request.headers)
        )
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    return httpx.MockTransport(handle)


@pytest.fixture
def client(app_client: TestClient) -> Iterator[Client]:
    with Client(url=URL, token=TOKEN, transport=through(app_client)) as sync_client:
        yield sync_client


def test_every_method_against_the_api(client: Client, tmp_path: Path) -> None:
    assert client.healthz() is True
    assert client.apply(document()) == {"name": "hello", "generation": 1, "changed": True}
    assert client.apply(parse_spec(document())) == {"name": "hello", "generation": 1, "changed": False}
    spec_file = tmp_path / "other.yaml"
    other = document("other", "v2")
    other["spec"]["ingress"]["port"] = 8001
    spec_file.write_text(yaml.safe_dump(other))
    assert client.apply(spec_file)["name"] == "other"
    assert client.apply(str(spec_file))["changed"] is False
    view = client.get("hello")
    assert view["name"] == "hello" and view["generation"] == 1 and view["observedGeneration"] == 0
    assert [v["name"] for v in client.list()] == ["hello", "other"]
    assert client.events("hello") == [] and client.events(limit=5) == []
    assert client.delete("hello") == {"name": "hello", "deleting": True}
    assert client.get("hello")["deleting"] is True


def test_not_found_and_invalid_specs_are_clear_errors(client: Client, tmp_path: Path) -> None:
    with pytest.raises(ServiceNotFound, match="service 'nope' not found") as not_found:
        client.get("nope")
    assert not_found.value.status == 404
    with pytest.raises(ServiceNotFound):
        client.delete("nope")
    bad = document("Bad_Name")
    del bad["spec"]["ingress"]
    with pytest.raises(SpecInvalid) as invalid:
        client.apply(bad)  # checked by the daemon
    assert any(p.startswith("metadata.name:") for p in invalid.value.problems)
    assert any(p.startswith("spec.ingress:") for p in invalid.value.problems)
    assert invalid.value.source is None
    client.apply(document())
    clash = document("clash")
    with pytest.raises(SpecInvalid, match="spec.ingress.port: port 8000 is used by service 'hello'"):
        client.apply(clash)


def test_a_bad_file_is_refused_before_any_daemon_is_looked_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document("Bad_Name")))
    with Client(tmp_path / "no-daemon-here") as client, pytest.raises(SpecInvalid) as invalid:
        client.apply(bad)
    assert invalid.value.source == str(bad)
    assert [p.split(":")[0] for p in invalid.value.problems] == ["metadata.name"]


def test_without_a_daemon_or_token(tmp_path: Path, app_client: TestClient) -> None:
    with Client(tmp_path) as client, pytest.raises(DaemonNotRunning, match="servekeeper up --detach"):
        client.list()
    with Client(url="http://127.0.0.1:9", token="x") as client, pytest.raises(DaemonNotRunning):
        client.list()  # nothing listens on the discard port
    with Client(url=URL, token="wrong", transport=through(app_client)) as client, pytest.raises(Unauthorized):
        client.list()
    with pytest.raises(ValueError):
        Client(url=URL)


def test_the_daemon_is_found_from_the_state_dir_on_every_call(tmp_path: Path, app_client: TestClient) -> None:
    seen: list[tuple[str, str]] = []
    inner = through(app_client)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url.copy_with(path="/", query=None)), request.headers["authorization"]))
        return inner.handle_request(request)

    client = Client(tmp_path, transport=httpx.MockTransport(handle))
    with pytest.raises(DaemonNotRunning):
        client.list()  # made before `up`: fine, it looks again on the next call
    (tmp_path / "token").write_text(TOKEN + "\n")
    with open(tmp_path / LOCK_FILE_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the daemon holds it, its pid in it
        lock.write(str(os.getpid()))
        lock.flush()
        (tmp_path / "api.json").write_text(json.dumps({"url": "http://127.0.0.1:4321", "pid": os.getpid()}))
        assert client.list() == [] and client.daemon_pid == os.getpid()
        # restarted on another port (the lock holder, a live process, is this test's process)
        (tmp_path / "api.json").write_text(json.dumps({"url": "http://127.0.0.1:4322", "pid": os.getpid()}))
        assert client.list() == []
    assert seen == [("http://127.0.0.1:4321/", f"Bearer {TOKEN}"), ("http://127.0.0.1:4322/", f"Bearer {TOKEN}")]
    client.close()


def condition(kind: str, status: bool, reason: str = "R", message: str = "m") -> dict[str, Any]:
    return {"type": kind, "status": str(status), "reason": reason, "message": message, "lastTransitionTime": 1.0}


def views_transport(views: list[dict[str, Any]]) -> httpx.MockTransport:
    """Answers GET /api/v1/services/svc with each view in turn, the last one from then on."""

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=views.pop(0) if len(views) > 1 else views[0])

    return httpx.MockTransport(handle)


def view(generation: int, observed: int, *conditions: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "svc",
        "generation": generation,
        "observedGeneration": observed,
        "conditions": list(conditions),
        "ingress": {"url": "http://127.0.0.1:8000", "port": 8000, "routedTo": None},
    }


UPGRADING = view(2, 1, condition("Ready", True), condition("UpgradeInProgress", True))
DONE = view(2, 2, condition("Ready", True), condition("UpgradeInProgress", False), condition("RolloutFailed", False))
FAILED = view(2, 2, condition("Ready", True), condition("RolloutFailed", True, "AppFailed", "boom"))
OUTDATED = view(2, 2, condition("Ready", True), condition("ClusterSpecOutdated", True, "UpgradeStrategyNone", "x"))


@pytest.mark.parametrize(
    ("views", "expect"),
    [
        pytest.param([UPGRADING, UPGRADING, DONE], None, id="rolled-out"),
        pytest.param([UPGRADING, FAILED], RolloutFailed, id="failed"),
        pytest.param([OUTDATED], RolloutFailed, id="outdated"),
        pytest.param([UPGRADING], WaitTimeout, id="timeout"),
    ],
)
async def test_wait_sync_and_async(views: list[dict[str, Any]], expect: type[Exception] | None) -> None:
    def sync_wait() -> Any:
        with Client(url=URL, token=TOKEN, transport=views_transport(list(views))) as client:
            return client.wait("svc", timeout=0.2, poll_interval=0.01)

    async def async_wait() -> Any:
        async with AsyncClient(url=URL, token=TOKEN, transport=views_transport(list(views))) as client:
            return await client.wait("svc", timeout=0.2, poll_interval=0.01)

    if expect is None:
        assert sync_wait()["observedGeneration"] == 2
    else:
        with pytest.raises(expect):
            sync_wait()
    if expect is None:
        assert (await async_wait())["observedGeneration"] == 2
    else:
        with pytest.raises(expect) as raised:
            await async_wait()
        if expect is RolloutFailed:
            assert isinstance(raised.value, RolloutFailed)
            assert str(raised.value).startswith("service/svc generation 2 not rolled out: ")
        else:
            assert str(raised.value) == "timed out waiting for service/svc: Ready=True (R: m)"


async def test_the_async_client_against_the_api(app_client: TestClient) -> None:
    async with AsyncClient(url=URL, token=TOKEN, transport=through(app_client)) as client:  # Mock serves async too
        assert await client.healthz()
        assert (await client.apply(document()))["changed"] is True
        assert (await client.get("hello"))["name"] == "hello"
        assert [v["name"] for v in await client.list()] == ["hello"]
        assert await client.events("hello") == []
        with pytest.raises(ServiceNotFound):
            await client.get("nope")
        with pytest.raises(SpecInvalid):
            await client.apply(document("Bad_Name"))
        assert (await client.delete("hello"))["deleting"] is True
