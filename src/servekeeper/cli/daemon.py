"""`servekeeper up`, `down` and `dashboard`: the daemon's life, and the way into its web dashboard."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import psutil
import typer

from servekeeper.cli import common
from servekeeper.cli.common import StateDir
from servekeeper.client import Client, ServekeeperError, read_api_info
from servekeeper.store.store import StoreError


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
    directory = common.state_path(state_dir)
    if log_format not in ("text", "json"):
        common.errors.print(f"--log-format must be text or json, not {log_format!r}", markup=False)
        raise typer.Exit(2)
    if detach:
        extra = ["--api-host", api_host, "--api-port", str(api_port)] + (["--allow-remote"] if allow_remote else [])
        extra += ["--log-format", log_format] + ([] if metrics_port is None else ["--metrics-port", str(metrics_port)])
        _start_detached(directory, extra)
        return
    # The daemon (FastAPI, the controller, every provider) is imported by `up` alone: every other
    # command starts in a third of the time without it (tests and scripts call the CLI hundreds of
    # times; a busy machine made each call seconds).
    from servekeeper.daemon import DaemonError, configure_logging, run_daemon

    configure_logging(log_format)
    try:
        asyncio.run(run_daemon(directory, api_host, api_port, allow_remote, metrics_port))
    except (DaemonError, StoreError) as exc:
        common.errors.print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from exc


def _start_detached(directory: Path, extra: list[str]) -> None:
    from servekeeper.daemon import DaemonError, start_detached

    info = read_api_info(directory)
    if info is not None and _api_answers(directory):
        common.console.print(f"servekeeper already running (pid {info['pid']}), API {info['url']}")
        return
    try:
        info = start_detached(directory, extra)
    except DaemonError as exc:
        common.errors.print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from exc
    common.console.print(f"servekeeper up (pid {info['pid']}), API {info['url']}, state in {directory}")


def _api_answers(directory: Path) -> bool:
    try:
        with Client(directory) as client:
            return client.healthz()
    except ServekeeperError:
        return False


def dashboard(
    state_dir: StateDir = None,
    open_browser: Annotated[bool, typer.Option("--open", help="Open the URL in a browser.")] = False,
) -> None:
    """Print a URL that logs a browser in to the web dashboard: its secret path (new with every
    daemon, also the session cookie's Path) and a one-time code, valid 60 s, exchanged for a
    session cookie; the API token never leaves this machine's state dir."""
    with common.shown_errors():
        client = common.client(state_dir)
        url = client.dashboard_login_url()
    common.console.print(url, markup=False, highlight=False, soft_wrap=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)


def down(
    state_dir: StateDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for everything to stop.")] = 120,
) -> None:
    """Stop the daemon, the ingress and every cluster (the specs stay stored)."""
    directory = common.state_path(state_dir)
    if read_api_info(directory) is not None and _api_answers(directory):
        _stop_daemon(directory, timeout)
    else:
        from servekeeper.offline import StateDirBusy, stop_everything_offline

        try:
            stopped = asyncio.run(stop_everything_offline(directory))
        except (StoreError, StateDirBusy, OSError) as exc:
            common.errors.print(str(exc), style="red", markup=False)
            raise typer.Exit(1) from exc
        common.console.print(f"no daemon was running; stopped {stopped.stopped} cluster(s) and the ingress directly")
        for kept in stopped.kept:
            common.errors.print(f"kept on record (run `servekeeper down` again): {kept}", markup=False)
        if stopped.kept:
            raise typer.Exit(1)
    common.console.print("servekeeper is down")


def _stop_daemon(directory: Path, timeout: float) -> None:
    """Ask the running daemon to stop everything; wait until it is gone (exit 1 if it is not in time)."""
    client = Client(directory)
    pid = client.daemon_pid or -1  # read before the daemon removes api.json
    with common.shown_errors():
        client.shutdown(stop_clusters=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and read_api_info(directory) is not None:
        time.sleep(0.2)
    while time.monotonic() < deadline and psutil.pid_exists(pid) and not _is_zombie(pid):
        time.sleep(0.2)
    if read_api_info(directory) is not None or (psutil.pid_exists(pid) and not _is_zombie(pid)):
        common.errors.print("[red]the daemon did not stop in time[/red]")
        raise typer.Exit(1)


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
