"""A cluster's own environment (issue 21): the Ray release, Python and extra packages its spec
declares (`rayVersion`, `pythonVersion`, `pip`), in a virtualenv built with uv under the state
dir, as an image would hold them. Content-addressed twice: the request (Python, Ray, packages,
platform) is resolved once into a lock, kept; the environment is named by the lock's hash, so
every cluster whose request resolves alike shares one build. A virtualenv's scripts name their
own path (`bin/ray` starts with its interpreter's), so it is built where it stays, and a marker
written last tells a finished build from one a crash cut short."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import uv
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.providers.base import PermanentProviderError
from servekeeper.providers.ray_release import ray_release_time

ENVIRONMENTS = "environments"  # under the state dir
READY_MARK = ".servekeeper-ready"
LOCKS = "locks"
WHEELHOUSES = "wheels"  # a pool environment's wheels, downloaded once for its hosts
TRASH = "trash"  # environments taken out of use, deleted beside the ticks
ANSWER_TAIL = 2000  # characters of uv's message kept in an event

# (argv, extra environment) -> (exit code, output): uv run for real, or a test's stand-in
CommandRunner = Callable[[Sequence[str], dict[str, str]], Awaitable[tuple[int, str]]]
# a Ray version -> when it was published (None: unknown); the package index, or a test's stand-in
ReleaseTime = Callable[[str], Awaitable[str | None]]


class EnvironmentFailed(PermanentProviderError):
    """A resolve or install that failed: waiting will not mend it; the spec must change."""


def pinned(config: RayClusterConfigSpec) -> RayClusterConfigSpec:
    """The spec a cluster is created with: where it has an environment of its own, an unset
    Ray or Python is the controller's at creation, written down, so that an upgrade of the
    controller's Ray or Python never changes which environment a running cluster uses."""
    if not config.has_own_environment():
        return config
    own = {"rayVersion": config.rayVersion or version("ray"), "pythonVersion": config.pythonVersion or own_python()}
    return config.model_copy(update=own)


def own_python() -> str:
    """This interpreter's minor version: what a cluster of its own gets when pythonVersion is unset."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


# What Ray's own images hold and its wheel does not say, added to the resolve of the releases
# they apply to as hard constraints (the user's packages cannot move them).
RAY_IMAGE_CONSTRAINTS: tuple[tuple[SpecifierSet, str], ...] = (
    # Serve before 2.57.0 reads FieldDescriptor.label, which protobuf 7 removed: Ray 2.56.0
    # resolved as of its release day gets protobuf 7.35, and its Serve config API fails.
    (SpecifierSet("<2.57.0"), "protobuf<7"),
)
# Packages a release's Serve imports and its `serve` extra forgets (its image has them): added to
# the request of that release.
RAY_IMAGE_ADDITIONS: tuple[tuple[SpecifierSet, str], ...] = (
    # Serve's haproxy module in 2.57 and 2.58 imports jinja2 at the dashboard's start ("Serve
    # dependencies are not installed": no Serve REST API); the extra lists it from 2.59.0 on.
    (SpecifierSet(">=2.57.0,<2.59.0"), "jinja2"),
)


@dataclass(frozen=True)
class EnvironmentRequest:
    python: str  # a minor version, "3.11"
    ray: str  # a release, "2.59.0"
    packages: tuple[str, ...]  # requirement specifiers as declared, sorted
    platform: str

    @classmethod
    def of(cls, config: RayClusterConfigSpec) -> EnvironmentRequest | None:
        """None: the cluster runs the controller's own Ray and Python."""
        if not config.has_own_environment():
            return None
        return cls(
            python=config.pythonVersion or own_python(),
            ray=config.rayVersion or version("ray"),
            packages=tuple(sorted(config.pip)),
            platform=sysconfig.get_platform(),
        )

    def key(self) -> str:
        # Never changes for a request: a running cluster keeps finding its environment.
        return _digest(json.dumps([self.python, self.ray, self.packages, self.platform]))

    def lock_holds_image_fixes(self, locked: str) -> bool:
        """Whether a lock has this release's additions and meets its constraints: one written
        before they were known (a release whose environment never served) is resolved anew."""
        pins = dict(line.split("==", 1) for line in locked.split() if "==" in line)
        pins = {canonicalize_name(name.split("[")[0]): release for name, release in pins.items()}
        if any(canonicalize_name(Requirement(line).name) not in pins for line in self.additions()):
            return False
        for line in self.constraints():
            wanted = Requirement(line)
            pinned_release = pins.get(canonicalize_name(wanted.name))
            if pinned_release is not None and pinned_release not in wanted.specifier:
                return False
        return True

    def constraints(self) -> list[str]:
        """RAY_IMAGE_CONSTRAINTS of this Ray release."""
        return [line for releases, line in RAY_IMAGE_CONSTRAINTS if Version(self.ray) in releases]

    def additions(self) -> list[str]:
        """RAY_IMAGE_ADDITIONS of this Ray release."""
        return [line for releases, line in RAY_IMAGE_ADDITIONS if Version(self.ray) in releases]

    def ray_requirement(self) -> str:
        # Serve's extra (its proxy, the REST config API) is what a node of a service needs.
        return f"ray[serve]=={self.ray}"

    def requirements(self) -> list[str]:
        return [self.ray_requirement(), *self.additions(), *self.packages]

    def describe(self) -> str:
        extra = f" with {', '.join(self.packages)}" if self.packages else ""
        return f"Ray {self.ray} on Python {self.python}{extra}"


