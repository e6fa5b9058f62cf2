"""The CI-sized soak: cluster upgrades in a row under load (the long one: `python -m bench.soak`).
Replicas take 8 s to become ready, the window the readiness gate must cover; the switch is atomic
(after the first answer of a new version, only requests already in flight answer the old one) and
each old cluster is drained, then deleted, leaving nothing behind."""

from __future__ import annotations

import pytest
from bench.soak import run_soak

pytestmark = pytest.mark.ray

CLIENTS = 32


def test_upgrades_in_a_row_drop_nothing_switch_atomically_and_leak_nothing() -> None:
    report = run_soak(upgrades=2, clients=CLIENTS, ready_delay=8.0)
    assert report["failed"] == 0, report["failures_by_kind"]
    assert all(count <= CLIENTS for count in report["old_answers_after_switch"]), report["old_answers_after_switch"]
    assert report["clusters_drained"] == 2
    assert report["clusters_created"] == 3
    assert report["leftover_processes"] == []
    assert report["leftover_temp_dirs"] == []
    assert report["ports_still_bound"] == []
    assert report["fd_growth"] <= 8, report["samples"]
    assert report["rss_growth_mb"] < 30, report["samples"]
