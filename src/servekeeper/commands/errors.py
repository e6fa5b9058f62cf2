"""What a command raises when it refuses: nothing has changed. The transports map each kind once
(the API to an HTTP status in `api/errors.py`, the dashboard through the same mapping)."""

from __future__ import annotations

from collections.abc import Sequence


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
