"""Issue 19, item 5: the state dir and what is in it are the owner's only, also after an upgrade
from a version that left them readable by everyone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from servekeeper.rayapi.package import build_package
from servekeeper.store.secrets import secrets_dir, set_secret
from servekeeper.store.store import Store, private_state_dir


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
