"""A cluster's own environment (issue 21), uv faked: the spec's fields and what they hash, a
request resolved once and built once, shared by every request that resolves alike, a failure
told with uv's message, a build a crash cut short done again, and pruning."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servekeeper.commands.apply import store_spec
from servekeeper.controller.environments import EnvironmentBuilds, environments_in_use
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.model.hostpool import HostSpec
from servekeeper.providers import environments as environments_module
from servekeeper.providers.base import RetryableProviderError
from servekeeper.providers.environments import (
    READY_MARK,
    WHEELHOUSES,
    EnvironmentFailed,
    EnvironmentRequest,
    Environments,
    find_interpreters,
    locked_set,
    pinned,
)
from servekeeper.providers.host_environments import HostEnvironments
from servekeeper.providers.ray_release import release_time_of
from servekeeper.providers.ssh import Copied, RemoteResult
from servekeeper.providers.ssh_nodes import SshNodes
from servekeeper.store.store import Store
from tests.unit.test_controller import make_spec
from tests.unit.test_hostpool import host


class FakeUv:
    """uv's three commands, as files: compile pins each requirement (`ray[serve]==2.59.0` stays;
    a bare name gets ==1.0, or what `resolves` says), venv makes bin/, sync writes bin/ray."""

    def __init__(self, resolves: dict[str, str] | None = None, fail: str | None = None) -> None:
        self.resolves = resolves or {}
        self.fail = fail
        self.calls: list[list[str]] = []

    async def __call__(self, argv: Sequence[str], env: dict[str, str]) -> tuple[int, str]:
        assert env["UV_PYTHON_DOWNLOADS"] == "never"
        self.calls.append(list(argv))
        if self.fail is not None and self.fail in argv[:2]:
            return 1, "  × No solution found when resolving dependencies:\n  ╰─▶ nope-not-a-package was not found"
        if argv[:2] == ["pip", "compile"]:
            wanted = Path(argv[2]).read_text().split()
            pins = [self.resolves.get(w, w if "==" in w else f"{w}==1.0") for w in wanted]
            Path(argv[argv.index("-o") + 1]).write_text("# compiled\n" + "\n".join(pins) + "\n    # via x\n")
        elif argv[0] == "venv":
            (Path(argv[-1]) / "bin").mkdir(parents=True)
        elif argv[:2] == ["pip", "sync"]:
            python = Path(argv[argv.index("--python") + 1])
            (python.parent / "ray").write_text("#!ray")
        return 0, ""

    def count(self, *command: str) -> int:
        return sum(1 for call in self.calls if call[: len(command)] == list(command))


async def unknown_release(version: str) -> None:
    """An index that gives no upload times: the request resolves against today's packages."""


OWN_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # the suite runs on 3.10 and 3.11


def interpreters() -> dict[str, Path]:
    return {minor: Path(f"/usr/bin/python{minor}") for minor in sorted({"3.10", "3.11", OWN_PYTHON})}


def config(**fields: Any) -> RayClusterConfigSpec:
    return RayClusterConfigSpec.model_validate(fields)


