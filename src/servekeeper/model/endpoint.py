"""Where a cluster's Serve proxy listens: what a provider reports and the data plane routes to
(the data plane refuses a backend with an endpoint it cannot use)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
