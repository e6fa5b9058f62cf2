"""The `servekeeper` command line. Every command but `up` talks to the daemon's API."""

from __future__ import annotations

import typer

from servekeeper.cli import daemon, rollouts, services
from servekeeper.cli.hosts import hosts_app
from servekeeper.cli.jobs import env_command, job_app
from servekeeper.cli.secrets import secret_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

# Registered in the order `servekeeper --help` lists them.
app.command()(daemon.up)
app.command()(services.apply)
app.command()(daemon.dashboard)
app.command()(services.delete)
app.command()(services.get)
app.command()(services.describe)
app.command()(rollouts.promote)
app.command()(rollouts.abort)
app.command()(rollouts.undo)
app.command()(rollouts.history)
app.command()(services.events)
app.command()(services.wait)
app.command()(services.export)
app.command("env")(env_command)
app.command()(daemon.down)

app.add_typer(rollouts.rollout_app, name="rollout")
app.add_typer(secret_app, name="secret")
app.add_typer(hosts_app, name="hosts")  # host pools (issue 10)
app.add_typer(job_app, name="job")


def main() -> None:
    app(prog_name="servekeeper")


if __name__ == "__main__":
    main()
