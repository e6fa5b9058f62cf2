"""The `servekeeper` command line. Every command but `up` talks to the daemon's API."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import psutil
import typer
from rich.console import Console
from rich.table import Table

from servekeeper.daemon import DaemonError, default_state_dir, read_api_info, run_daemon, start_detached
from servekeeper.spec import SpecError, load_spec_file
from servekeeper.store import StoreError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()
errors = Console(stderr=True)

StateDir = Annotated[
    Path | None,
    typer.Option("--state-dir", envvar="SERVEKEEPER_STATE_DIR", help="Where servekeeper keeps its state."),
]

EXIT_NOT_RUNNING = 3


def _state(state_dir: Path | None) -> Path:
    return (state_dir or default_state_dir()).expanduser().resolve()


class ApiClient:
    def __init__(self, state_dir: Path) -> None:
        info = read_api_info(state_dir)
        token_path = state_dir / "token"
        if info is None or not token_path.exists():
            _not_running(state_dir)
        self.state_dir = state_dir
        self.pid = info["pid"]
        self._http = httpx.Client(
            base_url=info["url"],
            headers={"Authorization": f"Bearer {token_path.read_text().strip()}"},
            timeout=30,
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError:
            _not_running(self.state_dir)
        if response.status_code == 404:
            errors.print(f"[red]{response.json().get('detail')}[/red]")
            raise typer.Exit(1)
        if response.status_code == 422:
            detail = response.json().get("detail")
            problems = detail.get("problems") if isinstance(detail, dict) else None
            if not isinstance(problems, list):
                problems = [json.dumps(detail)]
            errors.print("[red]invalid service spec:[/red]")
            for problem in problems:
                errors.print(f"  - {problem}", markup=False)
            raise typer.Exit(1)
        if response.status_code >= 400:
            errors.print(f"[red]API error {response.status_code}:[/red] {response.text}", markup=True)
            raise typer.Exit(1)
        return response.json()


def _not_running(state_dir: Path) -> NoReturn:
    errors.print(f"servekeeper is not running for {state_dir}; start it with: servekeeper up --detach")
    raise typer.Exit(EXIT_NOT_RUNNING)


@app.command()
def up(
    state_dir: StateDir = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Run in the background; return once the API answers.")
    ] = False,
    api_host: Annotated[str, typer.Option(help="Address the API binds to.")] = "127.0.0.1",
    api_port: Annotated[int, typer.Option(help="API port (0: pick a free one).")] = 0,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="Allow a non-loopback API address.")] = False,
) -> None:
    """Start the controller, its API and the ingress (re-adopting running clusters)."""
    directory = _state(state_dir)
    if detach:
        info = read_api_info(directory)
        if info is not None and _api_answers(directory):
            console.print(f"servekeeper already running (pid {info['pid']}), API {info['url']}")
            return
        extra = ["--api-host", api_host, "--api-port", str(api_port)] + (["--allow-remote"] if allow_remote else [])
        try:
            info = start_detached(directory, extra)
        except DaemonError as exc:
            errors.print(str(exc), style="red", markup=False)
            raise typer.Exit(1) from exc
        console.print(f"servekeeper up (pid {info['pid']}), API {info['url']}, state in {directory}")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        asyncio.run(run_daemon(directory, api_host, api_port, allow_remote))
    except (DaemonError, StoreError) as exc:
        errors.print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from exc


def _api_answers(directory: Path) -> bool:
    try:
        ApiClient(directory).call("GET", "/healthz")
        return True
    except (typer.Exit, httpx.HTTPError):
        return False


@app.command()
def apply(
    file: Annotated[Path, typer.Option("-f", "--file", help="The service spec (YAML).")],
    state_dir: StateDir = None,
) -> None:
    """Create or update a service from a spec file."""
    try:
        spec = load_spec_file(file)
    except SpecError as exc:
        errors.print(f"[red]invalid service spec {file}:[/red]")
        for problem in exc.problems:
            errors.print(f"  - {problem}", markup=False)
        raise typer.Exit(1) from exc
    result = ApiClient(_state(state_dir)).call("POST", "/api/v1/services", json={"spec": spec.model_dump(mode="json")})
    verb = "configured" if result["changed"] else "unchanged"
    console.print(f"service/{result['name']} {verb} (generation {result['generation']})")


@app.command()
def delete(name: str, state_dir: StateDir = None) -> None:
    """Delete a service: stop every cluster of it and remove its route."""
    ApiClient(_state(state_dir)).call("DELETE", f"/api/v1/services/{name}")
    console.print(f"service/{name} deleting")


def _condition(view: dict[str, Any], condition_type: str) -> dict[str, Any] | None:
    for condition in view["conditions"]:
        if condition["type"] == condition_type:
            return dict(condition)
    return None


def _is_true(view: dict[str, Any], condition_type: str) -> bool:
    condition = _condition(view, condition_type)
    return condition is not None and condition["status"] == "True"


@app.command()
def get(
    name: Annotated[str | None, typer.Argument()] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="table | json")] = "table",
    state_dir: StateDir = None,
) -> None:
    """Show services (or one service)."""
    client = ApiClient(_state(state_dir))
    views = [client.call("GET", f"/api/v1/services/{name}")] if name else client.call("GET", "/api/v1/services")
    if output == "json":
        print(json.dumps(views[0] if name else views, indent=2))
        return
    table = Table("NAME", "READY", "GENERATION", "ACTIVE", "PENDING", "INGRESS", box=None)
    for view in views:
        table.add_row(
            view["name"],
            "True" if _is_true(view, "Ready") else "False",
            f"{view['observedGeneration']}/{view['generation']}",
            (view["activeCluster"] or {}).get("name", "-"),
            (view["pendingCluster"] or {}).get("name", "-"),
            view["ingress"]["url"],
        )
    console.print(table)


def _when(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S") if timestamp else "-"


@app.command()
def describe(name: str, state_dir: StateDir = None) -> None:
    """Conditions, clusters, applications and recent events of a service."""
    client = ApiClient(_state(state_dir))
    view = client.call("GET", f"/api/v1/services/{name}")
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
            _when(condition["lastTransitionTime"]),
        )
    console.print(conditions)
    clusters = [("active", view["activeCluster"]), ("pending", view["pendingCluster"])]
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
        apps = Table("APPLICATION", "STATUS", "SOURCE", "MESSAGE", box=None)
        for app_name, app_state in cluster["applications"].items():
            apps.add_row(app_name, app_state["status"], app_state["source"], app_state["message"][:200])
        console.print(apps)
    _print_events(client.call("GET", "/api/v1/events", params={"service": name, "limit": 15}), title="\nRecent events")


def _print_events(items: list[dict[str, Any]], title: str = "") -> None:
    table = Table("TIME", "SERVICE", "TYPE", "REASON", "MESSAGE", box=None, title=title or None, title_justify="left")
    for event in items:
        table.add_row(_when(event["time"]), event["service"], event["type"], event["reason"], event["message"])
    console.print(table)


@app.command()
def events(
    name: Annotated[str | None, typer.Argument()] = None,
    limit: Annotated[int, typer.Option(help="How many of the latest events.")] = 50,
    state_dir: StateDir = None,
) -> None:
    """Events of one service or of all."""
    params: dict[str, Any] = {"limit": limit}
    if name:
        params["service"] = name
    _print_events(ApiClient(_state(state_dir)).call("GET", "/api/v1/events", params=params))


@app.command()
def wait(
    name: str,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 900,
    state_dir: StateDir = None,
) -> None:
    """Exit 0 once the latest generation is rolled out and Ready, 1 if it failed, 2 on timeout."""
    client = ApiClient(_state(state_dir))
    deadline = time.monotonic() + timeout
    while True:
        view = client.call("GET", f"/api/v1/services/{name}")
        current = view["observedGeneration"] == view["generation"]
        if current and (_is_true(view, "RolloutFailed") or _is_true(view, "ClusterSpecOutdated")):
            failed = (
                _condition(view, "RolloutFailed")
                if _is_true(view, "RolloutFailed")
                else _condition(view, "ClusterSpecOutdated")
            )
            assert failed is not None
            errors.print(
                f"service/{name} generation {view['generation']} not rolled out: "
                f"{failed['reason']}: {failed['message']}"
            )
            raise typer.Exit(1)
        if current and _is_true(view, "Ready") and not _is_true(view, "UpgradeInProgress"):
            console.print(f"service/{name} generation {view['generation']} is Ready at {view['ingress']['url']}")
            return
        if time.monotonic() >= deadline:
            ready = _condition(view, "Ready") or {}
            errors.print(
                f"timed out waiting for service/{name}: Ready={ready.get('status')} "
                f"({ready.get('reason')}: {ready.get('message')})"
            )
            raise typer.Exit(2)
        time.sleep(0.5)


@app.command()
def down(
    state_dir: StateDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for everything to stop.")] = 120,
) -> None:
    """Stop the daemon, the ingress and every cluster (the specs stay stored)."""
    directory = _state(state_dir)
    if read_api_info(directory) is not None and _api_answers(directory):
        client = ApiClient(directory)
        client.call("POST", "/api/v1/shutdown", json={"stopClusters": True})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and read_api_info(directory) is not None:
            time.sleep(0.2)
        while time.monotonic() < deadline and psutil.pid_exists(client.pid) and not _is_zombie(client.pid):
            time.sleep(0.2)
        if read_api_info(directory) is not None or (psutil.pid_exists(client.pid) and not _is_zombie(client.pid)):
            errors.print("[red]the daemon did not stop in time[/red]")
            raise typer.Exit(1)
    else:
        from servekeeper.offline import stop_everything_offline

        try:
            stopped = asyncio.run(stop_everything_offline(directory))
        except StoreError as exc:
            errors.print(str(exc), style="red", markup=False)
            raise typer.Exit(1) from exc
        console.print(f"no daemon was running; stopped {stopped} cluster(s) and the ingress directly")
    console.print("servekeeper is down")


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def main() -> None:
    app(prog_name="servekeeper")


if __name__ == "__main__":
    main()
