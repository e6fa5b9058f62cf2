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

from servekeeper.testing.harness import Servekeeper
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
    own = f"{sys.version_info[0]}.{sys.version_info[1]}"  # the hosts' python is this run's
    assert checked.stdout.count("; interpreters ") == 3 and own in checked.stdout.split("; interpreters ")[1]


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


def test_ports_are_probed_on_each_host(fleet: Fleet) -> None:
    """A port busy on one host only is skipped where it must be free on all (Serve's proxy port),
    and still handed out on the others; `reserved` ports are never handed out."""
    import asyncio
    import subprocess

    from servekeeper.model.hostpool import parse_host_pool
    from servekeeper.providers.ports import PORT_LOW
    from servekeeper.providers.ssh_nodes import SshNodes

    busy = PORT_LOW  # the probe goes upward from here: the first it would pick
    listener = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            fleet.hosts[1].namespace,
            sys.executable,
            "-c",
            LISTEN,
            fleet.hosts[1].address,
            str(busy),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == b"listening"
        nodes = SshNodes(list(parse_host_pool(fleet.host_pool_document()).spec.hosts))

        async def allocate() -> tuple[list[int], list[int], list[int]]:
            try:
                on_host_1, _ = await nodes.allocate_ports("host-1", 2)
                on_host_2, _ = await nodes.allocate_ports("host-2", 2, reserved=[busy + 1])
                common = await nodes.ports_free_on_all(["host-1", "host-2", "host-3"], 2)
                return on_host_1, on_host_2, common
            finally:
                await nodes.close()

        on_host_1, on_host_2, common = asyncio.run(allocate())
    finally:
        listener.kill()
        listener.wait()
    assert on_host_1 == [busy, busy + 1]  # free there: another host's listener is another network
    assert busy not in on_host_2 and busy + 1 not in on_host_2
    assert busy not in common and len(set(common)) == 2


LISTEN = """
import socket, sys, time
server = socket.socket()
# An earlier test's node may have used the port: its closed connections linger in TIME_WAIT.
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen()
print("listening", flush=True)
time.sleep(60)
"""
