"""The node agent (providers/remote/node_agent.py) on this machine, without root or sshd: its /proc
reading and session logic on harmless processes, its commands, its argument parsing and output
protocol, and the file run standalone by the controller's python and by a bare Python 3.10."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servekeeper.model.hostpool import HostSpec
from servekeeper.providers.remote import node_agent, node_agent_source
from servekeeper.providers.ssh_nodes import NODE_TAG_ENV, SshNodes
from tests.unit.test_hostpool import host

PYTHON_310 = Path("/root/.pyenv/versions/3.10.13/bin/python3.10")
AGENT_FILE = Path(node_agent.__file__)

# Stands in for `ray start --block`: carries the node's --temp-dir in its argv and leaves a child
# (`sleep`) in its session, as the raylet and GCS are in a real node's.
STAND_IN = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    state, _ = node_agent.stat_of(pid)
    return state is None or state == "Z"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts itself; whatever is left is killed and reaped."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


@pytest.fixture
def launched() -> Iterator[list[int]]:
    """Pids the agent launched in this process: killed (their session) and reaped at the end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def stand_in_request(marker: str, log: Path) -> dict[str, Any]:
    return {
        "argv": [sys.executable, "-c", STAND_IN, f"--temp-dir={marker}"],
        "env": {NODE_TAG_ENV: marker},
        "log": str(log),
        "cwd": marker,
    }


def test_the_tag_is_the_one_the_controller_sets() -> None:
    assert node_agent.TAG == NODE_TAG_ENV


def test_launch_alive_and_stop_end_exactly_the_node(
    tmp_path: Path, launched: list[int], processes: list[subprocess.Popen[bytes]]
) -> None:
    marker = str(tmp_path / "node")
    assert node_agent.run("prepare", {"dirs": [marker]}) == {}
    answer = node_agent.run("launch", stand_in_request(marker, tmp_path / "node.log"))
    pid, sid = answer["pid"], answer["sid"]
    launched.append(pid)
    assert sid == pid  # a session of its own, led by the node
    wait_for(lambda: len(node_agent.members(sid, marker)) == 2)  # the stand-in and its sleep
    # Not the node: a process in a session of its own, untagged, and one tagged for another node.
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other_node = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, NODE_TAG_ENV: "other"})
    # The node's, though it left the session: tagged.
    straggler = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, NODE_TAG_ENV: marker})
    processes.extend([bystander, other_node, straggler])
    wait_for(lambda: node_agent.tagged(straggler.pid, marker))

    node = node_agent.members(sid, marker)
    assert straggler.pid in node and pid in node and len(node) == 3
    assert bystander.pid not in node and other_node.pid not in node
    assert node_agent.run("alive", {"pid": pid, "sid": sid, "marker": marker}) == {"alive": True, "members": 3}

    # TERM goes to the session; the straggler outside it is KILLed once the grace is over.
    assert node_agent.run("stop", {"sid": sid, "marker": marker, "term_grace": 1.0, "kill_grace": 5.0}) == {"left": []}
    assert all(gone(p) for p in node)
    assert straggler.wait(5) == -signal.SIGKILL
    assert bystander.poll() is None and other_node.poll() is None  # untouched
    assert node_agent.run("alive", {"pid": pid, "sid": sid, "marker": marker}) == {"alive": False, "members": 0}
    assert not Path(marker).exists() and (tmp_path / "node.log").exists()  # the temp dir goes, the log stays


