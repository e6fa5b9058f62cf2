"""The processes of this machine's clusters, found by what marks them as ours: the session of
each node (its `ray start` is the session leader, `setsid`), its temp dir, or the owner tag in
its environment; and where a node's temp dir goes, kept private. Never `ray stop`: it kills
every cluster on the machine."""

from __future__ import annotations

import contextlib
import os
import stat

import psutil

from servekeeper.model.records import ClusterRecord
from servekeeper.providers.local_nodes import NODE_TAG_ENV, processes_tagged
from servekeeper.providers.remote.node_agent import UnsafePath, holds_files_under, private_dir

OWNER_ENV = "SERVEKEEPER_CLUSTER_LOG_DIR"


def tagged_processes(prefix: str) -> list[psutil.Process]:
    """Live processes whose owner tag starts with `prefix` (a cluster's log dir, or a state dir)."""
    below = prefix.rstrip("/") + "/"
    return processes_tagged(OWNER_ENV, lambda tag: tag == prefix or tag.startswith(below))


def session_members(session_ids: tuple[int, ...]) -> list[psutil.Process]:
    """Live (non-zombie) processes in any of the given sessions."""
    wanted = set(session_ids)
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getsid(process.pid) in wanted:
                members.append(process)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def is_our_node(pid: int, temp_dir: str) -> bool:
    """Guards against pid reuse: the pid must still be a `ray start` of this cluster."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return f"--temp-dir={temp_dir}" in process.cmdline()
    except psutil.Error:
        return False


def unrecorded_leader(tag: str, temp_dir: str) -> int | None:
    """The `ray start` of a node that runs with no pid on record (a controller killed between
    spawning it and recording it): the process carrying the node's tag that leads its own
    session and is a `ray start` of this cluster. None when there is none, or more than one
    (stopped by their tag instead). Blocks: run it in a worker thread."""
    found = []
    for process in processes_tagged(NODE_TAG_ENV, tag.__eq__):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == process.pid and is_our_node(process.pid, temp_dir):
                found.append(process.pid)
    return found[0] if len(found) == 1 else None


def local_temp_dir(name: str, uid: int | None = None) -> str:
    """Where a local cluster's nodes keep their Ray temp dir: in a parent of this user's that
    stays 0700 (private_temp_dir), because `ray start` makes the temp dir itself, and the
    session, sockets and logs dirs under it, mode 0777. Short on purpose: Ray's unix socket
    paths under it (<temp>/session_<date>_<pid>/sockets/dash_TaskEventsHead) must stay below
    107 bytes, with room for any uid."""
    return f"/tmp/sk-{os.geteuid() if uid is None else uid}/{name}"


def private_temp_dir(temp_dir: str) -> None:
    """A node's temp dir (Ray keeps unix sockets there): made 0700, and refused (UnsafePath,
    naming it) if another user made it or a component first, or planted a symlink. A parent of
    ours must also be closed to others: Ray opens the temp dir itself to everyone."""
    private_dir(temp_dir)
    parent = os.path.dirname(temp_dir.rstrip("/"))
    info = os.lstat(parent)
    if info.st_uid == os.geteuid() and not info.st_mode & stat.S_ISVTX and info.st_mode & 0o077:
        # (A sticky one is a shared /tmp: a record from before the per-user parent.)
        raise UnsafePath(
            f"{parent} is open to other users (mode {stat.S_IMODE(info.st_mode):o}) and Ray makes "
            f"{temp_dir} world-writable: make {parent} 0700"
        )


def alive_members(sessions: tuple[int, ...], log_dir: str) -> list[int]:
    alive = [process.pid for process in session_members(sessions)]
    return alive or [process.pid for process in tagged_processes(log_dir)]


def kill_all(sessions: tuple[int, ...], log_dir: str) -> None:
    for process in session_members(sessions) + tagged_processes(log_dir):
        with contextlib.suppress(psutil.Error):
            process.kill()


def our_sessions(cluster: ClusterRecord) -> tuple[int, ...]:
    return tuple(pid for pid in cluster.session_ids if session_is_ours(pid, cluster.temp_dir, cluster.log_dir))


def session_is_ours(session_id: int, temp_dir: str, log_dir: str) -> bool:
    """A recorded session id may have been reused by an unrelated session after a reboot.

    It is ours if its leader is still our `ray start`, or if any live member of the session
    names our temp dir, carries our owner tag, or holds a file open under our temp dir (the
    leader is gone but its children linger; actor workers rename themselves,
    "ray::ServeReplica:...", hiding the temp dir, and `ray::DashboardAgent` hides its environment
    too, but each keeps its logs open there, so another cluster's processes are never taken for ours).
    """
    if is_our_node(session_id, temp_dir):
        return True
    for process in session_members((session_id,)):
        # psutil raises a bare OSError too when a process exits as its files are read
        with contextlib.suppress(psutil.Error, OSError):
            if any(temp_dir in part for part in process.cmdline()):
                return True
            if process.environ().get(OWNER_ENV) == log_dir:
                return True
            if holds_files_under(process.pid, temp_dir):
                return True
    return False
