"""The reference experiment's load: every request on a new connection, no think time.

Half the requests are POSTs with a random body that the hello example echoes after its version
line, so a truncated or mixed-up answer counts as a failure too. Every failure is reported as
"<kind>: <detail>", kind one of connect, reset, timeout, HTTP <status>, echo-mismatch.

No request is ever re-sent: Locust's HttpUser sends through requests' HTTPAdapter, whose default
`Retry(0, read=False)` does not retry (bare urllib3 would: `Retry.DEFAULT` is 3 tries, reads
included, for GET). `on_start` pins that on every adapter so a version change cannot bring it back.

With SERVEKEEPER_LOCUST_FINAL set, the final totals and failures by kind are written there as
JSON when Locust exits (its `quit` event, after the users are stopped): Locust's `_stats.csv` and
`_failures.csv` are rewritten only once a second while it runs, never at shutdown, so they miss
the end of the run, and `--json-file` has the totals but not the failures.
"""

import json
import os
import random
import string
from typing import Any

import requests
from locust import HttpUser, constant, events, task
from locust.env import Environment
from locust.stats import StatsError
from urllib3.util.retry import Retry

POST_SHARE = 0.5
BODY_ALPHABET = string.ascii_letters + string.digits + " \n"


def failure_kind(error: Exception) -> str:
    """A requests exception as "<kind>: <innermost cause>"."""
    cause: BaseException = error
    while cause.__context__ is not None or cause.__cause__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    if isinstance(error, requests.exceptions.Timeout):
        kind = "timeout"
    elif isinstance(cause, ConnectionRefusedError) or "NewConnectionError" in type(cause).__name__:
        kind = "connect"
    elif isinstance(error, (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError)):
        kind = "reset"  # closed or reset before a full answer
    else:
        kind = "error"
    return f"{kind}: {type(cause).__name__}"


_environment: list[Environment] = []


@events.init.add_listener
def _remember_environment(environment: Environment, **_: Any) -> None:
    _environment.append(environment)


@events.quit.add_listener
def _write_final_stats(exit_code: int, **_: Any) -> None:
    path = os.environ.get("SERVEKEEPER_LOCUST_FINAL")
    if not path or not _environment:
        return
    stats = _environment[0].stats
    total = stats.total
    final = {
        "exit_code": exit_code,
        "requests": total.num_requests,
        "failures": total.num_failures,
        "p50_ms": total.get_response_time_percentile(0.50),
        "p99_ms": total.get_response_time_percentile(0.99),
        "rps": round(total.total_rps, 2),
        "by_method": {
            entry.method: {"requests": entry.num_requests, "failures": entry.num_failures}
            for entry in stats.entries.values()
        },
        "failures_by_kind": [
            {"method": error.method, "error": StatsError.parse_error(error.error), "occurrences": error.occurrences}
            for error in stats.errors.values()
        ],
    }
    with open(path, "w") as handle:
        json.dump(final, handle, indent=1)


class NewConnectionUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        for adapter in self.client.adapters.values():
            adapter.max_retries = Retry(total=0, read=False)  # type: ignore[attr-defined]

    @task
    def call(self) -> None:
        # `Connection: close` makes every request open a fresh TCP connection, like the
        # reference's load, so a cluster that stops accepting shows up as failures at once.
        headers = {"Connection": "close"}
        sent = None
        if random.random() < POST_SHARE:
            sent = "".join(random.choices(BODY_ALPHABET, k=random.randint(200, 4000)))
            headers["Content-Type"] = "text/plain; charset=utf-8"
        method = "GET" if sent is None else "POST"
        data = None if sent is None else sent.encode()
        with self.client.request(method, "/", data=data, headers=headers, timeout=60, catch_response=True) as response:
            if response.error is not None:
                response.failure(failure_kind(response.error))
            elif response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
            elif sent is not None:
                _, newline, echoed = response.content.decode("utf-8", "replace").partition("\n")
                if not newline or echoed != sent:
                    response.failure("echo-mismatch")
                else:
                    response.success()
            else:
                response.success()
