"""Content-addressed code packages: deterministic zips, ignore rules, limits, Ray's layout."""

from __future__ import annotations

import errno
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from servekeeper.model.spec import SpecError, parse_spec
from servekeeper.rayapi.package import (
    DEFAULT_MAX_PACKAGE_BYTES,
    Package,
    PackageError,
    build_package,
    package_for_spec,
    prune_packages,
)


def write_tree(root: Path, files: dict[str, str | bytes], order: list[str] | None = None) -> Path:
    for name in order or list(files):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        content = files[name]
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


APP = {
    "hello.py": "from pkg.greet import greet\napp = greet\n",
    "pkg/__init__.py": "",
    "pkg/greet.py": "def greet():\n    return 'hi'\n",
    "run.sh": "#!/bin/sh\necho hi\n",
}


def names(package: Package) -> list[str]:
    with zipfile.ZipFile(package.path) as archive:
        return archive.namelist()


def test_same_files_give_same_hash_and_bytes_whatever_the_mtimes_and_creation_order(tmp_path: Path) -> None:
    first = write_tree(tmp_path / "a", APP)
    second = write_tree(tmp_path / "b", APP, order=list(reversed(APP)))
    for path in second.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    one = build_package(first, tmp_path / "packages-1")
    two = build_package(second, tmp_path / "packages-2")
    assert one.hash == two.hash and len(one.hash) == 64
    assert one.path.read_bytes() == two.path.read_bytes()
    assert one.size == one.path.stat().st_size
    assert one.path == tmp_path / "packages-1" / f"{one.hash}.zip"
    assert one.uri == f"gcs://_ray_pkg_{one.hash}.zip"


