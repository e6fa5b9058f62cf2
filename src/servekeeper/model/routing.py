"""A header route: requests that carry a header value go to the canary, whatever its weight."""

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
