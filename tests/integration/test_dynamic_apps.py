"""Services that create Serve apps at run time (the model-registry example), on real Ray."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.registry_upgrade import upgrade_under_load

from servekeeper.testing.harness import (
    MODELS,
    Servekeeper,
    free_port,
    model_urls,
    registry_spec,
    wait_until,
)

pytestmark = pytest.mark.ray

CLIENTS = 32
UNHEALTHY_THRESHOLD_S = 3


def ray_apps(view: dict[str, Any]) -> dict[str, Any]:
    """Application details straight from the active cluster's Ray dashboard."""
    url = view["activeCluster"]["dashboardUrl"] + "/api/serve/applications/"
    return dict(httpx.get(url, timeout=10).json()["applications"])


@dataclass
class Registry:
    sk: Servekeeper
    port: int


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """One daemon and one registry service for the module's tests, which run in order (a failed
    run-time app, a controller kill then an in-place change, judging every app, an upgrade)."""
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skstate-")), tmp_path_factory.mktemp("registry"))
    sk.up()
    try:
        yield Registry(sk, free_port())
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def test_a_failed_run_time_app_neither_blocks_nor_replaces_the_service(registry: Registry) -> None:
    sk, port = registry.sk, registry.port
    sk.apply(registry_spec(port, unhealthy_threshold=UNHEALTHY_THRESHOLD_S))
    assert sk.wait("registry") == 0
    view = sk.get("registry")
    apps = view["activeCluster"]["applications"]
    assert apps["model-broken-upload"]["status"] == "DEPLOY_FAILED"
    assert apps["model-broken-upload"]["source"] == "imperative"
    assert all(apps[f"model-{name}"]["status"] == "RUNNING" for name in MODELS)
    assert view["activeCluster"]["probes"][0]["passing"] is True
    cluster = view["activeCluster"]["name"]

    # Longer than the unhealthy threshold: a failed app that counted would have started a replacement.
    time.sleep(8)
    assert sk.condition("registry", "Ready")["status"] == "True"
    assert sk.get("registry")["activeCluster"]["name"] == cluster
    assert sk.get("registry")["pendingCluster"] is None
    assert "ClusterUnhealthy" not in sk.events("registry")


def test_controller_kill9_then_in_place_change_leaves_run_time_apps_untouched(registry: Registry) -> None:
    sk, port = registry.sk, registry.port
    before = ray_apps(sk.get("registry"))
    answers = {url: httpx.get(url).json() for url in model_urls(port)}

    sk.kill_controller()
    sk.up()
    # (the default threshold again, as it was: 300 s)
    sk.apply(registry_spec(port, version="v1-patched"))
    assert sk.wait("registry") == 0
    wait_until(lambda: httpx.get(model_urls(port)[0]).json()["router"] == "v1-patched", 60, "the patched router")
    after = ray_apps(sk.get("registry"))
    for name in [f"model-{m}" for m in MODELS] + ["model-broken-upload"]:
        assert after[name]["source"] == "imperative"
        assert after[name]["last_deployed_time_s"] == before[name]["last_deployed_time_s"], name
    for name in MODELS:
        assert after[f"model-{name}"]["status"] == "RUNNING"
    for url, answer in answers.items():
        assert {**httpx.get(url).json(), "router": "v1"} == answer
    assert len(sk.submissions()) == 2, "only the first config and the change were submitted"


def test_judging_every_app_makes_the_service_unready_naming_the_failed_one(registry: Registry) -> None:
    sk, port = registry.sk, registry.port
    sk.apply(registry_spec(port, version="v1-patched", applications="all"))
    wait_until(lambda: sk.condition("registry", "Ready")["status"] == "False", 30, "Ready to turn False")
    ready = sk.condition("registry", "Ready")
    assert "model-broken-upload" in ready["message"]


def test_registry_upgrade_waits_for_the_probe_and_drops_nothing(registry: Registry) -> None:
    # the benchmark's own upgrade (BENCHMARKS.md), on this module's service: judged by its
    # declarative apps again, the run-time ones keep neither cluster from being ready
    report = upgrade_under_load(registry.sk, registry.port, probes=True, clients=CLIENTS)
    assert report["failed"] == 0, f"failed requests: {report['failures_by_kind']}"
    assert report["models_answering_v2"] == MODELS
