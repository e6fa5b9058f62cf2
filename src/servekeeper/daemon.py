"""`servekeeper up`: the controller, its loopback API, and the ingress process beside it.

Files in the state dir:
  store.db        everything servekeeper knows (SQLite, WAL)
  token           the API bearer token (mode 0600), created on first `up`
  api.json        where the running daemon's API listens, and its pid
  controller.pid  the running controller's pid
  controller.lock held while a controller runs: one controller per state dir
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import aiohttp
import uvicorn

from servekeeper.api.app import build_app
from servekeeper.api.metrics import add_metrics_route, build_metrics_app
from servekeeper.client import default_state_dir as default_state_dir  # re-exported: the client
from servekeeper.client import read_api_info as read_api_info  # reads what the daemon writes
from servekeeper.client.common import LOCK_FILE_NAME
from servekeeper.controller.faults import hooks_from_environment
from servekeeper.controller.loop import Controller
from servekeeper.controller.metrics import ControllerMetrics, Metrics
from servekeeper.core.hooks import Hooks
from servekeeper.dataplane import DataPlane, DataPlaneError
from servekeeper.model.enums import SwitchGate
from servekeeper.providers.environments import environments_of
from servekeeper.providers.host_environments import HostEnvironments
from servekeeper.providers.local import LocalProvider
from servekeeper.providers.local_monitor import NodeApi, point_monitors_at
from servekeeper.providers.pool import PoolProvider
from servekeeper.providers.ports import PortAllocator
from servekeeper.providers.redis_server import RedisServer, redis_dir
from servekeeper.providers.router import ProviderRouter
from servekeeper.store.store import Store, private_state_dir
from servekeeper.web.pages import Dashboard

logger = logging.getLogger(__name__)

GATE_ENV = "SERVEKEEPER_UNSAFE_SWITCH_GATE"  # tests and benchmarks only: ready | healthy | none
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class DaemonError(RuntimeError):
    pass


def ensure_token(state_dir: Path) -> str:
    path = state_dir / "token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32))
    os.chmod(path, 0o600)
    return path.read_text().strip()


LOCK_TRIES = 10  # a client's probe holds the lock for microseconds: try again a moment later
LOCK_RETRY_S = 0.05


def _take_lock(state_dir: Path) -> IO[str]:
    """One controller per state dir. The holder writes its pid in the lock file and removes a
    stale api.json at once: clients send the token only when both name the same live daemon."""
    handle = open(state_dir / LOCK_FILE_NAME, "a+")
    for attempt in range(LOCK_TRIES):
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError as exc:
            if attempt + 1 < LOCK_TRIES:
                time.sleep(LOCK_RETRY_S)
                continue
            handle.close()
            info = read_api_info(state_dir) or {}
            raise DaemonError(f"a controller already runs for {state_dir} (pid {info.get('pid', '?')})") from exc
    with contextlib.suppress(FileNotFoundError):
        (state_dir / "api.json").unlink()  # a dead daemon's: names a port anyone may bind now
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


async def stop_data_plane(dataplane: DataPlane) -> None:
    """`down`: no route left behind (the next `up` starts clean), then the Envoy processes."""
    with contextlib.suppress(DataPlaneError):
        for service in await dataplane.routes():
            await dataplane.remove_route(service)
    await dataplane.stop()
    dataplane.forget_routes()  # even if a process could not be read above


async def run_daemon(
    state_dir: Path,
    api_host: str = "127.0.0.1",
    api_port: int = 0,
    allow_remote: bool = False,
    metrics_port: int | None = None,
) -> None:
    """`metrics_port`: also serve GET /metrics without the token on 127.0.0.1:PORT (0: any free port)."""
    if api_host not in LOOPBACK_HOSTS and not allow_remote:
        raise DaemonError(f"refusing to bind the API to {api_host}: pass --allow-remote to expose it")
    lock, token, store = _open_state(state_dir)
    gate = _switch_gate()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        # Envoy runs in processes of its own: adopted if they run, started if not; they outlive
        # this daemon (even kill -9), and the supervisor restarts any that dies.
        dataplane = DataPlane(state_dir)
        await dataplane.start_or_adopt()
        hooks = hooks_from_environment()  # tests and benchmarks only; production gets no-op hooks
        controller_metrics = ControllerMetrics()
        port = api_port or PortAllocator().one()
        node_api = NodeApi(f"http://{_url_host(api_host)}:{port}", token)
        point_monitors_at(node_api, store.list_clusters(), configs=True)  # heads that outlived the last daemon
        provider = _providers(store, state_dir, hooks, node_api)
        controller = Controller(
            store, provider, dataplane, session, state_dir, gate=gate, hooks=hooks, metrics=controller_metrics
        )
        metrics = Metrics(
            store, controller_metrics, controller.status_snapshot, dataplane.routes, dataplane.backend_stats
        )
        stop = asyncio.Event()
        supervisor = asyncio.create_task(dataplane.supervise(stop), name="dataplane-supervisor")
        dashboard = Dashboard()  # /ui: its logins, and the ingress stats its charts draw
        sampler = asyncio.create_task(dashboard.history.run(dataplane.backend_stats, stop), name="stats-history")
        shutdown = _ShutdownRequest()
        app = build_app(
            controller, store, token, shutdown.request, packages_dir=state_dir / "packages", dashboard=dashboard
        )
        add_metrics_route(app, metrics)  # behind the token, like every call of the API
        server = shutdown.server = _server(app, api_host, port)
        loop_task = asyncio.create_task(controller.run(stop), name="controller")
        serve_task = asyncio.create_task(server.serve(), name="api")
        background = (loop_task, supervisor, sampler)
        if not await _started(server, serve_task):
            await _wind_down(stop, background)
            await dataplane.close()
            raise DaemonError(f"the API could not listen on {api_host}:{port}")
        metrics_server = await _announce(state_dir, api_host, port, metrics, metrics_port)
        try:
            await serve_task
        finally:
            if metrics_server is not None:
                metrics_server.should_exit = True
            await _wind_down(stop, background)
            await controller.shutdown(stop_clusters=shutdown.stop_clusters)
            await _let_go(state_dir, dataplane, shutdown.stop_clusters)
            if shutdown.stop_clusters and not store.list_clusters():  # no GCS needs it any more
                await asyncio.to_thread(RedisServer(redis_dir(state_dir)).stop)
            store.close()
            lock.close()


def _providers(store: Store, state_dir: Path, hooks: Hooks, node_api: NodeApi) -> ProviderRouter:
    """Built once: each cluster goes to this machine's provider or its host pool's; both find a
    cluster's own environment under one state dir."""
    environments = environments_of(state_dir)
    pool = PoolProvider(
        store, state_dir, host_environments=HostEnvironments(environments), node_api=node_api, hooks=hooks
    )
    return ProviderRouter(LocalProvider(hooks, environments, node_api), pool)


