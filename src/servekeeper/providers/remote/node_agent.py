"""The node agent: starts, watches and stops Ray nodes on a pool host, for servekeeper's SSH side.

servekeeper sends this file as text and runs it with the host's python (`python -c <source>
COMMAND`): the request is JSON on stdin, the answer one JSON line on stdout (the commands are in
COMMANDS below). It runs on a bare host Python (3.10 or newer) with the standard library only,
and reads Linux's /proc itself: no psutil, no servekeeper.

A node is found again by its session (the `ray start` launched here leads one of its own) and
by its tag: every process of a node inherits `SERVEKEEPER_NODE=<temp dir>` in its environment.
Ray's own processes that rename themselves (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`,
workers) overwrite what /proc shows of their environment: they are known by the files they hold
open under the node's temp dir (their logs), since they can outlive the `ray start` and raylet
that led their session (a raylet that lost its GCS exits, its agent may not).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

TAG = "SERVEKEEPER_NODE"  # servekeeper.providers.ssh_nodes.NODE_TAG_ENV (a test keeps them equal)
POLL_SECONDS = 0.1

Request = dict[str, Any]
Answer = dict[str, Any]


class UnsafePath(OSError):
    """A directory we would create or reuse that another user could control. An OSError, as one
    that cannot be made is: a caller that handles one (a start that fails) handles both."""


# -- private directories -------------------------------------------------------------------------------


def private_dir(path: str) -> None:
    """Make `path` (0700) and its missing parents, checking every component: ours (no symlink, not
    writable by group or others), or a system directory others cannot rename entries in (root's,
    or sticky as /tmp). Below the first of ours, everything must be ours: another user of a shared
    /tmp could have pre-created a directory or planted a symlink."""
    if not os.path.isabs(path):
        raise UnsafePath(f"{path} is not an absolute path")
    current = "/"
    ours_from_here = False
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            pass
        ours_from_here = _check_component(current, ours_from_here) or ours_from_here


def _check_component(path: str, must_be_ours: bool) -> bool:
    """Refuse `path` if another user could change what it leads to; True if it is ours."""
    info = os.lstat(path)
    me = os.geteuid()
    writable_by_others = bool(info.st_mode & 0o022)
    if not must_be_ours:
        # Above our own directories: a system one (root's) that others cannot rename in.
        system = info.st_uid == 0 and (stat.S_ISLNK(info.st_mode) or info.st_mode & stat.S_ISVTX)
        if system or (info.st_uid == 0 != me and not writable_by_others):
            return False
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePath(f"{path} is a symlink; refusing to follow it (remove it, or set another workDir)")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if info.st_uid != me:
        raise UnsafePath(
            f"{path} is owned by uid {info.st_uid}, not by us (uid {me}); remove it or set another workDir"
        )
    if writable_by_others:
        raise UnsafePath(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            "make it 0700 or set another workDir"
        )
    return True


def open_log(path: str) -> int:
    """The node's log, appended to, never through a symlink (O_NOFOLLOW), created 0600."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


# -- /proc -------------------------------------------------------------------------------------------


def stat_of(pid: int | str) -> tuple[str | None, int | None]:
    """A process's state letter and session id (None, None if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()  # after the command name, which may hold ")"
        return fields[0], int(fields[3])
    except (OSError, IndexError, ValueError):
        return None, None


def tagged(pid: int | str, marker: str) -> bool:
    """Does the process carry the node's tag (`SERVEKEEPER_NODE=<marker>`) in its environment?"""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return (TAG + "=" + marker).encode() in file.read().split(b"\0")
    except OSError:
        return False


def holds_files_under(pid: int | str, directory: str) -> bool:
    """Does the process hold a file open under `directory` (a node's temp dir: its logs)? By the
    resolved path too, as the kernel names it (a work dir reached through a symlink)."""
    prefixes = tuple({directory.rstrip("/") + "/", os.path.realpath(directory).rstrip("/") + "/"})
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for descriptor in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{descriptor}").startswith(prefixes):
                return True
        except OSError:
            continue
    return False


