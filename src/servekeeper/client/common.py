"""What the blocking and the async client share: where the daemon is, what its answers mean,
and what `apply` sends. Nothing here does I/O with the daemon itself.

Without `url` and `token` a client reads the state dir (`--state-dir`, `SERVEKEEPER_STATE_DIR`,
or `~/.servekeeper`) on every call: `api.json` (where the running daemon listens) and `token`,
so a client made before `servekeeper up`, or one that outlives a restart of the daemon on
another port, finds it. The token goes only to the daemon that holds the state dir's lock
(`controller.lock`, with its pid written in it) and whose pid `api.json` names: after a kill -9,
`api.json` still names a loopback port any local user may bind.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from servekeeper.client.errors import (
    ApiError,
    Conflict,
    DaemonNotRunning,
    RevisionNotFound,
    RolloutFailed,
    ServiceNotFound,
    SpecInvalid,
    Unauthorized,
)
from servekeeper.model.documents import is_kuberay
from servekeeper.model.hostpool import is_host_pool, parse_host_pool, read_single_document
from servekeeper.model.spec import MAX_SPEC_BYTES, ServiceSpec, SpecError, load_spec_file
from servekeeper.model.wire import EventView, HostPoolView, RevisionView, ServiceView, condition, is_true

DEFAULT_TIMEOUT_S = 30.0
WAIT_POLL_S = 0.5
HOST_CHECK_TIMEOUT_S = 120.0  # every host at once, each with its connect timeout and a retry

SpecSource = str | os.PathLike[str] | Mapping[str, Any] | ServiceSpec
# Aliases: inside the client classes `list` names a method.
ServiceViews = list[ServiceView]
EventViews = list[EventView]
RevisionViews = list[RevisionView]
HostPoolViews = list[HostPoolView]


def default_state_dir() -> Path:
    configured = os.environ.get("SERVEKEEPER_STATE_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".servekeeper"


LOCK_FILE_NAME = "controller.lock"  # flock'd by the running daemon, which writes its pid in it


def lock_holder_pid(state_dir: Path) -> int | None:
    """The pid of the daemon holding the state dir's lock, or None if no daemon holds it.

    Probed with a shared lock taken and dropped at once (the daemon retries its own for a
    moment, so a probe never makes a starting daemon think another one runs)."""
    try:
        fd = os.open(state_dir / LOCK_FILE_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            written = os.read(fd, 32).decode(errors="replace").strip()
            return int(written) if written.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # nobody holds it: the daemon that wrote api.json is gone
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Is `pid` a live process of ours? (A child of a killed daemon may still hold its lock.)"""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def read_api_info(state_dir: Path) -> dict[str, Any] | None:
    """What the running daemon wrote in `api.json` (`url`, `pid`), or None."""
    try:
        return dict(json.loads((state_dir / "api.json").read_text()))
    except (OSError, ValueError):
        return None


class Endpoint:
    """Where the daemon is and how to authenticate: given, or read from the state dir."""

    def __init__(self, state_dir: str | os.PathLike[str] | None, url: str | None, token: str | None) -> None:
        if (url is None) != (token is None):
            raise ValueError("give both url and token, or neither (then they are read from the state dir)")
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().resolve()
        self._url = url.rstrip("/") if url else None
        self._token = token

    @property
    def where(self) -> str:
        return self._url or str(self.state_dir)

    def resolve(self) -> tuple[str, dict[str, str]]:
        if self._url is not None and self._token is not None:
            return self._url, {"Authorization": f"Bearer {self._token}"}
        info = read_api_info(self.state_dir)
        try:
            token = (self.state_dir / "token").read_text().strip()
        except OSError:
            token = None
        if info is None or token is None or "url" not in info:
            raise DaemonNotRunning(self.where)
        holder = lock_holder_pid(self.state_dir)
        if holder is None or info.get("pid") != holder or not _alive(holder):
            # Stale api.json (kill -9, or a daemon starting): nothing is sent anywhere.
            cause = "no daemon holds the state dir's lock" if holder is None else f"api.json is not from pid {holder}"
            raise DaemonNotRunning(self.where, cause)
        return str(info["url"]), {"Authorization": f"Bearer {token}"}

    def daemon_pid(self) -> int | None:
        info = read_api_info(self.state_dir) if self._url is None else None
        return int(info["pid"]) if info and "pid" in info else None


