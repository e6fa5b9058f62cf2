"""A pool cluster's token: Ray's token authentication (`RAY_AUTH_MODE=token`) on every node.

The controller keeps each cluster's token in a 0600 file under its state dir (the CLI reads it
there too); the nodes read it from a 0600 file on their host, written over SFTP.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def new_cluster_token() -> str:
    """256 bits, hex (what `ray get-auth-token --generate` makes)."""
    return secrets.token_hex(32)


def token_dir(state_dir: Path) -> Path:
    """Where the controller keeps its pool clusters' tokens (the CLI reads them there too)."""
    return state_dir / "tokens"


def token_file(directory: Path, cluster: str) -> Path:
    return directory / f"{cluster}.token"


def save_cluster_token(directory: Path, cluster: str, token: str) -> Path:
    """Store a cluster's token on the controller, readable by its owner only."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = token_file(directory, cluster)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(token)
    os.chmod(path, 0o600)
    return path


def read_cluster_token(directory: Path, cluster: str) -> str:
    return token_file(directory, cluster).read_text().strip()


def auth_headers(token: str) -> dict[str, str]:
    """What every call of servekeeper's to a managed cluster's dashboard carries."""
    return {"Authorization": f"Bearer {token}"}
