"""The Redis servekeeper runs for GCS fault tolerance, with Debian's real redis-server (no Ray):
started with a password only its config file holds, adopted by a new controller, started again
on the same port with its data after a SIGKILL, rebound when another address is needed, a
cluster's namespace removed alone, a user per cluster reaching its own keys only, stopped by `down`."""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from servekeeper.providers.gcs_storage import delete_namespace, namespace_kept
from servekeeper.providers.redis_server import RedisServer, RedisTarget
from servekeeper.testing.harness import wait_until


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    running = RedisServer(tmp_path / "redis")
    try:
        yield running
    finally:
        running.stop()
        assert running.pid() is None


def client(target: RedisTarget, password: str | None = None) -> redis.Redis:
    host, port = target.address.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), password=password, socket_timeout=5)


def test_started_with_its_password_adopted_and_started_again_with_its_data(server: RedisServer) -> None:
    target = server.ensure("127.0.0.1")
    pid = server.pid()
    assert pid is not None and target.password and len(target.password) == 64
    with pytest.raises(redis.AuthenticationError):
        client(target).set("k", "v")
    assert target.password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), "not on its command line"
    assert stat.S_IMODE(server.config_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((server.directory / "password").stat().st_mode) == 0o600
    client(target, target.password).hset("RAYsvc-a@KV", "serve", "state")
    # A new controller (a new object on the same state dir) adopts it: same process, same port.
    again = RedisServer(server.directory)
    assert again.pid() == pid and again.ensure("127.0.0.1") == target and again.pid() == pid
    time.sleep(1.5)  # appendfsync everysec: what was written a second ago is on disk
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: server.pid() is None, 5, "the killed redis-server gone")
    restarted = server.ensure("127.0.0.1")
    assert restarted == target and server.pid() not in (None, pid), "same port and password, a new process"
    assert client(target, target.password).hget("RAYsvc-a@KV", "serve") == b"state", "its data back from the AOF"


def test_a_new_address_rebinds_it_keeping_port_and_data(server: RedisServer) -> None:
    first = server.ensure("127.0.0.1")
    client(first, first.password).set("RAYsvc-a@T", "1")
    pid = server.pid()
    second = server.ensure("127.0.0.2")  # another pool's hosts reach this machine elsewhere
    assert second.address == f"127.0.0.2:{first.address.rsplit(':', 1)[1]}" and server.pid() != pid
    assert client(first, first.password).get("RAYsvc-a@T") == b"1" and client(second, second.password).ping()


def test_a_clusters_namespace_goes_alone(server: RedisServer) -> None:
    target = server.ensure("127.0.0.1")
    store = client(target, target.password)
    for key in ("RAYsvc-a@KV", "RAYsvc-a@NODE", "RAYsvc-ab@KV", "RAYsvc-b@KV", "other"):
        store.hset(key, "f", "v")
    assert delete_namespace(target, "svc-a") == 2
    assert sorted(store.keys()) == [b"RAYsvc-ab@KV", b"RAYsvc-b@KV", b"other"]


def test_clusters_starting_at_once_get_one_server(server: RedisServer) -> None:
    """Several heads start (or look) at once, each in a worker thread: one redis-server, one port,
    one password (a second server would share the first's data dir and AOF)."""
    with ThreadPoolExecutor(4) as pool:
        targets = set(pool.map(lambda _: server.ensure("127.0.0.1"), range(4)))
    assert len(targets) == 1 and server.pid() is not None
    (target,) = targets
    assert client(target, target.password).ping()
    port = target.address.rsplit(":", 1)[1]
    assert servers_on(port) == [server.pid()], "one redis-server on its port, the recorded one"


def test_each_cluster_signs_in_as_its_own_user_that_reaches_only_its_namespace(server: RedisServer) -> None:
    """A cluster's head (or whoever reads its GCS command line) cannot read or wipe another's
    tables, nor run admin commands; its user survives a SIGKILL of the server, and goes with it."""
    a = server.ensure("127.0.0.1", "svc-g1-a")
    b = server.ensure("127.0.0.1", "svc-g2-b")
    assert (a.username, b.username) == ("sk-svc-g1-a", "sk-svc-g2-b") and a.password != b.password
    as_a = redis.Redis(*a.address.split(":"), username=a.username, password=a.password, socket_timeout=5)
    # What Ray's client and GCS do: DEL DUMMY on connecting, its tables, INFO, CLUSTER INFO.
    as_a.delete("DUMMY")
    as_a.hset("RAYsvc-g1-a@KV", "f", "v")
    as_a.incrby("RAYsvc-g1-a@JobCounter", 1)
    assert as_a.hmget("RAYsvc-g1-a@KV", ["f"]) == [b"v"] and as_a.hscan("RAYsvc-g1-a@KV")[1] == {b"f": b"v"}
    assert as_a.info("server")["redis_version"] and as_a.hget("RAYsvc-g1-a@KV", "f") == b"v"
    with pytest.raises(redis.ResponseError, match="cluster support disabled") as answered:
        as_a.execute_command("CLUSTER", "INFO")  # not refused by the ACL: this Redis is no cluster
    assert not isinstance(answered.value, redis.exceptions.NoPermissionError)
    for denied in (
        lambda: as_a.hget("RAYsvc-g2-b@KV", "f"),
        lambda: as_a.set("other", "x"),
        lambda: as_a.flushall(),
        lambda: as_a.config_get("requirepass"),
        lambda: as_a.keys("*"),
        lambda: as_a.get("DUMMY"),  # DUMMY is only deleted
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            denied()
    pid = server.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: server.pid() is None, 5, "the killed redis-server gone")
    assert server.ensure("127.0.0.1") is not None  # started again, by another cluster's look
    again = redis.Redis(*a.address.split(":"), username=a.username, password=a.password, socket_timeout=5)
    assert again.ping(), "its user is back before its head reconnects"
    assert namespace_kept(a, "svc-g1-a") and not namespace_kept(b, "svc-g2-b"), "b wrote no table"
    assert delete_namespace(a, "svc-g1-a") == 2, "its own user deletes its namespace"
    assert not namespace_kept(a, "svc-g1-a")
    server.forget_user("svc-g1-a")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(*a.address.split(":"), username=a.username, password=a.password, socket_timeout=5).ping()
    server.stop()
    server.ensure("127.0.0.1")
    assert redis.Redis(*b.address.split(":"), username=b.username, password=b.password, socket_timeout=5).ping()
    with pytest.raises(redis.AuthenticationError):  # nor written back at the next start
        redis.Redis(*a.address.split(":"), username=a.username, password=a.password, socket_timeout=5).ping()
    assert a.password != hmac_of(server, "sk-svc-g1-a"), "not derived from the password heads once had"


def hmac_of(server: RedisServer, user: str) -> str:
    import hashlib
    import hmac

    key = (server.directory / "password").read_text().strip().encode()
    return hmac.new(key, user.encode(), hashlib.sha256).hexdigest()


def servers_on(port: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            title = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"redis-server" in title and f":{port}".encode() in title:
            found.append(int(entry))
    return found