# The titles Ray gives its processes (agents and workers; the dashboard head's modules), which
# overwrite the environment /proc shows when they are longer than the original command line.
RAY_TITLES = (b"ray::", b"ray-dashboard-")


def renamed_by_ray(pid: int | str) -> bool:
    """Did Ray rename the process, perhaps overwriting its environment as /proc shows it?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read(32).startswith(RAY_TITLES)
    except OSError:
        return False


def is_node(pid: int, marker: str) -> bool:
    """Is `pid` a live process started with `--temp-dir=<marker>` (the node's `ray start`)?"""
    state, _ = stat_of(pid)
    if state is None or state == "Z":
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().split(b"\0")
    except OSError:
        return False
    return ("--temp-dir=" + marker).encode() in argv


def members(sid: int, marker: str) -> list[int]:
    """The node's live processes: those in session `sid`, and those that carry its tag (or,
    renamed by Ray, hold its files). The session counts only while it is provably the node's (its
    leader is our `ray start`, or a member carries our tag): a session id is a pid, and pids are reused."""
    in_session: list[int] = []
    by_tag: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        state, session = stat_of(entry)
        if state is None or state == "Z":
            continue
        if tagged(entry, marker) or (renamed_by_ray(entry) and holds_files_under(entry, marker)):
            by_tag.append(int(entry))
        elif session == sid:
            in_session.append(int(entry))
    if by_tag or is_node(sid, marker):
        return sorted(set(by_tag + in_session))
    return []


# -- signals -----------------------------------------------------------------------------------------


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(sid: int, marker: str, seconds: float) -> list[int]:
    """Wait up to `seconds` for the node's processes to end; those still alive."""
    deadline = time.monotonic() + seconds
    while True:
        alive = members(sid, marker)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_SECONDS)


def free(port: int) -> bool:
    """Can a listener bind `port` on every address of the host right now?"""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


# -- the commands ------------------------------------------------------------------------------------


def prepare(request: Request) -> Answer:
    """Make the directories (0700): a cluster's dir, a node's temp dir."""
    for directory in request["dirs"]:
        private_dir(directory)
    return {}


