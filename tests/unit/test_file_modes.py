"""Issue 19, item 5: the state dir and what is in it are the owner's only, also after an upgrade
from a version that left them readable by everyone."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from servekeeper.rayapi.package import build_package
from servekeeper.store.secrets import secrets_dir, set_secret
from servekeeper.store.store import Store, StoreError, private_state_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_existing_store_and_its_dir_are_tightened_on_open(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    Store(state_dir / "store.db").close()
    db_files = [state_dir / name for name in ("store.db", "store.db-wal", "store.db-shm")]
    for path in db_files:
        path.touch()
        os.chmod(path, 0o644)  # as an older servekeeper left them
    os.chmod(state_dir, 0o755)
    store = Store(state_dir / "store.db")
    try:
        assert {path.name: mode(path) for path in db_files} == {path.name: 0o600 for path in db_files}
        assert mode(state_dir) == 0o700
    finally:
        store.close()


def test_a_new_state_dir_is_private(tmp_path: Path) -> None:
    state_dir = private_state_dir(tmp_path / "new" / "state")
    assert mode(state_dir) == 0o700
    Store(state_dir / "store.db").close()
    assert mode(state_dir / "store.db") == 0o600


def test_packages_are_readable_by_the_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "app"
    root.mkdir()
    (root / "main.py").write_text("print('hi')\n")
    package = build_package(root, tmp_path / "packages")
    assert mode(package.path) == 0o400
    assert mode(tmp_path / "packages") == 0o700
    os.chmod(package.path, 0o444)  # as an older servekeeper left it
    again = build_package(root, tmp_path / "packages")
    assert again.path == package.path and mode(again.path) == 0o400


def test_a_secret_set_before_the_first_up_makes_the_state_dir_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "fresh"
    set_secret(secrets_dir(state_dir), "db", {"password": "p"})
    assert mode(state_dir) == 0o700 and mode(secrets_dir(state_dir)) == 0o700


def test_a_state_dir_of_another_user_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was chmod-ed (as root) or gave a raw PermissionError traceback (as anyone else)."""
    state_dir = tmp_path / "theirs"
    state_dir.mkdir(mode=0o755)
    os.chmod(state_dir, 0o755)
    someone_else = os.stat(state_dir).st_uid + 1
    monkeypatch.setattr(os, "geteuid", lambda: someone_else)
    with pytest.raises(StoreError, match=str(state_dir)) as refused:
        private_state_dir(state_dir)
    assert "owned by" in str(refused.value)
    assert mode(state_dir) == 0o755  # left as it was


def test_tightening_an_existing_dir_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`--state-dir .` or `$HOME` was made 0700 without a word."""
    os.chmod(tmp_path, 0o755)
    with caplog.at_level(logging.WARNING, logger="servekeeper.store.store"):
        private_state_dir(tmp_path)
    assert mode(tmp_path) == 0o700
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert str(tmp_path) in caplog.text and "0755" in caplog.text
    caplog.clear()
    private_state_dir(tmp_path)  # already private: nothing to say
    assert caplog.records == []


def test_secret_set_in_a_state_dir_of_another_user_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from servekeeper.cli.main import app

    someone_else = os.stat(tmp_path).st_uid + 1
    monkeypatch.setattr(os, "geteuid", lambda: someone_else)
    result = CliRunner().invoke(app, ["secret", "set", "db", "k=-", "--state-dir", str(tmp_path)], input="v")
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())  # the console wraps at its width, wherever tmp_path ends
    assert str(tmp_path) in said and "owned by" in said, result.stderr
