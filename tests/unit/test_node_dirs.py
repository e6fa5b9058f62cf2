"""Issue 19, item 7: a node's directories and log in a shared /tmp. Another user of a pool host
(or of this machine) can pre-create the work dir or plant symlinks; every component we create
or reuse must be ours, not writable by others, and not a symlink, and the node log is never
opened through a symlink. The default work dir is per user."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from servekeeper.model.hostpool import MAX_WORK_DIR_LENGTH, parse_host_pool
from servekeeper.model.records import ClusterRecord
from servekeeper.providers.local_processes import private_temp_dir
from servekeeper.providers.remote import node_agent
from tests.unit.test_controller import World, make_spec, world
from tests.unit.test_hostpool import VALID, host

__all__ = ["world"]  # the fixture, imported for pytest

NOBODY = 65534


def test_the_default_work_dir_is_per_user() -> None:
    document = {**VALID, "spec": {"hosts": [host("a", "10.0.0.11")]}}
    assert parse_host_pool(document).spec.hosts[0].workDir == "/tmp/servekeeper-ray"
    long_user = "u" * 32
    document["spec"]["hosts"][0]["ssh"]["user"] = long_user
    work_dir = parse_host_pool(document).spec.hosts[0].workDir
    assert work_dir.startswith("/tmp/") and len(work_dir) <= MAX_WORK_DIR_LENGTH
    other = {
        **VALID,
        "spec": {"hosts": [dict(host("a", "10.0.0.11"), ssh={**host("a", "x")["ssh"], "user": "u" * 31})]},
    }
    assert parse_host_pool(other).spec.hosts[0].workDir != work_dir


def refused(directory: Path) -> str:
    with pytest.raises(node_agent.UnsafePath) as caught:
        node_agent.run("prepare", {"dirs": [str(directory / "cluster" / "node")]})
    return str(caught.value)


def test_a_work_dir_owned_by_another_user_is_refused_by_name(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    os.chown(work, NOBODY, NOBODY)
    assert str(work) in refused(work) and "owned by uid 65534" in refused(work)
    assert "set another workDir" in refused(work)  # a predictable default pre-created: what to do
    assert not (work / "cluster").exists()


def test_a_world_or_group_writable_work_dir_is_refused_by_name(tmp_path: Path) -> None:
    for mode in (0o777, 0o770):
        work = tmp_path / f"work-{mode:o}"
        work.mkdir()
        os.chmod(work, mode)
        assert str(work) in refused(work) and "writable" in refused(work)


def test_a_symlinked_component_is_refused_by_name(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    work = tmp_path / "work"
    work.symlink_to(elsewhere)
    assert str(work) in refused(work) and "symlink" in refused(work)
    assert not (elsewhere / "cluster").exists()


def test_an_existing_private_dir_of_ours_is_reused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    target = work / "cluster" / "node"
    assert node_agent.run("prepare", {"dirs": [str(target)]}) == {}
    assert node_agent.run("prepare", {"dirs": [str(target)]}) == {}
    assert stat.S_IMODE(target.stat().st_mode) & 0o077 == 0


def test_the_agent_exits_with_the_reason_on_an_unsafe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    os.chmod(work, 0o777)
    monkeypatch.setattr("sys.stdin", io.StringIO(f'{{"dirs": ["{work}/c"]}}'))
    with pytest.raises(SystemExit) as caught:
        node_agent.main(["prepare"])
    assert str(work) in str(caught.value.code)


def test_a_symlinked_node_log_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "node.log"
    log.symlink_to(victim)
    request = {"argv": ["true"], "env": {}, "log": str(log), "cwd": str(tmp_path)}
    with pytest.raises(OSError):
        node_agent.run("launch", request)
    assert victim.read_text() == "precious\n"


def test_the_local_provider_refuses_an_unsafe_temp_dir(tmp_path: Path) -> None:
    planted = tmp_path / "sk-planted"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(node_agent.UnsafePath, match=str(planted)):
        private_temp_dir(str(planted))
    fresh = tmp_path / "sk-fresh"
    private_temp_dir(str(fresh))
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


async def test_a_head_start_refused_for_an_unsafe_path_fails_the_cluster_naming_the_path(
    world: World, tmp_path: Path
) -> None:
    """UnsafePath is an OSError: from a provider's start_head it becomes the cluster's
    StartFailed (its rollout fails saying which path), not an error out of the tick."""
    planted = tmp_path / "sk-planted"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)

    def make_temp_dir(cluster: ClusterRecord) -> None:  # as LocalProvider.start_head does first
        private_temp_dir(str(planted / cluster.name))

    world.provider.before_start_head = make_temp_dir
    world.apply(make_spec())
    await world.tick()
    [cluster] = world.clusters()
    assert (cluster.failure_reason or "").startswith(f"StartFailed: {planted} is owned by uid {NOBODY}")
    assert isinstance(node_agent.UnsafePath("x"), OSError)
