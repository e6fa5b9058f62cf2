"""Where a cluster's Serve proxy listens: what a provider reports and the data plane routes to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"endpoint port {self.port} is out of range")
