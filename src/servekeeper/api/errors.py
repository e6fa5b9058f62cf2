"""Where a command's refusal becomes the API's HTTP answer: the status and `detail` that
commands/errors.py gives each kind of refusal, shaped as the client reads it."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from servekeeper.commands.errors import CommandError, detail_of, status_of


def add_error_handler(app: FastAPI) -> None:
    """Every route's (and the dashboard's) CommandError answered as `{"detail": ...}`, as FastAPI
    answers an HTTPException."""

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, CommandError)  # registered for CommandError only
        return JSONResponse({"detail": detail_of(exc)}, status_code=status_of(exc))

    app.add_exception_handler(CommandError, refused)
