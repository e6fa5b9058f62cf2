"""Content-addressed code packages: a service's workingDir frozen into one immutable zip.

A live `local:///path` working_dir lets an edit on disk change what the *active* cluster imports
on its next replica restart, and no hash sees the edit. Instead the directory is zipped
deterministically (sorted entries, fixed timestamps and modes), named by the sha256 of its
content, written once to `packages_dir/<hash>.zip`, uploaded to the cluster's GCS through the
dashboard and referenced as `gcs://_ray_pkg_<hash>.zip`, the URI form Ray's job SDK uses.

Layout: files sit at the top level of the zip (`hello.py`, `pkg/mod.py`), exactly like Ray's
own `_zip_files(..., include_parent_dir=False)` for a working_dir, because Ray unpacks a `gcs://`
zip with `remove_top_level_directory=False` into the directory it puts on `sys.path` and uses as
the replica's cwd; `import_path: hello:app` then resolves from the package root.

Building reads files and writes a zip: call it off the event loop (`asyncio.to_thread`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import pathspec

if TYPE_CHECKING:
    from servekeeper.model.spec import ServiceSpec

logger = logging.getLogger(__name__)

# The dashboard reads an upload with aiohttp's `client_max_size`, which Ray sets to
# `ray_constants.DASHBOARD_CLIENT_MAX_SIZE` (100 MiB): a larger body is refused with HTTP 413.
# (GCS itself allows up to the gRPC message limit, 512 MiB.)
DEFAULT_MAX_PACKAGE_BYTES = 100 * 1024 * 1024
IGNORE_FILE = ".servekeeperignore"
# Never worth shipping, and never re-included by a `!pattern` in the ignore file.
ALWAYS_EXCLUDED = ("__pycache__/", "*.pyc", ".git")
RAY_PKG_PREFIX = "_ray_pkg_"
# The earliest time a zip entry can hold; any fixed value makes the bytes independent of mtimes.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
HASH_FORMAT = b"servekeeper-package/1\n"
PACKAGE_FILE = re.compile(r"^[0-9a-f]{64}\.zip$")
TEMP_PREFIX = ".building-"
STALE_TEMP_SECONDS = 3600
_CHUNK = 1024 * 1024


class PackageError(RuntimeError):
    """The working directory cannot be packaged; the message says why and what to change."""


@dataclass(frozen=True)
class Package:
    hash: str
    path: Path
    size: int

    @property
    def package_name(self) -> str:
        return f"{RAY_PKG_PREFIX}{self.hash}.zip"

    @property
    def uri(self) -> str:
        return f"gcs://{self.package_name}"


@dataclass(frozen=True)
class _Entry:
    """One zip member: a regular file (`source` set) or an empty directory (name ends in '/')."""

    name: str
    source: Path | None
    mode: int
    size: int


def build_package(
    working_dir: Path,
    packages_dir: Path,
    excludes: Sequence[str] = (),
    max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES,
) -> Package:
    """Zip `working_dir` into `packages_dir/<sha256>.zip` unless that package already exists."""
    root = Path(working_dir).expanduser().absolute()
    if not root.is_dir():
        reason = "does not exist" if not root.exists() else "is not a directory"
        raise PackageError(f"workingDir {root} {reason}")
    entries = _collect(root, _ignore_spec(root, excludes))
    content_hash = _content_hash(entries)
    target = packages_dir / f"{content_hash}.zip"
    if target.exists():
        # Immutable: the same content always gives this file; never rewrite it (but an older
        # servekeeper left it readable by everyone).
        os.chmod(target, 0o400)
        size = target.stat().st_size
        if size > max_bytes:
            raise _too_large(root, size, max_bytes, entries, partial=False)
        return Package(content_hash, target, size)
    packages_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if packages_dir.stat().st_mode & 0o077:
        os.chmod(packages_dir, 0o700)  # made 0755 by an older servekeeper
    size = _write_zip(root, entries, content_hash, target, max_bytes)
    logger.info("packaged %s as %s (%d files, %d bytes)", root, target.name, len(entries), size)
    return Package(content_hash, target, size)


def package_for_spec(spec: ServiceSpec, packages_dir: Path) -> Package | None:
    """The package for a spec's workingDir, or None when there is nothing for servekeeper to ship.

    A workingDir with a scheme is left to Ray: `https://`, `s3://`, `gcs://` URIs are fetched by
    Ray itself, and an explicit `local:///path` is the deliberate opt-out (a live directory).
    """
    config = spec.spec.rayClusterConfig
    if not config.workingDir or "://" in config.workingDir:
        return None
    return build_package(Path(config.workingDir), packages_dir, config.excludes)


def prune_packages(packages_dir: Path, keep: set[str], now: float | None = None) -> list[str]:
    """Delete package zips whose hash is not in `keep`, and temp files of builds that died.

    Returns the hashes deleted. Files that are not packages are left alone.
    """
    if not packages_dir.is_dir():
        return []
    current = time.time() if now is None else now
    deleted = []
    for path in sorted(packages_dir.iterdir()):
        if PACKAGE_FILE.match(path.name):
            content_hash = path.name.removesuffix(".zip")
            if content_hash in keep:
                continue
            path.unlink(missing_ok=True)
            deleted.append(content_hash)
        elif path.name.startswith(TEMP_PREFIX):
            try:
                stale = current - path.stat().st_mtime > STALE_TEMP_SECONDS
            except FileNotFoundError:
                continue
            if stale:
                path.unlink(missing_ok=True)
    return deleted


def _ignore_spec(root: Path, excludes: Sequence[str]) -> pathspec.GitIgnoreSpec:
    lines = list(excludes)
    ignore_file = root / IGNORE_FILE
    if ignore_file.is_file():
        try:
            lines = ignore_file.read_text(encoding="utf-8").splitlines() + lines
        except (OSError, UnicodeDecodeError) as exc:
            raise PackageError(f"cannot read {ignore_file}: {exc}") from exc
    try:
        return pathspec.GitIgnoreSpec.from_lines(lines)
    except (ValueError, TypeError) as exc:
        raise PackageError(f"bad ignore pattern for workingDir {root} ({IGNORE_FILE} or excludes): {exc}") from exc


_ALWAYS = pathspec.GitIgnoreSpec.from_lines(ALWAYS_EXCLUDED)


def _ignored(spec: pathspec.GitIgnoreSpec, relative: str) -> bool:
    return _ALWAYS.match_file(relative) or spec.match_file(relative)


def _collect(root: Path, spec: pathspec.GitIgnoreSpec) -> list[_Entry]:
    """Every file to ship, sorted by its name in the zip. Symlinks are followed, as Ray does."""
    entries: list[_Entry] = []
    root_stat = root.stat()
    _visit(root, "", spec, frozenset({(root_stat.st_dev, root_stat.st_ino)}), entries)
    if not entries:
        raise PackageError(f"workingDir {root} has no files to package (all excluded or empty)")
    entries.sort(key=lambda entry: entry.name)
    return entries


def _visit(
    directory: Path, prefix: str, spec: pathspec.GitIgnoreSpec, ancestors: frozenset[tuple[int, int]], out: list[_Entry]
) -> None:
    try:
        children = sorted(os.listdir(directory))
    except OSError as exc:
        raise PackageError(f"cannot read directory {directory}: {exc}") from exc
    if not children and prefix:
        out.append(_Entry(prefix, None, 0o755, 0))  # an empty directory, kept as Ray keeps it
        return
    for name in children:
        path = directory / name
        relative = prefix + name
        if not prefix and name == IGNORE_FILE:
            continue  # control-plane config, not code: editing a comment must not make a new package
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PackageError(f"file name {path!r} is not valid UTF-8") from exc
        try:
            info = path.stat()  # follows symlinks
        except OSError as exc:
            if path.is_symlink():
                logger.warning("skipping broken symlink %s", path)
                continue
            raise PackageError(f"cannot read {path}: {exc}") from exc
        if stat.S_ISDIR(info.st_mode):
            if _ignored(spec, relative + "/"):
                continue
            identity = (info.st_dev, info.st_ino)
            if identity in ancestors:
                raise PackageError(f"symlink loop at {path}")
            _visit(path, relative + "/", spec, ancestors | {identity}, out)
        elif stat.S_ISREG(info.st_mode):
            if _ignored(spec, relative):
                continue
            mode = 0o755 if info.st_mode & stat.S_IXUSR else 0o644
            out.append(_Entry(relative, path, mode, info.st_size))
        else:
            logger.warning("skipping %s: not a regular file or directory", path)


def _content_hash(entries: Sequence[_Entry], digests: Sequence[bytes] | None = None) -> str:
    """sha256 over names, modes and file digests: independent of zlib, mtimes and walk order."""
    digest = hashlib.sha256(HASH_FORMAT)
    for index, entry in enumerate(entries):
        kind = b"D" if entry.source is None else b"F"
        if entry.source is None:
            file_digest = b""
        else:
            file_digest = digests[index] if digests is not None else _file_digest(entry.source)
        digest.update(kind + b"\0" + entry.name.encode("utf-8") + b"\0" + oct(entry.mode).encode() + b"\0")
        digest.update(file_digest)
    return digest.hexdigest()


def _read_chunks(source: Path) -> Iterator[bytes]:
    try:
        with source.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                yield chunk
    except OSError as exc:
        raise PackageError(f"cannot read {source}: {exc}") from exc


def _file_digest(source: Path) -> bytes:
    digest = hashlib.sha256()
    for chunk in _read_chunks(source):
        digest.update(chunk)
    return digest.digest()


def _zip_info(entry: _Entry) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(entry.name, date_time=ZIP_EPOCH)
    info.create_system = 3  # unix, so Ray's unzip applies the mode below (external_attr >> 16)
    if entry.source is None:
        info.external_attr = ((stat.S_IFDIR | entry.mode) << 16) | 0x10  # 0x10: MS-DOS directory flag
        info.compress_type = zipfile.ZIP_STORED
    else:
        info.external_attr = (stat.S_IFREG | entry.mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        info.file_size = entry.size  # a hint for zip64; the real size is what is read
    return info


def _write_zip(root: Path, entries: Sequence[_Entry], content_hash: str, target: Path, max_bytes: int) -> int:
    handle, temp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".zip", dir=target.parent)
    temp = Path(temp_name)
    try:
        with os.fdopen(handle, "wb") as raw:
            digests = _write_entries(root, entries, raw, max_bytes)
            raw.flush()
            os.fsync(raw.fileno())
            size = raw.tell()
        if size > max_bytes:
            raise _too_large(root, size, max_bytes, entries, partial=False)
        if _content_hash(entries, digests) != content_hash:
            raise PackageError(f"files in workingDir {root} changed while it was being packaged; try again")
        os.chmod(temp, 0o400)  # the daemon's own: it reads and uploads it
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return size


def _write_entries(root: Path, entries: Sequence[_Entry], raw: BinaryIO, max_bytes: int) -> list[bytes]:
    digests: list[bytes] = []
    with zipfile.ZipFile(raw, "w") as archive:  # deflate at zlib's default level
        for entry in entries:
            info = _zip_info(entry)
            if entry.source is None:
                archive.writestr(info, b"")
                digests.append(b"")
            else:
                digest = hashlib.sha256()
                with archive.open(info, "w", force_zip64=entry.size > 2**31) as member:
                    for chunk in _read_chunks(entry.source):
                        digest.update(chunk)
                        member.write(chunk)
                        if raw.tell() > max_bytes:  # stop early: a 10 GB file must not be zipped first
                            raise _too_large(root, raw.tell(), max_bytes, entries, partial=True)
                digests.append(digest.digest())
            if raw.tell() > max_bytes:
                raise _too_large(root, raw.tell(), max_bytes, entries, partial=True)
    return digests


def _too_large(root: Path, size: int, max_bytes: int, entries: Sequence[_Entry], partial: bool) -> PackageError:
    largest = sorted((entry for entry in entries if entry.source), key=lambda entry: (-entry.size, entry.name))[:5]
    listing = ", ".join(f"{entry.name} ({_mib(entry.size)})" for entry in largest)
    found = f"more than {_mib(size)} (stopped zipping there)" if partial else _mib(size)
    return PackageError(
        f"workingDir {root} packs to {found}, over the limit of {_mib(max_bytes)} "
        f"(the Ray dashboard refuses larger uploads). Largest files: {listing}. "
        f"Exclude what the service does not import with {IGNORE_FILE} or rayClusterConfig.excludes, "
        "or serve the code from a remote URI (https://, s3://) as workingDir."
    )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1024 * 1024):.2f} MiB ({num_bytes} bytes)"
