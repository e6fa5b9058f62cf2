"""A load client for tests and benchmarks: closed-loop HTTP clients that count every request
that was sent and lost."""

from __future__ import annotations

import asyncio
import collections
import math
import random
import string
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadResult:
    ok: int = 0
    # every failed request by "<kind>: <exception>", kind one of connect, reset, timeout, error;
    # or "HTTP <status>", or "echo-mismatch" (a 200 whose POST echo is not the body sent)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    # each failed HTTP answer by "<status> <method>: <its body's first line>" (who answered: Envoy
    # names the reset or the missing upstream, Serve its own error), for a failure's diagnosis
    failed_answers: collections.Counter[str] = field(default_factory=collections.Counter)
    # answers by version: a GET's whole body, a POST's first line (after its echo was checked)
    bodies: collections.Counter[str] = field(default_factory=collections.Counter)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (time, version or failure key)
    by_method: collections.Counter[str] = field(default_factory=collections.Counter)  # ok answers: GET, POST
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (time answered, seconds) of ok answers
    # requests still in flight when stop() gave up waiting: cancelled, neither ok nor failed
    abandoned: int = 0
    # (time, seconds) of each stall of the clients' own event loop past STALL_S: a gap between
    # answers that overlaps one may be the client's (a starved or paused process), not the server's
    stalls: list[tuple[float, float]] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def failed_of_kind(self, kind: str) -> int:
        return sum(n for key, n in self.failures.items() if key.split(":")[0] == kind)

    def longest_gap(self, start: float, end: float | None = None) -> tuple[float, float]:
        """The longest time from `start` to `end` (default: the last answer) without an answered
        request, and how much of that time the clients' own loop stood still (the client's doing:
        a starved test process, not the server's)."""
        answered = sorted(when for when, label in self.timeline if label in self.bodies and when >= start)
        edges = [start, *(when for when in answered if end is None or when <= end)]
        if end is not None:
            edges.append(end)
        gap, earlier, later = max(((b - a, a, b) for a, b in zip(edges, edges[1:], strict=False)), default=(0.0, 0, 0))
        stalled = sum(max(0.0, min(at, later) - max(at - late, earlier)) for at, late in self.stalls)
        return gap, stalled


_BODY_ALPHABET = string.ascii_letters + string.digits + " \n"
STALL_TICK_S = 0.05
STALL_S = 0.25


def _failure_key(exc: BaseException) -> str:
    """A transport error as "<kind>: <exception name>"."""
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        kind = "timeout"
    elif isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)):
        kind = "connect"  # refused or unreachable: nothing was sent
    elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError, OSError)):
        kind = "reset"  # the connection closed or was reset before a full answer
    else:
        kind = "error"
    return f"{kind}: {type(exc).__name__}"


class Load:
    """Closed-loop clients in a thread of their own, until stopped.

    Honest by construction: the HTTP client never re-sends a request (httpx over httpcore with
    transport retries 0; httpcore only retries a failed *connect*, and with 0 not even that; a
    pooled connection the server closed while idle is dropped before a request is written to it),
    so every request that was sent and lost shows up in `failures`.

    A share `connection_mix` of the clients opens a new connection per request (`Connection: close`,
    like the reference's Locust experiment); the others keep theirs alive. `new_connections=True`
    means all of them. A share `post_share` of requests are POSTs with a random body that the
    hello example echoes after its version line; use `post_share=0` for URLs that do not echo.
    """

    def __init__(
        self,
        url: str | list[str],
        clients: int = 32,
        new_connections: bool = False,
        timeout: float = 30,
        connection_mix: float = 0.5,
        post_share: float = 0.5,
        stop_grace_s: float = 5,
    ) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        self.clients = clients
        self.new_connections = new_connections
        self.connection_mix = 1.0 if new_connections else connection_mix
        self.post_share = post_share
        self.timeout = timeout
        self.stop_grace_s = stop_grace_s
        self.result = LoadResult()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Future[Any] | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        """Let in-flight requests finish for up to `stop_grace_s`, then cancel them (`abandoned`)."""
        self._stop.set()
        self._thread.join(timeout=self.stop_grace_s)
        if self._thread.is_alive() and self._loop is not None and self._main is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join(timeout=5)
        return self.result

    def _new_connection_client(self, index: int) -> bool:
        # spread the two kinds evenly over the clients (and so over the URLs)
        return math.floor((index + 1) * self.connection_mix) > math.floor(index * self.connection_mix)

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        clients = [
            self._client(self.urls[i % len(self.urls)], self._new_connection_client(i), random.Random(i))
            for i in range(self.clients)
        ]
        self._main = asyncio.gather(*clients, self._watch_stalls())
        try:
            await self._main
        except asyncio.CancelledError:
            pass  # stop() ran out of patience; each client counted its abandoned request

    async def _watch_stalls(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(STALL_TICK_S)
            late = time.monotonic() - before - STALL_TICK_S
            if late > STALL_S:
                self.result.stalls.append((time.time(), late))

    async def _client(self, url: str, new_connection: bool, rng: random.Random) -> None:
        keepalive = 0 if new_connection else 1
        transport = httpx.AsyncHTTPTransport(
            retries=0, limits=httpx.Limits(max_connections=1, max_keepalive_connections=keepalive)
        )
        headers = {"Connection": "close"} if new_connection else {}
        async with httpx.AsyncClient(
            transport=transport, timeout=self.timeout, headers=headers, trust_env=False
        ) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                if rng.random() < self.post_share:
                    sent = "".join(rng.choices(_BODY_ALPHABET, k=rng.randint(200, 4000)))
                    answered, label = await self._request(client, "POST", url, sent)
                else:
                    answered, label = await self._request(client, "GET", url, None)
                self.result.timeline.append((time.time(), label))
                if answered:
                    self.result.latencies.append((time.time(), time.monotonic() - began))
                if not answered:
                    await asyncio.sleep(0.01)  # no hot loop against a refusing port

    async def _request(self, client: httpx.AsyncClient, method: str, url: str, sent: str | None) -> tuple[bool, str]:
        """One request, counted; returns (True, version) or (False, failure key)."""
        try:
            response = await asyncio.wait_for(
                client.request(method, url, content=None if sent is None else sent.encode()), self.timeout
            )
        except asyncio.CancelledError:
            self.result.abandoned += 1
            raise
        except Exception as exc:  # every error is a counted failure, never a dead client
            return self._fail(_failure_key(exc))
        text = response.content.decode("utf-8", errors="replace")
        if response.status_code != 200:
            said = text.strip().partition("\n")[0][:120]
            self.result.failed_answers[f"{response.status_code} {method}: {said}"] += 1
            return self._fail(f"HTTP {response.status_code}")
        version = text
        if sent is not None:
            version, newline, echoed = text.partition("\n")
            if not newline or echoed != sent:
                return self._fail("echo-mismatch")
        self.result.ok += 1
        self.result.by_method[method] += 1
        self.result.bodies[version] += 1
        return True, version

    def _fail(self, key: str) -> tuple[bool, str]:
        self.result.failures[key] += 1
        return False, key
