"""`servekeeper job submit` and `servekeeper env` on a cluster of a host pool: its token goes with
every call and is exported, and the job's `python` is the head host's (no Ray started: the Jobs
client is faked)."""

from __future__ import annotations

import io
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.enums import ClusterRole
from servekeeper.model.records import NodePlacement
from servekeeper.providers.cluster_token import save_cluster_token, token_dir
from servekeeper.rayapi.jobs import NoSuchCluster, env_lines, pool_access, submit_job
from servekeeper.views.service import cluster_view
from tests.unit.ssh_fakes import pool_document
from tests.unit.test_pool_clusters import draft
from tests.unit.test_ssh import PORTS


def a_view(pool: str | None) -> dict[str, Any]:
    nodes = (NodePlacement("b", "10.0.0.12", "head", PORTS, "/tmp/servekeeper/c1/n0", pid=9),) if pool else ()
    config = RayClusterConfigSpec.model_validate({"hostPool": pool})
    cluster = draft("svc-g1-abc", config).with_changes(role=ClusterRole.ACTIVE, pool=pool, nodes=nodes)
    return {"name": "svc", "activeCluster": cluster_view(cluster, None, 100)}


def test_env_of_a_local_cluster_has_no_token(tmp_path: Path) -> None:
    lines = env_lines(a_view(None), "active", tmp_path)
    assert lines[0].startswith("export RAY_ADDRESS=127.0.0.1:")
    assert "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in lines
    assert not any("RAY_AUTH" in line for line in lines)


def test_env_of_a_pool_cluster_exports_its_token_file(tmp_path: Path) -> None:
    lines = env_lines(a_view("fleet"), "active", tmp_path)
    assert lines[0].startswith("export RAY_ADDRESS=10.0.0.12:")
    assert "export RAY_AUTH_MODE=token" in lines
    assert f"export RAY_AUTH_TOKEN_PATH={tmp_path}/tokens/svc-g1-abc.token" in lines


def test_a_pool_cluster_job_carries_the_token_and_the_head_hosts_python(tmp_path: Path) -> None:
    save_cluster_token(token_dir(tmp_path), "svc-g1-abc", "t0k3n")
    pool = pool_document(("a", 4), ("b", 4))  # both hosts' python: /opt/ray-env/bin/python
    pool["spec"]["hosts"][1]["python"] = "/srv/ray/bin/python3"
    cluster = a_view("fleet")["activeCluster"]
    headers, python = pool_access(cluster, tmp_path, [pool["spec"]])
    assert headers == {"Authorization": "Bearer t0k3n"} and python == "/srv/ray/bin/python3"

    with pytest.raises(NoSuchCluster, match="cannot read the token of cluster svc-g1-abc at .*tokens/svc-g1-abc.token"):
        pool_access(cluster, tmp_path / "elsewhere", [pool["spec"]])


class FakeJobs:
    made: list[FakeJobs] = []

    def __init__(self, address: str, headers: dict[str, str] | None = None) -> None:
        self.address, self.headers = address, headers
        self.submitted: dict[str, Any] = {}
        FakeJobs.made.append(self)

    def submit_job(self, **kwargs: Any) -> str:
        self.submitted = kwargs
        return "job-1"

    async def tail_job_logs(self, job_id: str) -> Any:
        yield "hello from the head\n"

    def get_job_status(self, job_id: str) -> Any:
        return types.SimpleNamespace(value="SUCCEEDED")

    def get_job_info(self, job_id: str) -> Any:
        return types.SimpleNamespace(message="")


def test_submit_job_sends_the_headers_and_puts_the_heads_python_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray.job_submission", types.SimpleNamespace(JobSubmissionClient=FakeJobs))
    out = io.StringIO()
    headers = {"Authorization": "Bearer t0k3n"}
    code = submit_job("http://10.0.0.12:8265", ["python", "x.py"], tmp_path, out, headers, "/srv/ray/bin/python")
    assert code == 0 and out.getvalue() == "hello from the head\n"
    [client] = FakeJobs.made[-1:]
    assert client.headers == headers
    # `python` by its path: the head's PATH may find another first (a pyenv shim: seen on the fleet)
    assert client.submitted["entrypoint"] == "/srv/ray/bin/python x.py"
    assert client.submitted["runtime_env"]["env_vars"] == {"PATH": "/srv/ray/bin:${PATH}"}  # Ray expands it on the head

    submit_job("http://127.0.0.1:8265", ["python", "x.py"], tmp_path, io.StringIO())  # a local cluster
    local = FakeJobs.made[-1]
    assert local.headers is None
    assert local.submitted["runtime_env"]["env_vars"]["PATH"].startswith(str(Path(sys.executable).parent))
    assert local.submitted["entrypoint"] == shlex.join([sys.executable, "x.py"])
    submit_job("http://127.0.0.1:8265", ["sh", "-c", "python x.py"], tmp_path, io.StringIO())
    assert FakeJobs.made[-1].submitted["entrypoint"] == "sh -c 'python x.py'", "only a leading python"
