"""Drivers on a managed cluster: Ray's Jobs API (`servekeeper job submit`) and the environment a
local `ray.init()` needs (`servekeeper env`)."""

from __future__ import annotations

import asyncio
import os
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


def env_lines(view: dict[str, Any], role: str = "active") -> list[str]:
    """`export` lines for a local driver. Ray rewrites a loopback bootstrap address to the host's
    IP unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the cluster listens on 127.0.0.1 only). Managed
    clusters have no token auth yet, so there is no token to export."""
    cluster = pick_cluster(view, role)
    return [
        f"export RAY_ADDRESS={shlex.quote(str(cluster['address']))}",
        "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0",
        f"# dashboard {cluster['dashboardUrl']}, cluster {cluster['name']}; no token: managed clusters "
        "have no token auth yet",
    ]


def submit_job(dashboard_url: str, entrypoint: list[str], working_dir: Path, out: TextIO = sys.stdout) -> int:
    """Run `entrypoint` as a Ray job on the cluster (its driver runs on the head), with
    `working_dir` uploaded as the job's working_dir; stream its logs; return its exit code."""
    from ray.job_submission import JobSubmissionClient  # slow to import: only for this command

    client = JobSubmissionClient(dashboard_url)
    # `python` in the entrypoint must be the Python that runs Ray (as in KubeRay's Ray image), not
    # whatever the head's PATH finds first: on this provider that is the Python servekeeper runs in.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
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
