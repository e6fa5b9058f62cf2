from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servekeeper.testing.harness import Servekeeper
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


@pytest.fixture(scope="module")
def pool_daemon(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servekeeper]:
    """A daemon of its own for a test module on the fleet; at its end nothing may be left running,
    here or on any host."""
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("daemon"))
    sk.up()
    try:
        yield sk
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"
        on_hosts = fleet.leftovers_described()
        assert not on_hosts, f"left on the hosts: {on_hosts}"


def apply_yaml(sk: Servekeeper, document: dict[str, Any], label: str) -> None:
    """`servekeeper apply -f` of `document`, written to the daemon's work dir as `label`.yaml."""
    path = sk.workdir / f"{label}.yaml"
    path.write_text(yaml.safe_dump(document))
    sk.cli("apply", "-f", str(path))