@dataclass(frozen=True)
class Environment:
    key: str  # the lock's hash: the directory's name
    path: Path

    @property
    def ray(self) -> Path:
        return self.path / "bin" / "ray"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def locked_set(compiled: str) -> str:
    """The resolved pins alone (no comments, sorted): what the environment's name hashes."""
    pins = (line.strip() for line in compiled.splitlines())
    return "".join(f"{pin}\n" for pin in sorted(p for p in pins if p and not p.startswith("#")))


def find_interpreters(search: Iterable[Path] | None = None) -> dict[str, Path]:
    """The Python interpreters of this machine by minor version (3.10 -> its path): on PATH and
    under pyenv's versions. pyenv's shims are left out: they answer only for the selected one."""
    found: dict[str, Path] = {}
    if search is None:
        path_dirs = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p and "shims" not in p]
        search = [*path_dirs, *sorted(Path.home().glob(".pyenv/versions/3.*/bin"))]
    for directory in search:
        for candidate in sorted(directory.glob("python3.*")):
            minor = candidate.name.removeprefix("python")
            if minor.count(".") == 1 and minor.replace(".", "").isdigit() and os.access(candidate, os.X_OK):
                found.setdefault(minor, candidate)
    return found


async def run_uv(argv: Sequence[str], extra_env: dict[str, str]) -> tuple[int, str]:
    return await run_command([uv.find_uv_bin(), *argv], extra_env)


