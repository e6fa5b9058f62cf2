"""A local cluster's Ray temp dir (issue 19, item 7 follow-up).

`ray start --temp-dir` makes that dir, and the session, sockets and logs dirs under it, mode
0777 (ray/_common/utils.py `try_to_create_directory`). Directly in /tmp, that opens Ray's unix
sockets and session logs to every local user: the temp dir lives under a per-user parent kept
0700, which Ray never touches. And it stays short: a unix socket path is limited to 107 bytes,
and Ray nests its sockets under it."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from servekeeper.providers.local_processes import local_temp_dir, private_temp_dir
from servekeeper.providers.remote.node_agent import UnsafePath
from tests.unit.test_controller import World, make_spec, world

__all__ = ["world"]  # the fixture, imported for pytest

MAX_UNIX_SOCKET_PATH = 107  # sun_path is 108 bytes with its NUL (Ray's validate_socket_filepath)
# Ray's session dir is session_<date with microseconds>_<pid of `ray start`> (pid_max up to 2**22).
LONGEST_SESSION = "session_9999-12-31_23-59-59_999999_4194304"
# Ray's unix sockets in <session>/sockets: the dashboard modules' (dash_<module class>, the
# longest TaskEventsHead), and each node's raylet / plasma_store (.N for the N-th node sharing it).
LONGEST_SOCKETS = ("dash_TaskEventsHead", "plasma_store.99", "raylet.99")
LARGEST_UID = 2**32 - 2


async def created_temp_dir(world: World) -> str:
    world.apply(make_spec())
    await world.tick()
    await world.background_settled()
    [cluster] = world.clusters()
    return cluster.temp_dir


async def test_a_local_clusters_temp_dir_has_a_private_parent_that_ray_does_not_open(world: World) -> None:
    temp_dir = Path(await created_temp_dir(world))
    assert str(temp_dir) == local_temp_dir(temp_dir.name)  # the executor names it so
    parent = temp_dir.parent
    assert parent != Path("/tmp")
    try:
        private_temp_dir(str(temp_dir))
        os.chmod(temp_dir, 0o777)  # what `ray start` does to it
        info = parent.lstat()
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o700  # nobody else reaches the open dir below
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


async def test_the_longest_ray_socket_path_under_a_local_temp_dir_fits(world: World) -> None:
    name = Path(await created_temp_dir(world)).name
    for uid in (0, os.geteuid(), LARGEST_UID):
        for socket in LONGEST_SOCKETS:
            path = f"{local_temp_dir(name, uid)}/{LONGEST_SESSION}/sockets/{socket}"
            assert len(path.encode()) <= MAX_UNIX_SOCKET_PATH, path


def test_a_temp_dir_parent_of_ours_open_to_others_is_refused_naming_it(tmp_path: Path) -> None:
    parent = tmp_path / "sk-open"
    parent.mkdir(mode=0o755)
    parent.chmod(0o755)
    with pytest.raises(UnsafePath, match=f"{parent}.*0700"):
        private_temp_dir(str(parent / "leaf"))
    parent.chmod(0o700)
    private_temp_dir(str(parent / "leaf"))
    assert stat.S_IMODE((parent / "leaf").stat().st_mode) == 0o700
