"""What every `servekeeper` command shares: the consoles, the `--state-dir` option, the client,
and how the client's errors are shown, with their exit codes (mapped here once).

Sub-modules read these as `common.console`, `common.client(...)`: tests replace them here once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from servekeeper.client import (
    ApiError,
    Client,
    Conflict,
    DaemonNotRunning,
    RevisionNotFound,
    RolloutFailed,
    ServiceNotFound,
    SpecInvalid,
    WaitTimeout,
    default_state_dir,
)

console = Console()
errors = Console(stderr=True)

StateDir = Annotated[
    Path | None,
    typer.Option("--state-dir", envvar="SERVEKEEPER_STATE_DIR", help="Where servekeeper keeps its state."),
]

EXIT_FAILED = 1
EXIT_TIMEOUT = 2
EXIT_NOT_RUNNING = 3


def state_path(state_dir: Path | None) -> Path:
    return (state_dir or default_state_dir()).expanduser().resolve()


def client(state_dir: Path | None) -> Client:
    """The daemon's Python client (servekeeper.client): every command talks to the API through it."""
    return Client(state_path(state_dir))


@contextlib.contextmanager
def shown_errors() -> Iterator[None]:
    """The client's errors as the CLI shows them, with its exit codes (1; 2 timeout; 3 not running)."""
    try:
        yield
    except DaemonNotRunning as exc:
        errors.print(str(exc))
        raise typer.Exit(EXIT_NOT_RUNNING) from exc
    except ServiceNotFound as exc:
        errors.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from exc
    except SpecInvalid as exc:
        errors.print(f"[red]invalid service spec{f' {exc.source}' if exc.source else ''}:[/red]")
        for problem in exc.problems:
            errors.print(f"  - {problem}", markup=False)
        raise typer.Exit(EXIT_FAILED) from exc
    except RolloutFailed as exc:
        errors.print(str(exc))
        raise typer.Exit(EXIT_FAILED) from exc
    except WaitTimeout as exc:
        errors.print(str(exc))
        raise typer.Exit(EXIT_TIMEOUT) from exc
    except (Conflict, RevisionNotFound) as exc:  # promote/abort/undo refused: the daemon says why
        errors.print(str(exc), style="red", markup=False)
        raise typer.Exit(EXIT_FAILED) from exc
    except ApiError as exc:
        errors.print(f"[red]API error {exc.status}:[/red] {exc.text}", markup=True)
        raise typer.Exit(EXIT_FAILED) from exc


def when(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S") if timestamp else "-"