def request_of(**fields: Any) -> EnvironmentRequest:
    request = EnvironmentRequest.of(config(**fields))
    assert request is not None
    return request


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rayVersion": "2.59"}, "rayVersion"),
        ({"pythonVersion": "3"}, "pythonVersion"),
        ({"pip": ["--index-url=http://x"]}, "is an option"),
        ({"pip": ["-e ."]}, "is an option"),
        ({"pip": ["torch @ https://example.invalid/torch.whl"]}, "names a URL"),
        ({"pip": ["not a requirement!"]}, "is not a requirement"),
    ],
)
def test_the_environment_fields_are_checked_at_apply(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config(**fields)


def test_unset_fields_keep_a_clusters_hash_and_each_set_one_changes_it() -> None:
    base = make_spec().cluster_spec_hash()
    assert make_spec(rayClusterConfig={}).cluster_spec_hash() == base
    changed = {
        make_spec(rayClusterConfig={"rayVersion": "2.59.0"}).cluster_spec_hash(),
        make_spec(rayClusterConfig={"pythonVersion": "3.10"}).cluster_spec_hash(),
        make_spec(rayClusterConfig={"pip": ["numpy"]}).cluster_spec_hash(),
    }
    assert len(changed) == 3 and base not in changed
    assert EnvironmentRequest.of(config()) is None, "no own environment: the controller's"


def test_a_request_defaults_to_the_controllers_python_and_ray_and_ignores_the_order_of_pip() -> None:
    request = request_of(pip=["b", "a"])
    assert request.packages == ("a", "b") and request.requirements()[0].startswith("ray[serve]==")
    assert request.key() == request_of(pip=["a", "b"]).key()
    other = "3.10" if OWN_PYTHON != "3.10" else "3.11"
    assert request.key() != request_of(pip=["a", "b"], pythonVersion=other).key()


async def test_an_environment_is_resolved_once_built_once_and_shared(tmp_path: Path) -> None:
    uv = FakeUv(resolves={"numpy": "numpy==2.0", "numpy>=2": "numpy==2.0"})
    environments = Environments(tmp_path, run=uv, interpreters=interpreters, released=unknown_release)
    first, built = await environments.prepare(request_of(rayVersion="2.59.0", pip=["numpy"]))
    assert built and (first.path / READY_MARK).exists() and first.ray.exists()
    again, built = await environments.prepare(request_of(rayVersion="2.59.0", pip=["numpy"]))
    assert (again, built) == (first, False)
    assert uv.count("pip", "compile") == 1 and uv.count("venv") == 1, "resolved once, built once"
    # Another request that resolves to the same pins: the same environment, not built again.
    same, built = await environments.prepare(request_of(rayVersion="2.59.0", pip=["numpy>=2"]))
    assert same == first and not built and uv.count("pip", "compile") == 2 and uv.count("venv") == 1
    assert environments.lookup(config(rayVersion="2.59.0", pip=["numpy"])) == first
    assert environments.lookup(config()) is None, "the controller's own"
    venv = next(call for call in uv.calls if call[0] == "venv")
    assert venv[venv.index("--python") + 1] == f"/usr/bin/python{OWN_PYTHON}", "the controller's minor version"


async def test_a_failed_resolve_is_told_with_uvs_message_and_nothing_is_left_as_built(tmp_path: Path) -> None:
    environments = Environments(
        tmp_path, run=FakeUv(fail="compile"), interpreters=interpreters, released=unknown_release
    )
    spec = config(pip=["nope-not-a-package"])
    request = EnvironmentRequest.of(spec)
    assert request is not None
    with pytest.raises(EnvironmentFailed, match="nope-not-a-package was not found") as failed:
        await environments.prepare(request)
    assert "uv pip compile failed" in str(failed.value)
    with pytest.raises(EnvironmentFailed, match="is not built"):
        environments.lookup(spec)


async def test_a_python_the_machine_lacks_is_refused_by_version(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    with pytest.raises(EnvironmentFailed, match=r"Python 3.13: no interpreter of it .*has 3.10, 3.11"):
        await environments.prepare(request_of(pythonVersion="3.13"))


async def test_a_build_cut_short_is_done_again_from_nothing(tmp_path: Path) -> None:
    uv = FakeUv()
    environments = Environments(tmp_path, run=uv, interpreters=interpreters, released=unknown_release)
    request = request_of(rayVersion="2.59.0")
    environment, _ = await environments.prepare(request)
    (environment.path / READY_MARK).unlink()  # as if the controller died before the marker
    (environment.path / "half-copied").write_text("x")
    assert environments.built(request) is None
    again, built = await environments.prepare(request)
    assert again == environment and built and not (environment.path / "half-copied").exists()


async def test_pruning_deletes_what_no_spec_uses_and_never_what_one_does(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    kept, _ = await environments.prepare(request_of(rayVersion="2.59.0"))
    dropped, _ = await environments.prepare(request_of(rayVersion="2.58.0"))
    assert environments.prune([config(rayVersion="2.59.0"), config()]) == [dropped.key]
    assert kept.path.exists() and not dropped.path.exists()
    assert environments.prune([config(rayVersion="2.59.0")]) == []


async def test_a_pool_environments_wheels_are_pruned_with_it_and_kept_while_used(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    kept, _ = await environments.prepare(request_of(rayVersion="2.59.0"))
    dropped, _ = await environments.prepare(request_of(rayVersion="2.58.0"))
    wheels = tmp_path / WHEELHOUSES
    for name in (kept.key, f"{kept.key}.partial", dropped.key):
        (wheels / name).mkdir(parents=True)
    assert sorted(environments.prune([config(rayVersion="2.59.0")])) == sorted([dropped.key, dropped.key])
    assert sorted(p.name for p in wheels.iterdir()) == [kept.key, f"{kept.key}.partial"], "a download under way stays"


def test_locked_set_keeps_pins_alone_in_order() -> None:
    assert locked_set("# header\nb==1\n    # via a\n\na==2\n") == "a==2\nb==1\n"


def test_interpreters_are_found_by_minor_version(tmp_path: Path) -> None:
    for name in ("python3.10", "python3.12", "python3.12-config", "python3"):
        executable = tmp_path / name
        executable.write_text("")
        executable.chmod(0o755)
    found = find_interpreters([tmp_path])
    assert found == {"3.10": tmp_path / "python3.10", "3.12": tmp_path / "python3.12"}


class FakeHosts(SshNodes):
    """The SSH side of HostEnvironments: hosts as dicts (files copied, commands run, files written)."""

    def __init__(self, interpreters: dict[str, str]) -> None:
        super().__init__(
            [HostSpec.model_validate({**host(n, "10.0.0.1"), "workDir": f"/work/{n}"}) for n in ("h1", "h2")]
        )
        self.have = interpreters
        self.files: dict[str, dict[str, str]] = {}  # host dir -> name -> sha256
        self.written: dict[str, bytes] = {}
        self.commands: list[tuple[str, list[str]]] = []

    async def interpreters(self, host: str) -> dict[str, str]:
        return dict(self.have)

    async def make_dirs(self, host: str, directories: Sequence[str]) -> None:
        pass

    async def sync_files(self, host: str, directory: str, files: Mapping[str, tuple[Path, str]], mode: int) -> Copied:
        held = self.files.setdefault(f"{host}:{directory}", {})
        missing = [name for name, (_, sha) in files.items() if held.get(name) != sha]
        held.update({name: files[name][1] for name in missing})
        return Copied(len(missing), 0)

    def list_or_remove(self, host: str, argv: list[str]) -> RemoteResult:
        """`ls -1 DIR` (files copied there, folders written under it) or `rm -rf -- PATH...`."""
        if argv[0] == "ls":
            folder = argv[-1]
            names = set(self.files.get(f"{host}:{folder}", {}))
            names |= {key.split(":", 1)[1][len(folder) + 1 :].split("/")[0] for key in self.written_under(host, folder)}
            return RemoteResult(0 if names else 2, "\n".join(sorted(names)), "")
        for path in argv[3:]:
            folder, _, file = path.rpartition("/")
            self.files.get(f"{host}:{folder}", {}).pop(file, None)
            for key in self.written_under(host, path):
                del self.written[key]
        return RemoteResult(0, "", "")

    def written_under(self, host: str, folder: str) -> list[str]:
        return [key for key in self.written if key.startswith(f"{host}:{folder}/") or key == f"{host}:{folder}"]

    def connection(self, name: str) -> Any:
        hosts = self

        class Connection:
            async def run(self, argv: list[str], **_: Any) -> RemoteResult:
                hosts.commands.append((name, argv))
                if argv[0] in ("ls", "rm"):
                    return hosts.list_or_remove(name, argv)
                done = argv[0] == "test" and f"{name}:{argv[-1]}" in hosts.written
                return RemoteResult(0 if argv[0] != "test" or done else 1, "", "")

            async def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
                hosts.written[f"{name}:{path}"] = data

        return Connection()


async def fake_download(argv: Sequence[str], env: dict[str, str]) -> tuple[int, str]:
    """pip download: a wheel per pin of the lock, in -d."""
    into = Path(argv[argv.index("-d") + 1])
    for pin in Path(argv[argv.index("-r") + 1]).read_text().split():
        name, _, release = pin.partition("==")
        (into / f"{name.split('[')[0]}-{release}-py3-none-any.whl").write_text(pin)
    return 0, ""


async def test_a_pool_environment_is_copied_to_each_host_once_and_installed_offline(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    spec = config(rayVersion="2.59.0", pythonVersion="3.11", pip=["numpy"], hostPool="fleet")
    request = EnvironmentRequest.of(spec)
    assert request is not None
    environment, _ = await environments.prepare(request)
    downloads: list[Sequence[str]] = []

    async def download(argv: Sequence[str], env: dict[str, str]) -> tuple[int, str]:
        downloads.append(argv)
        return await fake_download(argv, env)

    hosts = FakeHosts({"3.11": "/usr/bin/python3.11"})
    uv_binary = tmp_path / "uv"
    uv_binary.write_text("uv")
    on_hosts = HostEnvironments(environments, download=download, uv_binary=str(uv_binary))
    pythons = await on_hosts.pythons_on(hosts, ["h1", "h2", "h1"], spec)
    directory = f"/work/h1/environments/{environment.key}"
    assert pythons["h1"] == f"{directory}/bin/python" and set(pythons) == {"h1", "h2"}
    assert len(downloads) == 1, "the wheels are downloaded once, for every host"
    download_argv = list(downloads[0])
    assert download_argv[download_argv.index("--python-version") + 1] == "3.11"
    assert {"download", "--only-binary=:all:", "--no-deps"} <= set(download_argv), "binary wheels, as locked"
    assert sorted(hosts.files["h1:/work/h1/wheels"]) == ["numpy-1.0-py3-none-any.whl", "ray-2.59.0-py3-none-any.whl"]
    installs = [argv for name, argv in hosts.commands if name == "h1" and argv[0] == "env"]
    assert [argv[5:7] for argv in installs] == [["venv", "--clear"], ["pip", "sync"]]
    assert {"--offline", "--no-index", "/work/h1/wheels"} <= set(installs[1])
    assert "--python" in installs[0] and "/usr/bin/python3.11" in installs[0]
    assert f"h1:{directory}/{READY_MARK}" in hosts.written, "the marker is written last"

    copies = {key: dict(files) for key, files in hosts.files.items()}
    commands = len(hosts.commands)
    again = HostEnvironments(environments, download=download, uv_binary=str(uv_binary))  # a restarted controller
    assert await again.pythons_on(hosts, ["h1", "h2"], spec) == pythons
    assert hosts.files == copies and len(downloads) == 1, "a marked environment is not copied again"
    assert [argv[0] for _, argv in hosts.commands[commands:]] == ["test", "test"]


async def test_a_host_without_the_requested_python_is_refused_by_name(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    spec = config(rayVersion="2.59.0", pythonVersion="3.10", hostPool="fleet")
    request = EnvironmentRequest.of(spec)
    assert request is not None
    await environments.prepare(request)
    on_hosts = HostEnvironments(environments, download=fake_download, uv_binary=sys.executable)
    with pytest.raises(EnvironmentFailed, match=r"host h1 has no Python 3.10 \(it has 3.11, 3.12\)"):
        await on_hosts.pythons_on(FakeHosts({"3.11": "/a", "3.12": "/b"}), ["h1"], spec)
    assert await on_hosts.pythons_on(FakeHosts({}), ["h1"], config(hostPool="fleet")) == {}, "the hosts' own"


async def test_a_deleted_clusters_environment_goes_unless_a_kept_revision_uses_it(tmp_path: Path, store: Store) -> None:
    """`undo` may go back to any kept revision: its environment stays; one nothing names goes."""
    environments = Environments(
        tmp_path / "environments", run=FakeUv(), interpreters=interpreters, released=unknown_release
    )
    told: list[set[str]] = []
    reads: list[float] = []

    async def prune_elsewhere(keep: set[str], read_at: float) -> None:
        told.append(keep)
        reads.append(read_at)

    builds = EnvironmentBuilds(store, environments, clock=lambda: 0.0, prune_elsewhere=prune_elsewhere)
    old, _ = await environments.prepare(request_of(rayVersion="2.58.0"))
    kept, _ = await environments.prepare(request_of(rayVersion="2.59.0"))
    gone, _ = await environments.prepare(request_of(rayVersion="2.57.0"))
    for ray in ("2.58.0", "2.59.0"):  # two revisions of one service: 2.58.0 kept for undo
        spec = make_spec(rayClusterConfig={"rayVersion": ray})
        store_spec(store, spec.name, spec.to_json(), None, None, history_limit=10)
    before = time.monotonic()
    await builds.prune()
    assert old.path.exists() and kept.path.exists() and not gone.path.exists()
    assert told == [{old.key, kept.key}], "the provider is told the keys that stay, once one went"
    assert before <= reads[0] <= time.monotonic(), "with when the store was read"
    await builds.prune()
    assert len(told) == 1, "nothing went: the hosts are left alone"
    assert [config.rayVersion for config in environments_in_use(store)] == ["2.59.0", "2.58.0", "2.59.0"]


def test_a_cluster_is_created_with_its_ray_and_python_written_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec with only `pip` keeps its hash across a controller upgrade (no new cluster), so the
    cluster's record names the Ray and Python it was built on: the environment it uses never moves."""
    only_pip = config(pip=["numpy"])
    kept = pinned(only_pip)
    assert kept.rayVersion is not None and kept.pythonVersion is not None and kept.pip == ["numpy"]
    assert pinned(config()) == config(), "the controller's own: nothing written"
    before = EnvironmentRequest.of(kept)
    monkeypatch.setattr(environments_module, "version", lambda _: "9.9.9")  # the controller upgraded
    assert EnvironmentRequest.of(kept) == before
    assert EnvironmentRequest.of(only_pip) != before, "an unpinned one would have moved"


async def test_requests_that_resolve_alike_build_their_directory_once_at_a_time(tmp_path: Path) -> None:
    uv = FakeUv(resolves={"numpy": "numpy==2.0", "numpy>=2": "numpy==2.0"})
    environments = Environments(tmp_path, run=uv, interpreters=interpreters, released=unknown_release)
    built = await asyncio.gather(
        environments.prepare(request_of(pip=["numpy"])), environments.prepare(request_of(pip=["numpy>=2"]))
    )
    assert built[0][0] == built[1][0] and sorted(now for _, now in built) == [False, True]
    assert uv.count("venv") == 1


async def test_an_environment_taken_out_of_use_loses_its_marker_before_anything_else(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    environment, _ = await environments.prepare(request_of(rayVersion="2.58.0"))
    (retired,) = environments.retire_unused([])
    assert retired == environment.path and not environment.path.exists()
    trash = list((tmp_path / "trash").iterdir())
    assert len(trash) == 1 and not (trash[0] / READY_MARK).exists() and (trash[0] / "bin").exists()
    assert environments.built(request_of(rayVersion="2.58.0")) is None
    environments.empty_trash()
    assert not (tmp_path / "trash").exists()


async def test_ray_and_its_dependencies_resolve_as_of_its_release_then_the_request_prefers_them(
    tmp_path: Path,
) -> None:
    """Ray 2.52.0's Serve fails on protobuf 7 (released after it): its image holds protobuf 5."""

    async def released(version: str) -> str:
        assert version == "2.52.0"
        return "2025-11-20T18:00:00Z"

    uv = FakeUv()
    environments = Environments(tmp_path, run=uv, interpreters=interpreters, released=released)
    await environments.prepare(request_of(rayVersion="2.52.0", pip=["numpy"]))
    ray_alone, full = [call for call in uv.calls if call[:2] == ["pip", "compile"]]
    assert ray_alone[ray_alone.index("--exclude-newer") + 1] == "2025-11-20T18:00:00Z"
    assert Path(ray_alone[2]).read_text() == "ray[serve]==2.52.0\n"
    assert "--exclude-newer" not in full, "the user's packages are not held to Ray's day"
    assert full[full.index("-o") + 1] == ray_alone[ray_alone.index("-o") + 1], "Ray's pins are the preferences"
    assert Path(full[2]).read_text() == "ray[serve]==2.52.0\nnumpy\n"


def test_a_release_is_published_when_its_last_file_is_uploaded() -> None:
    page = [
        {"filename": "ray-2.52.0-cp311-cp311-manylinux2014_x86_64.whl", "upload-time": "2025-11-20T17:00:00.1Z"},
        {"filename": "ray-2.52.0-cp312-cp312-manylinux2014_x86_64.whl", "upload-time": "2025-11-20T18:00:00.2Z"},
        {"filename": "ray-2.52.1-cp311-cp311-manylinux2014_x86_64.whl", "upload-time": "2025-12-20T18:00:00Z"},
        {"filename": "ray-2.5.0-cp311-cp311-manylinux2014_x86_64.whl", "upload-time": "2023-06-01T00:00:00Z"},
    ]
    assert release_time_of(page, "2.52.0") == "2025-11-20T18:01:00Z", "a minute past its last file: uv keeps it"
    assert release_time_of(page, "2.5.0") == "2023-06-01T00:01:00Z", "2.5.0 is not 2.52.0's prefix"
    assert release_time_of([{"filename": "ray-2.52.0-cp311-none.whl"}], "2.52.0") is None, "no upload times"
    assert release_time_of(page, "2.46.0") is None


async def test_a_download_the_index_did_not_answer_is_retried_and_one_without_a_wheel_names_it(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    spec = config(rayVersion="2.59.0", pythonVersion="3.11", pip=["sdist-only==1.0"], hostPool="fleet")
    request = EnvironmentRequest.of(spec)
    assert request is not None
    await environments.prepare(request)
    retry = "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(...)'"
    no_wheel = (
        "ERROR: Could not find a version that satisfies the requirement sdist-only==1.0 (from versions: none)\n"
        "ERROR: No matching distribution found for sdist-only==1.0"
    )
    answers = [
        f"{retry}: /simple/ray/\nERROR: Could not find a version that satisfies the requirement ray",
        no_wheel,
        f"{retry}: /simple/numpy/\n{no_wheel}",  # a blip for another package, which pip then got
        f"{retry}: /simple/sdist-only/\n{no_wheel}",  # the index did not answer for that one
    ]
    downloads = 0

    async def download(argv: Sequence[str], env: dict[str, str]) -> tuple[int, str]:
        nonlocal downloads
        downloads += 1
        return 1, answers.pop(0)

    hosts = FakeHosts({"3.11": "/usr/bin/python3.11"})
    on_hosts = HostEnvironments(environments, download=download, uv_binary=sys.executable)
    with pytest.raises(RetryableProviderError, match="the package index did not answer"):
        await on_hosts.pythons_on(hosts, ["h1", "h2"], spec)
    assert downloads == 1, "the second host waited behind the failed download and got its answer"
    for expected in (EnvironmentFailed, EnvironmentFailed, RetryableProviderError):
        # (a new controller: a failed download's answer is kept for the hosts of one start only)
        again = HostEnvironments(environments, download=download, uv_binary=sys.executable)
        with pytest.raises(expected) as raised:
            await again.pythons_on(hosts, ["h1"], spec)
        if expected is EnvironmentFailed:
            assert "no binary wheel" in str(raised.value) and "sdist-only==1.0" in str(raised.value)
    assert not hosts.files, "nothing copied"


class SlowCopies(FakeHosts):
    """Copies that take a while: how many hosts copy at once."""

    def __init__(self, interpreters: dict[str, str]) -> None:
        super().__init__(interpreters)
        self.copying, self.most = 0, 0

    async def sync_files(self, host: str, directory: str, files: Mapping[str, tuple[Path, str]], mode: int) -> Copied:
        self.copying += 1
        self.most = max(self.most, self.copying)
        await asyncio.sleep(0.05)
        self.copying -= 1
        return await super().sync_files(host, directory, files, mode)


async def test_the_hosts_of_a_cluster_are_made_ready_at_once_from_one_download(tmp_path: Path) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    spec = config(rayVersion="2.59.0", pythonVersion="3.11", hostPool="fleet")
    request = EnvironmentRequest.of(spec)
    assert request is not None
    await environments.prepare(request)
    downloads: list[Sequence[str]] = []

    async def download(argv: Sequence[str], env: dict[str, str]) -> tuple[int, str]:
        downloads.append(argv)
        return await fake_download(argv, env)

    hosts = SlowCopies({"3.11": "/usr/bin/python3.11"})
    on_hosts = HostEnvironments(environments, download=download, uv_binary=sys.executable)
    pythons = await on_hosts.pythons_on(hosts, ["h1", "h2", "h1"], spec)
    assert set(pythons) == {"h1", "h2"} and len(downloads) == 1
    assert hosts.most == 2, "the two hosts copied at the same time"


async def test_a_host_keeps_only_the_environments_and_wheels_in_use_or_asked_for_since_the_store_was_read(
    tmp_path: Path,
) -> None:
    environments = Environments(tmp_path, run=FakeUv(), interpreters=interpreters, released=unknown_release)
    specs = {
        ray: config(rayVersion=ray, pythonVersion="3.11", hostPool="fleet", pip=[f"only-{ray}"])
        for ray in ("2.58.0", "2.59.0")
    }
    hosts = FakeHosts({"3.11": "/usr/bin/python3.11"})
    keys = {}
    for ray, spec in specs.items():
        request = EnvironmentRequest.of(spec)
        assert request is not None
        keys[ray] = (await environments.prepare(request))[0].key
        await HostEnvironments(environments, download=fake_download, uv_binary=sys.executable).pythons_on(
            hosts, ["h1", "h2"], spec
        )
    wheels = hosts.files["h1:/work/h1/wheels"]
    assert {"only-2.58.0-1.0-py3-none-any.whl", "only-2.59.0-1.0-py3-none-any.whl"} <= set(wheels)

    foreign = "0123456789abcdef"  # another controller's environment on the shared workDir
    hosts.written[f"h1:/work/h1/environments/{foreign}/bin/python"] = b""
    hosts.files["h1:/work/h1/wheels"]["ray-2.59.0-py3-none-any.whl.1f2e.tmp"] = "an upload under way"
    fresh = HostEnvironments(environments, download=fake_download, uv_binary=sys.executable)  # nothing asked since
    await fresh.prune(hosts, ["h1", "h2"], {keys["2.59.0"]}, time.monotonic())
    assert "ray-2.59.0-py3-none-any.whl.1f2e.tmp" in hosts.files["h1:/work/h1/wheels"], "not a wheel: left"
    for name in ("h1", "h2"):
        left = hosts.list_or_remove(name, ["ls", "-1", f"/work/{name}/environments"]).stdout.split()
        ours = [keys["2.59.0"], f"{keys['2.59.0']}.txt"]
        assert left == sorted([*ours, foreign] if name == "h1" else ours), left
        wheels = set(hosts.files[f"{name}:/work/{name}/wheels"])
        assert "only-2.58.0-1.0-py3-none-any.whl" not in wheels and "only-2.59.0-1.0-py3-none-any.whl" in wheels
        assert "ray-2.59.0-py3-none-any.whl" in wheels

    asked = HostEnvironments(environments, download=fake_download, uv_binary=sys.executable)
    read_at = time.monotonic()
    await asked.pythons_on(hosts, ["h1"], specs["2.58.0"])  # a cluster created after the store was read
    await asked.prune(hosts, ["h1"], set(), read_at)
    left = hosts.list_or_remove("h1", ["ls", "-1", "/work/h1/environments"]).stdout.split()
    assert keys["2.58.0"] in left and keys["2.59.0"] not in left, left


async def test_a_ray_release_is_resolved_with_what_its_image_holds_and_its_wheel_omits(tmp_path: Path) -> None:
    """Ray 2.56.0's Serve fails on protobuf 7 (out before it): both resolves get protobuf<7;
    2.57.0's needs jinja2, which its `serve` extra does not list."""

    async def published(version: str) -> str:
        return "2026-01-01T00:01:00Z"

    uv_calls = FakeUv()
    environments = Environments(tmp_path, run=uv_calls, interpreters=interpreters, released=published)
    await environments.prepare(request_of(rayVersion="2.56.0"))
    compiles = [call for call in uv_calls.calls if call[:2] == ["pip", "compile"]]
    assert len(compiles) == 2
    for call in compiles:
        assert Path(call[call.index("--constraints") + 1]).read_text() == "protobuf<7\n", call
    later = FakeUv()
    await Environments(tmp_path / "b", run=later, interpreters=interpreters, released=published).prepare(
        request_of(rayVersion="2.57.0")
    )
    assert not [call for call in later.calls if "--constraints" in call], "no constraint from 2.57.0 on"
    # 2.57's Serve imports jinja2, which its extra forgets (2.58's too): added to both resolves
    for call in [call for call in later.calls if call[:2] == ["pip", "compile"]]:
        assert "jinja2" in Path(call[2]).read_text().split(), call


async def test_a_lock_written_before_its_releases_image_fixes_is_resolved_anew(tmp_path: Path) -> None:
    """A 2.57.0 lock without jinja2 (its environment never served) is resolved again, under the
    same key; 2.55.0's (protobuf 6, meets protobuf<7) is kept as it is."""
    uv_calls = FakeUv()
    environments = Environments(tmp_path, run=uv_calls, interpreters=interpreters, released=unknown_release)
    old = request_of(rayVersion="2.57.0")
    lock = environments.lock_of(old)
    lock.parent.mkdir(parents=True)
    lock.write_text("protobuf==7.35.1\nray==2.57.0\n")
    assert not old.lock_holds_image_fixes(lock.read_text())
    await environments.prepare(old)
    assert "jinja2==1.0" in lock.read_text().split() and environments.lock_of(old) == lock
    kept = request_of(rayVersion="2.55.0")
    environments.lock_of(kept).write_text("protobuf==6.33.6\nray==2.55.0\n")
    compiles = uv_calls.count("pip", "compile")
    await environments.prepare(kept)
    assert uv_calls.count("pip", "compile") == compiles, "a lock that holds the fixes is not resolved again"
    assert not request_of(rayVersion="2.56.0").lock_holds_image_fixes("protobuf==7.35.1\nray==2.56.0\n")
