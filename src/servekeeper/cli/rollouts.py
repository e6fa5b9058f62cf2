"""`servekeeper rollout status`, `promote`, `abort`, `undo`, `history`: following and steering rollouts."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from servekeeper.cli import common
from servekeeper.cli.common import StateDir
from servekeeper.model.wire import RevisionView

rollout_app = typer.Typer(no_args_is_help=True, help="Follow rollouts.")


@rollout_app.command("status")
def rollout_status(
    name: str,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Update in place until the rollout ends.")] = False,
    timeout: Annotated[float, typer.Option(help="With --watch: seconds to watch.")] = 900,
    state_dir: StateDir = None,
) -> None:
    """The rollout's phase, traffic split and latest events. Exit codes as `wait`: 0 rolled out,
    1 failed, 2 timed out (without --watch: 2 while it still goes on)."""
    watch_until_done(name, state_dir, follow=watch, timeout=timeout, events_from=0.0)


def watch_until_done(name: str, state_dir: Path | None, *, follow: bool, timeout: float, events_from: float) -> None:
    """Show the rollout (live with `follow`) and exit with its code (0 rolled out, 1 failed, 2 not yet)."""
    from servekeeper.cli.live import watch_rollout

    with common.shown_errors():
        client = common.client(state_dir)
        code = watch_rollout(
            lambda: client.get(name),
            lambda: client.events(name, limit=50),
            common.console,
            follow=follow,
            timeout=timeout,
            events_from=events_from,
        )
    raise typer.Exit(code)


def promote(
    name: str,
    full: Annotated[
        bool, typer.Option("--full", help="Skip every remaining step and analysis: all traffic to the new cluster.")
    ] = False,
    state_dir: StateDir = None,
) -> None:
    """Let a canary rollout go on past its current pause (or, with --full, finish it at once)."""
    with common.shown_errors():
        result = common.client(state_dir).promote(name, full=full)
    if full:
        common.console.print(f"service/{name} promoting {result['cluster']} fully: every remaining step skipped")
    else:
        common.console.print(f"service/{name} promoting {result['cluster']} (promote #{result['promoteRequests']})")


def abort(name: str, state_dir: StateDir = None) -> None:
    """Abort the rollout in progress: the new cluster loses its traffic at once and is removed."""
    with common.shown_errors():
        result = common.client(state_dir).abort(name)
    common.console.print(f"service/{name} aborting the rollout of {result['cluster']}")


def undo(
    name: str,
    to_revision: Annotated[
        int | None,
        typer.Option("--to-revision", help="The revision to roll out again (default: the last one that rolled out)."),
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Roll out an earlier revision's spec and code again, as a new generation (within the
    rollback window, traffic moves back to the old cluster without starting a new one)."""
    with common.shown_errors():
        result = common.client(state_dir).undo(name, to_revision=to_revision)
    if result["changed"]:
        common.console.print(
            f"service/{name} rolling back to revision {result['toRevision']} (generation {result['generation']})"
        )
    else:
        common.console.print(f"service/{name} unchanged: it already runs revision {result['toRevision']}'s spec")


def history(
    name: str,
    output: Annotated[str, typer.Option("-o", "--output", help="table | json")] = "table",
    state_dir: StateDir = None,
) -> None:
    """The service's revisions (oldest first): when, spec and code hashes, cause and outcome."""
    with common.shown_errors():
        revisions = common.client(state_dir).history(name)
    if output == "json":
        print(json.dumps(revisions, indent=2))
        return
    common.console.print(history_table(revisions))


def history_table(revisions: list[RevisionView]) -> Table:
    table = Table("REVISION", "TIME", "SPEC", "PACKAGE", "CAUSE", "OUTCOME", "ENDED BY", "MESSAGE", box=None)
    for revision in revisions:
        created = datetime.fromtimestamp(revision["createdAt"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            f"{revision['revision']}{' (current)' if revision['current'] else ''}",
            created,
            revision["specHash"][:12],
            (revision["packageHash"] or "-")[:12],
            Text(revision["cause"]),
            revision["outcome"],
            Text(revision["endedBy"] or "-"),
            Text(revision["message"] or ""),  # a daemon's message is text, never Rich markup
            style="bold" if revision["current"] else None,
        )
    return table
