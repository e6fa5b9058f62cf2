"""The SSH adapter and the node commands, without a host: version checks, retries, host keys
refused before any connection, argv shapes, the token file."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import asyncssh
import pytest

from servekeeper.model.hostpool import HostSpec, parse_host_pool
from servekeeper.model.records import NodePorts
from servekeeper.providers.cluster_token import new_cluster_token, read_cluster_token, save_cluster_token
from servekeeper.providers.node_argv import HeadPorts, RemoteNode, cluster_dir, head_argv, worker_argv
from servekeeper.providers.ssh import (
    CommandFailed,
    CommandTimeout,
    HostConnection,
    HostKeyRefused,
    HostUnreachable,
    SessionRefused,
    SshError,
    Versions,
    controller_versions,
    version_mismatch,
    with_retries,
)
from tests.unit.ssh_fakes import FakeSshConnection
from tests.unit.test_hostpool import VALID

PORTS = NodePorts(
    node_manager=1, object_manager=2, metrics_export=3, agent_listen=4, agent_grpc=5, runtime_env_agent=6,
    min_worker=100, max_worker=147,
)  # fmt: skip


def a_host(**ssh: str) -> HostSpec:
    document = {
        **VALID,
        "spec": {"hosts": [dict(VALID["spec"]["hosts"][0], ssh={**VALID["spec"]["hosts"][0]["ssh"], **ssh})]},
    }
    return parse_host_pool(document).spec.hosts[0]


@pytest.mark.parametrize(
    ("remote", "expected"),
    [
        pytest.param(Versions("3.11.7", "2.60.0"), None, id="same"),
        pytest.param(
            Versions("3.11.7", "2.59.0"), "host gpu-a has Ray 2.59.0 (the controller has Ray 2.60.0)", id="ray"
        ),
        pytest.param(
            Versions("3.11.9", "2.60.0"), "host gpu-a has Python 3.11.9 (the controller has Python 3.11.7)", id="python"
        ),
        pytest.param(Versions("3.11.7", None), "host gpu-a has Ray (not installed)", id="no-ray"),
    ],
)
def test_version_mismatch_names_host_and_both_versions(remote: Versions, expected: str | None) -> None:
    found = version_mismatch("gpu-a", remote, Versions("3.11.7", "2.60.0"))
    assert found == expected if expected is None else (found is not None and found.startswith(expected))


def test_controller_versions_are_this_process() -> None:
    import platform

    assert controller_versions().python == platform.python_version()
    assert controller_versions().ray == "2.60.0"


async def test_retries_only_retryable_errors_with_backoff() -> None:
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise HostUnreachable("h", "no route")
        return "ok"

    assert await with_retries(flaky, attempts=3, first_delay=1, sleep=sleep) == "ok"
    assert len(delays) == 2 and delays[1] > delays[0]

    async def refused() -> str:
        raise HostKeyRefused("h", "not in known_hosts")

    with pytest.raises(HostKeyRefused):
        await with_retries(refused, sleep=sleep)
    assert len(delays) == 2  # a permanent error is not retried

    async def slow() -> str:
        raise CommandTimeout("h", "too slow")

    with pytest.raises(CommandTimeout):
        await with_retries(slow, attempts=2, sleep=sleep)
    assert CommandTimeout.retryable and not SshError.retryable


def test_missing_known_hosts_file_is_refused_before_connecting(tmp_path: Path) -> None:
    host = a_host(knownHostsFile=str(tmp_path / "nope"))

    async def connect() -> None:
        async with HostConnection(host) as connection:
            await connection.run(["true"])

    with pytest.raises(
        HostKeyRefused, match=r"host gpu-a \(10.0.0.11:22\): its known_hosts file .*nope does not exist"
    ):
        asyncio.run(connect())


def test_node_argv_has_owned_ports_and_no_shell(tmp_path: Path) -> None:
    host = a_host()
    head = head_argv(host, "/tmp/servekeeper/c1/head", HeadPorts(10, 11, 12), PORTS, ["--num-cpus=1"])
    assert head[:5] == ["/opt/ray-env/bin/python", "-m", "ray.scripts.scripts", "start", "--block"]
    assert "--node-ip-address=10.0.0.11" in head and "--dashboard-host=10.0.0.11" in head
    assert {"--port=10", "--dashboard-port=11", "--min-worker-port=100", "--max-worker-port=147"} <= set(head)
    worker = worker_argv(host, "/tmp/servekeeper/c1/w1", "10.0.0.11:10", PORTS)
    assert "--address=10.0.0.11:10" in worker and "--head" not in worker


def test_cluster_dir_stays_short() -> None:
    host = a_host()
    assert cluster_dir(host, "hello-g2-9c0eed") == "/tmp/servekeeper-ray/hello-g2-9c0eed"
    long_name = "a-very-long-service-name-g12-0123456789"
    assert len(cluster_dir(host, long_name)) <= len("/tmp/servekeeper-ray/") + 24
    assert cluster_dir(host, long_name) != cluster_dir(host, long_name + "x")


def test_token_is_stored_0600(tmp_path: Path) -> None:
    token = new_cluster_token()
    assert len(token) == 64 and token != new_cluster_token()
    path = save_cluster_token(tmp_path / "tokens", "c1", token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_cluster_token(tmp_path / "tokens", "c1") == token


def test_remote_node_round_trips() -> None:
    node = RemoteNode("h1", "10.0.0.1", "worker", 123, 123, "/tmp/sk/c1/w1", "/tmp/sk/c1/w1.log", PORTS)
    assert RemoteNode.from_json(node.to_json()) == node


async def test_a_file_is_replaced_by_a_rename_never_truncated_in_place(tmp_path: Path) -> None:
    """A node of the cluster may be reading its token file when another node of it on the same
    host (or a restart) writes it again: it must find a whole file, old or new, at any moment."""
    path = tmp_path / "auth_token"
    old = "token-1-the-old-one-longer-than-the-next"
    path.write_text(old)
    path.chmod(0o600)
    connection = HostConnection(a_host())
    fake = FakeSshConnection()
    connection._connection = fake  # type: ignore[assignment]
    # Each write differs from the file it replaces, shorter then longer: a write in place (the old
    # file truncated, or only partly overwritten) would show in what a reader or the file holds.
    with path.open() as reader:  # a reader of the old file
        await connection.write_file(str(path), b"token-2", mode=0o600)
        assert reader.read() == old  # the file it holds was never truncated nor overwritten
    assert path.read_text() == "token-2" and stat.S_IMODE(path.stat().st_mode) == 0o600
    with path.open() as reader:
        await connection.write_file(str(path), b"token-3-longer-than-the-one-before", mode=0o600)
        assert reader.read() == "token-2"
    assert path.read_text() == "token-3-longer-than-the-one-before" and stat.S_IMODE(path.stat().st_mode) == 0o600
    opened = [where for op, where in fake.sftp.ops if op.startswith("open")]
    assert opened and str(path) not in opened  # written under another name only
    assert fake.sftp.ops[-1][0] == "rename" and fake.sftp.ops[-1][1].endswith(f" -> {path}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auth_token"]  # nothing left beside it


async def test_a_write_that_fails_leaves_the_file_as_it_was_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "auth_token"
    path.write_text("token-1")
    connection = HostConnection(a_host())
    fake = FakeSshConnection()
    fake.sftp.fail_write = asyncssh.SFTPFailure("disk full")
    connection._connection = fake  # type: ignore[assignment]
    with pytest.raises(CommandFailed, match="disk full"):
        await connection.write_file(str(path), b"token-2")
    assert path.read_text() == "token-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auth_token"]


async def test_a_host_that_refuses_sftp_says_so_and_is_not_retried_as_a_lost_connection(tmp_path: Path) -> None:
    connection = HostConnection(a_host())
    fake = FakeSshConnection()

    def refuse() -> None:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "Session request failed")

    fake.start_sftp_client = refuse  # type: ignore[method-assign,assignment]
    connection._connection = fake  # type: ignore[assignment]
    with pytest.raises(SessionRefused, match="refused an SFTP session .*sftp subsystem") as refused:
        await connection.write_file(str(tmp_path / "auth_token"), b"token")
    assert not refused.value.retryable and not fake.closed  # the login itself stays usable
