"""A hot standby behind the active backend: when the active refuses connections, Envoy sends its
traffic to the standby at once, before any controller tick (issue 20, item 2): HTTP and gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from servekeeper.dataplane import Backend, DataPlane, Endpoint
from servekeeper.dataplane.clusters import render_clusters
from servekeeper.dataplane.render import render_route_configs
from tests.dataplane.conftest import (
    GrpcFactory,
    PlaneFactory,
    UpstreamFactory,
    free_port,
    process_configs,
    route,
)


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
    # A silent active (its host cut off) is ejected as fast as one node of several, and the
    # requests hung on it end by TCP's own timeouts instead of their clients'; a lone
    # cluster with nothing behind it keeps the generous timing.
    assert clusters["http-a"]["close_connections_on_host_health_failure"]
    assert clusters["http-a"]["health_checks"][0]["timeout"] == "2s"
    assert not clusters["http-s"]["close_connections_on_host_health_failure"]
    assert clusters["http-s"]["health_checks"][0]["timeout"] == "3s"
    keepalive = {"keepalive_time": 2, "keepalive_interval": 1, "keepalive_probes": 2}
    for cluster in (clusters["http-a"], clusters["http-s"]):
        assert cluster["upstream_connection_options"]["tcp_keepalive"] == keepalive
        assert cluster["upstream_bind_config"]["socket_options"][0]["int_value"] == 4000  # TCP_USER_TIMEOUT, ms
    weighted = render_route_configs([standing])["http-svc"]["virtual_hosts"][0]["routes"][0]["route"]
    assert weighted["weighted_clusters"]["clusters"] == [
        {"name": "failover-a", "weight": 100},
        {"name": "http-s", "weight": 0},
    ]
    speaking = [
        Backend("a", a.http, (Endpoint("127.0.0.1", 20003),)),
        Backend("s", s.http, (Endpoint("127.0.0.1", 20004),)),
    ]
    with_grpc = route("svc", 8000, speaking, {"a": 100, "s": 0}, grpc_port=8001, standby="s")
    grpc_clusters = render_clusters([with_grpc])
    assert {"grpc-a", "grpc-s", "grpcfailover-a"} <= set(grpc_clusters)
    assert grpc_clusters["grpcfailover-a"]["cluster_type"]["typed_config"]["clusters"] == ["grpc-a", "grpc-s"]
    assert "outlier_detection" in grpc_clusters["grpc-a"] and "outlier_detection" not in grpc_clusters["grpc-s"]
    grpc_route = render_route_configs([with_grpc])["grpc-svc"]["virtual_hosts"][0]["routes"][0]["route"]
    assert [c["name"] for c in grpc_route["weighted_clusters"]["clusters"]] == ["grpcfailover-a", "grpc-s"]
    assert grpc_route["retry_policy"]["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    # A standby without gRPC cannot take gRPC: the active's gRPC is routed as without a standby.
    mute = route("svc", 8000, [speaking[0], s], {"a": 100, "s": 0}, grpc_port=8001, standby="s")
    assert "grpcfailover-a" not in render_clusters([mute]) and "failover-a" in render_clusters([mute])
    plain = route("svc", 8000, [a, s], {"a": 100, "s": 0})
    assert (
        set(render_clusters([plain])) == {"http-a", "http-s"}
        and "outlier_detection" not in render_clusters([plain])["http-a"]
    )


async def failed_over_until(plane: DataPlane, backend: str, count: int) -> int:
    """The backend's rq_failed_over once it reaches `count`, or after 4 s (stats are read live)."""
    for _ in range(40):
        failed_over = (await plane.backend_stats())[backend].rq_failed_over
        if failed_over == count:
            break
        await asyncio.sleep(0.1)
    return failed_over


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
    assert stats.rq_failed_over == 0

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
    # The standby's answers are booked on the active's failover cluster too: the active's figures
    # tell them apart, and its analysis counts them as its failures (test_render).
    by_standby = sum(answer == "s" for _, answer in answers)
    failed_over = await failed_over_until(plane, "a", by_standby)
    assert failed_over == by_standby, f"{failed_over} failed over of {by_standby} standby answers"


async def test_a_dead_active_fails_grpc_over_to_the_standby_at_once(
    make_plane: PlaneFactory, upstream: UpstreamFactory, grpc_server: GrpcFactory
) -> None:
    grpc_a, grpc_s = await grpc_server("a"), await grpc_server("s")
    a = Backend("a", ((await upstream("a")).endpoint,), (grpc_a.endpoint,))
    s = Backend("s", ((await upstream("s")).endpoint,), (grpc_s.endpoint,))
    plane = await make_plane()
    port, grpc_port = free_port(), free_port()
    await plane.set_route(route("svc", port, [a, s], {"a": 100, "s": 0}, grpc_port=grpc_port, standby="s"))
    for config in await process_configs(plane):
        assert {"grpc-a", "grpc-s", "grpcfailover-a"} <= config.active_clusters

    answers: list[tuple[float, str]] = []
    stop = asyncio.Event()

    async def client() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            say = channel.unary_unary("/echo.Echo/Say")
            while not stop.is_set():
                try:
                    answer = (await say(b"x", timeout=5)).decode().partition(":")[0]
                except grpc.aio.AioRpcError as exc:
                    answer = f"error {exc.code().name}"
                answers.append((time.monotonic(), answer))

    clients = [asyncio.create_task(client()) for _ in range(16)]
    for _ in range(150):
        if len(answers) >= 2 * len(clients):
            break
        await asyncio.sleep(0.1)
    # The answers through the failover cluster count as the active's (what a canary reads).
    assert (await plane.backend_stats())["a"].rq_2xx > 0
    killed_at = time.monotonic()
    await grpc_a.stop()  # the active's gRPC proxy is gone: its port refuses connections
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*clients)

    before = [answer for when, answer in answers if when < killed_at]
    after = [answer for when, answer in answers if when > killed_at]
    assert before and set(before) == {"a"}
    failed = [answer for answer in after if answer not in ("a", "s")]
    assert len(failed) <= len(clients), f"{len(failed)} failed after the active died: {sorted(set(failed))}"
    # Only the calls in flight on the dying server: cancelled by it, or their stream reset.
    assert set(failed) <= {"error CANCELLED", "error UNAVAILABLE"}, sorted(set(failed))
    served = [when for when, answer in answers if answer in ("a", "s")]
    gap = max(later - earlier for earlier, later in zip(served, served[1:], strict=False))
    assert gap < 1.0, f"{gap:.2f}s without an answer"
    assert after[-50:] == ["s"] * 50, "the standby serves every call once the active is gone"
