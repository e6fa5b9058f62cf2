"""Whether a recorded session is still one of our local nodes (providers/local_processes.py),
on harmless processes: a session id is a pid, pids are reused, and Ray's renamed processes hide
what names them as ours."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from servekeeper.providers.local_processes import session_is_ours


@pytest.fixture
def renamed(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A `ray::DashboardAgent` stand-in leading a session of its own, its log open under a node's
    temp dir and no tag in its environment (Ray's rename hides it): one for our node, one for
    another's. Killed and reaped at the end."""
    started: dict[str, subprocess.Popen[bytes]] = {}
    for node in ("ours", "theirs"):
        (tmp_path / node).mkdir()
        with (tmp_path / node / "dashboard_agent.log").open("wb") as log:
            started[node] = subprocess.Popen(
                ["bash", "-c", 'exec -a "ray::DashboardAgent" sleep 60'],
                stdout=log,
                start_new_session=True,
                env={"PATH": os.environ["PATH"]},
            )
    deadline = time.monotonic() + 10
    while not all(psutil.Process(p.pid).cmdline()[:1] == ["ray::DashboardAgent"] for p in started.values()):
        assert time.monotonic() < deadline, "the stand-ins did not rename themselves"
        time.sleep(0.05)
    yield started
    for process in started.values():
        process.kill()
        process.wait()


def test_a_lingering_renamed_process_holding_our_logs_keeps_the_session_ours(
    tmp_path: Path, renamed: dict[str, subprocess.Popen[bytes]]
) -> None:
    ours, log_dir = str(tmp_path / "ours"), str(tmp_path / "logs")
    assert session_is_ours(renamed["ours"].pid, ours, log_dir)
    assert not session_is_ours(renamed["theirs"].pid, ours, log_dir), "another node's files are not ours"