def test_one_byte_edit_makes_a_new_package(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", APP)
    before = build_package(root, tmp_path / "packages")
    (root / "pkg" / "greet.py").write_text("def greet():\n    return 'ho'\n")
    after = build_package(root, tmp_path / "packages")
    assert after.hash != before.hash
    assert before.path.exists() and after.path.exists()  # the old one is kept until pruned


def test_the_executable_bit_is_part_of_the_content(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", APP)
    plain = build_package(root, tmp_path / "packages")
    (root / "run.sh").chmod(0o755)
    executable = build_package(root, tmp_path / "packages")
    assert executable.hash != plain.hash
    with zipfile.ZipFile(executable.path) as archive:
        assert archive.getinfo("run.sh").external_attr >> 16 == 0o100755
        assert archive.getinfo("hello.py").external_attr >> 16 == 0o100644
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


@pytest.mark.parametrize(
    ("extra", "ignore_file", "excludes"),
    [
        pytest.param({"pkg/__pycache__/greet.cpython-311.pyc": b"\0bytecode"}, None, [], id="pycache"),
        pytest.param({"stray.pyc": b"\0"}, "!*.pyc\n", [], id="pyc-cannot-be-re-included"),
        pytest.param({".git/HEAD": "ref: refs/heads/main\n"}, None, [], id="git-dir"),
        pytest.param(
            {"data/big.bin": b"x" * 1000, "notes.log": "n"}, "# comment\ndata/\n*.log\n", [], id="ignore-file"
        ),
        pytest.param({"data/big.bin": b"x" * 1000}, None, ["data/"], id="excludes"),
        pytest.param({"a/deep/cache.tmp": "t"}, None, ["*.tmp"], id="excludes-match-at-any-depth"),
    ],
)
def test_ignored_files_do_not_change_the_hash(
    tmp_path: Path, extra: dict[str, str | bytes], ignore_file: str | None, excludes: list[str]
) -> None:
    clean = build_package(write_tree(tmp_path / "clean", APP), tmp_path / "packages")
    noisy_root = write_tree(tmp_path / "noisy", {**APP, **extra})
    if ignore_file is not None:
        (noisy_root / ".servekeeperignore").write_text(ignore_file)
    noisy = build_package(noisy_root, tmp_path / "packages", excludes=excludes)
    assert noisy.hash == clean.hash
    assert names(noisy) == names(clean)


def test_negation_re_includes_a_file_and_anchored_patterns_stay_at_the_top(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", {**APP, "a.log": "a", "keep.log": "k", "top.txt": "t", "sub/top.txt": "s"})
    (root / ".servekeeperignore").write_text("*.log\n!keep.log\n/top.txt\n")
    assert set(names(build_package(root, tmp_path / "packages"))) == {*APP, "keep.log", "sub/top.txt"}


def test_the_zip_holds_the_files_at_top_level_as_ray_unpacks_a_gcs_working_dir(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", APP)
    (root / "empty").mkdir()
    package = build_package(root, tmp_path / "packages")
    assert names(package) == ["empty/", "hello.py", "pkg/__init__.py", "pkg/greet.py", "run.sh"]

    # Unpack with Ray's own code, the call its working_dir plugin makes for a gcs:// zip.
    from ray._private.runtime_env.packaging import unzip_package

    copy = tmp_path / "download.zip"
    copy.write_bytes(package.path.read_bytes())
    target = tmp_path / "unpacked"
    unzip_package(str(copy), str(target), remove_top_level_directory=False, unlink_zip=True)
    unpacked = sorted(str(path.relative_to(target)) for path in target.rglob("*"))
    assert unpacked == ["empty", "hello.py", "pkg", "pkg/__init__.py", "pkg/greet.py", "run.sh"]
    assert (target / "pkg" / "greet.py").read_text() == APP["pkg/greet.py"]


def test_a_single_top_level_directory_is_kept_not_flattened(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", {"pkg/__init__.py": "", "pkg/app.py": "app = 1\n"})
    assert names(build_package(root, tmp_path / "packages")) == ["pkg/__init__.py", "pkg/app.py"]


def test_symlinked_files_are_packed_by_content(tmp_path: Path) -> None:
    shared = write_tree(tmp_path / "shared", {"util.py": "X = 1\n"})
    root = write_tree(tmp_path / "app", APP)
    (root / "util.py").symlink_to(shared / "util.py")
    (root / "dangling.py").symlink_to(tmp_path / "nowhere.py")
    with zipfile.ZipFile(build_package(root, tmp_path / "packages").path) as archive:
        assert archive.read("util.py") == b"X = 1\n"
        assert "dangling.py" not in archive.namelist()


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", APP)
    (root / "pkg" / "loop").symlink_to(root)
    with pytest.raises(PackageError, match="symlink loop"):
        build_package(root, tmp_path / "packages")


def test_too_large_names_directory_size_limit_and_largest_files(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", {**APP, "weights.bin": os.urandom(64 * 1024), "small.bin": os.urandom(9000)})
    with pytest.raises(PackageError) as caught:
        build_package(root, tmp_path / "packages", max_bytes=32 * 1024)
    message = str(caught.value)
    assert str(root) in message
    assert "limit of 0.03 MiB (32768 bytes)" in message
    assert "MiB (" in message.split("packs to", 1)[1]
    assert "weights.bin (0.06 MiB (65536 bytes)), small.bin" in message
    assert list((tmp_path / "packages").iterdir()) == []  # no temp file left behind


def test_the_limit_counts_the_finished_zip(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", APP)
    size = build_package(root, tmp_path / "packages").size
    assert build_package(root, tmp_path / "again", max_bytes=size).size == size
    with pytest.raises(PackageError, match=f"packs to 0.00 MiB \\({size} bytes\\)"):
        build_package(root, tmp_path / "tight", max_bytes=size - 1)
    assert DEFAULT_MAX_PACKAGE_BYTES == 100 * 1024 * 1024


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        pytest.param(lambda path: None, "does not exist", id="missing"),
        pytest.param(lambda path: path.write_text("x"), "is not a directory", id="a-file"),
        pytest.param(lambda path: path.mkdir(), "no files to package", id="empty"),
    ],
)
def test_unusable_directories_are_refused_clearly(tmp_path: Path, make: object, reason: str) -> None:
    working_dir = tmp_path / "app"
    make(working_dir)  # type: ignore[operator]
    with pytest.raises(PackageError, match=reason) as caught:
        build_package(working_dir, tmp_path / "packages")
    assert str(working_dir) in str(caught.value)


def test_an_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_tree(tmp_path / "app", APP)
    unreadable = root / "pkg" / "greet.py"
    real_open = Path.open

    def open_refusing_one_file(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == unreadable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_open(self, *args, **kwargs)

    # A chmod 0 would not do: root reads any file. Refuse it where the package opens files.
    monkeypatch.setattr(Path, "open", open_refusing_one_file)
    with pytest.raises(PackageError, match="greet.py") as caught:
        build_package(root, tmp_path / "packages")
    assert f"cannot read {unreadable}" in str(caught.value)
    assert "Permission denied" in str(caught.value)
    assert isinstance(caught.value.__cause__, PermissionError)
    assert not any((tmp_path / "packages").glob("*"))  # nothing half-written is left


def test_the_package_file_is_written_once_and_read_only(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", APP)
    first = build_package(root, tmp_path / "packages")
    assert first.path.stat().st_mode & 0o777 == 0o400
    before = first.path.stat()
    for path in root.rglob("*"):
        os.utime(path, (2_000_000, 2_000_000))
    second = build_package(root, tmp_path / "packages")
    after = second.path.stat()
    assert second == first
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(path.name for path in (tmp_path / "packages").iterdir()) == [first.path.name]


def test_prune_keeps_referenced_packages_and_foreign_files(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    root = write_tree(tmp_path / "app", APP)
    old = build_package(root, packages)
    (root / "hello.py").write_text("app = None\n")
    new = build_package(root, packages)
    (packages / "README").write_text("not a package")
    stale_temp = packages / ".building-dead.zip"
    stale_temp.write_bytes(b"partial")
    fresh_temp = packages / ".building-live.zip"
    fresh_temp.write_bytes(b"partial")
    os.utime(stale_temp, (0, 0))
    assert prune_packages(packages, keep={new.hash}) == [old.hash]
    assert sorted(path.name for path in packages.iterdir()) == sorted([new.path.name, "README", ".building-live.zip"])
    assert prune_packages(tmp_path / "absent", keep=set()) == []


def spec_with(ray_cluster_config: dict[str, object]) -> dict[str, object]:
    return {
        "apiVersion": "servekeeper/v1alpha1",
        "kind": "RayService",
        "metadata": {"name": "s"},
        "spec": {
            "ingress": {"port": 8000},
            "rayClusterConfig": ray_cluster_config,
            "serveConfig": {"applications": [{"name": "a", "import_path": "hello:app"}]},
        },
    }


@pytest.mark.parametrize(
    "working_dir",
    [
        pytest.param(None, id="none"),
        pytest.param("https://example.com/app.zip", id="https"),
        pytest.param("s3://bucket/app.zip", id="s3"),
        pytest.param("gcs://_ray_pkg_abc.zip", id="gcs"),
        pytest.param("local:///srv/app", id="explicit-local-opt-out"),
    ],
)
def test_package_for_spec_leaves_uris_to_ray(tmp_path: Path, working_dir: str | None) -> None:
    config = {} if working_dir is None else {"workingDir": working_dir}
    assert package_for_spec(parse_spec(spec_with(config)), tmp_path / "packages") is None


def test_package_for_spec_honours_excludes(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "app", {**APP, "data/big.bin": b"x" * 100})
    spec = parse_spec(spec_with({"workingDir": str(root), "excludes": ["data/"]}))
    package = package_for_spec(spec, tmp_path / "packages")
    assert package is not None and "data/big.bin" not in names(package)
    assert package.hash == build_package(write_tree(tmp_path / "clean", APP), tmp_path / "packages").hash


@pytest.mark.parametrize("pattern", ["a\nb", "x\x00", "y\r"])
def test_excludes_reject_line_breaks_and_nul(pattern: str) -> None:
    with pytest.raises(SpecError, match="excludes"):
        parse_spec(spec_with({"workingDir": "/srv/app", "excludes": [pattern]}))
