"""The `servekeeper` command line. Every command but `up` talks to the daemon's API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated

import psutil
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from servekeeper.cli.hosts import hosts_app
from servekeeper.client import (
    ApiError,
    Client,
    Conflict,
    DaemonNotRunning,
    RevisionNotFound,
    RolloutFailed,
    ServekeeperError,
    ServiceNotFound,
    SpecInvalid,
    WaitTimeout,
    default_state_dir,
    read_api_info,
)
from servekeeper.daemon import DaemonError, configure_logging, run_daemon, start_detached
from servekeeper.kuberay.status import kuberay_service
from servekeeper.model.wire import EventView, RevisionView, is_true
from servekeeper.rayapi.jobs import NoSuchCluster, env_lines, pick_cluster, pool_access, submit_job
from servekeeper.store.secrets import SecretError, delete_secret, list_secrets, parse_pairs, secrets_dir, set_secret
from servekeeper.store.store import StoreError

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


def _client(state_dir: Path | None) -> Client:
    """The daemon's Python client (servekeeper.client): every command talks to the API through it."""
    return Client(_state(state_dir))


@contextlib.contextmanager
def _shown_errors() -> Iterator[None]:
    """The client's errors as the CLI shows them, with its exit codes (1; 2 timeout; 3 not running)."""
    try:
        yield
    except DaemonNotRunning as exc:
        errors.print(str(exc))
        raise typer.Exit(EXIT_NOT_RUNNING) from exc
    except ServiceNotFound as exc:
        errors.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    except SpecInvalid as exc:
        errors.print(f"[red]invalid service spec{f' {exc.source}' if exc.source else ''}:[/red]")
        for problem in exc.problems:
            errors.print(f"  - {problem}", markup=False)
        raise typer.Exit(1) from exc
    except RolloutFailed as exc:
        errors.print(str(exc))
        raise typer.Exit(1) from exc
    except WaitTimeout as exc:
        errors.print(str(exc))
        raise typer.Exit(2) from exc
    except (Conflict, RevisionNotFound) as exc:  # promote/abort/undo refused: the daemon says why
        errors.print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from exc
    except ApiError as exc:
        errors.print(f"[red]API error {exc.status}:[/red] {exc.text}", markup=True)
        raise typer.Exit(1) from exc


@app.command()
def up(
    state_dir: StateDir = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Run in the background; return once the API answers.")
    ] = False,
    api_host: Annotated[str, typer.Option(help="Address the API binds to.")] = "127.0.0.1",
    api_port: Annotated[int, typer.Option(help="API port (0: pick a free one).")] = 0,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="Allow a non-loopback API address.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Also serve GET /metrics without the token on 127.0.0.1:PORT (0: pick a free one)."),
    ] = None,
    log_format: Annotated[
        str, typer.Option(help="text | json (one JSON object per line; events carry service and reason).")
    ] = "text",
) -> None:
    """Start the controller, its API and the ingress (re-adopting running clusters)."""
    directory = _state(state_dir)
    if log_format not in ("text", "json"):
        errors.print(f"--log-format must be text or json, not {log_format!r}", markup=False)
        raise typer.Exit(2)
    if detach:
        info = read_api_info(directory)
        if info is not None and _api_answers(directory):
            console.print(f"servekeeper already running (pid {info['pid']}), API {info['url']}")
            return
        extra = ["--api-host", api_host, "--api-port", str(api_port)] + (["--allow-remote"] if allow_remote else [])
        extra += ["--log-format", log_format] + ([] if metrics_port is None else ["--metrics-port", str(metrics_port)])
        try:
            info = start_detached(directory, extra)
        except DaemonError as exc:
            errors.print(str(exc), style="red", markup=False)
            raise typer.Exit(1) from exc
        console.print(f"servekeeper up (pid {info['pid']}), API {info['url']}, state in {directory}")
        return
    configure_logging(log_format)
    try:
        asyncio.run(run_daemon(directory, api_host, api_port, allow_remote, metrics_port))
    except (DaemonError, StoreError) as exc:
        errors.print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from exc


def _api_answers(directory: Path) -> bool:
    try:
        with Client(directory) as client:
            return client.healthz()
    except ServekeeperError:
        return False


@app.command()
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
    with _shown_errors():  # the file is checked before the daemon is looked for
        result = _client(state_dir).apply(file)
    verb = "configured" if result["changed"] else "unchanged"
    if result.get("kind") == "HostPool":  # `kind: HostPool`: see servekeeper hosts
        console.print(f"hostpool/{result['name']} {verb}")
        return
    console.print(f"service/{result['name']} {verb} (generation {result['generation']})")
    if watch:
        _watch(result["name"], state_dir, follow=True, timeout=timeout, events_from=applied_at - 1)


rollout = typer.Typer(no_args_is_help=True, help="Follow rollouts.")
app.add_typer(rollout, name="rollout")


