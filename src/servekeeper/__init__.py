"""servekeeper: run Ray Serve services and change them without dropping a request.

from servekeeper import Client    # the Python client of the daemon (servekeeper.client)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from servekeeper.client import (
        AsyncClient,
        Client,
        Conflict,
        DaemonNotRunning,
        RevisionNotFound,
        RolloutFailed,
        ServekeeperError,
        ServiceNotFound,
        SpecInvalid,
        Unauthorized,
        WaitTimeout,
    )

__all__ = [
    "AsyncClient",
    "Client",
    "Conflict",
    "DaemonNotRunning",
    "RevisionNotFound",
    "RolloutFailed",
    "ServekeeperError",
    "ServiceNotFound",
    "SpecInvalid",
    "Unauthorized",
    "WaitTimeout",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import servekeeper.core...` (and every tool that imports a part of
    # servekeeper) stays free of the client's HTTP and spec dependencies.
    if name in __all__:
        from servekeeper import client

        return getattr(client, name)
    raise AttributeError(f"module 'servekeeper' has no attribute {name!r}")
