"""The head's proxy of a multi-node cluster is a fallback endpoint (real Envoy): it gets no request
while a worker's proxy is healthy, all of them when none is, and none again once one is back.
Serve reports a head's proxy ready before it knows any replica; one started again would hold
every request sent to it until Serve's controller has recovered."""

from __future__ import annotations

import asyncio

import httpx

from servekeeper.dataplane import Backend, Endpoint
from servekeeper.dataplane.clusters import ALL_TO_FIRST_HEALTHY_LEVEL, render_clusters
from servekeeper.dataplane.model import route_from_json, route_to_json
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, route


def test_a_fallback_endpoint_is_rendered_at_the_next_priority_and_kept_in_the_routes_json() -> None:
    head, worker = Endpoint("10.0.0.1", 8000, fallback=True), Endpoint("10.0.0.2", 8000)
    rendered = route("svc", 9000, [Backend("c", (head, worker))], {"c": 100})
    assignment = render_clusters([rendered])["http-c"]["load_assignment"]
    levels = [(level.get("priority", 0), level["lb_endpoints"]) for level in assignment["endpoints"]]
    assert [
        (priority, [e["endpoint"]["address"]["socket_address"]["address"] for e in lb]) for priority, lb in levels
    ] == [
        (0, ["10.0.0.2"]),
        (1, ["10.0.0.1"]),
    ]
    assert assignment["policy"] == {"overprovisioning_factor": ALL_TO_FIRST_HEALTHY_LEVEL}
    assert route_from_json(route_to_json(rendered)) == rendered
    alone = route("svc", 9000, [Backend("c", (Endpoint("10.0.0.2", 8000),))], {"c": 100})
    plain = render_clusters([alone])["http-c"]["load_assignment"]
    assert "policy" not in plain and len(plain["endpoints"]) == 1
    stored_before = {**route_to_json(alone), "backends": [{"name": "c", "http": [["10.0.0.2", 8000]], "grpc": []}]}
    assert route_from_json(stored_before) == alone, "routes stored before fallbacks read as before"


async def test_the_heads_proxy_takes_traffic_only_while_no_worker_proxy_is_healthy(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    head, one, two = await upstream("head"), await upstream("one"), await upstream("two")
    plane = await make_plane(processes=1)
    port = free_port()
    endpoints = (Endpoint(head.endpoint.host, head.endpoint.port, fallback=True), one.endpoint, two.endpoint)
    await plane.set_route(route("svc", port, [Backend("c", endpoints)], {"c": 100}))

    async def answers(count: int) -> list[str]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            return [(await http.get("/")).text for _ in range(count)]

    async def settled(expected: set[str]) -> list[str]:
        for _ in range(100):  # health checks run each second
            got = await answers(30)
            if set(got) == expected:
                return got
            await asyncio.sleep(0.2)
        raise AssertionError(f"answers {sorted(set(got))}, expected {sorted(expected)}")

    await settled({"one", "two"})
    one.healthy = two.healthy = False  # no worker proxy knows a replica: the head's takes it all
    await settled({"head"})
    two.healthy = True
    await settled({"two"})
    assert head.requests > 0 and all(text == "two" for text in await answers(60)), "none to the head again"