@rollout.command("status")
def rollout_status(
    name: str,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Update in place until the rollout ends.")] = False,
    timeout: Annotated[float, typer.Option(help="With --watch: seconds to watch.")] = 900,
    state_dir: StateDir = None,
) -> None:
    """The rollout's phase, traffic split and latest events. Exit codes as `wait`: 0 rolled out,
    1 failed, 2 timed out (without --watch: 2 while it still goes on)."""
    _watch(name, state_dir, follow=watch, timeout=timeout, events_from=0.0)


def _watch(name: str, state_dir: Path | None, *, follow: bool, timeout: float, events_from: float) -> None:
    from servekeeper.cli.live import watch_rollout

    with _shown_errors():
        client = _client(state_dir)
        code = watch_rollout(
            lambda: client.get(name),
            lambda: client.events(name, limit=50),
            console,
            follow=follow,
            timeout=timeout,
            events_from=events_from,
        )
    raise typer.Exit(code)


@app.command()
def dashboard(
    state_dir: StateDir = None,
    open_browser: Annotated[bool, typer.Option("--open", help="Open the URL in a browser.")] = False,
) -> None:
    """Print a URL that logs a browser in to the web dashboard (a one-time code, valid 60 s,
    exchanged for a session cookie; the API token never leaves this machine's state dir)."""
    with _shown_errors():
        client = _client(state_dir)
        url = client.dashboard_login_url()
    console.print(url, markup=False, highlight=False, soft_wrap=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)


@app.command()
def delete(name: str, state_dir: StateDir = None) -> None:
    """Delete a service: stop every cluster of it and remove its route."""
    with _shown_errors():
        _client(state_dir).delete(name)
    console.print(f"service/{name} deleting")


