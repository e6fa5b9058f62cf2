"""The reference experiment's load: every request on a new connection, no think time.

Half the requests are POSTs with a random body that the hello example echoes after its version
line, so a truncated or mixed-up answer counts as a failure too. Every failure is reported as
"<kind>: <detail>", kind one of connect, reset, timeout, HTTP <status>, echo-mismatch.

No request is ever re-sent: Locust's HttpUser sends through requests' HTTPAdapter, whose default
`Retry(0, read=False)` does not retry (bare urllib3 would: `Retry.DEFAULT` is 3 tries, reads
included, for GET). `on_start` pins that on every adapter so a version change cannot bring it back.
"""

import random
import string

import requests
from locust import HttpUser, constant, task
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