def launch(request: Request) -> Answer:
    """Start `argv` in a session of its own, its output appended to `log`; its pid and session."""
    env = dict(os.environ)
    env.update(request["env"])
    with os.fdopen(open_log(request["log"]), "ab") as log:
        child = subprocess.Popen(
            request["argv"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
            cwd=request["cwd"],
        )
    return {"pid": child.pid, "sid": os.getsid(child.pid)}


def alive(request: Request) -> Answer:
    return {
        "alive": is_node(request["pid"], request["marker"]),
        "members": len(members(request["sid"], request["marker"])),
    }


def leaders(request: Request) -> Answer:
    """The node's `ray start`s (tagged, leading their own session) when its launch was never
    recorded (a controller killed in between): one is adopted rather than started again."""
    marker = request["marker"]
    found = [int(e) for e in os.listdir("/proc") if e.isdigit() and stat_of(e)[1] == int(e) and tagged(e, marker)]
    return {"pids": [pid for pid in found if is_node(pid, marker)]}


def gcs_kept(request: Request) -> Answer:
    """Does a head's GCS storage still hold a session (Ray writes its name there at the first
    start)? A host that rebooted with its /tmp wiped answers no: the head must not be started
    again "in place" on an empty store, as a fresh cluster without the service's apps."""
    return {"kept": os.path.isfile(os.path.join(request["dir"], "session_name"))}


def tail(request: Request) -> Answer:
    """The last `bytes` bytes of a node's log (what it said before it exited), never through a symlink."""
    try:
        descriptor = os.open(request["log"], os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return {"tail": "", "error": f"{request['log']}: {exc.strerror}"}
    with os.fdopen(descriptor, "rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - int(request["bytes"])))
        return {"tail": log.read().decode(errors="replace")}


def stop(request: Request) -> Answer:
    """TERM the node's session (or its tagged processes), wait, KILL what is left, and verify;
    the pids that survived. The node's temp dir goes once nothing is left (its log stays)."""
    sid, marker = request["sid"], request["marker"]
    found = members(sid, marker)
    if is_node(sid, marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGTERM)  # `ray start` and the system processes in its group
    else:
        signal_all(found, signal.SIGTERM)
    still = wait_gone(sid, marker, request["term_grace"]) if found else []
    signal_all(still, signal.SIGKILL)
    left = wait_gone(sid, marker, request["kill_grace"]) if still else []
    if not left:
        shutil.rmtree(marker, ignore_errors=True)
    return {"left": left}


def forget(request: Request) -> Answer:
    """Remove a cluster's dir (token, logs) directly under the work dir, its nodes there stopped."""
    directory = request["dir"]
    if os.path.dirname(directory.rstrip("/")) == request["work_dir"].rstrip("/"):
        shutil.rmtree(directory, ignore_errors=True)
    return {}


def ports(request: Request) -> Answer:
    """`count` free ports from the bottom of [low, high], not `reserved`, and the start of a
    free block of `block` ports from the top (None if there is none)."""
    taken = set(request["reserved"])
    singles: list[int] = []
    for port in range(request["low"], request["high"] + 1):
        if len(singles) == request["count"]:
            break
        if port not in taken and free(port):
            singles.append(port)
    block = None
    size = request["block"]
    for start in range(request["high"] - size + 1, request["low"] - 1, -size):
        span = range(start, start + size)
        if not taken.intersection(span) and not set(singles).intersection(span) and all(free(p) for p in span):
            block = start
            break
    return {"ports": singles, "block": block}


def free_ports(request: Request) -> Answer:
    return {"free": list(filter(free, request["candidates"]))}


def hashes(request: Request) -> Answer:
    """The files of `dir` (made 0700 if missing) and their sha256, partial copies (`*.tmp`) left
    out: what the host already has of an environment's wheels."""
    directory = request["dir"]
    private_dir(directory)
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".tmp") or not os.path.isfile(path):
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        found[name] = digest.hexdigest()
    return {"files": found}


def interpreters(request: Request) -> Answer:
    """The host's Python interpreters by minor version ("3.11" -> path): the one this runs on
    (the pool's `python`), then `python3.N` beside it and on PATH, the first found of each."""
    found = {f"{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    directories = [os.path.dirname(sys.executable), *os.environ.get("PATH", "").split(os.pathsep)]
    for directory in [d for d in directories if d and os.path.isdir(d)]:
        try:
            names = sorted(os.listdir(directory))
        except OSError:  # a PATH entry this user cannot read
            continue
        for name in names:
            minor = name[len("python") :] if name.startswith("python3.") else ""
            path = os.path.join(directory, name)
            if minor.replace(".", "").isdigit() and minor.count(".") == 1 and os.access(path, os.X_OK):
                found.setdefault(minor, path)
    return {"interpreters": found}


COMMANDS: dict[str, Callable[[Request], Answer]] = {
    "prepare": prepare,
    "launch": launch,
    "alive": alive,
    "leaders": leaders,
    "gcs_kept": gcs_kept,
    "tail": tail,
    "stop": stop,
    "forget": forget,
    "ports": ports,
    "free": free_ports,
    "hashes": hashes,
    "interpreters": interpreters,
}


def run(command: str, request: Request) -> Answer:
    try:
        handler = COMMANDS[command]
    except KeyError:
        raise SystemExit(f"unknown command {command}") from None
    return handler(request)


def main(argv: Sequence[str] | None = None) -> None:
    """`node_agent COMMAND`, the request (JSON) on stdin; prints the answer as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit(f"usage: node_agent {{{','.join(COMMANDS)}}} < request.json")
    request = json.loads(sys.stdin.read() or "{}")
    try:
        answer = run(args[0], request)
    except UnsafePath as exc:
        raise SystemExit(f"node_agent {args[0]}: {exc}") from None  # the reason, on stderr
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
