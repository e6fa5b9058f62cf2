"""A shadow (mirror) route (issue 23): a share of the requests of the copied methods also goes to
the canary; the client gets the routed backend's answer only, and the copies count in the
canary's stats (what its analysis reads). Rendered, read back from Envoy, and served by real Envoy."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

from servekeeper.dataplane import Backend, Endpoint
from servekeeper.dataplane.model import route_from_json, route_to_json
from servekeeper.dataplane.render import render_route_configs
from servekeeper.model.routing import Mirror
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, free_port, route

A, B = Backend("a", (Endpoint("127.0.0.1", 20001),)), Backend("b", (Endpoint("127.0.0.1", 20002),))


def test_the_copied_methods_get_the_weights_and_a_mirror_policy_the_others_only_the_weights() -> None:
    shadowed = route("svc", 8000, [A, B], {"a": 100, "b": 0}, mirror=Mirror("b", 25))
    copied, plain = render_route_configs([shadowed])["http-svc"]["virtual_hosts"][0]["routes"]
    assert copied["match"]["headers"] == [
        {"name": ":method", "string_match": {"safe_regex": {"regex": "GET|HEAD"}}},
        {"name": "upgrade", "present_match": True, "invert_match": True},
    ]
    assert copied["route"]["request_mirror_policies"] == [
        {"cluster": "http-b", "runtime_fraction": {"default_value": {"numerator": 25, "denominator": "HUNDRED"}}}
    ]
    assert copied["route"]["weighted_clusters"] == plain["route"]["weighted_clusters"]
    assert "request_mirror_policies" not in plain["route"] and plain["match"] == {"prefix": "/"}
    assert route_from_json(route_to_json(shadowed)) == shadowed, "kept across a controller restart"


async def test_envoy_copies_gets_to_the_canary_and_the_clients_see_only_the_stable_answer(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    stable, canary = await upstream("stable"), await upstream("canary")
    plane = await make_plane()
    port = free_port()
    backends = [Backend("stable", (stable.endpoint,)), Backend("canary", (canary.endpoint,))]
    await plane.set_route(route("svc", port, backends, {"stable": 100, "canary": 0}, mirror=Mirror("canary", 50)))
    observed = (await plane.routes())["svc"]
    assert observed.mirror == Mirror("canary", 50, ("GET", "HEAD")) and observed.in_sync
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        answers = [(await http.get(f"/r{i}")).text for i in range(1000)]
        await settle(canary)
        copies_of_gets = canary.requests
        posts = [(await http.post("/r", content=b"write")).text for _ in range(100)]
        await asyncio.sleep(0.5)
    assert set(answers) == {"stable"} and set(posts) == {"stable"}, "the clients never get the canary's answer"
    # The bound: the share copied within 5 points of the percent (3 standard deviations here).
    assert 450 <= copies_of_gets <= 550, f"{copies_of_gets} copies of 1,000 GETs at 50%"
    assert canary.requests == copies_of_gets, "POST is not copied unless listed in methods"
    for _ in range(40):  # the copies count in the canary's stats (what its analysis reads)
        stats = (await plane.backend_stats())["canary"]
        if stats.rq_total >= copies_of_gets:
            break
        await asyncio.sleep(0.1)
    assert stats.rq_total == copies_of_gets

    # A WebSocket is never copied: the copy would stay open on the canary, frames and all.
    copies_before = (await plane.backend_stats())["canary"].rq_total
    async with aiohttp.ClientSession() as session, session.ws_connect(f"http://127.0.0.1:{port}/ws") as socket:
        await socket.send_str("write")
        answer = await socket.receive_json(timeout=5)
    assert answer["backend"] == "stable"
    await asyncio.sleep(1.5)  # the stats flush each second
    assert (await plane.backend_stats())["canary"].rq_total == copies_before, "the upgrade was copied"

    await plane.set_route(route("svc", port, backends, {"stable": 100, "canary": 0}))
    assert (await plane.routes())["svc"].mirror is None
    before = canary.requests
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        assert {(await http.get("/")).text for _ in range(50)} == {"stable"}
    await asyncio.sleep(0.5)
    assert canary.requests == before, "no copy once the mirror is off"


async def settle(server: object, quiet_s: float = 0.3) -> None:
    """Copies go out beside the answered requests: wait until the count stops moving."""
    last = -1
    while last != server.requests:
        last = server.requests
        await asyncio.sleep(quiet_s)
