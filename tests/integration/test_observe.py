"""Observing a real daemon: the Python client (every method, its errors) and /metrics scraped
during an upgrade of the hello service. One daemon for the module, to save CI time: the tests
run in order (first rollout, upgrade, delete)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servekeeper import AsyncClient, Client, ServiceNotFound, SpecInvalid
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until
from servekeeper.testing.load import Load

pytestmark = pytest.mark.ray

NAME = "observed"
Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Daemon:
    sk: Servekeeper
    client: Client
    port: int
    api_url: str
    metrics_url: str
    token: str


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    state_dir = Path(tempfile.mkdtemp(prefix="skstate-"))
    sk = Servekeeper(state_dir, tmp_path_factory.mktemp("observe"))
    try:
        sk.cli("up", "--detach", "--metrics-port", "0", "--log-format", "json", timeout=90)
        info = json.loads((state_dir / "api.json").read_text())
        with Client(state_dir) as client:
            yield Daemon(
                sk, client, free_port(), info["url"], info["metricsUrl"], (state_dir / "token").read_text().strip()
            )
    finally:
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"


def test_the_client_rolls_out_a_service_and_reports_errors(daemon: Daemon) -> None:
    client = daemon.client
    result = client.apply(hello_spec(NAME, daemon.port, msg="v1"))
    assert result == {"name": NAME, "generation": 1, "changed": True}
    view = client.wait(NAME, timeout=120)
    assert view["observedGeneration"] == 1 and view["activeCluster"] is not None
    assert httpx.get(view["ingress"]["url"], timeout=10).text == "v1"
    assert [v["name"] for v in client.list()] == [NAME]
    assert (client.get(NAME)["activeCluster"] or {}).get("name") == view["activeCluster"]["name"]
    reasons = [event["reason"] for event in client.events(NAME)]
    assert "ClusterCreating" in reasons and "TrafficSwitched" in reasons

    with pytest.raises(ServiceNotFound, match="service 'nope' not found"):
        client.get("nope")
    with pytest.raises(ServiceNotFound):
        client.delete("nope")
    bad = hello_spec("Bad_Name", daemon.port)
    bad["spec"]["readinessTimeoutSeconds"] = -1
    with pytest.raises(SpecInvalid) as invalid:
        client.apply(bad)
    fields = {problem.split(":")[0] for problem in invalid.value.problems}
    assert {"metadata.name", "spec.readinessTimeoutSeconds"} <= fields, invalid.value.problems

    async def from_async() -> list[str]:
        async with AsyncClient(daemon.sk.state_dir) as async_client:
            assert (await async_client.get(NAME))["generation"] == 1
            return [v["name"] for v in await async_client.list()]

    assert asyncio.run(from_async()) == [NAME]


@dataclass
class Scrapes:
    samples: list[dict[Key, float]] = field(default_factory=list)
    monotonic: dict[Key, float] = field(default_factory=dict)  # the counters of the last scrape
    decreased: list[str] = field(default_factory=list)


def scrape(url: str, token: str | None) -> dict[Key, float]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(url, headers=headers, timeout=10)
    answer.raise_for_status()
    samples: dict[Key, float] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def is_counter(name: str) -> bool:
    return name.endswith(("_total", "_count", "_bucket", "_sum"))


def get(samples: dict[Key, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metrics_follow_an_upgrade(daemon: Daemon) -> None:
    scrapes = Scrapes()
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            samples = scrape(f"{daemon.api_url}/metrics", daemon.token)
            for key, value in samples.items():
                if is_counter(key[0]):
                    if value < scrapes.monotonic.get(key, value):
                        scrapes.decreased.append(f"{key}: {scrapes.monotonic[key]} -> {value}")
                    scrapes.monotonic[key] = value
            scrapes.samples.append(samples)
            time.sleep(0.25)

    old = daemon.client.get(NAME)["activeCluster"]
    assert old is not None
    before = scrape(daemon.metrics_url, None)  # the metrics port: no token
    succeeded_before = get(before, "servekeeper_rollouts_total", service=NAME, result="succeeded")
    assert succeeded_before == 1
    thread = threading.Thread(target=scraper, daemon=True)
    with Load(f"http://127.0.0.1:{daemon.port}/", clients=8) as load:
        thread.start()
        wait_until(lambda: load.result.ok > 20, 30, "load to start")
        daemon.client.apply(hello_spec(NAME, daemon.port, msg="v2", head_cpus=2, ready_delay_s=2))
        view = daemon.client.wait(NAME, timeout=150)
        new = view["activeCluster"]
        assert new is not None and new["name"] != old["name"]
        old_name = old["name"]
        wait_until(lambda: all(c["name"] != old_name for c in daemon.sk.api_get(NAME)["otherClusters"]), 90, "drained")
        time.sleep(1)
    stop.set()
    thread.join(timeout=15)
    assert load.result.failed == 0, dict(load.result.failures)
    assert not scrapes.decreased, scrapes.decreased

    def series(name: str, **labels: str) -> list[float | None]:
        values = [get(s, name, **labels) for s in scrapes.samples]
        # consecutive repeats folded: the moves the series made
        return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]

    upgrading = series("servekeeper_service_condition", service=NAME, type="UpgradeInProgress")
    assert upgrading[0] == 0 and 1 in upgrading and upgrading[-1] == 0, upgrading
    assert series("servekeeper_service_generation", service=NAME)[-1] == 2
    assert series("servekeeper_service_observed_generation", service=NAME) == [1, 2]
    new_traffic = series("servekeeper_cluster_traffic_ratio", service=NAME, cluster=new["name"], role="pending")
    assert new_traffic[-1] in (0, None) and 0 in new_traffic, new_traffic
    assert series("servekeeper_cluster_traffic_ratio", service=NAME, cluster=new["name"], role="active")[-1] == 1
    old_active = series("servekeeper_cluster_traffic_ratio", service=NAME, cluster=old["name"], role="active")
    assert old_active[0] == 1, old_active
    old_draining = series("servekeeper_cluster_traffic_ratio", service=NAME, cluster=old["name"], role="draining")
    assert 0 in old_draining and old_draining[-1] is None, old_draining  # drained: the series is gone
    old_inflight = series("servekeeper_cluster_inflight_requests", service=NAME, cluster=old["name"])
    new_inflight = series("servekeeper_cluster_inflight_requests", service=NAME, cluster=new["name"])
    assert max(v or 0 for v in old_inflight) > 0 and old_inflight[-1] is None, old_inflight
    assert max(v or 0 for v in new_inflight) > 0, new_inflight

    after = scrape(daemon.metrics_url, None)
    assert get(after, "servekeeper_rollouts_total", service=NAME, result="succeeded") == 2
    assert (get(after, "servekeeper_rollout_duration_seconds_count", service=NAME) or 0) >= 2
    assert (get(after, "servekeeper_config_submissions_total", service=NAME) or 0) >= 2
    assert (get(after, "servekeeper_reconcile_duration_seconds_count", service=NAME) or 0) > 10
    ok = get(after, "servekeeper_ingress_requests_total", service=NAME, cluster=new["name"], code_class="2xx")
    assert ok is not None and ok > 0
    assert get(after, "servekeeper_dataplane_stats_up") == 1

    # the API port wants the token; the metrics port does not
    assert httpx.get(f"{daemon.api_url}/metrics", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.get(f"{daemon.api_url}/metrics", headers=wrong, timeout=10).status_code == 401
    assert httpx.get(daemon.metrics_url, timeout=10).status_code == 200

    # --log-format json: the events are structured lines of the daemon's log
    log = (daemon.sk.state_dir / "controller.log").read_text().splitlines()
    lines = [json.loads(line) for line in log if line.startswith("{")]
    switched = [line for line in lines if line.get("reason") == "TrafficSwitched"]
    assert len(switched) == 2 and all(line["service"] == NAME for line in switched)


def test_the_client_deletes_the_service(daemon: Daemon) -> None:
    assert daemon.client.delete(NAME) == {"name": NAME, "deleting": True}

    def gone() -> bool:
        try:
            daemon.client.get(NAME)
        except ServiceNotFound:
            return True
        return False

    wait_until(gone, 60, "the service to be deleted")
    assert daemon.client.list() == []
