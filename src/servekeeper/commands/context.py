"""What every command works on: the store, the controller to wake, and the daemon's folders."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from servekeeper.controller.loop import Controller
from servekeeper.store.store import Store


@dataclass(frozen=True)
class CommandContext:
    """`packages_dir`: where code packages go (the daemon's state dir); without it, a local
    workingDir is handed to Ray as a live `local://` path (unit tests of the API only).
    `secrets_dir`: `servekeeper secret`s for KubeRay's secretKeyRef (None: no secrets).

    Commands run on the controller's event loop (see api/app.py): a command's store reads and
    writes never interleave with a tick's, since none of them awaits in between."""

    store: Store
    controller: Controller
    packages_dir: Path | None = None
    secrets_dir: Path | None = None
    # Applies (and undos) one at a time from packaging to pruning: a prune never removes the
    # package of an apply whose spec is not stored yet, and two applies cannot take one port.
    packaging: asyncio.Lock = field(default_factory=asyncio.Lock)
