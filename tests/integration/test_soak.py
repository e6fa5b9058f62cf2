"""The CI-sized soak: several upgrades in a row under load (the long one: `python -m bench.soak`)."""

from __future__ import annotations

import pytest
from bench.soak import run_soak

pytestmark = pytest.mark.ray


def test_upgrades_in_a_row_drop_nothing_and_leak_nothing() -> None:
    report = run_soak(upgrades=2, clients=16)
    assert report["failed"] == 0, report["failures_by_kind"]
    assert report["clusters_created"] == 3
    assert report["leftover_processes"] == []
    assert report["leftover_temp_dirs"] == []
    assert report["ports_still_bound"] == []
    assert report["fd_growth"] <= 8, report["samples"]
    assert report["rss_growth_mb"] < 30, report["samples"]
