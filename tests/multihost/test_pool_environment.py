"""Every cluster its own Ray on a host pool (issue 21): the fleet's hosts have Python and sshd and
no route out (no package index). A service on Ray 2.59.0, which the hosts lack, comes up: the
controller downloaded the wheels, copied them over SFTP and uv installed them offline on each
host; the nodes' processes run 2.59.0. A second service on the same environment copies nothing."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from servekeeper.providers.host_environments import HOST_ENVIRONMENTS, HOST_TOOLS, HOST_WHEELS
from servekeeper.testing.harness import HELLO_APP, Servekeeper, free_port, wait_until
from tests.fleet import Fleet, FleetHost
from tests.multihost.conftest import apply_yaml
from tests.multihost.test_service_on_fleet import tagged_pids
from tests.multihost.test_small_fleet_upgrade import node_dirs_of

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(900)]

POOL = "envpool"
RAY = "2.59.0"  # the version test_own_ray builds too: CI builds two environments in all


def spec(name: str, port: int, head_host: str, worker_host: str | None) -> dict[str, Any]:
    workers = [{"name": "cpu", "replicas": 1, "numCpus": 1, "host": worker_host}] if worker_host else []
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "ingress": {"port": port},
            "rayClusterConfig": {
                "hostPool": POOL,
                "rayVersion": RAY,
                "workingDir": str(HELLO_APP),
                "head": {"numCpus": 1, "host": head_host},
                "workerGroups": workers,
            },
            "serveConfig": {
                "applications": [
                    {"name": "hello", "route_prefix": "/", "import_path": "hello:app", "args": {"msg": name}}
                ]
            },
        },
    }


def ray_versions(pids: list[int]) -> dict[str, set[str]]:
    """The Ray release each system process runs, read from the `ray-<version>.dist-info` beside
    the package its binary lives in (<site-packages>/ray/core/src/ray/{gcs,raylet}/...)."""
    found: dict[str, set[str]] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name, exe = process.name(), process.exe()
        except psutil.Error:
            continue
        if name in ("gcs_server", "raylet"):
            site_packages = Path(exe).parents[5]
            versions = {p.name.removeprefix("ray-").removesuffix(".dist-info") for p in site_packages.glob("ray-*")}
            found.setdefault(name, set()).update(versions)
    return found


def copied_files(host: FleetHost) -> dict[str, tuple[int, int]]:
    """The wheels and tools on the host, each as (inode, mtime): a copy replaces both."""
    found = {}
    for folder in (HOST_WHEELS, HOST_TOOLS):
        for path in sorted((Path(host.work_dir) / folder).iterdir()):
            stat = path.stat()
            found[f"{folder}/{path.name}"] = (stat.st_ino, stat.st_mtime_ns)
    return found


def no_route_out(host: FleetHost) -> bool:
    probe = "import socket; socket.create_connection(('151.101.0.223', 443), timeout=3)"  # pypi.org
    return host.run("python3", "-c", probe, check=False).returncode != 0


def test_a_pool_cluster_on_a_ray_the_hosts_lack_comes_up_and_a_second_copies_nothing(
    pool_daemon: Servekeeper, fleet: Fleet
) -> None:
    daemon = pool_daemon
    first, second = fleet.hosts[0], fleet.hosts[1]
    assert importlib.metadata.version("ray") != RAY, "the hosts' python is the controller's: another Ray"
    assert no_route_out(first) and no_route_out(second), "the hosts reach no package index"
    apply_yaml(daemon, fleet.host_pool_document(POOL, cpus=2), "pool")

    port = free_port()
    apply_yaml(daemon, spec("envone", port, first.name, second.name), "envone")
    assert daemon.wait("envone", timeout=600) == 0, daemon.cli("events", "envone").stdout[-3000:]
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "envone"
    active = daemon.api_get("envone")["activeCluster"]
    pids = tagged_pids(node_dirs_of(daemon, active["name"]))
    assert ray_versions(pids) == {"gcs_server": {RAY}, "raylet": {RAY}}
    copies = {host.name: copied_files(host) for host in (first, second)}
    for host in (first, second):
        names = list(copies[host.name])
        assert any(name.startswith(f"{HOST_WHEELS}/ray-{RAY}-") for name in names), names
        assert any(name.startswith(f"{HOST_TOOLS}/uv-") for name in names), names
    for line in (daemon.state_dir / "controller.log").read_text().splitlines():
        if "servekeeper.providers.host_environments" in line:
            print(line)  # per host: the time taken, what was copied

    other = free_port()
    apply_yaml(daemon, spec("envtwo", other, second.name, first.name), "envtwo")
    assert daemon.wait("envtwo", timeout=300) == 0, daemon.cli("events", "envtwo").stdout[-3000:]
    assert httpx.get(f"http://127.0.0.1:{other}/", timeout=10).text == "envtwo"
    assert {host.name: copied_files(host) for host in (first, second)} == copies, "nothing copied again"

    for name in ("envone", "envtwo"):
        daemon.cli("delete", name)
    wait_until(lambda: not daemon.clusters(), 180, "both clusters stopped")
    # Nothing uses the environment now: it goes from each host, and so do its wheels.
    wait_until(lambda: not any(left_on(host) for host in (first, second)), 120, "the environment pruned on the hosts")


def left_on(host: FleetHost) -> list[str]:
    """The environments and wheels on the host."""
    folders = [Path(host.work_dir) / folder for folder in (HOST_ENVIRONMENTS, HOST_WHEELS)]
    return [path.name for folder in folders if folder.exists() for path in folder.iterdir()]
