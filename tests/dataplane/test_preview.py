"""The preview port through real Envoy processes: all of it to the preview backend, the main port
and its observed weights untouched; 503 with a reason when there is nothing to preview."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import httpx
import pytest

from servekeeper.dataplane import Backend, BackendStats, DataPlane, DataPlaneError, ServiceRoute
from tests.dataplane.conftest import (
    PlaneFactory,
    UpstreamFactory,
    free_port,
    inflight_until,
    process_configs,
    route,
)
from tests.dataplane.upstream import Upstream

NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)  # a connection each, spread over the processes


async def answers(port: int, count: int = 20) -> list[str]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=NO_KEEPALIVE) as client:
        return [(await client.get("/")).text for _ in range(count)]


async def two_backends(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> tuple[DataPlane, tuple[Upstream, Upstream], list[Backend]]:
    a, b = await upstream("a"), await upstream("b")
    return await make_plane(), (a, b), [Backend("a", (a.endpoint,)), Backend("b", (b.endpoint,))]


async def test_preview_port_goes_to_the_preview_backend_while_the_main_port_keeps_its_weights(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    plane, (a, b), backends = await two_backends(make_plane, upstream)
    port, preview_port = free_port(), free_port()
    await plane.set_route(route("svc", port, backends, {"a": 100, "b": 0}))
    before = await plane.routes()

    await plane.set_route(
        route("svc", port, backends, {"a": 100, "b": 0}, preview_port=preview_port, preview_backend="b")
    )
    assert await answers(port) == ["a"] * 20
    assert await answers(preview_port) == ["b"] * 20
    assert (a.requests, b.requests) == (20, 20)

    # The controller's view of the service is exactly what it was: no second route, same weights.
    assert await plane.routes() == before
    assert before["svc"].weights == {"a": 100, "b": 0} and before["svc"].in_sync
    # (Compared before the WebSocket below, whose close Envoy counts down a moment later.)
    async with aiohttp.ClientSession() as session, session.ws_connect(f"http://127.0.0.1:{preview_port}/ws") as ws:
        await ws.send_str("hi")
        assert json.loads(await ws.receive_str()) == {"backend": "b", "echo": "hi"}
    for config in await process_configs(plane):
        assert config.active_listeners == {"http-svc", "preview-svc"}
        assert set(config.route_versions) == {"http-svc", "preview-svc"}
        assert config.route_weights["http-svc"] == {"http-a": 100, "http-b": 0}
        # The preview port's clusters of its own: its requests are not the backends' user traffic.
        assert config.active_clusters == {"http-a", "http-b", "preview-a", "preview-b"}


async def test_preview_changes_on_a_live_route(make_plane: PlaneFactory, upstream: UpstreamFactory) -> None:
    plane, (a, b), backends = await two_backends(make_plane, upstream)
    port, preview_port = free_port(), free_port()

    def with_preview(backend: str | None, weights: dict[str, int], at: int | None = preview_port) -> ServiceRoute:
        return route("svc", port, backends, weights, preview_port=at, preview_backend=backend)

    await plane.set_route(with_preview(None, {"a": 100, "b": 0}))
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{preview_port}", limits=limits) as client:
        peers: set[object] = set()

        async def trace(event: str, info: dict[str, object]) -> None:
            if event == "connection.connect_tcp.complete":
                peers.add(info["return_value"].get_extra_info("client_addr"))  # type: ignore[attr-defined]

        async def ask() -> httpx.Response:
            return await client.get("/", extensions={"trace": trace})

        nothing = await ask()
        assert nothing.status_code == 503
        assert nothing.text == "no preview: service svc has no pending cluster\n"
        assert nothing.headers["content-type"].startswith("text/plain")
        assert await answers(port) == ["a"] * 20  # the main port serves on, whatever the preview says

        # A pending cluster appears (at weight 0), then gets some user traffic: the preview stays on it.
        await plane.set_route(with_preview("b", {"a": 100, "b": 0}))
        assert [(await ask()).text for _ in range(5)] == ["b"] * 5
        await plane.set_route(with_preview("b", {"a": 90, "b": 10}))
        assert [(await ask()).text for _ in range(5)] == ["b"] * 5
        # Only the preview route file changed: the client kept its one connection throughout.
        assert len(peers) == 1, f"the preview client reconnected: {peers}"

    # The switch is done and the old cluster drained away: nothing is pending, nothing to preview.
    await plane.set_route(with_preview(None, {"b": 100, "a": 0}))
    assert await answers(preview_port, 4) == ["no preview: service svc has no pending cluster\n"] * 4
    assert (await plane.routes())["svc"].weights == {"a": 0, "b": 100}

    # Another preview port, then none: the old port stops answering, the main port never does.
    moved = free_port()
    await plane.set_route(with_preview("a", {"a": 0, "b": 100}, at=moved))
    assert await answers(moved) == ["a"] * 20
    assert _refused(preview_port)
    await plane.set_route(with_preview(None, {"a": 0, "b": 100}, at=None))
    assert _refused(moved)
    assert await answers(port) == ["b"] * 20
    for config in await process_configs(plane):
        # (Its route config may linger while the removed listener drains; nothing reads it as weights.)
        assert config.active_listeners == {"http-svc"}
        assert config.active_clusters == {"http-a", "http-b"}  # the preview clusters left with their port
    for index in range(2):
        assert sorted(p.name for p in (plane.dir / f"envoy-{index}" / "rds").iterdir()) == ["http-svc.json"]


async def test_preview_port_conflicts_are_refused(make_plane: PlaneFactory, upstream: UpstreamFactory) -> None:
    a = await upstream("a")
    plane = await make_plane(processes=1)
    backends = [Backend("a", (a.endpoint,))]
    port, preview_port = free_port(), free_port()
    await plane.set_route(route("one", port, backends, {"a": 100}, preview_port=preview_port))
    with pytest.raises(DataPlaneError, match=f"port {port} is already in use"):
        await plane.set_route(route("two", free_port(), backends, {"a": 100}, preview_port=port))
    with pytest.raises(DataPlaneError, match=f"port {preview_port} is already in use"):
        await plane.set_route(route("two", preview_port, backends, {"a": 100}))
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        taken = foreign.getsockname()[1]
        with pytest.raises(DataPlaneError, match=f"port {taken} is already in use"):
            await plane.set_route(route("one", port, backends, {"a": 100}, preview_port=taken))
    assert set(await plane.routes()) == {"one"}
    assert plane.desired_route("one") == route("one", port, backends, {"a": 100}, preview_port=preview_port)


async def test_a_restarted_daemon_adopts_envoy_with_the_preview(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    plane, (a, b), backends = await two_backends(make_plane, upstream)
    port, preview_port = free_port(), free_port()
    desired = route("svc", port, backends, {"a": 100, "b": 0}, preview_port=preview_port, preview_backend="b")
    await plane.set_route(desired)
    await plane.close()

    adopting: DataPlane = await make_plane()
    assert [p.pid for p in adopting.processes()] == [p.pid for p in plane.processes()]
    assert adopting.desired_route("svc") == desired
    assert await answers(preview_port) == ["b"] * 20
    assert await answers(port) == ["a"] * 20


async def test_preview_requests_are_not_counted_in_the_backend_stats(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    """The canary is judged on backend_stats(): smoke tests on the preview port must not count there."""
    plane, (a, b), backends = await two_backends(make_plane, upstream)
    port, preview_port = free_port(), free_port()
    await plane.set_route(
        route("svc", port, backends, {"a": 0, "b": 100}, preview_port=preview_port, preview_backend="b")
    )
    await asyncio.sleep(STATS_FLUSH_S)
    before = await plane.backend_stats()

    assert await answers(preview_port) == ["b"] * 20
    await asyncio.sleep(STATS_FLUSH_S)  # histograms reach the admin interface at a flush
    assert b.requests == 20
    assert await plane.backend_stats() == before

    assert await answers(port) == ["b"] * 20
    await asyncio.sleep(STATS_FLUSH_S)
    after = (await plane.backend_stats())["b"]
    assert (after.rq_total, after.rq_2xx) == (before["b"].rq_total + 20, before["b"].rq_2xx + 20)
    assert _latency_count(after) == _latency_count(before["b"]) + 20
    assert (await plane.backend_stats())["a"] == before["a"]


async def test_a_preview_request_in_flight_keeps_its_backend_busy(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    """A cluster is drained only once idle: a smoke test still running counts, even after the
    preview moved on, and its request is not cut by the move."""
    plane, (a, b), backends = await two_backends(make_plane, upstream)
    port, preview_port = free_port(), free_port()
    await plane.set_route(
        route("svc", port, backends, {"a": 100, "b": 0}, preview_port=preview_port, preview_backend="b")
    )
    before = (await plane.backend_stats())["b"]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{preview_port}") as client:
        slow = asyncio.create_task(client.get("/", params={"sleep": "2"}))
        await inflight_until(plane, lambda inflight: inflight == {"a": 0, "b": 1})
        stats = (await plane.backend_stats())["b"]
        assert stats.rq_active == 1 and stats.rq_total == before.rq_total  # in flight, yet no traffic

        # The pending cluster is dropped (the switch aborted): no preview, the backend drains at 0.
        await plane.set_route(route("svc", port, backends, {"a": 100, "b": 0}, preview_port=preview_port))
        assert (await plane.routes())["svc"].inflight == {"a": 0, "b": 1}
        response = await slow
        assert (response.status_code, response.text) == (200, "b")
    await inflight_until(plane, lambda inflight: inflight == {"a": 0, "b": 0})


async def test_a_backends_completed_requests_leave_out_those_in_flight_and_those_given_up(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    """What a canary's analysis divides by: requests with an answer (or an error). A request still
    in flight, or one whose client gave up, is no success (a stuck canary counted them as such)."""
    plane, _, backends = await two_backends(make_plane, upstream)
    port = free_port()
    await plane.set_route(route("svc", port, backends, {"a": 0, "b": 100}))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=NO_KEEPALIVE) as client:
        assert [(await client.get("/", params={"status": code})).status_code for code in (200, 500) * 3] == [
            200,
            500,
        ] * 3
        held = [asyncio.create_task(client.get("/", params={"sleep": "5"}, timeout=10)) for _ in range(3)]
        with pytest.raises(httpx.TimeoutException):
            await client.get("/", params={"sleep": "5"}, timeout=0.3)  # given up on
        await inflight_until(plane, lambda inflight: inflight.get("b") == 3)
        await asyncio.sleep(STATS_FLUSH_S)
        stats = (await plane.backend_stats())["b"]
        assert (stats.rq_completed, stats.rq_5xx) == (6, 3), stats
        assert stats.rq_total == 10, "Envoy's total counts every request sent, answered or not"
        assert [response.status_code for response in await asyncio.gather(*held)] == [200] * 3
    await asyncio.sleep(STATS_FLUSH_S)
    assert (await plane.backend_stats())["b"].rq_completed == 9


STATS_FLUSH_S = 1.3  # the bootstrap's stats_flush_interval (1 s) and some room


def _latency_count(stats: BackendStats) -> int:
    """Requests timed so far: the count of the largest bucket (the buckets are cumulative)."""
    return max(stats.latency_ms_buckets.values(), default=0)


def _refused(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0
