"""`servekeeper secret`: named sets of KEY=VALUE in the state dir, one file per secret, mode 0600
in a 0700 folder. Values are read back only to be injected as env (a KubeRay manifest's
`valueFrom.secretKeyRef`); the CLI shows key names only."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from servekeeper.model.base import DNS_LABEL
from servekeeper.store.store import private_state_dir

SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # Kubernetes' secret key rule
STDIN = "-"
MAX_SECRET_FILE_BYTES = 1024 * 1024  # a certificate or key is a few KiB; /dev/zero never ends


class SecretError(ValueError):
    pass


def secrets_dir(state_dir: Path) -> Path:
    return state_dir / "secrets"


def _path(directory: Path, name: str) -> Path:
    if not DNS_LABEL.match(name) or len(name) > 253:
        raise SecretError(f"secret name {name!r} is not a DNS label (lowercase letters, digits, '-')")
    return directory / f"{name}.json"


def read_values(pairs: Sequence[str], from_files: Sequence[str], read_stdin: Callable[[], str]) -> dict[str, str]:
    """A secret's values, never from argv (seen by `ps`, kept in shell history): `KEY=-` reads
    that key's value from standard input (one trailing newline dropped), `--from-file KEY=PATH`
    from a file (byte for byte, UTF-8, at most MAX_SECRET_FILE_BYTES). `KEY=VALUE` is refused,
    saying how to pass it; so is a key given twice."""
    values: dict[str, str] = {}
    stdin_key: str | None = None
    for pair in pairs:
        key, value = _split(pair, "KEY=-", values)
        if value != STDIN:
            raise SecretError(
                f"{key!r}: a secret value on the command line is visible to `ps` and kept in shell "
                f"history; pass {key}=- and the value on standard input, or --from-file {key}=PATH"
            )
        if stdin_key is not None:
            raise SecretError(f"{stdin_key!r} and {key!r} both read standard input; give one of them --from-file")
        stdin_key = key
        raw = read_stdin()
        values[key] = raw[:-1] if raw.endswith("\n") else raw
    for pair in from_files:
        key, path = _split(pair, "KEY=PATH", values)
        values[key] = _read_file(key, path)
    if not values:
        raise SecretError("no values: give KEY=- (the value on standard input) or --from-file KEY=PATH")
    for key, value in values.items():
        if "\x00" in value:
            raise SecretError(f"the value of {key!r} contains a NUL byte")
    return values


def _split(pair: str, shape: str, given: dict[str, str]) -> tuple[str, str]:
    key, sep, value = pair.partition("=")
    if not sep or not SECRET_KEY.match(key):
        raise SecretError(f"{key!r}: expected {shape} with a key of letters, digits, '-', '.', '_'")
    if key in given:
        raise SecretError(f"{key!r} is given twice; give each key once")
    return key, value


def _read_file(key: str, path: str) -> str:
    """The file's bytes as UTF-8 text, unchanged (no newline translation, no locale encoding)."""
    try:
        with Path(path).expanduser().open("rb") as handle:
            data = handle.read(MAX_SECRET_FILE_BYTES + 1)  # bounded: a device may never end
    except OSError as exc:
        raise SecretError(f"{key!r}: cannot read {path}: {exc}") from exc
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretError(f"{key!r}: {path} is larger than {MAX_SECRET_FILE_BYTES} bytes; a secret value is not")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SecretError(
            f"{key!r}: {path} is not UTF-8 text (byte {exc.start}); store it encoded, e.g. base64"
        ) from exc


def set_secret(directory: Path, name: str, values: dict[str, str]) -> None:
    """Replace the secret `name` with `values` (atomically: a reader sees the old or the new)."""
    path = _path(directory, name)
    private_state_dir(directory.parent)  # `secret set` may come before the first `up`
    directory.mkdir(mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(values, handle, sort_keys=True)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def delete_secret(directory: Path, name: str) -> bool:
    path = _path(directory, name)
    if not path.exists():
        return False
    path.unlink()
    return True


def list_secrets(directory: Path) -> dict[str, list[str]]:
    """Secret name -> its key names (never the values)."""
    return {name: sorted(values) for name, values in read_secrets(directory).items()}


def read_secrets(directory: Path) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(values, dict):
            found[path.stem] = {str(k): str(v) for k, v in values.items()}
    return found
