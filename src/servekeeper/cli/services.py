"""`servekeeper apply`, `get`, `describe`, `delete`, `events`, `wait`, `export`: services."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from servekeeper.cli import common
from servekeeper.cli.common import StateDir, when
from servekeeper.cli.rollouts import watch_until_done
from servekeeper.kuberay.status import kuberay_service
from servekeeper.model.wire import EventView, is_true


def apply(
    file: Annotated[Path, typer.Option("-f", "--file", help="The service spec (YAML).")],
    state_dir: StateDir = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Show the rollout live until it ends; exit codes as `wait`.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="With --watch: seconds to watch.")] = 900,
) -> None:
    """Create or update a service from a spec file."""
    applied_at = time.time()
    with common.shown_errors():  # the file is checked before the daemon is looked for
        result = common.client(state_dir).apply(file)
    verb = "configured" if result["changed"] else "unchanged"
    if result.get("kind") == "HostPool":  # `kind: HostPool`: see servekeeper hosts
        common.console.print(f"hostpool/{result['name']} {verb}")
        return
    common.console.print(f"service/{result['name']} {verb} (generation {result['generation']})")
    if watch:
        watch_until_done(result["name"], state_dir, follow=True, timeout=timeout, events_from=applied_at - 1)


def delete(name: str, state_dir: StateDir = None) -> None:
    """Delete a service: stop every cluster of it and remove its route."""
    with common.shown_errors():
        common.client(state_dir).delete(name)
    common.console.print(f"service/{name} deleting")


def get(
    name: Annotated[str | None, typer.Argument()] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="table | json | kuberay")] = "table",
    state_dir: StateDir = None,
) -> None:
    """Show services (or one service)."""
    with common.shown_errors():
        client = common.client(state_dir)
        views = [client.get(name)] if name else client.list()
    if output == "json":
        print(json.dumps(views[0] if name else views, indent=2))
        return
    if output == "kuberay":  # KubeRay's RayService status shape, as `kubectl get rayservice -o json`
        objects = [kuberay_service(dict(view)) for view in views]
        print(json.dumps(objects[0] if name else {"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
        return
    table = Table("NAME", "READY", "GENERATION", "ACTIVE", "PENDING", "STANDBY", "INGRESS", box=None)
    for view in views:
        table.add_row(
            view["name"],
            "True" if is_true(view, "Ready") else "False",
            f"{view['observedGeneration']}/{view['generation']}",
            active["name"] if (active := view["activeCluster"]) else "-",
            pending["name"] if (pending := view["pendingCluster"]) else "-",
            view.get("standby", "none"),  # an older daemon's view has no standby
            view["ingress"]["url"],
        )
    common.console.print(table)


def describe(name: str, state_dir: StateDir = None) -> None:
    """Conditions, clusters, applications and recent events of a service."""
    with common.shown_errors():
        client = common.client(state_dir)
        view = client.get(name)
        recent = client.events(name, limit=15)
    console = common.console
    console.print(
        f"[bold]Service[/bold] {view['name']}  generation {view['observedGeneration']}/{view['generation']}"
        f"  ingress {view['ingress']['url']}"
    )
    conditions = Table("CONDITION", "STATUS", "REASON", "MESSAGE", "SINCE", box=None)
    for condition in view["conditions"]:
        conditions.add_row(
            condition["type"],
            condition["status"],
            condition["reason"],
            condition["message"],
            when(condition["lastTransitionTime"]),
        )
    console.print(conditions)
    notes = view.get("importNotes") or []
    if notes:
        console.print(f"\n[bold]Ignored on this provider[/bold] (imported from {view.get('importedFrom')})")
        for note in notes:
            console.print(f"  {note['path']}  {note['kind']}: {note['message']}", markup=False)
    pending_cluster = view["pendingCluster"]
    canary = pending_cluster.get("canary") if pending_cluster else None
    if canary:
        from servekeeper.cli.live import canary_block

        console.print()
        console.print(canary_block(canary))
    clusters = [("active", view["activeCluster"]), ("pending", view["pendingCluster"])]
    clusters.append(("standby", view.get("standbyCluster")))
    clusters += [(c["role"], c) for c in view["otherClusters"]]
    for role, cluster in clusters:
        if cluster is None:
            continue
        console.print(
            f"\n[bold]{role} cluster[/bold] {cluster['name']} (generation {cluster['generation']}, "
            f"{cluster['trafficPercent']}% traffic)  gcs {cluster['address']}  "
            f"dashboard {cluster['dashboardUrl']}  serve {cluster['serveUrl']}"
        )
        package = (cluster.get("packageHash") or "-")[:16]
        console.print(f"  config {cluster.get('appliedConfigHash') or '-'}  code package {package}")
        for group in cluster.get("workerGroups") or []:
            bounds = f"min {group['minNodes']}, max {group['maxNodes']}" if group["autoscaled"] else "fixed"
            console.print(
                f"  group {group['name']}: {group['nodes']} node(s) running of {group['desired']} asked for ({bounds})",
                markup=False,
            )
        apps = Table("APPLICATION", "STATUS", "SOURCE", "MESSAGE", box=None)
        for app_name, app_state in cluster["applications"].items():
            apps.add_row(app_name, app_state["status"], app_state["source"], app_state["message"][:200])
        console.print(apps)
    print_events(recent, title="\nRecent events")


def print_events(items: list[EventView], title: str = "") -> None:
    table = Table("TIME", "SERVICE", "TYPE", "REASON", "MESSAGE", box=None, title=title or None, title_justify="left")
    for event in items:
        table.add_row(when(event["time"]), event["service"], event["type"], event["reason"], event["message"])
    common.console.print(table)


def events(
    name: Annotated[str | None, typer.Argument()] = None,
    limit: Annotated[int, typer.Option(help="How many of the latest events.")] = 50,
    state_dir: StateDir = None,
) -> None:
    """Events of one service or of all."""
    with common.shown_errors():
        items = common.client(state_dir).events(name, limit=limit)
    print_events(items)


def wait(
    name: str,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 900,
    state_dir: StateDir = None,
) -> None:
    """Exit 0 once the latest generation is rolled out and Ready, 1 if it failed, 2 on timeout."""
    with common.shown_errors():  # RolloutFailed: exit 1, WaitTimeout: exit 2
        view = common.client(state_dir).wait(name, timeout=timeout)
    common.console.print(f"service/{name} generation {view['generation']} is Ready at {view['ingress']['url']}")


def export(
    name: str,
    output_format: Annotated[str, typer.Option("--format", help="kuberay")] = "kuberay",
    state_dir: StateDir = None,
) -> None:
    """Print the service as a KubeRay RayService manifest (ray.io/v1)."""
    with common.shown_errors():
        print(common.client(state_dir).export(name, format=output_format), end="")
