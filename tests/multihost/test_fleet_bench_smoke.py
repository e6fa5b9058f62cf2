"""bench.zero_downtime on the session's fleet, at a tiny size, so that the pool variant does not
rot (the real run, next to the same on one host: bench.fleet_zero_downtime, BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fleet import Fleet
from tests.integration.test_bench_smoke import run_bench

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.timeout(400)]


def test_zero_downtime_on_the_fleet_smoke(fleet: Fleet, tmp_path: Path) -> None:
    pool_file = tmp_path / "pool.yaml"
    # 4 CPUs a host: the old cluster and the new one (its head of 2 CPUs) side by side.
    pool_file.write_text(yaml.safe_dump(fleet.host_pool_document("benchfleet", cpus=4)))
    # 4 users: Locust's own CPU starved the new cluster's raylets past Ray's fixed 30 s wait to
    # register (2 of 3 runs late in a session on the 2 shared cores; the rollout then timed out).
    size = "--users 4 --spawn-rate 4 --upgrades 1 --ready-delay 2 --replicas 3 --deletion-delay 5 --settle 3"
    run_bench("zero_downtime", "--host-pool", str(pool_file), *size.split(), "--no-plot", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "zero_downtime-ready-1x-pool.json").read_text())
    assert report["host_pool"] == "benchfleet"
    assert report["failures"] == 0 and report["failures_by_kind"] == {}, report["failures_by_kind"]
    assert report["by_method"]["GET"]["requests"] > 0 and report["by_method"]["POST"]["requests"] > 0
    [upgrade] = report["upgrades_timed"]
    # The old cluster is deleted after the switch: once drained, within the deletion delay, then stopped.
    assert 0 < upgrade["apply_to_switch_s"] < upgrade["apply_to_old_deleted_s"], upgrade
    assert report["leftover_processes"] == []
    assert not fleet.leftover_processes(), f"left on the hosts: {fleet.leftover_processes()}"
