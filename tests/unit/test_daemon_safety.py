"""The daemon's own safety rules, checked on the real command (no Ray needed)."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

from servekeeper.daemon import ensure_token
from servekeeper.store.store import Store


def run_cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servekeeper.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_token_is_created_private(tmp_path: Path) -> None:
    token = ensure_token(tmp_path)
    mode = stat.S_IMODE(os.stat(tmp_path / "token").st_mode)
    assert mode == 0o600
    assert len(token) >= 32
    assert ensure_token(tmp_path) == token


def test_a_non_loopback_api_address_is_refused_without_allow_remote(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "up", "--api-host", "0.0.0.0")
    assert result.returncode == 1
    assert "--allow-remote" in result.stderr
    assert not (tmp_path / "api.json").exists()


def test_a_corrupt_store_stops_up_with_a_clear_message_and_is_left_untouched(tmp_path: Path) -> None:
    garbage = b"SQLite format 3\x00" + b"\xff" * 5000
    (tmp_path / "store.db").write_bytes(garbage)
    result = run_cli(tmp_path, "up")
    assert result.returncode == 1
    assert "corrupt" in result.stderr or "unreadable" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "store.db").read_bytes() == garbage


def test_commands_say_clearly_when_no_daemon_runs(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "get")
    assert result.returncode == 3
    assert "servekeeper up --detach" in result.stderr


def test_commands_other_than_up_leave_the_daemon_unloaded() -> None:
    """The daemon (FastAPI, the controller, every provider) more than doubled each command's
    start-up; only `up` needs it."""
    probe = (
        "import sys; from servekeeper.cli.main import app; "
        "print(sorted(m for m in ('servekeeper.daemon', 'fastapi', 'servekeeper.controller.loop') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_an_invalid_file_is_rejected_locally_with_every_problem(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("apiVersion: servekeeper/v1alpha1\nkind: RayService\nmetadata: {name: Bad_Name}\nspec: {}\n")
    result = run_cli(tmp_path, "apply", "-f", str(spec))
    assert result.returncode == 1
    assert "metadata.name" in result.stderr and "spec.ingress" in result.stderr


WRITER = """
import sys, time
from pathlib import Path
from servekeeper.store.store import Store
store = Store(Path(sys.argv[1]))
i = 0
while True:
    i += 1
    store.apply_spec(f"svc-{i % 50}", '{"n": %d}' % i, now=time.time())
"""


def test_killing_a_writer_mid_write_leaves_a_consistent_store(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    Store(path).close()
    for _ in range(3):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        try:
            writer.wait(timeout=1.5)
        except subprocess.TimeoutExpired:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    store = Store(path)
    services = store.list_services()
    assert services, "the writer should have committed something"
    assert all(s.spec_json.startswith('{"n": ') for s in services)
