from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from servekeeper.testing.harness import Servekeeper


@pytest.fixture
def sk(tmp_path: Path) -> Iterator[Servekeeper]:
    """A fresh state dir with its own daemon; at the end, `down` must leave no process behind."""
    # Short path: Ray's unix sockets live under cluster temp dirs, and logs under the state dir.
    state_dir = Path(tempfile.mkdtemp(prefix="skstate-"))
    harness = Servekeeper(state_dir, tmp_path)
    try:
        yield harness
    finally:
        leftovers = harness.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"
