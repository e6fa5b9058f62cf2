"""Fixtures several unit test modules share (a module's own fixture of the same name wins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servekeeper.store.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A real SQLite store in the test's tmp_path."""
    store = Store(tmp_path / "store.db")
    yield store
    store.close()