def decoded_answer(response: httpx.Response) -> Any:
    """The decoded answer, or the matching error."""
    if response.status_code < 400:
        return response.json()
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    if response.status_code == 401:
        raise Unauthorized(401, detail, response.text)
    if response.status_code == 404:
        if isinstance(detail, str) and detail.startswith("revision "):
            raise RevisionNotFound(404, detail, response.text, message=detail)
        raise ServiceNotFound(404, detail, response.text, message=str(detail))
    if response.status_code == 409:
        raise Conflict(409, detail, response.text, message=str(detail))
    if response.status_code == 422:
        problems = detail.get("problems") if isinstance(detail, dict) else None
        if not isinstance(problems, list):
            problems = [json.dumps(detail)]
        raise SpecInvalid([str(p) for p in problems])
    raise ApiError(response.status_code, detail, response.text)


def apply_request(spec: SpecSource) -> tuple[str, dict[str, Any]]:
    """Where `apply` POSTs, and what: a host pool to its own path, anything else as a service."""
    pool = host_pool_document(spec)
    if pool is not None:
        return "/api/v1/hostpools", {"spec": pool}
    return "/api/v1/services", apply_body(spec)


def apply_body(spec: SpecSource) -> dict[str, Any]:
    """What `apply` POSTs for a service. A KubeRay manifest file goes as it is, every document of
    it, with its folder: the daemon translates it (and keeps the notes), so the CLI and this
    client agree."""
    if not isinstance(spec, (ServiceSpec, Mapping)):
        path = Path(spec)
        documents = _kuberay_documents(path)
        if documents is not None:
            return {"documents": documents, "baseDir": str(path.parent.resolve())}
    return {"spec": _spec_document(spec)}


def _kuberay_documents(path: Path) -> list[Any] | None:
    try:
        text = path.read_text()
    except OSError:
        return None  # load_spec_file reports it
    if len(text.encode()) > MAX_SPEC_BYTES:
        return None
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return None
    return documents if is_kuberay(documents) else None


def _spec_document(spec: SpecSource) -> dict[str, Any]:
    """A file is read and checked here (a relative workingDir is resolved against its folder),
    so a bad file is refused before the daemon is even looked for; a mapping is sent as it is
    (its workingDir should be absolute) and checked by the daemon."""
    if isinstance(spec, ServiceSpec):
        return spec.model_dump(mode="json")
    if isinstance(spec, Mapping):
        return dict(spec)
    path = Path(spec)
    try:
        return load_spec_file(path).model_dump(mode="json")
    except SpecError as exc:
        raise SpecInvalid(exc.problems, source=str(path)) from exc


def host_pool_document(spec: SpecSource) -> dict[str, Any] | None:
    """A HostPool (a file or a mapping whose kind says so) as `apply` posts it, else None. A file
    is checked here, like a service spec, so a bad one never reaches the daemon."""
    if isinstance(spec, ServiceSpec):
        return None
    if isinstance(spec, Mapping):
        return dict(spec) if is_host_pool(dict(spec)) else None
    path = Path(spec)
    try:
        document = read_single_document(path)
    except SpecError:
        return None  # reported as the service spec it then is taken for
    if not is_host_pool(document):
        return None
    try:
        return parse_host_pool(document).model_dump(mode="json")
    except SpecError as exc:
        raise SpecInvalid(exc.problems, source=str(path)) from exc


def wait_verdict(view: ServiceView) -> bool:
    """True once the latest generation is rolled out and Ready; raises if it will not be."""
    current = view.get("observedGeneration") == view.get("generation")
    if current:
        for failed_type in ("RolloutFailed", "ClusterSpecOutdated"):
            failed = condition(view, failed_type)
            if failed is not None and failed["status"] == "True":
                raise RolloutFailed(view, failed)
    return current and is_true(view, "Ready") and not is_true(view, "UpgradeInProgress")


def events_params(name: str | None, limit: int) -> dict[str, Any]:
    return {"limit": limit, **({"service": name} if name else {})}
