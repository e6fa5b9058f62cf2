"""What a command raises when it refuses: nothing has changed.

Each kind carries its HTTP meaning here, once (as Kubernetes' API errors carry their status
code): the API (`api/errors.py`) and the dashboard answer with `status_of` and `detail_of`, so
neither transport imports the other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CommandError(Exception):
    """A command refused; `message` says why, in words a user can act on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(CommandError):
    """What the command names does not exist."""


class ServiceNotFound(NotFound):
    def __init__(self, name: str) -> None:
        super().__init__(f"service {name!r} not found")
        self.name = name


class RevisionNotFound(NotFound):
    def __init__(self, revision: int, kept: Sequence[int]) -> None:
        super().__init__(f"revision {revision} is not in the history (kept: {list(kept)})")
        self.revision = revision


class HostPoolNotFound(NotFound):
    def __init__(self, name: str) -> None:
        super().__init__(f"host pool {name!r} not found")
        self.name = name


class Conflict(CommandError):
    """Not possible in the current state (nothing to promote, a host still in use, ...)."""


class Invalid(CommandError):
    """The request itself is wrong; `problems` are `path: message` lines, one per fault."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class InvalidSpec(Invalid):
    """The spec (or KubeRay manifest) cannot be applied: invalid, unplaceable, or a port taken."""


BAD_REQUEST = 400


def status_of(error: CommandError) -> int:
    if isinstance(error, NotFound):
        return 404
    if isinstance(error, Conflict):
        return 409
    if isinstance(error, Invalid):
        return 422
    return BAD_REQUEST


def detail_of(error: CommandError) -> str | dict[str, Any]:
    if isinstance(error, Invalid):
        return {"problems": error.problems}
    return error.message
