"""A node that exits says why: the last lines of its log, bounded, for the event an operator
reads (issue 19, item 0), from a local node's log and from a pool host's node agent."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from servekeeper.model.hostpool import HostSpec
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.node_argv import RemoteNode
from servekeeper.providers.node_log import LAST_CHARS, last_lines
from servekeeper.providers.remote import node_agent
from servekeeper.providers.ssh_nodes import SshNodes
from tests.unit.test_hostpool import host
from tests.unit.test_node_agent import LocalShell
from tests.unit.test_pool_clusters import draft, pool_spec
from tests.unit.test_ssh import PORTS

LOG = "starting\n\n" + "".join(f"step {i}\n" for i in range(10)) + "ValueError: bad port\nray start exited\n"


def test_last_lines_are_the_last_five_non_empty_ones_cut_to_their_last_characters() -> None:
    assert last_lines(LOG) == "step 7 | step 8 | step 9 | ValueError: bad port | ray start exited"
    long = last_lines("a" * 5000 + "\nthe cause")
    assert len(long) == LAST_CHARS and long.startswith("...") and long.endswith("the cause")
    assert last_lines("\n \n") == "empty log"
    hidden = last_lines("token=abcdef123456 port=8265\n", hide=["abcdef", "abcdef123456", ""])
    assert hidden == "token=*** port=8265", "the longest first, once"


def test_a_local_node_that_exited_gives_its_last_lines_not_only_its_last_error(tmp_path: Path) -> None:
    config = pool_spec(workers=0, head={"numCpus": 1, "env": {"PASSWORD": "hunter2hunter2"}}).spec.rayClusterConfig
    cluster = draft("c", config).with_changes(log_dir=str(tmp_path))
    (tmp_path / "head.log").write_text("x" * 10000 + "\n" + LOG + "login hunter2hunter2 refused\n")
    reason = LocalProvider().exit_reason(cluster)
    assert reason == "step 8 | step 9 | ValueError: bad port | ray start exited | login *** refused"
    (tmp_path / "head.log").unlink()
    assert LocalProvider().exit_reason(cluster) == "no log"


def test_the_node_agent_reads_the_end_of_a_log_and_never_through_a_symlink(tmp_path: Path) -> None:
    log = tmp_path / "n0.log"
    log.write_text("y" * 9000 + LOG)
    answer = node_agent.run("tail", {"log": str(log), "bytes": 4096})
    assert len(answer["tail"]) == 4096 and answer["tail"].endswith("ray start exited\n")
    secret = tmp_path / "secret"
    secret.write_text("not a log")
    planted = tmp_path / "n1.log"
    os.symlink(secret, planted)
    answer = node_agent.run("tail", {"log": str(planted), "bytes": 4096})
    assert answer["tail"] == "" and str(planted) in answer["error"]


async def test_the_controller_side_reads_a_nodes_last_lines_through_the_agent(tmp_path: Path) -> None:
    spec = HostSpec.model_validate({**host("here", "127.0.0.1"), "python": sys.executable})
    nodes = SshNodes([spec])
    nodes.connection("here")._connection = LocalShell()  # type: ignore[assignment]
    marker = str(tmp_path / "n0")
    node = RemoteNode("here", "127.0.0.1", "worker", 4242, 4242, marker, f"{marker}.log", PORTS)
    Path(f"{marker}.log").write_text("z" * 20000 + "\n" + LOG)
    assert await nodes.last_lines(node) == "step 7 | step 8 | step 9 | ValueError: bad port | ray start exited"
    assert (await nodes.last_lines(node, hide=["ValueError"])).endswith("***: bad port | ray start exited")
    Path(f"{marker}.log").unlink()
    assert (await nodes.last_lines(node)).startswith("no log (")
