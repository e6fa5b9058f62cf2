"""Every error the client raises: one base class, and one class per answer a caller acts on."""

from __future__ import annotations

from typing import Any

from servekeeper.model.wire import ConditionView, ServiceView, condition


class ServekeeperError(Exception):
    """Every error this client raises."""


class DaemonNotRunning(ServekeeperError):
    """No daemon answers for the state dir (or at the given URL)."""

    def __init__(self, where: str, cause: str = "") -> None:
        self.where = where
        self.cause = cause
        super().__init__(f"servekeeper is not running for {where}; start it with: servekeeper up --detach")


class ApiError(ServekeeperError):
    """The daemon refused a call. `status` is the HTTP status, `detail` its decoded answer."""

    def __init__(self, status: int, detail: Any, text: str, message: str | None = None) -> None:
        self.status = status
        self.detail = detail
        self.text = text
        super().__init__(message or f"API error {status}: {text}")


class Unauthorized(ApiError):
    """Missing or wrong bearer token (the `token` file of the state dir)."""


class ServiceNotFound(ApiError):
    """No service of that name (the message is the daemon's: "service 'x' not found")."""


class RevisionNotFound(ApiError):
    """`undo --to-revision N` named a revision the history does not keep."""


class Conflict(ApiError):
    """The call does not fit the service's state (409): promote or abort with no rollout in
    progress, undo with nothing to undo to, to the current revision, or to a deleted package."""


class SpecInvalid(ServekeeperError):
    """The spec was refused; `problems` lists each as "field.path: message". `source` is the file
    it came from, when it was rejected before reaching the daemon."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" {source}" if source else ""
        super().__init__(f"invalid service spec{where}:\n" + "\n".join(f"  - {p}" for p in problems))


class WaitTimeout(ServekeeperError):
    def __init__(self, view: ServiceView) -> None:
        self.view = view
        ready = condition(view, "Ready")
        status, reason, message = (ready["status"], ready["reason"], ready["message"]) if ready else (None, None, None)
        super().__init__(f"timed out waiting for service/{view.get('name')}: Ready={status} ({reason}: {message})")


class RolloutFailed(ServekeeperError):
    """The latest generation will not roll out: it failed (`RolloutFailed`), or its cluster change
    is not rolled out by design (`ClusterSpecOutdated`, `upgradeStrategy: None`)."""

    def __init__(self, view: ServiceView, failed: ConditionView) -> None:
        self.view = view
        self.generation = view.get("generation")
        self.reason = failed["reason"]
        self.message = failed["message"]
        super().__init__(
            f"service/{view.get('name')} generation {self.generation} not rolled out: {self.reason}: {self.message}"
        )
