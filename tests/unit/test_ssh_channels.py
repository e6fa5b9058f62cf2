"""Channels on one SSH connection (issue 19, item 11): sshd allows a few sessions per
connection (OpenSSH's MaxSessions, 10 by default); commands sent at once beyond that are
refused one by one. A `HostConnection` never opens more than its bound at once, and a channel
refused on a live connection fails only that command, as retryable, closing nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import asyncssh
import pytest

from servekeeper.model.records import ClusterRecord, NodePlacement
from servekeeper.providers import pool_liveness
from servekeeper.providers.node_argv import remote_node
from servekeeper.providers.ssh import ChannelRefused, HostConnection, HostUnreachable
from servekeeper.providers.ssh_nodes import SshNodes
from tests.unit.ssh_fakes import FakeSshConnection
from tests.unit.test_pool_clusters import draft, pool_spec
from tests.unit.test_ssh import PORTS, a_host


class ChannelCountingConnection(FakeSshConnection):
    """A live connection whose `run` holds a channel open until `release` is set, counting the
    channels open at once; `refuse_next` refuses the next channel like a host at its limit."""

    def __init__(self, max_sessions: int = 10) -> None:
        super().__init__()
        self.max_sessions = max_sessions
        self.open_now = 0
        self.most_open = 0
        self.release = asyncio.Event()
        self.refuse_next: asyncssh.ChannelOpenError | None = None
        self.drop_on_refusal = False  # the connection itself goes down with the refusal

    async def run(self, command: str, **kwargs: Any) -> SimpleNamespace:
        if self.refuse_next is not None:
            refusal, self.refuse_next = self.refuse_next, None
            self.closed = self.closed or self.drop_on_refusal
            raise refusal
        if self.open_now >= self.max_sessions:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "open failed")
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.release.wait()
        finally:
            self.open_now -= 1
        return SimpleNamespace(exit_status=0, stdout=command, stderr="")


async def test_twenty_commands_at_once_never_open_more_channels_than_the_bound() -> None:
    connection = HostConnection(a_host(), max_channels=8)
    fake = ChannelCountingConnection()
    connection._connection = fake  # type: ignore[assignment]
    commands = [asyncio.ensure_future(connection.run(["echo", str(i)])) for i in range(20)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert fake.open_now == 8  # the others wait for a channel, none was refused
    fake.release.set()
    results = await asyncio.gather(*commands)
    assert [r.stdout for r in results] == [f"echo {i}" for i in range(20)]
    assert fake.most_open == 8 and not fake.closed


async def test_the_default_bound_stays_under_openssh_max_sessions() -> None:
    connection = HostConnection(a_host())
    fake = ChannelCountingConnection(max_sessions=10)
    connection._connection = fake  # type: ignore[assignment]
    commands = [asyncio.ensure_future(connection.run(["true"])) for _ in range(20)]
    for _ in range(20):
        await asyncio.sleep(0)
    fake.release.set()
    await asyncio.gather(*commands)  # none refused
    assert 0 < fake.most_open < 10


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, id="administratively-prohibited"),
        pytest.param(asyncssh.OPEN_RESOURCE_SHORTAGE, id="resource-shortage"),
        pytest.param(asyncssh.OPEN_CONNECT_FAILED, id="open-failed"),  # what OpenSSH sends past MaxSessions
    ],
)
async def test_a_refused_channel_fails_that_command_only_and_closes_nothing(code: int) -> None:
    connection = HostConnection(a_host())
    fake = ChannelCountingConnection()
    connection._connection = fake  # type: ignore[assignment]
    others = [asyncio.ensure_future(connection.run(["sleep", "1"])) for _ in range(3)]
    await asyncio.sleep(0)
    fake.refuse_next = asyncssh.ChannelOpenError(code, "no more sessions")
    with pytest.raises(ChannelRefused, match=r"host gpu-a \(10.0.0.11:22\): .*refused a channel") as refused:
        await connection.run(["uptime"])
    assert refused.value.retryable and not isinstance(refused.value, HostUnreachable)
    assert not fake.closed and connection._connection is fake  # the connection stays, as do the others
    fake.release.set()
    assert [r.exit_status for r in await asyncio.gather(*others)] == [0, 0, 0]


async def test_a_channel_refused_because_the_connection_dropped_is_a_lost_connection() -> None:
    connection = HostConnection(a_host())
    fake = ChannelCountingConnection()
    connection._connection = fake  # type: ignore[assignment]
    fake.drop_on_refusal = True  # dropped under the command
    fake.refuse_next = asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "connection closed")
    with pytest.raises(HostUnreachable, match="connection lost"):
        await connection.run(["uptime"])
    assert connection._connection is None


async def test_an_sftp_write_refused_for_want_of_sessions_is_retryable(tmp_path: Any) -> None:
    connection = HostConnection(a_host())
    fake = FakeSshConnection()

    def refuse() -> None:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_RESOURCE_SHORTAGE, "too many sessions")

    fake.start_sftp_client = refuse  # type: ignore[method-assign,assignment]
    connection._connection = fake  # type: ignore[assignment]
    with pytest.raises(ChannelRefused) as refused:
        await connection.write_file(str(tmp_path / "auth_token"), b"token")
    assert refused.value.retryable and not fake.closed


# -- liveness looks beside slow commands (issue 19 follow-up) ----------------------------------------


class BusyHost(ChannelCountingConnection):
    """A host that answers: the node agent's `stop` holds its channel (TERM, wait, KILL, up to
    30 s) until `release`; `alive` and `tail` answer at once."""

    async def run(self, command: str, **kwargs: Any) -> SimpleNamespace:
        if command.endswith(" stop"):
            await super().run(command, **kwargs)
            return SimpleNamespace(exit_status=0, stdout='{"left": []}', stderr="")
        if self.open_now >= self.max_sessions:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "open failed")
        self.most_open = max(self.most_open, self.open_now + 1)
        await asyncio.sleep(0)
        answer = '{"alive": true}' if command.endswith(" alive") else '{"tail": "ray start exited"}'
        return SimpleNamespace(exit_status=0, stdout=answer, stderr="")


def started_cluster(host_name: str, count: int) -> ClusterRecord:
    config = pool_spec(workers=count - 1).spec.rayClusterConfig
    nodes = tuple(
        NodePlacement(host_name, "10.0.0.11", "head" if i == 0 else "worker", PORTS, f"/tmp/sk/n{i}", 100 + i, 100 + i)
        for i in range(count)
    )
    return draft("c", config).with_changes(pool="fleet", nodes=nodes)


async def test_a_liveness_look_answers_while_slow_commands_hold_every_channel(monkeypatch: Any) -> None:
    monkeypatch.setattr(pool_liveness, "LIVENESS_TIMEOUT_SECONDS", 0.5)
    nodes = SshNodes([a_host()])
    fake = BusyHost(max_sessions=10)
    nodes.connection("gpu-a")._connection = fake  # type: ignore[assignment]
    busy = started_cluster("gpu-a", 8)
    stops = [asyncio.ensure_future(nodes.stop(remote_node(node))) for node in busy.nodes]
    for _ in range(20):
        await asyncio.sleep(0)
    assert fake.open_now > 0  # the teardown holds channels, as many as it may
    looked = await pool_liveness.look(nodes, started_cluster("gpu-a", 2))
    assert looked.head_alive and not looked.head_silent and looked.dead_workers == [], looked.reason
    fake.release.set()
    assert await asyncio.gather(*stops) == [[]] * 8
    assert fake.most_open < 10 and not fake.closed  # within OpenSSH's MaxSessions, nothing refused


class SlowLooks(BusyHost):
    """A host under load: each look answers, but after `look_seconds`; `silent` answers none."""

    look_seconds = 0.3
    silent = False

    async def run(self, command: str, **kwargs: Any) -> SimpleNamespace:
        await (asyncio.Event().wait() if self.silent else asyncio.sleep(self.look_seconds))
        return await super().run(command, **kwargs)


async def test_a_look_waiting_behind_other_looks_gets_its_whole_timeout_once_it_has_a_channel(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(pool_liveness, "LIVENESS_TIMEOUT_SECONDS", 0.5)
    nodes = SshNodes([a_host()])
    nodes.connection("gpu-a")._connection = SlowLooks()  # type: ignore[assignment]
    looked = await pool_liveness.look(nodes, started_cluster("gpu-a", 4))  # 2 rounds of 0.3 s on 2 channels
    assert looked.head_alive and looked.dead_workers == [], looked.reason


async def test_a_silent_host_is_still_found_silent_within_the_looks_bound(monkeypatch: Any) -> None:
    monkeypatch.setattr(pool_liveness, "LIVENESS_TIMEOUT_SECONDS", 0.2)
    nodes = SshNodes([a_host()])
    fake = SlowLooks()
    fake.silent = True
    nodes.connection("gpu-a")._connection = fake  # type: ignore[assignment]
    started = asyncio.get_running_loop().time()
    looked = await pool_liveness.look(nodes, started_cluster("gpu-a", 4))
    assert not looked.head_alive and looked.head_silent
    assert asyncio.get_running_loop().time() - started <= pool_liveness.LOOK_BOUND_FACTOR * 0.2 + 0.2
