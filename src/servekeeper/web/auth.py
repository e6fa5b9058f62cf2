"""Dashboard login: one-time login codes exchanged for short-lived session cookies.

`servekeeper dashboard` asks the API (bearer token) for a login code and prints a URL with it.
The browser's first request spends the code (once, within `CODE_SECONDS`) and gets an
`HttpOnly`, `SameSite=Strict` session cookie instead, then a redirect to the dashboard: the URL
left in the browser's history holds a spent code, never the API token. Sessions live in the
daemon's memory only; a daemon restart logs every browser out, which is the safe direction.

The dashboard lives under a secret path of this daemon's, `/ui/<path key>`, and the cookie's
`Path` is that path. Browsers do not isolate cookies by port, so a cookie with `Path=/ui` would
also go to whatever listens on another port of 127.0.0.1 (a local user's server, which could then
read pages and their CSRF token with it); a path nobody else knows keeps it to this dashboard.

A POST (promote, abort, undo) also needs the session's CSRF token in the `X-Servekeeper-CSRF`
header (see `pages.py`): an HMAC of the session id under a key of this daemon's, so a page of
another origin can neither read it nor send the header without a CORS preflight nobody answers.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

CODE_SECONDS = 60.0
SESSION_SECONDS = 3600.0
SESSION_COOKIE = "servekeeper_session"
CSRF_HEADER = "X-Servekeeper-CSRF"


def same_secret(known: str, given: str) -> bool:
    """Constant-time equality of a secret of ours with what a request sent. Compared as bytes:
    `compare_digest` raises TypeError on a str that is not ASCII, and a request's code, cookie or
    header may be anything (a wrong secret is a 401/403, never a 500)."""
    return hmac.compare_digest(known.encode(), given.encode(errors="surrogatepass"))


class DashboardAuth:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        code_seconds: float = CODE_SECONDS,
        session_seconds: float = SESSION_SECONDS,
    ) -> None:
        self._clock = clock
        self.code_seconds = code_seconds
        self.session_seconds = session_seconds
        self._codes: dict[str, float] = {}  # code -> expiry
        self._sessions: dict[str, float] = {}  # session id -> expiry
        self._csrf_key = secrets.token_bytes(32)
        self._path_key = secrets.token_urlsafe(16)

    @property
    def base_path(self) -> str:
        """Where this daemon's dashboard lives, and the session cookie's `Path`: secret, per daemon."""
        return f"/ui/{self._path_key}"

    def path_key_valid(self, key: str) -> bool:
        return same_secret(self._path_key, key)

    def _expire(self) -> None:
        now = self._clock()
        for table in (self._codes, self._sessions):
            for key in [key for key, expiry in table.items() if expiry <= now]:
                del table[key]

    def new_code(self) -> str:
        self._expire()
        code = secrets.token_urlsafe(24)
        self._codes[code] = self._clock() + self.code_seconds
        return code

    def exchange(self, code: str) -> str | None:
        """A new session for a valid, unspent code; None otherwise. The code is spent either way."""
        self._expire()
        match = next((known for known in self._codes if same_secret(known, code)), None)
        if match is None:
            return None
        del self._codes[match]
        session = secrets.token_urlsafe(32)
        self._sessions[session] = self._clock() + self.session_seconds
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        self._expire()
        return any(same_secret(known, session) for known in self._sessions)

    def csrf_token(self, session: str) -> str:
        """The token a page of this session sends back with every POST."""
        return hmac.new(self._csrf_key, session.encode(), hashlib.sha256).hexdigest()

    def csrf_valid(self, session: str | None, token: str | None) -> bool:
        if not session or not token or not self.valid(session):
            return False
        return same_secret(self.csrf_token(session), token)
