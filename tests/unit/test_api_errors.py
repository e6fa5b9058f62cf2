"""The API maps each domain error to its HTTP status once (api/errors.py), in the shape the
client reads: a message, or `{"problems": [...]}` for an invalid request."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from servekeeper.api.errors import add_error_handler
from servekeeper.client import Client, Conflict, RevisionNotFound, ServiceNotFound, SpecInvalid
from servekeeper.commands import errors
from servekeeper.commands.errors import detail_of, status_of
from tests.unit.test_client import through

CASES = [
    pytest.param(errors.ServiceNotFound("hello"), 404, "service 'hello' not found", id="service-not-found"),
    pytest.param(
        errors.RevisionNotFound(9, [1, 2]), 404, "revision 9 is not in the history (kept: [1, 2])", id="revision"
    ),
    pytest.param(errors.HostPoolNotFound("fleet"), 404, "host pool 'fleet' not found", id="pool-not-found"),
    pytest.param(errors.Conflict("no rollout in progress"), 409, "no rollout in progress", id="conflict"),
    pytest.param(
        errors.InvalidSpec(["spec.x: bad", "spec.y: worse"]),
        422,
        {"problems": ["spec.x: bad", "spec.y: worse"]},
        id="invalid-spec",
    ),
    pytest.param(
        errors.Invalid(["format: 'helm' is not 'kuberay'"]),
        422,
        {"problems": ["format: 'helm' is not 'kuberay'"]},
        id="invalid",
    ),
    pytest.param(errors.CommandError("refused"), 400, "refused", id="any-other"),
]


@pytest.mark.parametrize(("error", "status", "detail"), CASES)
def test_each_domain_error_has_one_status_and_detail(error: errors.CommandError, status: int, detail: Any) -> None:
    assert status_of(error) == status
    assert detail_of(error) == detail


def raising(error: errors.CommandError) -> TestClient:
    app = FastAPI()
    add_error_handler(app)

    @app.get("/{path:path}")  # any path: the client's own calls too
    async def refused(path: str) -> None:
        raise error

    return TestClient(app)


@pytest.mark.parametrize(("error", "status", "detail"), CASES)
def test_a_route_that_raises_answers_the_mapped_status(error: errors.CommandError, status: int, detail: Any) -> None:
    response = raising(error).get("/refused")
    assert response.status_code == status
    assert response.json() == {"detail": detail}


@pytest.mark.parametrize(
    ("error", "client_error"),
    [
        (errors.ServiceNotFound("hello"), ServiceNotFound),
        (errors.RevisionNotFound(9, [1]), RevisionNotFound),
        (errors.Conflict("busy"), Conflict),
        (errors.InvalidSpec(["spec.x: bad"]), SpecInvalid),
    ],
    ids=lambda value: type(value).__name__,
)
def test_the_client_reads_each_answer_as_its_own_error(
    error: errors.CommandError, client_error: type[Exception]
) -> None:
    with Client(url="http://servekeeper.test", token="t", transport=through(raising(error))) as client:
        with pytest.raises(client_error):
            client.get("hello")
