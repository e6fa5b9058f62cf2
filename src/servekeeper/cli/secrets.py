"""`servekeeper secret set|list|delete`: secrets that KubeRay manifests name, kept in the state dir."""

from __future__ import annotations

import getpass
import sys
from typing import Annotated

import typer
from rich.table import Table

from servekeeper.cli import common
from servekeeper.cli.common import StateDir
from servekeeper.store.secrets import SecretError, delete_secret, list_secrets, read_values, secrets_dir, set_secret
from servekeeper.store.store import StoreError

secret_app = typer.Typer(no_args_is_help=True, help="Secrets that KubeRay manifests name in valueFrom.secretKeyRef.")


@secret_app.command("set")
def secret_set(
    name: str,
    pairs: Annotated[
        list[str] | None, typer.Argument(help="KEY=- : read KEY's value from standard input (never KEY=VALUE)")
    ] = None,
    from_file: Annotated[
        list[str] | None, typer.Option("--from-file", help="KEY=PATH: KEY's value is the file's content")
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Create or replace a secret (stored mode 0600 in the state dir); re-apply to use new values.
    Values never come from the command line (`ps`, shell history)."""
    try:
        values = read_values(pairs or [], from_file or [], _read_stdin)
        set_secret(secrets_dir(common.state_path(state_dir)), name, values)
    except (SecretError, StoreError) as exc:
        common.errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    common.console.print(f"secret/{name} set ({len(values)} key(s))")


def _read_stdin() -> str:
    if sys.stdin.isatty():
        return getpass.getpass("value (not echoed): ")  # typed: nothing on screen or in history
    return sys.stdin.read()


@secret_app.command("list")
def secret_list(state_dir: StateDir = None) -> None:
    """Secrets and their key names (never the values)."""
    table = Table("NAME", "KEYS", box=None)
    for name, keys in list_secrets(secrets_dir(common.state_path(state_dir))).items():
        table.add_row(name, ", ".join(keys))
    common.console.print(table)


@secret_app.command("delete")
def secret_delete(name: str, state_dir: StateDir = None) -> None:
    """Delete a secret (services applied with it keep the values they were given)."""
    try:
        deleted = delete_secret(secrets_dir(common.state_path(state_dir)), name)
    except SecretError as exc:
        common.errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    if not deleted:
        common.errors.print(f"secret {name!r} not found")
        raise typer.Exit(1)
    common.console.print(f"secret/{name} deleted")
