"""A pool cluster's own environment on its hosts (issue 21): hosts need a Python interpreter and
sshd, no package index. The controller downloads the lock's wheels once (pip, for the host's
Python), copies to each host over SFTP those it lacks (compared by sha256) together with uv's
binary, and uv installs them there offline into `<workDir>/environments/<key>`; a marker written
last tells a finished environment from a cut one. Hosts share the controller's platform (the
wheels are picked for it)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path

import uv
from packaging.utils import canonicalize_name

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.providers.base import RetryableProviderError
from servekeeper.providers.environments import (
    ANSWER_TAIL,
    READY_MARK,
    WHEELHOUSES,
    Environment,
    EnvironmentFailed,
    EnvironmentRequest,
    Environments,
    run_command,
)
from servekeeper.providers.ray_release import configured_index
from servekeeper.providers.ssh import CommandFailed
from servekeeper.providers.ssh_nodes import SshNodes

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"  # a wheelhouse's files and their sha256, written last
HOST_WHEELS = "wheels"  # under a host's workDir: every environment's wheels, shared
HOST_TOOLS = "tools"  # under a host's workDir: uv's binary
HOST_ENVIRONMENTS = "environments"  # under a host's workDir
INSTALL_TIMEOUT_SECONDS = 900.0
DOWNLOAD_FAILURE_KEPT_SECONDS = 10.0  # the hosts of one start share a failed download's answer

# (argv, extra environment) -> (exit code, output): a local command (pip download) or a stand-in
Command = Callable[[Sequence[str], dict[str, str]], Awaitable[tuple[int, str]]]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class HostEnvironments:
    """The environments of pool clusters, on their hosts: made ready once per (host, environment)."""

    def __init__(
        self, environments: Environments, download: Command = run_command, uv_binary: str | None = None
    ) -> None:
        self.environments = environments
        self.download = download
        self.uv_binary = Path(uv_binary or uv.find_uv_bin())
        self._locks: dict[str, asyncio.Lock] = {}
        # environment key -> when (time.monotonic()) a cluster last asked for it here: a prune
        # keeps one asked for after it read the store, whatever the keys it is told
        self._asked: dict[str, float] = {}
        self._failed_downloads: dict[str, tuple[float, Exception]] = {}  # key -> (when, what)

    async def pythons_on(self, ssh: SshNodes, hosts: Sequence[str], config: RayClusterConfigSpec) -> dict[str, str]:
        """Host -> the interpreter of the cluster's own environment there, for the `hosts` its
        nodes are about to start on; empty for a cluster on the hosts' own Ray and Python.
        The hosts are made ready at once (the wheels downloaded once, before any copy); every
        host's work ends before the first failure, in host order, is raised."""
        unique = list(dict.fromkeys(hosts))
        answers = await asyncio.gather(*(self.python_on(ssh, host, config) for host in unique), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return {host: python for host, python in zip(unique, answers, strict=True) if isinstance(python, str)}

    async def python_on(self, ssh: SshNodes, host: str, config: RayClusterConfigSpec) -> str | None:
        """The interpreter of the cluster's own environment on `host`, made ready first; None
        for a cluster on the hosts' own Ray and Python."""
        request = EnvironmentRequest.of(config)
        if request is None:
            return None
        environment = self.environments.lookup(config)
        assert environment is not None
        self._asked[environment.key] = time.monotonic()
        spec = ssh.host(host)
        directory = f"{spec.workDir.rstrip('/')}/{HOST_ENVIRONMENTS}/{environment.key}"
        # The marker is looked at every time (one quick command): a host rebooted with its
        # workDir under /tmp has lost the environment, and gets it again.
        async with self._locks.setdefault(f"{host} {environment.key}", asyncio.Lock()):
            if not await self._marked(ssh, host, directory):
                async with self._host_lock(host):  # never beside a prune of that host
                    await self._install(ssh, host, directory, environment, request)
        return f"{directory}/bin/python"

    async def prune(self, ssh: SshNodes, hosts: Sequence[str], keep: Collection[str], read_at: float) -> None:
        """On each of `hosts`, delete the environments whose key is not in `keep` (read from the
        store at `read_at`) nor asked for since, and the wheels no kept environment's wheelhouse
        lists (a later install copies what it lacks again). A host that does not answer keeps
        them until the next prune; it never fails one."""
        answers = await asyncio.gather(
            *(self._prune_host(ssh, host, set(keep), read_at) for host in hosts), return_exceptions=True
        )
        for host, answer in zip(hosts, answers, strict=True):
            if isinstance(answer, Exception):
                logger.warning("host %s: unused environments not deleted: %s", host, answer)

    async def _prune_host(self, ssh: SshNodes, host: str, keep: set[str], read_at: float) -> None:
        work_dir = ssh.host(host).workDir.rstrip("/")
        if not work_dir:
            return  # a workDir of "/": its environments/ and wheels/ are not ours to clean
        # Only environments this controller resolved: another one's on a shared workDir stay.
        ours = self.environments.known_keys()
        async with self._host_lock(host):  # no install copies or syncs meanwhile
            environments = await self._listing(ssh, host, f"{work_dir}/{HOST_ENVIRONMENTS}")
            wheel_files = await self._listing(ssh, host, f"{work_dir}/{HOST_WHEELS}")
            # A cluster created since the store was read keeps its own.
            keep |= {key for key, when in self._asked.items() if when >= read_at}
            wheels: set[str] = set()
            for key in keep:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    wheels |= set(_manifest(self.environments.root / WHEELHOUSES / key))
            stale = [path for path in environments if _key_of(path) in ours - keep]  # KEY/ and KEY.txt
            # Wheels are needed only while an install runs: one gone is copied again if needed.
            stale += [path for path in wheel_files if path.endswith(".whl") and _base(path) not in wheels]
            if stale:
                await ssh.connection(host).run(["rm", "-rf", "--", *stale], timeout=INSTALL_TIMEOUT_SECONDS)
                logger.info("host %s: deleted %d environments and wheels no cluster uses", host, len(stale))

    def _host_lock(self, host: str) -> asyncio.Lock:
        return self._locks.setdefault(f"host {host}", asyncio.Lock())

    @staticmethod
    async def _listing(ssh: SshNodes, host: str, folder: str) -> list[str]:
        """The paths in `folder` on `host` (none when it does not exist)."""
        listing = await ssh.connection(host).run(["ls", "-1", folder], check=False, quick=True)
        return [f"{folder}/{name}" for name in listing.stdout.split()]

    async def _marked(self, ssh: SshNodes, host: str, directory: str) -> bool:
        answer = await ssh.connection(host).run(["test", "-e", f"{directory}/{READY_MARK}"], check=False, quick=True)
        return answer.exit_status == 0

    async def _install(
        self, ssh: SshNodes, host: str, directory: str, environment: Environment, request: EnvironmentRequest
    ) -> None:
        started = time.monotonic()
        work_dir = ssh.host(host).workDir.rstrip("/")
        interpreter = await self._interpreter(ssh, host, request)
        wheelhouse = await self.wheelhouse(environment, request)
        wheels = {name: (wheelhouse / name, sha) for name, sha in _manifest(wheelhouse).items()}
        uv_name = f"uv-{sha256_of(self.uv_binary)[:12]}"
        copied = await ssh.sync_files(host, f"{work_dir}/{HOST_WHEELS}", wheels, 0o644)
        tool = {uv_name: (self.uv_binary, sha256_of(self.uv_binary))}
        copied_tool = await ssh.sync_files(host, f"{work_dir}/{HOST_TOOLS}", tool, 0o755)
        await ssh.make_dirs(host, [f"{work_dir}/{HOST_ENVIRONMENTS}"])
        lock = f"{directory}.txt"
        await ssh.connection(host).write_file(lock, self.environments.lock_of(request).read_bytes(), 0o644)
        uv_path = f"{work_dir}/{HOST_TOOLS}/{uv_name}"
        settings = [f"UV_CACHE_DIR={work_dir}/uv-cache", "UV_PYTHON_DOWNLOADS=never", "UV_NO_CONFIG=1"]
        venv = [uv_path, "venv", "--clear", "--quiet", "--python", interpreter, directory]
        sync = [uv_path, "pip", "sync", "--offline", "--no-index", "--find-links", f"{work_dir}/{HOST_WHEELS}"]
        for argv in (venv, [*sync, "--quiet", "--python", f"{directory}/bin/python", lock]):
            try:
                await ssh.connection(host).run(["env", *settings, *argv], timeout=INSTALL_TIMEOUT_SECONDS)
            except CommandFailed as exc:
                if exc.exit_status is None:  # killed (a signal, the host's OOM killer): not uv's answer
                    raise RetryableProviderError(
                        f"{request.describe()} on host {host}: uv {argv[1]} was killed"
                    ) from exc
                raise EnvironmentFailed(f"{request.describe()} on host {host}: uv {argv[1]} failed: {exc}") from exc
        marker = json.dumps({"python": request.python, "ray": request.ray}).encode()
        await ssh.connection(host).write_file(f"{directory}/{READY_MARK}", marker, 0o644)
        logger.info(
            "host %s: environment %s (%s) ready in %.1fs; copied %d files (%.0f MB), %d already there",
            host,
            environment.key,
            request.describe(),
            time.monotonic() - started,
            copied.files + copied_tool.files,
            (copied.bytes + copied_tool.bytes) / 1e6,
            len(wheels) + 1 - copied.files - copied_tool.files,
        )

    async def _interpreter(self, ssh: SshNodes, host: str, request: EnvironmentRequest) -> str:
        interpreters = await ssh.interpreters(host)
        if request.python not in interpreters:
            have = ", ".join(sorted(interpreters)) or "none"
            raise EnvironmentFailed(f"host {host} has no Python {request.python} (it has {have})")
        return interpreters[request.python]

    async def wheelhouse(self, environment: Environment, request: EnvironmentRequest) -> Path:
        """The environment's wheels on this machine, downloaded once (for the request's Python,
        binary wheels only: the hosts build nothing)."""
        folder = self.environments.root / WHEELHOUSES / environment.key
        async with self._locks.setdefault(f"wheelhouse {environment.key}", asyncio.Lock()):
            if (folder / MANIFEST).exists():
                return folder
            failed = self._failed_downloads.get(environment.key)
            if failed is not None and time.monotonic() - failed[0] < DOWNLOAD_FAILURE_KEPT_SECONDS:
                raise failed[1]  # the hosts that waited behind a failed download are told, not retried each
            partial = folder.with_name(f"{folder.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            lock = self.environments.lock_of(request)
            argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
            argv += ["--python-version", request.python, "-r", str(lock), "-d", str(partial), *configured_index()]
            code, output = await self.download(argv, {})
            if code != 0:
                failure = download_failure(request.describe(), output)
                self._failed_downloads[environment.key] = (time.monotonic(), failure)
                raise failure
            manifest = {path.name: sha256_of(path) for path in sorted(partial.iterdir())}
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
            return folder


# pip's words for an index it could not reach (it retries 5 times, then says so): a blip, tried
# again on the next look, unlike a package with no wheel, which no retry mends.
UNREACHABLE_INDEX = (
    "Retrying (Retry(",
    "Could not fetch URL",
    "NewConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Temporary failure in name resolution",
    "Connection reset by peer",
)
NO_WHEEL = ("No matching distribution found for", "Could not find a version that satisfies")


def download_failure(what: str, output: str) -> Exception:
    """What a failed `pip download` means: the index did not answer (retryable), or a package
    has no binary wheel for the hosts (they build nothing: an sdist-only package is refused by
    name), or pip's own message."""
    tail = output[-ANSWER_TAIL:].strip()
    missing = re.findall(r"No matching distribution found for ([A-Za-z0-9._-]+)", output)
    retried = [line for line in output.splitlines() if any(sign in line for sign in UNREACHABLE_INDEX)]
    # The index did not answer for the package pip then found no file of: a blip. Retries for
    # another one, which pip then got, do not make a missing wheel retryable.
    if retried and (not missing or any(f"/{canonicalize_name(name)}/" in " ".join(retried) for name in missing)):
        return RetryableProviderError(f"{what}: the package index did not answer pip download: {tail}")
    if any(sign in output for sign in NO_WHEEL):
        return EnvironmentFailed(
            f"{what}: a package has no binary wheel for the pool's hosts (they install wheels only and "
            f"build nothing; an sdist-only package cannot be used on a host pool): {tail}"
        )
    return EnvironmentFailed(f"{what}: pip download failed: {tail}")


def _base(path: str) -> str:
    return path.rsplit("/", 1)[1]


def _key_of(path: str) -> str:
    """The environment key of a host's `<key>` folder or `<key>.txt` lock."""
    return _base(path).split(".")[0]


def _manifest(wheelhouse: Path) -> dict[str, str]:
    return dict(json.loads((wheelhouse / MANIFEST).read_text()))
