"""Where a cluster's Serve proxy listens: what a provider reports and the data plane routes to
(the data plane refuses a backend with an endpoint it cannot use)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    # Takes traffic only while no other endpoint of its backend is healthy: the head's proxy on a
    # multi-node cluster with GCS fault tolerance. Serve reports a head's proxy ready before it
    # knows any replica, so a head started again would hold every request sent to it until
    # Serve's controller has recovered (measured: 7.7-16.2 s without an answer on the fleet).
    fallback: bool = False
