"""`servekeeper secret set|list|delete`: secrets that KubeRay manifests name, kept in the state dir."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from servekeeper.cli import common
from servekeeper.cli.common import StateDir
from servekeeper.store.secrets import SecretError, delete_secret, list_secrets, parse_pairs, secrets_dir, set_secret

secret_app = typer.Typer(no_args_is_help=True, help="Secrets that KubeRay manifests name in valueFrom.secretKeyRef.")


@secret_app.command("set")
def secret_set(
    name: str,
    pairs: Annotated[list[str], typer.Argument(help="KEY=VALUE pairs")],
    state_dir: StateDir = None,
) -> None:
    """Create or replace a secret (stored mode 0600 in the state dir); re-apply to use new values."""
    try:
        set_secret(secrets_dir(common.state_path(state_dir)), name, parse_pairs(pairs))
    except SecretError as exc:
        common.errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    common.console.print(f"secret/{name} set ({len(pairs)} key(s))")


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
