"""The one place where a command's refusal becomes an HTTP answer: its status, and its `detail`
shaped as the client reads it (a message; for an invalid request, `{"problems": [...]}`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from servekeeper.commands.errors import CommandError, Conflict, Invalid, NotFound

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


def add_error_handler(app: FastAPI) -> None:
    """Every route's (and the dashboard's) CommandError answered as `{"detail": ...}`, as FastAPI
    answers an HTTPException."""

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, CommandError)  # registered for CommandError only
        return JSONResponse({"detail": detail_of(exc)}, status_code=status_of(exc))

    app.add_exception_handler(CommandError, refused)
