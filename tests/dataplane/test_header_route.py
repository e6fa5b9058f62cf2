"""A header route (issue 23): requests with a header go to one backend (the canary) whatever the
weights; the others follow the weights. Rendered, read back from Envoy, and served by real Envoy."""

from __future__ import annotations

import httpx
import pytest

from servekeeper.dataplane import Backend, DataPlaneError, Endpoint
from servekeeper.dataplane.model import route_from_json, route_to_json
from servekeeper.dataplane.render import render_route_configs
from servekeeper.model.routing import HeaderMatch
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, route

A, B = Backend("a", (Endpoint("127.0.0.1", 20001),)), Backend("b", (Endpoint("127.0.0.1", 20002),))
CANARY = HeaderMatch("x-canary", "always")


def test_the_header_route_comes_first_and_sends_to_one_cluster() -> None:
    pinned = route("svc", 8000, [A, B], {"a": 100, "b": 0}, header_route=CANARY, header_backend="b")
    routes = render_route_configs([pinned])["http-svc"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"] == {
        "prefix": "/",
        "headers": [{"name": "x-canary", "string_match": {"exact": "always"}}],
    }
    assert routes[0]["route"]["cluster"] == "http-b" and "retry_policy" in routes[0]["route"]
    assert routes[1]["match"] == {"prefix": "/"} and "weighted_clusters" in routes[1]["route"]
    regex = route(
        "svc", 8000, [A, B], {"a": 100, "b": 0}, header_route=HeaderMatch("x-t", "qa-.*", True), header_backend="b"
    )
    matcher = render_route_configs([regex])["http-svc"]["virtual_hosts"][0]["routes"][0]["match"]["headers"][0]
    assert matcher == {"name": "x-t", "string_match": {"safe_regex": {"regex": "qa-.*"}}}
    assert route_from_json(route_to_json(regex)) == regex, "kept across a controller restart"


def test_a_header_route_needs_a_backend_of_the_route() -> None:
    with pytest.raises(DataPlaneError, match="header route"):
        route("svc", 8000, [A, B], {"a": 100, "b": 0}, header_route=CANARY, header_backend="c")
    with pytest.raises(DataPlaneError, match="header route"):
        route("svc", 8000, [A, B], {"a": 100, "b": 0}, header_route=CANARY)


async def test_envoy_sends_the_header_to_the_canary_at_weight_0_and_the_rest_by_weight(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    stable, canary = await upstream("stable"), await upstream("canary")
    plane = await make_plane()
    port = free_port()
    backends = [Backend("stable", (stable.endpoint,)), Backend("canary", (canary.endpoint,))]
    await plane.set_route(
        route("svc", port, backends, {"stable": 100, "canary": 0}, header_route=CANARY, header_backend="canary")
    )
    observed = (await plane.routes())["svc"]
    assert observed.header_route == CANARY and observed.header_backend == "canary" and observed.in_sync
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        plain = [(await http.get("/")).text for _ in range(20)]
        pinned = [(await http.get("/", headers={"X-Canary": "always"})).text for _ in range(20)]
        other_value = [(await http.post("/", headers={"x-canary": "never"})).text for _ in range(10)]
    assert set(plain) == {"stable"} and set(other_value) == {"stable"}
    assert set(pinned) == {"canary"}, "the header wins over weight 0, header names without case"

    await plane.set_route(
        route(
            "svc",
            port,
            backends,
            {"stable": 50, "canary": 50},
            header_route=HeaderMatch("x-tester", "qa-[0-9]+", regex=True),
            header_backend="canary",
        )
    )
    observed = (await plane.routes())["svc"]
    assert observed.header_route == HeaderMatch("x-tester", "qa-[0-9]+", regex=True) and observed.in_sync
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        plain = [(await http.get("/")).text for _ in range(200)]
        pinned = [(await http.get("/", headers={"x-tester": "qa-42"})).text for _ in range(20)]
        partial = [(await http.get("/", headers={"x-tester": "qa-42x"})).text for _ in range(200)]
    assert set(pinned) == {"canary"}
    assert 50 <= plain.count("canary") <= 150, "the others follow the weights"
    assert 50 <= partial.count("canary") <= 150, "a regex matches the whole value, or the weights decide"

    await plane.set_route(route("svc", port, backends, {"stable": 100, "canary": 0}))
    observed = (await plane.routes())["svc"]
    assert observed.header_route is None and observed.header_backend is None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        assert {(await http.get("/", headers={"x-canary": "always"})).text for _ in range(10)} == {"stable"}
