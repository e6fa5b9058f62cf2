"""`servekeeper hosts [POOL]` and `servekeeper hosts check POOL` (issue 10): host pools, as the
daemon sees them. A pool is stored with `servekeeper apply -f fleet.yaml` (`kind: HostPool`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from typer.core import TyperGroup

from servekeeper.cli import common
from servekeeper.cli.common import StateDir
from servekeeper.client import Client
from servekeeper.model.wire import HostCheckView


class _PoolOrCommand(TyperGroup):
    """`hosts` and `hosts POOL` list; `hosts check POOL` and `hosts delete POOL` act."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # Any: typer vendors its own click
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["list", *args]
        return super().parse_args(ctx, args)


hosts_app = typer.Typer(
    cls=_PoolOrCommand,
    help="Host pools: the machines multi-host clusters run on. `hosts [POOL]` lists their hosts with "
    "reachability and Ray version; `hosts check POOL` refuses hosts that do not match the controller.",
)


def _versions(host: HostCheckView) -> tuple[str, str]:
    return host.get("ray") or "-", host.get("python") or "-"


@hosts_app.command("list", hidden=True)
def list_hosts(
    pool: Annotated[str | None, typer.Argument(help="One pool (default: every pool).")] = None,
    state_dir: StateDir = None,
) -> None:
    """Every host with its reachability (the daemon connects to each), Ray version, and its
    capacity as used/total by the clusters placed on it (pending and draining ones included)."""
    with common.shown_errors(), Client(state_dir) as client:
        pools = client.host_pools(pool)
        checks = {view["name"]: client.check_hosts(view["name"]) for view in pools}
    table = Table(box=None)
    for column in ("POOL", "HOST", "ADDRESS", "STATE", "RAY", "PYTHON", "CPUS", "GPUS", "MEMORY"):
        table.add_column(column, no_wrap=True)  # never cut short: which clusters, below
    placed: list[str] = []
    for view in pools:
        for host in checks[view["name"]]["hosts"]:
            ray, python = _versions(host)
            resources, used = host["resources"], host["used"]
            used_memory_gib = sum(node["memoryBytes"] for node in used) / 2**30
            table.add_row(
                view["name"],
                host["name"],
                host["address"],
                host["state"],
                ray,
                python,
                f"{sum(node['cpus'] for node in used):g}/{resources['cpus']:g}",
                f"{sum(node['gpus'] for node in used):g}/{resources['gpus']:g}",
                f"{used_memory_gib:.3g}/{resources['memoryGiB']:g}Gi",
            )
            if used:
                nodes = ", ".join(f"{node['cluster']} {node['role']} ({node['cpus']:g} cpu)" for node in used)
                placed.append(f"{view['name']}/{host['name']}: {nodes}")
    if not pools:
        common.console.print("no host pools; store one with: servekeeper apply -f fleet.yaml (kind: HostPool)")
        return
    common.console.print(table)
    for line in placed:
        common.console.print(line, markup=False)


def _interpreters(host: HostCheckView) -> str:
    found = host.get("interpreters") or {}
    return f"; interpreters {', '.join(sorted(found, key=lambda m: [int(p) for p in m.split('.')]))}" if found else ""


@hosts_app.command()
def check(pool: str, state_dir: StateDir = None) -> None:
    """Connect to each host of POOL; exit 1 if any is unreachable, refused (host key), or runs
    another Ray or Python than the controller (Ray needs one version on every node). Each host's
    Python interpreters are listed: a cluster with its own rayVersion/pythonVersion needs only
    the interpreter on a host (its environment is copied there), not the controller's Ray."""
    with common.shown_errors(), Client(state_dir) as client:
        answer = client.check_hosts(pool)
    controller = answer["controller"]
    common.console.print(f"controller: Ray {controller['ray']}, Python {controller['python']}", markup=False)
    for host in answer["hosts"]:
        ray, python = _versions(host)
        if host["ok"]:
            line = f"ok      {host['name']} ({host['address']}): Ray {ray}, Python {python}"
            common.console.print(line + _interpreters(host), markup=False)
        else:
            line = f"{host['state']:<7} {host['name']} ({host['address']}): {host['problem']}"
            common.errors.print(line + _interpreters(host), markup=False)
    if not answer["ok"]:
        bad = [host["name"] for host in answer["hosts"] if not host["ok"]]
        common.errors.print(f"hostpool/{pool}: {len(bad)} of {len(answer['hosts'])} hosts refused: {', '.join(bad)}")
        raise typer.Exit(1)
    common.console.print(f"hostpool/{pool}: all {len(answer['hosts'])} hosts match the controller")


@hosts_app.command()
def delete(pool: str, state_dir: StateDir = None) -> None:
    """Forget a host pool (its hosts are not touched)."""
    with common.shown_errors(), Client(state_dir) as client:
        client.delete_host_pool(pool)
    common.console.print(f"hostpool/{pool} deleted")