def test_a_session_not_led_by_the_node_is_not_the_node(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """A session id is a pid, and pids are reused: a session whose leader is not the node's
    `ray start` and that holds none of its tagged processes is someone else's, and left alone."""
    marker = str(tmp_path / "node")
    Path(marker).mkdir()
    someone = subprocess.Popen(["sleep", "60"], start_new_session=True)
    processes.append(someone)
    wait_for(lambda: node_agent.stat_of(someone.pid)[1] == someone.pid)
    assert node_agent.members(someone.pid, marker) == []
    assert not node_agent.is_node(someone.pid, marker)
    answer = node_agent.run("stop", {"sid": someone.pid, "marker": marker, "term_grace": 0.2, "kill_grace": 0.2})
    assert answer == {"left": []}
    assert someone.poll() is None
    assert not Path(marker).exists()  # nothing of the node is left, so its temp dir goes


def test_a_process_ray_renamed_is_known_by_the_files_it_holds_once_its_session_leader_is_gone(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Ray's agents and workers rename themselves (`ray::DashboardAgent`), which overwrites the
    environment /proc shows, tag included; one outlived its raylet and `ray start` on a fleet
    host (a CI run). Holding its log open under the node's temp dir makes it the node's; a
    renamed process holding another node's files is left alone."""
    marker, elsewhere = tmp_path / "node", tmp_path / "other-node"
    marker.mkdir()
    elsewhere.mkdir()

    def renamed(log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:  # no tag in its environment, as /proc shows a renamed one
            return subprocess.Popen(
                ["bash", "-c", 'exec -a "ray::DashboardAgent" sleep 60'],
                stdout=out,
                start_new_session=True,
                env={"PATH": os.environ["PATH"]},
            )

    orphan, bystander = renamed(marker / "dashboard_agent.log"), renamed(elsewhere / "dashboard_agent.log")
    processes.extend([orphan, bystander])
    wait_for(lambda: node_agent.renamed_by_ray(orphan.pid) and node_agent.renamed_by_ray(bystander.pid))
    assert not node_agent.tagged(orphan.pid, str(marker))
    gone_leader = 2**22 + 7  # the session's leader (`ray start`) exited: a pid nothing has
    assert node_agent.members(gone_leader, str(marker)) == [orphan.pid]
    answer = node_agent.run("stop", {"sid": gone_leader, "marker": str(marker), "term_grace": 1.0, "kill_grace": 5.0})
    assert answer == {"left": []}
    assert orphan.wait(5) == -signal.SIGTERM
    assert bystander.poll() is None  # another node's


def test_a_dashboard_module_reached_through_a_symlinked_work_dir_is_the_nodes(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """The dashboard head's modules take titles of their own (`ray-dashboard-NodeHead-0 (...)`),
    and /proc names open files by their resolved path: a work dir reached through a symlink."""
    real = tmp_path / "real-work-dir"
    (real / "node").mkdir(parents=True)
    (tmp_path / "work-dir").symlink_to(real)
    marker = str(tmp_path / "work-dir" / "node")
    with (real / "node" / "dashboard.log").open("wb") as log:
        module = subprocess.Popen(
            ["bash", "-c", 'exec -a "ray-dashboard-NodeHead-0 (python)" sleep 60'],
            stdout=log,
            start_new_session=True,
            env={"PATH": os.environ["PATH"]},
        )
    processes.append(module)
    wait_for(lambda: node_agent.renamed_by_ray(module.pid))
    assert node_agent.holds_files_under(module.pid, marker)
    assert node_agent.members(2**22 + 7, marker) == [module.pid]


def test_stat_reads_past_a_command_name_with_parentheses_and_spaces(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    odd = tmp_path / "sl) e p"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", odd)
    process = subprocess.Popen([str(odd), "60"], start_new_session=True)
    processes.append(process)
    wait_for(lambda: node_agent.stat_of(process.pid)[1] == process.pid)
    state, session = node_agent.stat_of(process.pid)
    assert state in {"S", "R"} and session == process.pid
    by_text = node_agent.stat_of(str(process.pid))  # a pid as text reads the same process
    assert by_text[0] in {"S", "R"} and by_text[1] == session  # (its state may change between reads)


def test_a_process_that_is_gone_reads_as_nothing() -> None:
    process = subprocess.Popen(["true"])
    process.wait()
    assert node_agent.stat_of(process.pid) == (None, None)
    assert not node_agent.tagged(process.pid, "x")
    assert not node_agent.is_node(process.pid, "x")
    assert node_agent.stat_of("self")[0] == "R"  # /proc/self: this process, running


def test_prepare_makes_private_dirs(tmp_path: Path) -> None:
    target = tmp_path / "work" / "cluster" / "node"
    assert node_agent.run("prepare", {"dirs": [str(target)]}) == {}
    assert stat.S_IMODE(target.stat().st_mode) == 0o700 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_forget_removes_only_a_cluster_dir_directly_under_the_work_dir(tmp_path: Path) -> None:
    work = tmp_path / "work"
    cluster = work / "svc-1"
    deeper = work / "svc-2" / "inner"
    for directory in (cluster, deeper):
        directory.mkdir(parents=True)
    assert node_agent.run("forget", {"dir": f"{cluster}/", "work_dir": f"{work}/"}) == {}
    assert node_agent.run("forget", {"dir": str(deeper), "work_dir": str(work)}) == {}
    assert node_agent.run("forget", {"dir": str(tmp_path), "work_dir": str(work)}) == {}
    assert not cluster.exists() and deeper.exists() and work.exists()


def test_ports_skip_what_is_bound_or_reserved_and_keep_the_block_apart() -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        busy = held.getsockname()[1]
        low, high = busy - 2, busy + 40
        request = {"count": 4, "block": 8, "reserved": [busy - 1], "low": low, "high": high}
        answer = node_agent.run("ports", request)
        singles, block = answer["ports"], answer["block"]
        assert len(singles) <= 4 and busy not in singles and busy - 1 not in singles
        assert all(low <= port <= high for port in singles)
        if block is not None:
            span = range(block, block + 8)
            assert low <= block and block + 7 <= high
            assert busy not in span and busy - 1 not in span and not set(singles) & set(span)
        assert node_agent.run("free", {"candidates": [busy, *singles]}) == {"free": singles}
        assert not node_agent.free(busy)


def test_no_block_fits_in_a_range_smaller_than_a_block() -> None:
    answer = node_agent.run("ports", {"count": 0, "block": 8, "reserved": [], "low": 40000, "high": 40005})
    assert answer == {"ports": [], "block": None}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            [],
            "usage: node_agent {prepare,launch,alive,leaders,gcs_kept,tail,stop,forget,ports,free,hashes,interpreters}"
            " < request.json",
            id="no-command",
        ),
        pytest.param(["reboot"], "unknown command reboot", id="unknown"),
    ],
)
def test_a_bad_command_exits_with_a_message(monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("{}"))
    with pytest.raises(SystemExit) as exited:
        node_agent.main(argv)
    assert str(exited.value.code) == message


def test_the_answer_is_one_json_line_on_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "argv", ["-c", "prepare"])  # as `python -c <source> prepare` sets it
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"dirs": [str(tmp_path / "d")]})))
    node_agent.main()
    assert capsys.readouterr().out == "{}\n"
    assert (tmp_path / "d").is_dir()