async def _wind_down(stop: asyncio.Event, tasks: tuple[asyncio.Task[None], ...]) -> None:
    """Tell the background tasks to stop, and wait for each to end."""
    stop.set()
    for task in tasks:
        await task


async def _let_go(state_dir: Path, dataplane: DataPlane, stop_everything: bool) -> None:
    """`down` stops the Envoy processes too; an exit otherwise leaves them serving. Either way
    the files that say a daemon runs go."""
    if stop_everything:
        await stop_data_plane(dataplane)
    else:
        await dataplane.close()
    for name in ("api.json", "controller.pid"):
        with contextlib.suppress(FileNotFoundError):
            (state_dir / name).unlink()


def _open_state(state_dir: Path) -> tuple[IO[str], str, Store]:
    """The state dir's lock (one controller per state dir), API token and store."""
    private_state_dir(state_dir)
    lock = _take_lock(state_dir)
    token = ensure_token(state_dir)
    return lock, token, Store(state_dir / "store.db")


class _ShutdownRequest:
    """What the API's shutdown call asked for: the API server exits, and then `down` also stops
    the clusters and the Envoy processes."""

    def __init__(self) -> None:
        self.stop_clusters = False
        self.server: uvicorn.Server | None = None

    async def request(self, stop_clusters: bool) -> None:
        self.stop_clusters = stop_clusters
        if self.server is not None:
            self.server.should_exit = True