async def run_command(argv: Sequence[str], extra_env: dict[str, str]) -> tuple[int, str]:
    """Run `argv` here to its end: its exit code and output; cancelled, what it started goes too."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **extra_env},
        start_new_session=True,  # its own process group: what it starts goes with it
    )
    try:
        output, _ = await process.communicate()
    except asyncio.CancelledError:  # the cluster deleted mid-build: no uv left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    return process.returncode or 0, output.decode(errors="replace")


def environments_of(state_dir: Path) -> Environments:
    return Environments(state_dir / ENVIRONMENTS)


class Environments:
    """The environments under one state dir: looked up by a cluster's spec, built once, pruned."""

    def __init__(
        self,
        root: Path,
        run: CommandRunner = run_uv,
        interpreters: Callable[[], dict[str, Path]] = find_interpreters,
        released: ReleaseTime = ray_release_time,
    ) -> None:
        self.root = root
        self.run = run
        self.released = released
        self.interpreters = interpreters
        self.building: dict[str, asyncio.Lock] = {}  # request key -> its build (one at a time)

    def lock_of(self, request: EnvironmentRequest) -> Path:
        """The request's lock (its resolved pins), once `prepare` resolved it."""
        return self.root / LOCKS / f"{request.key()}.txt"

    def built(self, request: EnvironmentRequest) -> Environment | None:
        """The request's environment if a finished build of it is here."""
        lock = self.lock_of(request)
        if not lock.exists():
            return None
        environment = self._named(lock.read_text())
        return environment if (environment.path / READY_MARK).exists() else None

    def lookup(self, config: RayClusterConfigSpec) -> Environment | None:
        """The built environment of this spec; None for a spec on the controller's own. Raises
        EnvironmentFailed when it has not been built: a node is never started on a half one."""
        request = EnvironmentRequest.of(config)
        if request is None:
            return None
        environment = self.built(request)
        if environment is None:
            raise EnvironmentFailed(f"the environment of {request.describe()} is not built")
        return environment

    async def prepare(self, request: EnvironmentRequest) -> tuple[Environment, bool]:
        """The environment of `request`, built now if no cluster had it yet; True if built now."""
        key = request.key()
        async with self.building.setdefault(key, asyncio.Lock()):
            lock = self.root / LOCKS / f"{key}.txt"
            if not lock.exists() or not request.lock_holds_image_fixes(lock.read_text()):
                await self._resolve(request, lock)
            environment = self._named(lock.read_text())
        # Requests that resolve alike share the directory: one build of it at a time.
        async with self.building.setdefault(f"environment {environment.key}", asyncio.Lock()):
            if (environment.path / READY_MARK).exists():
                return environment, False
            await self._build(environment, lock, request)
            return environment, True

    async def _resolve(self, request: EnvironmentRequest, lock: Path) -> None:
        """Write the request's lock. Ray and its own dependencies are resolved first as they
        were when that Ray was published (what its image holds); the full request is then
        resolved preferring those pins, so the user's packages move one only when they need to."""
        lock.parent.mkdir(parents=True, exist_ok=True)
        interpreter = str(self._interpreter(request.python))
        compiled = lock.with_suffix(".compiled")
        compiled.unlink(missing_ok=True)  # a resolve a crash cut short is not a preference
        released = await self.released(request.ray)
        constrained: list[str] = []
        if request.constraints():
            constraints = lock.with_suffix(".constraints")
            constraints.write_text("".join(f"{line}\n" for line in request.constraints()))
            constrained = ["--constraints", str(constraints)]
        if released is not None:
            ray_alone = lock.with_suffix(".ray.in")
            ray_alone.write_text("".join(f"{line}\n" for line in [request.ray_requirement(), *request.additions()]))
            argv = ["pip", "compile", str(ray_alone), "--python", interpreter, "--quiet", "--exclude-newer", released]
            await self._uv([*argv, *constrained, "-o", str(compiled)], request)
        wanted = lock.with_suffix(".in")
        wanted.write_text("".join(f"{line}\n" for line in request.requirements()))
        # an existing output file's pins are uv's preferences (`--upgrade` is what ignores them)
        argv = ["pip", "compile", str(wanted), "--python", interpreter, "--quiet", *constrained, "-o", str(compiled)]
        await self._uv(argv, request)
        temporary = lock.with_suffix(".tmp")
        temporary.write_text(locked_set(compiled.read_text()))
        temporary.replace(lock)  # a request's lock, once written, is its resolution for good

    async def _build(self, environment: Environment, lock: Path, request: EnvironmentRequest) -> None:
        shutil.rmtree(environment.path, ignore_errors=True)  # a build a crash cut short
        interpreter = self._interpreter(request.python)
        await self._uv(["venv", "--python", str(interpreter), "--quiet", str(environment.path)], request)
        await self._uv(["pip", "sync", "--quiet", "--python", str(environment.python), str(lock)], request)
        (environment.path / READY_MARK).write_text(json.dumps({"python": request.python, "ray": request.ray}))

    def _interpreter(self, minor: str) -> Path:
        interpreters = self.interpreters()
        if minor not in interpreters:
            have = ", ".join(sorted(interpreters)) or "none"
            raise EnvironmentFailed(f"Python {minor}: no interpreter of it on this machine (it has {have})")
        return interpreters[minor]

    async def _uv(self, argv: list[str], request: EnvironmentRequest) -> str:
        # Never a Python downloaded: the interpreters are the host's own, found above.
        code, output = await self.run(argv, {"UV_PYTHON_DOWNLOADS": "never"})
        if code != 0:
            told = output[-ANSWER_TAIL:].strip()
            command = " ".join(argv[:2]) if argv[0] == "pip" else argv[0]
            raise EnvironmentFailed(f"{request.describe()}: uv {command} failed: {told}")
        return output

    def known_keys(self) -> set[str]:
        """Every environment (key) this controller has resolved: what its prunes may delete
        elsewhere (another controller's environments on a shared host are not its own)."""
        return {self._named(lock.read_text()).key for lock in sorted((self.root / LOCKS).glob("*.txt"))}

    def _named(self, locked: str) -> Environment:
        key = _digest(locked)
        return Environment(key, self.root / key)

    def retire_unused(self, used: Iterable[RayClusterConfigSpec]) -> list[Path]:
        """Take out of use every environment that no spec in `used` (the clusters', the
        services', the kept revisions') resolves to: its marker goes first (a deletion cut short
        is never taken for a build), then it moves to the trash, where `empty_trash` deletes
        it. Fast (no file contents touched): run between two ticks, no start sees it half gone.
        A lock stays: it is the request's resolution, a few lines."""
        keep = {LOCKS, TRASH, *self.keys_in_use(used)}
        retired = []
        wheelhouses = self.root / WHEELHOUSES  # pool environments' wheels, by environment (and `.partial`)
        for directory in [*self._children(self.root), *self._children(wheelhouses)]:
            if directory == wheelhouses:
                continue
            if directory.is_dir() and directory.name.split(".")[0] not in keep:
                (directory / READY_MARK).unlink(missing_ok=True)
                (self.root / TRASH).mkdir(exist_ok=True)
                directory.rename(self.root / TRASH / f"{directory.name}.{time.time_ns()}")
                retired.append(directory)
        return retired

    def keys_in_use(self, used: Iterable[RayClusterConfigSpec]) -> set[str]:
        """The environments (keys) the specs in `used` resolve to, those resolved so far."""
        keys = set()
        for config in used:
            request = EnvironmentRequest.of(config)
            lock = self.root / LOCKS / f"{request.key()}.txt" if request is not None else None
            if lock is not None and lock.exists():
                keys.add(self._named(lock.read_text()).key)
        return keys

    @staticmethod
    def _children(folder: Path) -> list[Path]:
        return sorted(folder.iterdir()) if folder.exists() else []

    def empty_trash(self) -> None:
        """Delete what `retire_unused` took out of use (hundreds of MB each: in a thread)."""
        shutil.rmtree(self.root / TRASH, ignore_errors=True)

    def prune(self, used: Iterable[RayClusterConfigSpec]) -> list[str]:
        """Both at once; the names of the environments deleted."""
        retired = self.retire_unused(used)
        self.empty_trash()
        return [directory.name for directory in retired]
