"""A hot standby behind the active backend: when the active refuses connections, Envoy sends its
traffic to the standby at once, before any controller tick (issue 20, item 2)."""

from __future__ import annotations

import asyncio
import time

import httpx

from servekeeper.dataplane import Backend, Endpoint
from servekeeper.dataplane.clusters import render_clusters
from servekeeper.dataplane.render import render_route_configs
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, process_configs, route


def test_the_active_reaches_the_standby_through_an_aggregate_cluster_and_ejects_on_refusal() -> None:
    a, s = Backend("a", (Endpoint("127.0.0.1", 20001),)), Backend("s", (Endpoint("127.0.0.1", 20002),))
    standing = route("svc", 8000, [a, s], {"a": 100, "s": 0}, standby="s")
    clusters = render_clusters([standing])
    assert set(clusters) == {"http-a", "http-s", "failover-a"}
    aggregate = clusters["failover-a"]["cluster_type"]["typed_config"]["clusters"]
    assert aggregate == ["http-a", "http-s"], "the active first, the standby when it has no healthy endpoint"
    assert clusters["http-a"]["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert clusters["http-a"]["outlier_detection"]["enforcing_consecutive_5xx"] == 0, "an app's 5xx never fails over"
    assert "outlier_detection" not in clusters["http-s"]
    weighted = render_route_configs([standing])["http-svc"]["virtual_hosts"][0]["routes"][0]["route"]
    assert weighted["weighted_clusters"]["clusters"] == [
        {"name": "failover-a", "weight": 100},
        {"name": "http-s", "weight": 0},
    ]
    plain = route("svc", 8000, [a, s], {"a": 100, "s": 0})
    assert (
        set(render_clusters([plain])) == {"http-a", "http-s"}
        and "outlier_detection" not in render_clusters([plain])["http-a"]
    )


async def test_a_dead_active_fails_over_to_the_standby_at_once(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    a, s = await upstream("a"), await upstream("s")
    plane = await make_plane()
    port = free_port()
    backends = [Backend("a", (a.endpoint,)), Backend("s", (s.endpoint,))]
    await plane.set_route(route("svc", port, backends, {"a": 100, "s": 0}, standby="s"))
    observed = (await plane.routes())["svc"]
    assert observed.weights == {"a": 100, "s": 0} and observed.active == "a"
    for config in await process_configs(plane):
        assert {"http-a", "http-s", "failover-a"} <= config.active_clusters
    assert observed.failover

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        assert [(await http.get("/")).text for _ in range(20)] == ["a"] * 20
    # Envoy books the answers on the failover cluster: the backend's figures (what a canary's
    # analysis reads) count them all the same.
    for _ in range(40):
        stats = (await plane.backend_stats())["a"]
        if stats.rq_2xx >= 20 and sum(stats.latency_ms_buckets.values()) > 0:  # histograms: flushed each second
            break
        await asyncio.sleep(0.1)
    assert stats.rq_total == stats.rq_completed == stats.rq_2xx == 20 and sum(stats.latency_ms_buckets.values()) > 0

    answers: list[tuple[float, str]] = []
    stop = asyncio.Event()

    async def client() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            while not stop.is_set():
                try:
                    answer = (await http.get("/")).text
                except httpx.HTTPError as exc:
                    answer = f"error {type(exc).__name__}"
                answers.append((time.monotonic(), answer))

    clients = [asyncio.create_task(client()) for _ in range(32)]
    # Kill once every client is answered (a fixed sleep saw no answer yet on a loaded CI machine).
    for _ in range(150):
        if len(answers) >= 2 * len(clients):
            break
        await asyncio.sleep(0.1)
    killed_at = time.monotonic()
    await a.stop()  # the active's proxy is gone: its port refuses connections
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*clients)

    before = [answer for when, answer in answers if when < killed_at]
    after = [answer for when, answer in answers if when > killed_at]
    assert before and set(before) == {"a"}
    failed = [answer for answer in after if answer not in ("a", "s")]
    # Only requests in flight on the dead backend fail (at most one per client); no new one does.
    assert len(failed) <= len(clients), f"{len(failed)} failed after the active died: {sorted(set(failed))}"
    assert all("connection termination" in answer for answer in failed), sorted(set(failed))
    served = [when for when, answer in answers if answer in ("a", "s")]
    gap = max(later - earlier for earlier, later in zip(served, served[1:], strict=False))
    assert gap < 1.0, f"{gap:.2f}s without an answer"
    assert after[-50:] == ["s"] * 50, "the standby serves everything once the active is gone"
