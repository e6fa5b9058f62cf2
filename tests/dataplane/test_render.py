"""Pure parts: rendering, validation, parsing admin answers, restart pacing. No Envoy here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from servekeeper.controller.observe import backend_counters_of
from servekeeper.dataplane import Backend, DataPlaneError, Endpoint, RouteObservation, ServiceRoute
from servekeeper.dataplane.admin import parse_config_dump, parse_stats
from servekeeper.dataplane.clusters import render_clusters, union_clusters
from servekeeper.dataplane.model import SILENT_UPSTREAM_S, route_from_json, route_to_json
from servekeeper.dataplane.names import backend_of
from servekeeper.dataplane.observe import never_falling, sum_backend_stats
from servekeeper.dataplane.render import render_listeners, render_route_configs
from servekeeper.dataplane.supervision import Backoff

A = Backend("hello-g1", (Endpoint("127.0.0.1", 9001), Endpoint("127.0.0.1", 9002)), (Endpoint("127.0.0.1", 9101),))
B = Backend("hello-g2", (Endpoint("127.0.0.1", 9003),), (Endpoint("127.0.0.1", 9103),))


def svc(weights: dict[str, int], grpc_port: int | None = None, **kwargs: Any) -> ServiceRoute:
    backends = tuple(b for b in (A, B) if b.name in weights)
    return ServiceRoute("hello", 8000, backends, weights, grpc_port=grpc_port, **kwargs)


def manager(listener: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return result


def test_listener_takes_routes_from_rds_and_does_not_change_with_weights() -> None:
    xds = Path("/state/envoy-0")
    before = render_listeners([svc({"hello-g1": 100})], xds)
    after = render_listeners([svc({"hello-g1": 0, "hello-g2": 100})], xds)
    assert before == after  # a weight change must never touch the listener
    listener = before["http-hello"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8000}
    assert listener["enable_reuse_port"] is True
    hcm = manager(listener)
    assert hcm["rds"]["config_source"]["path_config_source"]["path"] == "/state/envoy-0/rds/http-hello.json"
    assert hcm["codec_type"] == "AUTO" and hcm["use_remote_address"] is True
    assert hcm["http_protocol_options"]["accept_http_10"] is True
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert hcm["http_filters"][0]["typed_config"]["max_request_bytes"] == 64 * 1024 * 1024
    (upgrade,) = hcm["upgrade_configs"]
    assert upgrade["upgrade_type"] == "websocket"
    assert [f["name"] for f in upgrade["filters"]] == ["envoy.filters.http.router"]  # no buffering of upgrades


def test_grpc_listener_never_buffers() -> None:
    listeners = render_listeners([svc({"hello-g1": 100}, grpc_port=9000)], Path("/x"))
    assert set(listeners) == {"http-hello", "grpc-hello"}
    hcm = manager(listeners["grpc-hello"])
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    clusters = render_clusters([svc({"hello-g1": 100}, grpc_port=9000)])
    options = clusters["grpc-hello-g1"]["typed_extension_protocol_options"]
    assert (
        "http2_protocol_options"
        in options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    )


@pytest.mark.parametrize(
    ("timeout_s", "expected"),
    [pytest.param(0, "0.000s", id="no-limit"), pytest.param(30, "30.000s", id="thirty-seconds")],
)
def test_route_weights_timeout_and_retries(timeout_s: float, expected: str) -> None:
    configs = render_route_configs([svc({"hello-g1": 0, "hello-g2": 100}, request_timeout_s=timeout_s)])
    action = configs["http-hello"]["virtual_hosts"][0]["routes"][0]["route"]
    assert action["weighted_clusters"]["clusters"] == [
        {"name": "http-hello-g1", "weight": 0},
        {"name": "http-hello-g2", "weight": 100},
    ]
    assert action["timeout"] == expected
    retry = action["retry_policy"]
    assert retry["retry_on"] == "connect-failure,refused-stream,reset-before-request"
    assert retry["num_retries"] == 1
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"


def test_cluster_shape() -> None:
    cluster = render_clusters([svc({"hello-g1": 100})])["http-hello-g1"]
    assert cluster["type"] == "STATIC"
    hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["socket_address"]["port_value"] for h in hosts] == [9001, 9002]
    assert cluster["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    (check,) = cluster["health_checks"]
    assert check["http_health_check"]["path"] == "/-/healthz"
    assert (check["interval"], check["unhealthy_threshold"], check["healthy_threshold"]) == (
        "1s",
        2,
        1,
    )  # two proxies: the multi-node timing
    named = Backend("n", (Endpoint("node-1.internal", 9001),))
    dns = render_clusters([ServiceRoute("s", 1, (named,), {"n": 1})])["http-n"]
    assert dns["type"] == "STRICT_DNS"


def test_make_before_break_union_keeps_old_clusters_until_the_end() -> None:
    old = render_clusters([svc({"hello-g1": 100})])
    new = render_clusters([svc({"hello-g2": 100})])
    assert set(union_clusters(old, new)) == {"http-hello-g1", "http-hello-g2"}
    assert set(new) == {"http-hello-g2"}


def test_cluster_names_map_back_to_backends() -> None:
    assert backend_of("http-hello-g1") == ("http", "hello-g1")
    assert backend_of("grpc-x") == ("grpc", "x")
    assert backend_of("other") is None


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Backend("a.b", (Endpoint("h", 1),)), id="dot-in-name"),
        pytest.param(lambda: Backend("a", ()), id="no-endpoint"),
        pytest.param(lambda: Backend("a", (Endpoint("h", 0),)), id="bad-port"),
        pytest.param(lambda: svc({"hello-g1": 0}), id="zero-sum"),
        pytest.param(lambda: ServiceRoute("hello", 1, (A,), {"other": 1}), id="unknown-weight"),
        pytest.param(lambda: ServiceRoute("hello", 1, (A, A), {"hello-g1": 1}), id="duplicate-backend"),
        pytest.param(
            lambda: ServiceRoute("hello", 1, (Backend("x", (Endpoint("h", 1),)),), {"x": 1}, grpc_port=2),
            id="grpc-without-endpoints",
        ),
    ],
)
def test_invalid_routes_are_refused(make: Any) -> None:
    with pytest.raises(DataPlaneError):
        make()


def test_route_round_trips_through_json() -> None:
    route = svc({"hello-g1": 10, "hello-g2": 90}, grpc_port=9000, request_timeout_s=5, silent_upstream_s=0)
    assert route_from_json(route_to_json(route)) == route
    stored_before = {key: value for key, value in route_to_json(route).items() if key != "silent_upstream_s"}
    assert route_from_json(stored_before).silent_upstream_s == SILENT_UPSTREAM_S
    # Every upstream cluster of the service carries it (0: the kernel's own default).
    for cluster in render_clusters([route]).values():
        (option,) = cluster["upstream_bind_config"]["socket_options"]
        assert (option["description"], option["int_value"]) == ("TCP_USER_TIMEOUT", 0)


def test_observation_converts_to_the_controller_view() -> None:
    observed = RouteObservation("hello", {"g1": 0, "g2": 100}, True, {"g1": 2, "g2": 0})
    ingress = observed.to_ingress()
    assert ingress.active == "g2" and ingress.upstreams == frozenset({"g1", "g2"}) and ingress.inflight["g1"] == 2
    assert RouteObservation("hello", {"g1": 0}, True).active is None


def test_parse_admin_answers() -> None:
    dump = {
        "configs": [
            {
                "@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump",
                "version_info": "7",
                "dynamic_active_clusters": [{"cluster": {"name": "http-a"}}],
                "dynamic_warming_clusters": [{"cluster": {"name": "http-b"}}],
            },
            {
                "@type": "type.googleapis.com/envoy.admin.v3.ListenersConfigDump",
                "version_info": "8",
                "dynamic_listeners": [{"name": "http-s", "active_state": {}}, {"name": "http-t", "error_state": {}}],
            },
            {
                "@type": "type.googleapis.com/envoy.admin.v3.RoutesConfigDump",
                "dynamic_route_configs": [
                    {
                        "version_info": "9",
                        "route_config": {
                            "name": "http-s",
                            "virtual_hosts": [
                                {"routes": [{"route": {"weighted_clusters": {"clusters": [{"name": "http-a"}]}}}]}
                            ],
                        },
                    }
                ],
            },
        ]
    }
    config = parse_config_dump(dump)
    assert (config.cds_version, config.lds_version) == ("7", "8")
    assert config.active_clusters == {"http-a"} and config.warming_clusters == {"http-b"}
    assert config.active_listeners == {"http-s"} and set(config.listener_errors) == {"http-t"}
    assert config.route_versions == {"http-s": "9"} and config.route_weights == {"http-s": {"http-a": 0}}

    stats = {
        "stats": [
            {"name": "cluster.http-a.upstream_rq_active", "value": 2},
            {"name": "cluster.grpc-a.upstream_rq_active", "value": 1},
            {"name": "cluster.http-a.upstream_rq_pending_active", "value": 1},
            {"name": "cluster.other.upstream_rq_active", "value": 5},
            {
                "histograms": [
                    {"name": "cluster.http-a.upstream_rq_time", "buckets": [{"upper_bound": 1, "cumulative": 3}]}
                ]
            },
        ]
    }
    counters = parse_stats(stats)["a"]
    assert counters.values["upstream_rq_active"] == 3 and counters.latency_ms_buckets == {1.0: 3}
    assert set(parse_stats(stats)) == {"a"}


def test_backoff_restarts_at_once_then_slows_down() -> None:
    backoff = Backoff()
    assert backoff.may_restart(0)
    backoff.started(0)
    backoff.died(100)  # lived long: restart at once
    assert backoff.delay() == 0 and backoff.may_restart(100)
    delays = []
    now = 100.0
    for _ in range(8):
        backoff.started(now)
        now += 0.1
        backoff.died(now)  # died young, again and again
        delays.append(backoff.delay())
    assert delays[:4] == [0, 0.5, 1, 2] and delays[-1] == 30
    assert not backoff.may_restart(now + 1)


def test_a_silent_proxy_of_a_multi_node_cluster_is_ejected_sooner_and_its_connections_closed() -> None:
    clusters = render_clusters([svc({"hello-g1": 50, "hello-g2": 50}, grpc_port=9000)])
    several, one = clusters["http-hello-g1"], clusters["http-hello-g2"]
    (check,) = several["health_checks"]
    assert (check["timeout"], check["unhealthy_threshold"]) == ("2s", 2)
    assert several["close_connections_on_host_health_failure"] is True
    # A one-node cluster's only proxy: ejecting it is an outage, so the check stays generous.
    (check,) = one["health_checks"]
    assert (check["timeout"], check["unhealthy_threshold"]) == ("3s", 3)
    assert one["close_connections_on_host_health_failure"] is False
    assert clusters["grpc-hello-g1"]["health_checks"][0]["timeout"] == "3s"  # one gRPC endpoint


def test_answers_a_standby_gave_for_a_backend_count_as_the_backends_failures() -> None:
    # As real Envoy (1.40) reported them: 10 answers from "a", then "a" stopped and 7 answered
    # by the standby "s". The failover cluster holds every answer; "a"'s own cluster the 10 it took.
    def counter(name: str, value: int) -> dict[str, Any]:
        return {"name": f"cluster.{name}", "value": value}

    stats = {
        "stats": [
            counter("failover-a.upstream_rq_completed", 17),
            counter("failover-a.upstream_rq_2xx", 17),
            counter("http-a.upstream_rq_total", 10),
            counter("http-a.upstream_rq_pending_failure_eject", 1),
            counter("http-s.upstream_rq_total", 7),
            counter("http-b.upstream_rq_total", 5),  # a backend without a standby, one request in flight
            counter("http-b.upstream_rq_completed", 4),
            counter("http-b.upstream_rq_5xx", 1),
        ]
    }
    figures = sum_backend_stats([parse_stats(stats)])
    assert (figures["a"].rq_failed_over, figures["a"].rq_2xx, figures["a"].rq_total) == (7, 17, 10)
    assert figures["s"].rq_failed_over == 0 and figures["b"].rq_failed_over == 0
    # Requests started later lower completed - total: the figure is kept at its highest, as a
    # counter, until the Envoy processes change (another epoch).
    peaks: dict[str, tuple[str, int]] = {}
    assert never_falling(figures, peaks, "1,2")["a"].rq_failed_over == 7
    fewer = {"a": replace(figures["a"], rq_failed_over=4)}
    assert never_falling(fewer, peaks, "1,2")["a"].rq_failed_over == 7 and set(peaks) == {"a"}
    assert never_falling(fewer, peaks, "3,4")["a"].rq_failed_over == 4
    counters = backend_counters_of(figures)
    assert (counters["a"].requests, counters["a"].errors_5xx) == (17, 7)
    assert (counters["b"].requests, counters["b"].errors_5xx) == (4, 1)