def _switch_gate() -> SwitchGate:
    gate = SwitchGate(os.environ.get(GATE_ENV, SwitchGate.READY.value))
    if gate != SwitchGate.READY:
        logger.warning("UNSAFE: traffic switches on the %r gate (%s is set)", gate.value, GATE_ENV)
    return gate


def _server(app: Any, host: str, port: int) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", access_log=False)
    )


async def _started(server: uvicorn.Server, task: asyncio.Task[None]) -> bool:
    """Wait until the server listens (True) or its task ended, having failed to (False)."""
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    return not task.done()


async def _announce(
    state_dir: Path, api_host: str, port: int, metrics: Metrics, metrics_port: int | None
) -> uvicorn.Server | None:
    """Start the metrics endpoint if asked for, then tell clients where the API is (api.json)."""
    metrics_server = None
    if metrics_port is not None:
        metrics_server = await _serve_metrics(metrics, metrics_port)
    (state_dir / "controller.pid").write_text(str(os.getpid()))
    api_info: dict[str, Any] = {"url": f"http://{_url_host(api_host)}:{port}", "pid": os.getpid()}
    if metrics_server is not None:
        api_info["metricsUrl"] = f"http://127.0.0.1:{metrics_server.config.port}/metrics"
    _write_json(state_dir / "api.json", api_info)
    logger.info("servekeeper is up: API on %s:%d, state in %s", api_host, port, state_dir)
    return metrics_server


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "localhost") else (f"[{host}]" if ":" in host else host)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def start_detached(state_dir: Path, extra_args: list[str], timeout: float = 60.0) -> dict[str, Any]:
    """Start `servekeeper up` in a session of its own; return once its API answers."""
    private_state_dir(state_dir)
    with open(state_dir / "controller.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "servekeeper.cli", "up", "--state-dir", str(state_dir), *extra_args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = read_api_info(state_dir)
        if info and info.get("pid") == process.pid:
            return info
        if process.poll() is not None:
            raise DaemonError(f"servekeeper up exited with {process.returncode}; see {state_dir}/controller.log")
        time.sleep(0.1)
    raise DaemonError(f"servekeeper up did not answer within {timeout:g}s; see {state_dir}/controller.log")


async def _serve_metrics(metrics: Metrics, port: int) -> uvicorn.Server:
    """GET /metrics without the token, on loopback only: for a local Prometheus (or its agent)."""
    port = port or PortAllocator().one()
    server = _server(build_metrics_app(metrics), "127.0.0.1", port)
    task = asyncio.create_task(server.serve(), name="metrics")
    if not await _started(server, task):
        raise DaemonError(f"the metrics endpoint could not listen on 127.0.0.1:{port}")
    logger.info("metrics without the token on http://127.0.0.1:%d/metrics", port)
    return server


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line (`up --log-format json`); a controller event carries its fields
    (`service`, `event_type`, `reason`, `event_time`) beside the message."""

    FIELDS = ("service", "event_type", "reason", "event_time")

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in self.FIELDS:
            if name in record.__dict__:
                line[name] = record.__dict__[name]
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str = "text") -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # asyncssh logs every channel it opens at INFO: a pool daemon's watch alone wrote ~130,000
    # lines in 20 minutes of a CI run, burying the controller's own. Its warnings still show.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