def test_the_agent_needs_nothing_but_the_standard_library() -> None:
    tree = ast.parse(node_agent_source())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert modules and all(name.split(".")[0] in sys.stdlib_module_names for name in modules), modules


def test_the_source_sent_to_hosts_is_the_module_file() -> None:
    assert node_agent_source() == AGENT_FILE.read_text(encoding="utf-8")


def agent_call(python: str, how: list[str], command: str, request: dict[str, Any], cwd: Path) -> Any:
    """Run the agent as the controller does on a host: isolated (-I: no servekeeper, no
    PYTHONPATH, no site dir of the user), the request on stdin, the answer on the last line."""
    result = subprocess.run(
        [python, "-I", *how, command], input=json.dumps(request), capture_output=True, text=True, timeout=60, cwd=cwd
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "python",
    [
        pytest.param(sys.executable, id="controller-python"),
        pytest.param(
            str(PYTHON_310),
            id="python3.10",
            marks=pytest.mark.skipif(not PYTHON_310.exists(), reason="no Python 3.10 at " + str(PYTHON_310)),
        ),
    ],
)
@pytest.mark.parametrize("how", ["-c", "file"])
def test_the_agent_runs_standalone(python: str, how: str, tmp_path: Path) -> None:
    invocation = ["-c", node_agent_source()] if how == "-c" else [str(AGENT_FILE)]
    marker = str(tmp_path / "node")

    def call(command: str, request: dict[str, Any]) -> Any:
        return agent_call(python, invocation, command, request, tmp_path)

    assert call("prepare", {"dirs": [marker]}) == {}
    started = call("launch", stand_in_request(marker, tmp_path / "node.log"))
    pid, sid = started["pid"], started["sid"]
    try:
        assert sid == pid
        wait_for(lambda: call("alive", {"pid": pid, "sid": sid, "marker": marker}) == {"alive": True, "members": 2})
        assert call("stop", {"sid": sid, "marker": marker, "term_grace": 5.0, "kill_grace": 5.0}) == {"left": []}
        assert call("alive", {"pid": pid, "sid": sid, "marker": marker}) == {"alive": False, "members": 0}
        assert not Path(marker).exists()
    finally:
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert call("free", {"candidates": []}) == {"free": []}
    unknown = subprocess.run(
        [python, "-I", *invocation, "reboot"], input="{}", capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert unknown.returncode == 1 and "unknown command reboot" in unknown.stderr and unknown.stdout == ""


class LocalShell:
    """An open asyncssh connection whose commands run here, as sshd runs them: the command
    line, one string, through the login shell (`sh -c`)."""

    @dataclass
    class Completed:
        exit_status: int | None
        stdout: str
        stderr: str

    def is_closed(self) -> bool:
        return False

    async def run(self, command: str, *, input: str | None, timeout: float, check: bool, encoding: str) -> Completed:
        process = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await asyncio.wait_for(process.communicate((input or "").encode(encoding)), timeout)
        return self.Completed(process.returncode, out.decode(encoding), err.decode(encoding))


async def test_the_controller_side_drives_the_agent_through_a_shell(tmp_path: Path) -> None:
    """SshNodes, with its connection's commands run by a local shell: the agent's text quoted
    into one command line, its requests and answers, a node started, seen and stopped."""
    spec = HostSpec.model_validate({**host("here", "127.0.0.1"), "python": sys.executable})
    nodes = SshNodes([spec])
    nodes.connection("here")._connection = LocalShell()  # type: ignore[assignment]
    marker = str(tmp_path / "node")
    ports, _ = await nodes.node_ports("here")
    request = stand_in_request(marker, tmp_path / "node.log")
    node = await nodes.start_node("here", "worker", request["argv"], marker, ports, str(tmp_path / "token"))
    try:
        assert node.session_id == node.pid and node.log_path == f"{marker}.log" and Path(marker).is_dir()
        assert await nodes.alive(node)
        assert await nodes.stop(node) == []
        assert not await nodes.alive(node)
    finally:
        try:
            os.killpg(node.session_id, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_leaders_finds_the_unrecorded_ray_starts_of_a_node_and_nothing_else(
    tmp_path: Path, launched: list[int], processes: list[subprocess.Popen[bytes]]
) -> None:
    marker = str(tmp_path / "node")
    node_agent.run("prepare", {"dirs": [marker]})
    assert node_agent.run("leaders", {"marker": marker}) == {"pids": []}, "nothing runs yet"
    # Tagged but not a `ray start` of the node (no --temp-dir), and a `ray start` of another node.
    stray = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, NODE_TAG_ENV: marker})
    other = str(tmp_path / "other")
    node_agent.run("prepare", {"dirs": [other]})
    processes.append(stray)
    launched.append(node_agent.run("launch", stand_in_request(other, tmp_path / "other.log"))["pid"])
    wait_for(lambda: node_agent.tagged(stray.pid, marker))
    assert node_agent.run("leaders", {"marker": marker}) == {"pids": []}
    pid = node_agent.run("launch", stand_in_request(marker, tmp_path / "node.log"))["pid"]
    launched.append(pid)
    wait_for(lambda: len(node_agent.members(pid, marker)) >= 2)  # its child (the sleep) is no leader
    wait_for(lambda: node_agent.run("leaders", {"marker": marker}) == {"pids": [pid]})
    second = node_agent.run("launch", stand_in_request(marker, tmp_path / "node.log"))["pid"]
    launched.append(second)
    both = {"pids": sorted([pid, second])}  # to be told apart: neither is adopted
    wait_for(lambda: node_agent.run("leaders", {"marker": marker}) == both)


