"""The API under concurrent calls: a real uvicorn server, real HTTP, a real SQLite file, and a
stand-in controller writing status from its own thread the way the real one does (with
`persist_status`). Calls on one service are serialized by the test, so the expected final
state of every service is known exactly, while calls on different services interleave."""

from __future__ import annotations

import asyncio
import copy
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from servekeeper.api.app import build_app
from servekeeper.model.enums import ConditionType
from servekeeper.model.records import Condition
from servekeeper.model.spec import parse_spec
from servekeeper.store.store import Store
from tests.unit.test_api import SPEC, TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
THREADS = 8
CALLS_PER_THREAD = 50
SERVICES = [f"svc-{i}" for i in range(5)]


class LoopCheckingController:
    """Only what the API touches. `wake` records whether it ran on the server's event loop:
    the real one sets an asyncio.Event, which is unsafe from any other thread."""

    def __init__(self) -> None:
        self.wake_loops: list[asyncio.AbstractEventLoop | None] = []

    def wake(self, name: str) -> None:
        try:
            self.wake_loops.append(asyncio.get_running_loop())
        except RuntimeError:
            self.wake_loops.append(None)

    def status_snapshot(self, name: str) -> None:
        return None


@dataclass
class Served:
    url: str
    store: Store
    controller: LoopCheckingController
    server: uvicorn.Server


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = Store(tmp_path / "store.db")
    controller = LoopCheckingController()

    async def no_shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(controller, store, TOKEN, no_shutdown)  # type: ignore[arg-type]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", store, controller, server)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
        store.close()


def spec_for(name: str, version: int) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["metadata"]["name"] = name
    spec["spec"]["ingress"]["port"] = 18000 + SERVICES.index(name)  # no port conflicts between services
    spec["spec"]["serveConfig"]["applications"][0]["import_path"] = f"hello:app_v{version}"
    return spec


@dataclass
class Expected:
    """What the store must hold for one service after the calls made so far."""

    spec_json: str
    generation: int
    deleting: bool


def test_concurrent_apply_delete_get_end_in_the_state_of_the_last_call(served: Served) -> None:
    service_locks = {name: threading.Lock() for name in SERVICES}
    expected: dict[str, Expected | None] = dict.fromkeys(SERVICES)
    last_mutation: dict[str, str] = {}  # "apply" or "delete": the call that decides the final state
    failures: list[str] = []
    stop_controller = threading.Event()
    start = threading.Barrier(THREADS)

    def call(client: httpx.Client, rng: random.Random) -> None:
        name = rng.choice(SERVICES)
        operation = rng.choice(["apply", "apply", "delete", "get"])
        # Few versions, so re-applying the same spec (no change) happens too.
        version = rng.randrange(3)
        with service_locks[name]:
            model = expected[name]
            if operation == "apply":
                spec = spec_for(name, version)
                response = client.post("/api/v1/services", json={"spec": spec})
                spec_json = parse_spec(spec).to_json()
                if model is None:
                    model = Expected(spec_json, 1, False)
                    want = {"name": name, "generation": 1, "changed": True}
                elif model.spec_json == spec_json and not model.deleting:
                    want = {"name": name, "generation": model.generation, "changed": False}
                else:
                    model = Expected(spec_json, model.generation + 1, False)
                    want = {"name": name, "generation": model.generation, "changed": True}
                ok = response.status_code == 200 and response.json() == want
            elif operation == "delete":
                response = client.delete(f"/api/v1/services/{name}")
                if model is None:
                    ok = response.status_code == 404
                else:
                    model = Expected(model.spec_json, model.generation, True)
                    ok = response.status_code == 200 and response.json() == {"name": name, "deleting": True}
            else:
                response = client.get(f"/api/v1/services/{name}")
                if model is None:
                    ok = response.status_code == 404
                else:
                    body = response.json()
                    ok = response.status_code == 200 and (body["generation"], body["deleting"]) == (
                        model.generation,
                        model.deleting,
                    )
            if response.status_code >= 500 or not ok:
                failures.append(f"{operation} {name}: {response.status_code} {response.text[:300]}")
            expected[name] = model
            if operation != "get":
                last_mutation[name] = operation

    def client_thread(index: int) -> None:
        rng = random.Random(index)
        try:
            with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
                start.wait()
                for _ in range(CALLS_PER_THREAD):
                    call(client, rng)
        except Exception as exc:
            failures.append(f"thread {index}: {exc!r}")

    def controller_thread() -> None:
        # Like Controller._persist_status, from a thread of its own: read, work a little,
        # write the controller-owned fields only if the row is still what it read.
        rng = random.Random(99)
        try:
            while not stop_controller.is_set():
                for service in served.store.list_services():
                    time.sleep(rng.random() / 1000)
                    condition = Condition(ConditionType.READY, rng.random() < 0.5, "Tick", "", time.time())
                    served.store.persist_status(
                        service.name,
                        service.generation,
                        service.deleting,
                        observed_generation=service.generation,
                        conditions=(condition,),
                    )
                time.sleep(0.001)
        except Exception as exc:
            failures.append(f"controller: {exc!r}")

    controller = threading.Thread(target=controller_thread, name="controller")
    controller.start()
    clients = [threading.Thread(target=client_thread, args=(i,)) for i in range(THREADS)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=120)
    stop_controller.set()
    controller.join(timeout=10)

    assert not any(t.is_alive() for t in [*clients, controller])
    assert failures == []
    for name in SERVICES:
        model = expected[name]
        stored = served.store.get_service(name)
        if model is None:
            assert stored is None, name
            continue
        assert stored is not None, name
        assert (stored.spec_json, stored.generation, stored.deleting) == (
            model.spec_json,
            model.generation,
            model.deleting,
        ), f"{name}: last call {last_mutation[name]}"
        assert stored.deleting is (last_mutation[name] == "delete")
    db = sqlite3.connect(served.store.path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    # Every wake ran on the server's event loop, never in a worker thread.
    assert served.controller.wake_loops
    assert None not in served.controller.wake_loops
    assert len(set(served.controller.wake_loops)) == 1