@app.command()
def get(
    name: Annotated[str | None, typer.Argument()] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="table | json | kuberay")] = "table",
    state_dir: StateDir = None,
) -> None:
    """Show services (or one service)."""
    with _shown_errors():
        client = _client(state_dir)
        views = [client.get(name)] if name else client.list()
    if output == "json":
        print(json.dumps(views[0] if name else views, indent=2))
        return
    if output == "kuberay":  # KubeRay's RayService status shape, as `kubectl get rayservice -o json`
        objects = [kuberay_service(dict(view)) for view in views]
        print(json.dumps(objects[0] if name else {"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
        return
    table = Table("NAME", "READY", "GENERATION", "ACTIVE", "PENDING", "INGRESS", box=None)
    for view in views:
        active, pending = view["activeCluster"], view["pendingCluster"]
        table.add_row(
            view["name"],
            "True" if is_true(view, "Ready") else "False",
            f"{view['observedGeneration']}/{view['generation']}",
            active["name"] if active else "-",
            pending["name"] if pending else "-",
            view["ingress"]["url"],
        )
    console.print(table)


def _when(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S") if timestamp else "-"


@app.command()
def describe(name: str, state_dir: StateDir = None) -> None:
    """Conditions, clusters, applications and recent events of a service."""
    with _shown_errors():
        client = _client(state_dir)
        view = client.get(name)
        recent = client.events(name, limit=15)
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
    notes = view.get("importNotes") or []
    if notes:
        console.print(f"\n[bold]Ignored on this provider[/bold] (imported from {view.get('importedFrom')})")
        for note in notes:
            console.print(f"  {note['path']}  {note['kind']}: {note['message']}", markup=False)
    pending = view["pendingCluster"]
    canary = pending.get("canary") if pending else None
    if canary:
        from servekeeper.cli.live import canary_block

        console.print()
        console.print(canary_block(canary))
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
    _print_events(recent, title="\nRecent events")


@app.command()
def promote(
    name: str,
    full: Annotated[
        bool, typer.Option("--full", help="Skip every remaining step and analysis: all traffic to the new cluster.")
    ] = False,
    state_dir: StateDir = None,
) -> None:
    """Let a canary rollout go on past its current pause (or, with --full, finish it at once)."""
    with _shown_errors():
        result = _client(state_dir).promote(name, full=full)
    if full:
        console.print(f"service/{name} promoting {result['cluster']} fully: every remaining step skipped")
    else:
        console.print(f"service/{name} promoting {result['cluster']} (promote #{result['promoteRequests']})")


@app.command()
def abort(name: str, state_dir: StateDir = None) -> None:
    """Abort the rollout in progress: the new cluster loses its traffic at once and is removed."""
    with _shown_errors():
        result = _client(state_dir).abort(name)
    console.print(f"service/{name} aborting the rollout of {result['cluster']}")


@app.command()
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
    with _shown_errors():
        result = _client(state_dir).undo(name, to_revision=to_revision)
    if result["changed"]:
        console.print(
            f"service/{name} rolling back to revision {result['toRevision']} (generation {result['generation']})"
        )
    else:
        console.print(f"service/{name} unchanged: it already runs revision {result['toRevision']}'s spec")


@app.command()
def history(
    name: str,
    output: Annotated[str, typer.Option("-o", "--output", help="table | json")] = "table",
    state_dir: StateDir = None,
) -> None:
    """The service's revisions (oldest first): when, spec and code hashes, cause and outcome."""
    with _shown_errors():
        revisions = _client(state_dir).history(name)
    if output == "json":
        print(json.dumps(revisions, indent=2))
        return
    console.print(history_table(revisions))


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


def _print_events(items: list[EventView], title: str = "") -> None:
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
    with _shown_errors():
        items = _client(state_dir).events(name, limit=limit)
    _print_events(items)


@app.command()
def wait(
    name: str,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 900,
    state_dir: StateDir = None,
) -> None:
    """Exit 0 once the latest generation is rolled out and Ready, 1 if it failed, 2 on timeout."""
    with _shown_errors():  # RolloutFailed: exit 1, WaitTimeout: exit 2
        view = _client(state_dir).wait(name, timeout=timeout)
    console.print(f"service/{name} generation {view['generation']} is Ready at {view['ingress']['url']}")


@app.command()
def export(
    name: str,
    output_format: Annotated[str, typer.Option("--format", help="kuberay")] = "kuberay",
    state_dir: StateDir = None,
) -> None:
    """Print the service as a KubeRay RayService manifest (ray.io/v1)."""
    with _shown_errors():
        print(_client(state_dir).export(name, format=output_format), end="")


secret_app = typer.Typer(no_args_is_help=True, help="Secrets that KubeRay manifests name in valueFrom.secretKeyRef.")
app.add_typer(secret_app, name="secret")
app.add_typer(hosts_app, name="hosts")  # host pools (issue 10): cli_hosts.py


@secret_app.command("set")
def secret_set(
    name: str,
    pairs: Annotated[list[str], typer.Argument(help="KEY=VALUE pairs")],
    state_dir: StateDir = None,
) -> None:
    """Create or replace a secret (stored mode 0600 in the state dir); re-apply to use new values."""
    try:
        set_secret(secrets_dir(_state(state_dir)), name, parse_pairs(pairs))
    except SecretError as exc:
        errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    console.print(f"secret/{name} set ({len(pairs)} key(s))")


@secret_app.command("list")
def secret_list(state_dir: StateDir = None) -> None:
    """Secrets and their key names (never the values)."""
    table = Table("NAME", "KEYS", box=None)
    for name, keys in list_secrets(secrets_dir(_state(state_dir))).items():
        table.add_row(name, ", ".join(keys))
    console.print(table)


@secret_app.command("delete")
def secret_delete(name: str, state_dir: StateDir = None) -> None:
    """Delete a secret (services applied with it keep the values they were given)."""
    try:
        deleted = delete_secret(secrets_dir(_state(state_dir)), name)
    except SecretError as exc:
        errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    if not deleted:
        errors.print(f"secret {name!r} not found")
        raise typer.Exit(1)
    console.print(f"secret/{name} deleted")


job_app = typer.Typer(no_args_is_help=True, help="Ray jobs on a service's cluster.")
app.add_typer(job_app, name="job")


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
        errors.print("--cluster must be active or pending")
        raise typer.Exit(1)
    client = _client(state_dir)
    with _shown_errors():
        view = client.get(name)
    headers, python_dir = None, None
    try:
        target = pick_cluster(dict(view), cluster)
        if target.get("hostPool"):
            with _shown_errors():
                pools = [dict(pool) for pool in client.host_pools(str(target["hostPool"]))]
            headers, python_dir = pool_access(target, _state(state_dir), pools)
    except NoSuchCluster as exc:
        errors.print(str(exc), markup=False)
        raise typer.Exit(1) from exc
    raise typer.Exit(
        submit_job(str(target["dashboardUrl"]), entrypoint, working_dir, headers=headers, python_dir=python_dir)
    )


@app.command("env")
def env_command(
    name: str,
    cluster: Annotated[str, typer.Option("--cluster", help="active | pending")] = "active",
    state_dir: StateDir = None,
) -> None:
    """`export` lines that let a local `ray.init()` reach the service's cluster."""
    with _shown_errors():
        view = _client(state_dir).get(name)
    try:
        print("\n".join(env_lines(dict(view), cluster, _state(state_dir))))
    except NoSuchCluster as exc:
        errors.print(str(exc), markup=False)  # a name like [x] is text, not Rich markup
        raise typer.Exit(1) from exc


@app.command()
def down(
    state_dir: StateDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for everything to stop.")] = 120,
) -> None:
    """Stop the daemon, the ingress and every cluster (the specs stay stored)."""
    directory = _state(state_dir)
    if read_api_info(directory) is not None and _api_answers(directory):
        client = Client(directory)
        pid = client.daemon_pid or -1  # read before the daemon removes api.json
        with _shown_errors():
            client.shutdown(stop_clusters=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and read_api_info(directory) is not None:
            time.sleep(0.2)
        while time.monotonic() < deadline and psutil.pid_exists(pid) and not _is_zombie(pid):
            time.sleep(0.2)
        if read_api_info(directory) is not None or (psutil.pid_exists(pid) and not _is_zombie(pid)):
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