def test_gcs_kept_says_whether_a_head_storage_still_holds_its_session(tmp_path: Path) -> None:
    storage = tmp_path / "n0.gcs"
    assert node_agent.run("gcs_kept", {"dir": str(storage)}) == {"kept": False}, "never written, or wiped"
    storage.mkdir()
    (storage / "session_name").write_text("session_2026-12-01_20-00-00_000000_1")
    assert node_agent.run("gcs_kept", {"dir": str(storage)}) == {"kept": True}


def test_hashes_lists_what_a_host_has_by_sha256_and_leaves_partial_copies_out(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    assert node_agent.hashes({"dir": str(wheels)}) == {"files": {}}, "made when missing"
    assert stat.S_IMODE(wheels.stat().st_mode) == 0o700
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"wheel")
    (wheels / "b-1.0-py3-none-any.whl.1a2b.tmp").write_bytes(b"half")
    files = node_agent.hashes({"dir": str(wheels)})["files"]
    assert list(files) == ["a-1.0-py3-none-any.whl"]
    assert files["a-1.0-py3-none-any.whl"] == hashlib.sha256(b"wheel").hexdigest()


def test_interpreters_are_the_agents_own_then_python3_n_beside_it_and_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("python3.9", "python3.99", "python3", "python3.12-config", "python3.13"):
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "python3.14").write_text("")  # not executable
    monkeypatch.setenv("PATH", str(tmp_path))
    found = node_agent.interpreters({})["interpreters"]
    own = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert found[own] == sys.executable
    assert {k: v for k, v in found.items() if v.startswith(str(tmp_path))} == {
        minor: str(tmp_path / f"python{minor}") for minor in ("3.9", "3.99", "3.13") if minor != own
    }
