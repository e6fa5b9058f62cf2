"""Host pools through the CLI and a real daemon, against the fleet's sshd hosts: stored with
`apply -f`, listed with reachability and Ray version, checked against the controller's Python
and Ray (a host with another Ray is refused by name, with both versions), host keys verified
(an unknown key is refused, never accepted)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servekeeper.testing import Servekeeper
from tests.fleet import Fleet

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(180)]

FAKE_RAY = "2.59.0"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servekeeper]:
    import tempfile

    harness = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("hosts"))
    harness.up()
    try:
        yield harness
    finally:
        leftovers = harness.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def _apply(daemon: Servekeeper, document: dict[str, Any], name: str) -> Any:
    path = daemon.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return daemon.cli("apply", "-f", str(path), check=False)


def _fake_python(directory: Path) -> Path:
    """A python whose `ray` is another version: a ray dist-info ahead on its path."""
    site = directory / "fake-site"
    dist_info = site / f"ray-{FAKE_RAY}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ray\nVersion: {FAKE_RAY}\n")
    python = directory / "python-other-ray"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def test_apply_lists_and_checks_the_fleet(daemon: Servekeeper, fleet: Fleet) -> None:
    applied = _apply(daemon, fleet.host_pool_document("fleet"), "fleet")
    assert applied.returncode == 0, applied.stderr
    assert "hostpool/fleet configured" in applied.stdout
    assert "hostpool/fleet unchanged" in _apply(daemon, fleet.host_pool_document("fleet"), "fleet").stdout

    listed = daemon.cli("hosts")
    for host in fleet.hosts:
        line = next(line for line in listed.stdout.splitlines() if f" {host.name} " in line)
        assert host.address in line and " ok " in line and "2.60.0" in line, listed.stdout
    assert daemon.cli("hosts", "fleet").stdout.count("fleet") == 3

    checked = daemon.cli("hosts", "check", "fleet", check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "hostpool/fleet: all 3 hosts match the controller" in checked.stdout


def test_a_host_with_another_ray_is_refused_by_name(daemon: Servekeeper, fleet: Fleet, tmp_path: Path) -> None:
    document = fleet.host_pool_document("skewed")
    document["spec"]["hosts"][1]["python"] = str(_fake_python(tmp_path))
    assert _apply(daemon, document, "skewed").returncode == 0
    checked = daemon.cli("hosts", "check", "skewed", check=False)
    assert checked.returncode == 1
    message = " ".join(checked.stderr.split())  # rich may wrap long lines
    assert f"host host-2 has Ray {FAKE_RAY} (the controller has Ray 2.60.0)" in message, checked.stderr
    assert "1 of 3 hosts refused: host-2" in message
    assert "host-1" in checked.stdout and "host-3" in checked.stdout  # the others pass


def test_an_unknown_host_key_is_refused(daemon: Servekeeper, fleet: Fleet, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    lines = fleet.known_hosts.read_text().splitlines()
    known_hosts.write_text("\n".join(line for line in lines if not line.startswith(fleet.hosts[2].address)) + "\n")
    document = copy.deepcopy(fleet.host_pool_document("stranger"))
    for host in document["spec"]["hosts"]:
        host["ssh"]["knownHostsFile"] = str(known_hosts)
    assert _apply(daemon, document, "stranger").returncode == 0
    checked = daemon.cli("hosts", "check", "stranger", check=False)
    assert checked.returncode == 1
    message = " ".join(checked.stderr.split())
    assert f"host host-3 ({fleet.hosts[2].address}:22): its host key is not the one in {known_hosts}" in message
    assert "refused" in message and "1 of 3 hosts refused: host-3" in message


def test_an_invalid_pool_is_refused_with_field_paths(daemon: Servekeeper, fleet: Fleet) -> None:
    document = fleet.host_pool_document("broken")
    document["spec"]["hosts"][0]["ssh"]["port"] = 70000
    document["spec"]["hosts"][2]["python"] = "python3"
    refused = _apply(daemon, document, "broken")
    assert refused.returncode == 1
    assert "spec.hosts.0.ssh.port" in refused.stderr and "spec.hosts.2.python" in refused.stderr
    assert daemon.cli("hosts", "broken", check=False).returncode == 1  # nothing stored
