"""`servekeeper secret`: named sets of KEY=VALUE in the state dir, one file per secret, mode 0600
in a 0700 folder. Values are read back only to be injected as env (a KubeRay manifest's
`valueFrom.secretKeyRef`); the CLI shows key names only."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from servekeeper.model.base import DNS_LABEL

SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # Kubernetes' secret key rule


class SecretError(ValueError):
    pass


def secrets_dir(state_dir: Path) -> Path:
    return state_dir / "secrets"


def _path(directory: Path, name: str) -> Path:
    if not DNS_LABEL.match(name) or len(name) > 253:
        raise SecretError(f"secret name {name!r} is not a DNS label (lowercase letters, digits, '-')")
    return directory / f"{name}.json"


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not SECRET_KEY.match(key):
            raise SecretError(
                f"{pair.split('=', 1)[0]!r}: expected KEY=VALUE with a key of letters, digits, '-', '.', '_'"
            )
        if "\x00" in value:
            raise SecretError(f"the value of {key!r} contains a NUL byte")
        values[key] = value
    return values


def set_secret(directory: Path, name: str, values: dict[str, str]) -> None:
    """Replace the secret `name` with `values` (atomically: a reader sees the old or the new)."""
    path = _path(directory, name)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
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
