"""The Python client of the servekeeper daemon (`from servekeeper import Client`): `Client`
(blocking) and `AsyncClient` in `sync.py` and `aio.py`, the errors they raise in `errors.py`,
and the API's JSON shapes they return, declared once in `servekeeper.model.wire`."""

from servekeeper.client.aio import AsyncClient
from servekeeper.client.common import default_state_dir, read_api_info
from servekeeper.client.errors import (
    ApiError,
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
from servekeeper.client.sync import Client
from servekeeper.model.wire import (
    AbortResult,
    AnalysisView,
    ApplyResult,
    CanaryView,
    ClusterView,
    ConditionView,
    DeleteResult,
    EventView,
    HistoryView,
    PromoteResult,
    RevisionView,
    ServiceView,
    UndoResult,
    condition,
    is_true,
)

__all__ = [
    "AbortResult",
    "AnalysisView",
    "ApiError",
    "ApplyResult",
    "CanaryView",
    "ClusterView",
    "ConditionView",
    "DeleteResult",
    "EventView",
    "HistoryView",
    "PromoteResult",
    "RevisionView",
    "ServiceView",
    "UndoResult",
    "condition",
    "is_true",
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
    "default_state_dir",
    "read_api_info",
]
