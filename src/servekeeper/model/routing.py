"""Routes beside the weights: a header route (requests that carry a header value go to the
canary, whatever its weight) and a mirror (a share of the requests copied to the canary, its
answers dropped)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeaderMatch:
    """Requests whose `header` equals `value` exactly, or (`regex`) whose whole value matches
    the RE2 pattern `value`. Header names are compared without case (HTTP's rule)."""

    header: str
    value: str
    regex: bool = False

    def describe(self) -> str:
        return f"{self.header} ~ /{self.value}/" if self.regex else f"{self.header}: {self.value}"


@dataclass(frozen=True)
class Mirror:
    """`percent` of the requests with one of `methods` are also sent to `backend`; the client
    gets the routed backend's answer only, the copy's answer is dropped."""

    backend: str
    percent: int
    methods: tuple[str, ...] = ("GET", "HEAD")

    def describe(self) -> str:
        return f"{self.percent}% of {', '.join(self.methods)} copied to {self.backend}"
