"""Drivers on a managed cluster: Ray's Jobs API (`servekeeper job submit`) and the environment a
local `ray.init()` needs (`servekeeper env`)."""

from __future__ import annotations

import asyncio
import os
import posixpath
import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

# Terminal job statuses -> the exit code of `job submit`.
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}


class NoSuchCluster(LookupError):
    pass


def pick_cluster(view: dict[str, Any], role: str) -> dict[str, Any]:
    cluster = view.get(f"{role}Cluster")
    if not cluster:
        raise NoSuchCluster(f"service/{view.get('name')} has no {role} cluster")
    return dict(cluster)


def env_lines(view: dict[str, Any], role: str, state_dir: Path) -> list[str]:
    """`export` lines for a local driver. Ray rewrites a loopback bootstrap address to the host's
    IP unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (a local cluster listens on 127.0.0.1 only).
    A cluster on a host pool has token auth: its token file (the controller's) is exported."""
    cluster = pick_cluster(view, role)
    address = f"export RAY_ADDRESS={shlex.quote(str(cluster['address']))}"
    if not cluster.get("hostPool"):
        python = local_python(cluster, state_dir)
        # A cluster of its own Ray takes a driver of that Ray: its environment's python and ray first.
        path = [f'export PATH={shlex.quote(posixpath.dirname(python))}:"$PATH"'] if python is not None else []
        return [
            address,
            *path,
            "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0",
            f"# dashboard {cluster['dashboardUrl']}, cluster {cluster['name']}; no token: a cluster on this "
            "machine has no token auth",
        ]
    return [
        address,
        "export RAY_AUTH_MODE=token",
        f"export RAY_AUTH_TOKEN_PATH={shlex.quote(str(pool_token_path(cluster, state_dir)))}",
        f"# dashboard {cluster['dashboardUrl']}, cluster {cluster['name']} on host pool {cluster['hostPool']}. "
        "A ray.init() driver runs on a node of the cluster; from elsewhere use `servekeeper job submit`",
    ]


def local_python(cluster: dict[str, Any], state_dir: Path) -> str | None:
    """The Python of a local cluster's own environment (None: it runs the controller's)."""
    from servekeeper.model.cluster_spec import RayClusterConfigSpec
    from servekeeper.providers.base import ProviderError
    from servekeeper.providers.environments import environments_of

    fields = {key: cluster.get(key) for key in ("rayVersion", "pythonVersion", "pip") if cluster.get(key)}
    if not fields:
        return None
    try:
        environment = environments_of(state_dir).lookup(RayClusterConfigSpec.model_validate(fields))
    except ProviderError as exc:
        raise NoSuchCluster(f"cluster {cluster['name']}: {exc}") from exc
    return str(environment.python) if environment is not None else None


def pool_token_path(cluster: dict[str, Any], state_dir: Path) -> Path:
    """The token file of a pool cluster on the controller's machine (under its state dir)."""
    from servekeeper.providers.cluster_token import token_dir, token_file

    return token_file(token_dir(state_dir), str(cluster["name"]))


def pool_access(cluster: dict[str, Any], state_dir: Path, pools: list[dict[str, Any]]) -> tuple[dict[str, str], str]:
    """What a job on a pool cluster needs: the headers of every call to its dashboard (its token,
    read from the controller's state dir) and the Python that runs Ray on its head host (from the
    host pool)."""
    from servekeeper.providers.cluster_token import auth_headers

    path = pool_token_path(cluster, state_dir)
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise NoSuchCluster(
            f"cannot read the token of cluster {cluster['name']} at {path} ({exc.strerror}): run this where "
            "the controller runs, as its user, with its --state-dir"
        ) from exc
    head = cluster.get("headHost")
    hosts = [host for pool in pools for host in pool.get("hosts", []) if host.get("name") == head]
    if not hosts:
        raise NoSuchCluster(f"the head host {head!r} of cluster {cluster['name']} is not in its host pool")
    return auth_headers(token), str(hosts[0]["python"])


def submit_job(
    dashboard_url: str,
    entrypoint: list[str],
    working_dir: Path,
    out: TextIO = sys.stdout,
    headers: dict[str, str] | None = None,
    python: str | None = None,
) -> int:
    """Run `entrypoint` as a Ray job on the cluster (its driver runs on the head), with
    `working_dir` uploaded as the job's working_dir; stream its logs; return its exit code.
    `headers` go with every call (a pool cluster's token); `python` is the Python that runs Ray
    on the head (None: the head is this machine, and its Python is this one)."""
    from ray.job_submission import JobSubmissionClient  # slow to import: only for this command

    client = JobSubmissionClient(dashboard_url, headers=headers)
    # `python` in the entrypoint must be the Python that runs Ray (as in KubeRay's Ray image), not
    # whatever the head's PATH finds first: on this machine the Python servekeeper runs in; on a
    # pool's host its `python` (Ray expands ${PATH} to the head's own).
    # A leading `python` is that Python by its path: the head's PATH may put another first (a
    # pyenv shim, from the login environment of the SSH session that started the node).
    if python is not None:
        path = f"{posixpath.dirname(python)}{os.pathsep}${{PATH}}"
    else:
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if entrypoint and entrypoint[0] in ("python", "python3"):
        entrypoint = [python or sys.executable, *entrypoint[1:]]
    job_id = client.submit_job(
        entrypoint=shlex.join(entrypoint),
        runtime_env={"working_dir": str(working_dir.resolve()), "env_vars": {"PATH": path}},
    )
    print(f"job {job_id} submitted to {dashboard_url}", file=sys.stderr)

    async def stream() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    try:
        asyncio.run(stream())
    except KeyboardInterrupt:
        client.stop_job(job_id)
        print(f"job {job_id} stopped", file=sys.stderr)
        return 130
    status = str(client.get_job_status(job_id).value)
    info = client.get_job_info(job_id)
    print(f"job {job_id} {status}" + (f": {info.message}" if info.message else ""), file=sys.stderr)
    return EXIT_CODES.get(status, 1)
