"""Where a command's refusal becomes the API's HTTP answer: the status and `detail` that
commands/errors.py gives each kind of refusal, shaped as the client reads it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from servekeeper.commands.errors import CommandError, detail_of, status_of


class Problems(BaseModel):
    problems: list[str]  # `path: message`, one per fault of a spec


class ErrorAnswer(BaseModel):
    """Every refusal's body: a sentence, a spec's problems, or FastAPI's list of request errors."""

    detail: str | Problems | list[dict[str, Any]]


# Declared for every operation of the app, so the OpenAPI document (what a client or the fuzz run
# reads) says what a refusal looks like; 422 replaces FastAPI's own, whose `detail` is a list only.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorAnswer, "description": "a body that is not JSON, or a refusal of no other kind"},
    401: {"model": ErrorAnswer, "description": "missing or wrong bearer token"},
    404: {"model": ErrorAnswer, "description": "the service, revision or host pool named does not exist"},
    409: {"model": ErrorAnswer, "description": "not possible in the current state"},
    422: {"model": ErrorAnswer, "description": "the request or the spec in it is invalid"},
}


def add_error_handler(app: FastAPI) -> None:
    """Every route's (and the dashboard's) CommandError answered as `{"detail": ...}`, as FastAPI
    answers an HTTPException."""

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, CommandError)  # registered for CommandError only
        return JSONResponse({"detail": detail_of(exc)}, status_code=status_of(exc))

    app.add_exception_handler(CommandError, refused)

    async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own handler encodes each error's `input` as it came; a body sent without a
        # JSON content type comes as bytes, and bytes that are not UTF-8 made that encoding fail
        # (a 500). Such bytes are shown with U+FFFD instead.
        assert isinstance(exc, RequestValidationError)  # registered for it only
        errors = jsonable_encoder(exc.errors(), custom_encoder={bytes: lambda raw: raw.decode(errors="replace")})
        return JSONResponse({"detail": errors}, status_code=422)

    app.add_exception_handler(RequestValidationError, invalid_request)
