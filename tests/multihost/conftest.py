from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet import Fleet, fleet_of, fleet_unavailable_reason


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    """Three hosts (network namespaces on a bridge, each with its own sshd), shared by the
    multihost tests and torn down at the end, even after a failure."""
    reason = fleet_unavailable_reason()
    if reason is not None:
        pytest.fail(f"no fleet on this machine: {reason}")
    # Short path: hosts' work dirs and sshd files live here.
    with fleet_of(Path(tempfile.mkdtemp(prefix="skfleet-"))) as built:
        yield built
