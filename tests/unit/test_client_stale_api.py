"""Issue 19, item 4: the API token goes only to the daemon that holds the state dir's lock.

After a kill -9, `api.json` still names the dead daemon's loopback port, which any local user
can bind; a client that trusted it would hand its bearer token to that listener."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servekeeper import AsyncClient, Client, DaemonNotRunning
from servekeeper.client.common import LOCK_FILE_NAME

TOKEN = "stale-test-token"


class Listener:
    """A plain socket on a loopback port, as another local user would bind it: what it received."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with connection:
                connection.settimeout(1)
                try:
                    self.received += connection.recv(65536)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    serving = Listener()
    yield serving
    serving.close()


def stale_state_dir(state_dir: Path, port: int) -> None:
    """What a daemon killed with -9 leaves: its token, api.json, and an unlocked lock file."""
    (state_dir / "token").write_text(TOKEN + "\n")
    (state_dir / "api.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "pid": os.getpid()}))
    (state_dir / LOCK_FILE_NAME).write_text(str(os.getpid()))


def test_a_stale_api_json_gets_no_token(tmp_path: Path, listener: Listener) -> None:
    stale_state_dir(tmp_path, listener.port)
    with Client(tmp_path, timeout=2) as client, pytest.raises(DaemonNotRunning):
        client.list()
    assert listener.connections == 0 and TOKEN.encode() not in listener.received


async def test_a_stale_api_json_gets_no_token_from_the_async_client(tmp_path: Path, listener: Listener) -> None:
    stale_state_dir(tmp_path, listener.port)
    async with AsyncClient(tmp_path, timeout=2) as client:
        with pytest.raises(DaemonNotRunning):
            await client.list()
    assert listener.connections == 0


def test_the_token_goes_to_the_lock_holder_only(tmp_path: Path) -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["authorization"])
        return httpx.Response(200, json=[])

    stale_state_dir(tmp_path, 4321)
    with open(tmp_path / LOCK_FILE_NAME, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a running daemon holds it
        with Client(tmp_path, transport=httpx.MockTransport(handle)) as client:
            assert client.list() == []
            # The lock is held, but by another daemon than the one api.json names.
            (tmp_path / "api.json").write_text(json.dumps({"url": "http://127.0.0.1:4321", "pid": 1}))
            with pytest.raises(DaemonNotRunning):
                client.list()
    assert seen == [f"Bearer {TOKEN}"]


def test_a_lock_kept_by_a_dead_daemons_child_is_not_enough(tmp_path: Path) -> None:
    """A process that inherited the lock's descriptor keeps it held after the daemon died."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_state_dir(tmp_path, 4321)
    (tmp_path / "api.json").write_text(json.dumps({"url": "http://127.0.0.1:4321", "pid": dead.pid}))
    sent: list[httpx.Request] = []
    with open(tmp_path / LOCK_FILE_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(str(dead.pid))
        lock.flush()
        transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(200, json=[]))
        with Client(tmp_path, transport=transport) as client, pytest.raises(DaemonNotRunning):
            client.list()
    assert sent == []
