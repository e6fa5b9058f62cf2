"""`servekeeper job submit` and `servekeeper env`: reaching a service's Ray cluster directly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from servekeeper.cli import common
from servekeeper.cli.common import StateDir
from servekeeper.rayapi.jobs import NoSuchCluster, env_lines, local_python, pick_cluster, pool_access, submit_job

job_app = typer.Typer(no_args_is_help=True, help="Ray jobs on a service's cluster.")


@job_app.command("submit")
def job_submit(
    name: str,
    entrypoint: Annotated[list[str], typer.Argument(help="The driver command, after --")],
    cluster: Annotated[str, typer.Option("--cluster", help="active | pending")] = "active",
    working_dir: Annotated[Path, typer.Option("--working-dir", help="Uploaded as the job's working_dir.")] = Path(),
    state_dir: StateDir = None,
) -> None:
    """Run a driver on the service's cluster with Ray's Jobs API; exit with the job's code."""
    if cluster not in ("active", "pending"):
        common.errors.print("--cluster must be active or pending")
        raise typer.Exit(1)
    client = common.client(state_dir)
    with common.shown_errors():
        view = client.get(name)
    headers, python = None, None
    try:
        target = pick_cluster(dict(view), cluster)
        if target.get("hostPool"):
            with common.shown_errors():
                pools = [dict(pool) for pool in client.host_pools(str(target["hostPool"]))]
            headers, python = pool_access(target, common.state_path(state_dir), pools)
        else:
            python = local_python(target, common.state_path(state_dir))
    except NoSuchCluster as exc:
        common.errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    raise typer.Exit(submit_job(str(target["dashboardUrl"]), entrypoint, working_dir, headers=headers, python=python))


def env_command(
    name: str,
    cluster: Annotated[str, typer.Option("--cluster", help="active | pending")] = "active",
    state_dir: StateDir = None,
) -> None:
    """`export` lines that let a local `ray.init()` reach the service's cluster."""
    with common.shown_errors():
        view = common.client(state_dir).get(name)
    try:
        print("\n".join(env_lines(dict(view), cluster, common.state_path(state_dir))))
    except NoSuchCluster as exc:
        common.errors.print(str(exc), markup=False)  # a name like [x] is text, not Rich markup
        raise typer.Exit(1) from exc
