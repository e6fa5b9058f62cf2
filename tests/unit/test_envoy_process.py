"""An Envoy the controller adopted (not its child) is alive while its pid runs our bootstrap and
started when recorded: within a second's jitter of the kernel's boot time, which psutil adds to
every start time (a live Envoy once taken for dead was started twice); a reused pid is not ours."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import psutil
import pytest

from servekeeper.dataplane.process import EnvoyProcess


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def adopted(pid: int, create_time: float, bootstrap: str = "60") -> EnvoyProcess:
    return EnvoyProcess(index=0, pid=pid, admin_port=1, create_time=create_time, bootstrap=bootstrap)


def test_an_adopted_process_is_alive_through_a_boot_time_jitter(sleeper: subprocess.Popen[bytes]) -> None:
    started = psutil.Process(sleeper.pid).create_time()
    assert adopted(sleeper.pid, started).alive()
    assert adopted(sleeper.pid, started - 1.0).alive(), "btime moved by a second: the same process"
    assert not adopted(sleeper.pid, started - 10.0).alive(), "another process on a reused pid"
    assert not adopted(sleeper.pid, started, bootstrap="/other/bootstrap.json").alive()
    sleeper.kill()
    sleeper.wait()
    assert not adopted(sleeper.pid, started).alive()
