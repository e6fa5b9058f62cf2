"""Each benchmark, at tiny sizes, so that none of them rots (the real runs: BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servekeeper.testing.harness import REPO

pytestmark = pytest.mark.ray


def run_bench(module: str, *args: str, timeout: float = 600) -> None:
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{module} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_zero_downtime_smoke(tmp_path: Path) -> None:
    run_bench(
        "zero_downtime",
        "--users",
        "10",
        "--spawn-rate",
        "10",
        "--upgrades",
        "1",
        "--ready-delay",
        "2",
        "--replicas",
        "1",
        "--settle",
        "3",
        "--out-dir",
        str(tmp_path),
    )
    report = json.loads((tmp_path / "zero_downtime-ready-1x.json").read_text())
    assert report["requests"] > 0 and report["failures"] == 0 and report["failures_by_kind"] == {}
    # Exact totals from Locust's exit, split by method (the locustfile sends GETs and POSTs).
    assert sum(method["requests"] for method in report["by_method"].values()) == report["requests"]
    assert (tmp_path / "zero_downtime-ready-1x.png").stat().st_size > 10_000


def test_ingress_overhead_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ingress.json"
    run_bench("ingress_overhead", "--seconds", "1", "--rounds", "1", "--clients", "4", "--out", str(out))
    report = json.loads(out.read_text())
    for case in ("ray_proxy", "trivial_upstream"):
        assert report[case]["direct_rps"] > 0 and report[case]["ingress_rps"] > 0
        assert report[case]["failures"] == 0


def test_ingress_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ingress_cpu.json"
    run_bench("ingress_cpu", "--smoke", "--output", str(out), timeout=120)
    summary = json.loads(out.read_text())["summary"]
    assert summary["envoy"]["failures"] == 0
    assert summary["envoy"]["cpu_us_per_request"] > 0 and summary["trivial_aiohttp_upstream"]["cpu_us_per_request"] > 0


def test_upgrade_latency_smoke(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    run_bench("upgrade_latency", "--rounds", "1", "--ready-delay", "0", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["rounds"][0]["lower_bound_s"] > 0 and report["rounds"][0]["apply_to_full_traffic_s"] > 0


def test_control_plane_smoke(tmp_path: Path) -> None:
    run_bench(
        "control_plane",
        "--sizes",
        "10",
        "100",
        "--ticks",
        "2",
        "--real-services",
        "1",
        "--idle-seconds",
        "2",
        "--out-dir",
        str(tmp_path),
    )
    report = json.loads((tmp_path / "control_plane.json").read_text())
    assert [row["services"] for row in report["sim_scale"]] == [10, 100]
    assert report["real_controller"][0]["idle"]["rss_mb"] > 0
    assert (tmp_path / "control_plane_scale.png").exists()


def test_shadow_latency_smoke(tmp_path: Path) -> None:
    out = tmp_path / "shadow.json"
    run_bench("shadow_latency", "--seconds", "1", "--rounds", "1", "--clients", "4", "--out", str(out), timeout=120)
    summary = json.loads(out.read_text())["summary"]
    assert all(summary[case]["failures"] == 0 and summary[case]["rps"] > 0 for case in summary)
    assert summary["mirror-slow"]["p99_ratio"] > 0
