"""The preview port, pure parts: validation, storage, rendering, and that it leaves the main route
and its observation alone. No Envoy here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servekeeper.dataplane import Backend, DataPlaneError, Endpoint, ServiceRoute
from servekeeper.dataplane.admin import ProcessConfig, parse_stats
from servekeeper.dataplane.clusters import render_clusters
from servekeeper.dataplane.model import route_from_json, route_to_json
from servekeeper.dataplane.names import backend_of
from servekeeper.dataplane.observe import observe_routes, sum_backend_stats
from servekeeper.dataplane.render import render_listeners, render_route_configs

A = Backend("hello-g1", (Endpoint("127.0.0.1", 9001),), (Endpoint("127.0.0.1", 9101),))
B = Backend("hello-g2", (Endpoint("127.0.0.1", 9003),), (Endpoint("127.0.0.1", 9103),))
XDS = Path("/state/envoy-0")


def svc(preview_port: int | None = 8001, preview_backend: str | None = "hello-g2", **kwargs: Any) -> ServiceRoute:
    return ServiceRoute(
        "hello",
        8000,
        (A, B),
        {"hello-g1": 100, "hello-g2": 0},
        preview_port=preview_port,
        preview_backend=preview_backend,
        **kwargs,
    )


def manager(listener: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return result


def entry(config: dict[str, Any]) -> dict[str, Any]:
    (host,) = config["virtual_hosts"]
    (route,) = host["routes"]
    result: dict[str, Any] = route
    return result


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: svc(preview_port=8000), "equals port", id="preview-port-is-port"),
        pytest.param(lambda: svc(preview_port=9000, grpc_port=9000), "equals port", id="preview-port-is-grpc-port"),
        pytest.param(lambda: svc(preview_port=None), "has no preview_port", id="backend-without-port"),
        pytest.param(lambda: svc(preview_backend="hello-g3"), "not one of the backends", id="unknown-backend"),
    ],
)
def test_invalid_previews_are_refused(make: Any, message: str) -> None:
    with pytest.raises(DataPlaneError, match=message):
        make()


def test_valid_previews() -> None:
    assert svc().listener_ports() == [8000, 8001]
    assert svc(preview_backend=None).preview_backend is None  # a port with nothing to preview yet
    assert svc(preview_backend="hello-g1").preview_backend == "hello-g1"  # previewing the active one is allowed
    assert svc(preview_port=None, preview_backend=None, grpc_port=9000).listener_ports() == [8000, 9000]


def test_preview_round_trips_through_json_and_old_routes_still_load() -> None:
    route = svc(grpc_port=9000)
    assert route_from_json(route_to_json(route)) == route
    old = route_to_json(svc(preview_port=None, preview_backend=None))
    del old["preview_port"], old["preview_backend"]  # a route stored before previews existed
    loaded = route_from_json(old)
    assert (loaded.preview_port, loaded.preview_backend) == (None, None)


def test_preview_listener_is_the_main_listener_on_another_port_with_its_own_route_file() -> None:
    listeners = render_listeners([svc()], XDS)
    assert set(listeners) == {"http-hello", "preview-hello"}
    main, preview = listeners["http-hello"], listeners["preview-hello"]
    assert preview["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8001}
    assert preview["enable_reuse_port"] is True
    main_manager, preview_manager = manager(main), manager(preview)
    assert preview_manager["stat_prefix"] == "preview-hello"
    assert preview_manager["rds"]["route_config_name"] == "preview-hello"
    assert preview_manager["rds"]["config_source"]["path_config_source"]["path"] == f"{XDS}/rds/preview-hello.json"
    # Limits, timeouts, upgrades and filters: everything else is the main listener's.
    different = {"stat_prefix", "rds"}
    assert {k: v for k, v in preview_manager.items() if k not in different} == {
        k: v for k, v in main_manager.items() if k not in different
    }
    assert preview_manager["upgrade_configs"][0]["upgrade_type"] == "websocket"


def test_changing_the_preview_backend_touches_only_the_preview_route_file() -> None:
    to_g2, to_nothing = svc(), svc(preview_backend=None)
    assert render_listeners([to_g2], XDS) == render_listeners([to_nothing], XDS)
    # Every backend has its preview cluster while the service has a preview port, whatever it previews.
    assert (
        render_clusters([to_g2]) == render_clusters([to_nothing]) == render_clusters([svc(preview_backend="hello-g1")])
    )
    without = render_route_configs([svc(None, None)])
    for route in (to_g2, to_nothing):
        configs = render_route_configs([route])
        assert set(configs) == {"http-hello", "preview-hello"}
        assert configs["http-hello"] == without["http-hello"]  # the main route is exactly what it was


def test_preview_route_sends_everything_to_the_preview_backend() -> None:
    configs = render_route_configs([svc(request_timeout_s=30)])
    action = entry(configs["preview-hello"])["route"]
    assert action["cluster"] == "preview-hello-g2" and "weighted_clusters" not in action
    main_action = entry(configs["http-hello"])["route"]
    assert action["timeout"] == main_action["timeout"] == "30.000s"
    assert action["retry_policy"] == main_action["retry_policy"]


def test_no_preview_backend_answers_503_with_a_reason() -> None:
    route = entry(render_route_configs([svc(preview_backend=None)])["preview-hello"])
    assert "route" not in route
    assert route["direct_response"] == {
        "status": 503,
        "body": {"inline_string": "no preview: service hello has no pending cluster\n"},
    }


def test_a_preview_route_is_not_read_as_the_service_weights() -> None:
    weights = {
        "http-hello": {"http-hello-g1": 100, "http-hello-g2": 0},
        "preview-hello": {"http-hello-g2": 100},  # as if a preview route ever carried weights
    }
    with_preview = observe_routes([(ProcessConfig(route_weights=weights), {})])
    without = observe_routes([(ProcessConfig(route_weights={"http-hello": weights["http-hello"]}), {})])
    assert with_preview == without
    assert with_preview["hello"].weights == {"hello-g1": 100, "hello-g2": 0}


def test_preview_clusters_are_the_http_clusters_under_another_name() -> None:
    with_preview, without = render_clusters([svc(grpc_port=9000)]), render_clusters([svc(None, None, grpc_port=9000)])
    assert set(with_preview) == set(without) | {"preview-hello-g1", "preview-hello-g2"}
    for backend in ("hello-g1", "hello-g2"):
        preview, main = with_preview[f"preview-{backend}"], with_preview[f"http-{backend}"]
        assert preview["name"] == preview["load_assignment"]["cluster_name"] == f"preview-{backend}"
        # Endpoints, timeouts, health checks, circuit breakers, upstream protocol: all the HTTP cluster's.
        assert {**preview, "name": "", "load_assignment": {**preview["load_assignment"], "cluster_name": ""}} == {
            **main,
            "name": "",
            "load_assignment": {**main["load_assignment"], "cluster_name": ""},
        }
        assert with_preview[f"http-{backend}"] == without[f"http-{backend}"]  # the main ones are unchanged


@pytest.mark.parametrize(
    ("cluster", "owner"),
    [
        pytest.param("preview-x", ("preview", "x"), id="preview-cluster"),
        pytest.param("http-preview-x", ("http", "preview-x"), id="backend-named-preview"),
        pytest.param("preview-preview-x", ("preview", "preview-x"), id="its-preview-cluster"),
        pytest.param("preview-http-x", ("preview", "http-x"), id="preview-of-backend-named-http"),
        pytest.param("preview-", None, id="no-backend"),
        pytest.param("previews-x", None, id="other-kind"),
    ],
)
def test_preview_cluster_names_never_collide_with_backend_names(cluster: str, owner: tuple[str, str] | None) -> None:
    assert backend_of(cluster) == owner


def test_clusters_of_a_backend_named_like_a_preview_cluster_stay_apart() -> None:
    x = Backend("x", (Endpoint("127.0.0.1", 9001),))
    preview_x = Backend("preview-x", (Endpoint("127.0.0.1", 9002),))
    route = ServiceRoute("s", 8000, (x, preview_x), {"x": 1, "preview-x": 1}, preview_port=8001, preview_backend="x")
    clusters = render_clusters([route])
    assert set(clusters) == {"http-x", "http-preview-x", "preview-x", "preview-preview-x"}
    assert {backend_of(name) for name in clusters} == {
        ("http", "x"),
        ("http", "preview-x"),
        ("preview", "x"),
        ("preview", "preview-x"),
    }


def test_preview_requests_count_only_as_in_flight() -> None:
    def stat(cluster: str, name: str, value: int) -> dict[str, Any]:
        return {"name": f"cluster.{cluster}.{name}", "value": value}

    def histogram(cluster: str, count: int) -> dict[str, Any]:
        return {"name": f"cluster.{cluster}.upstream_rq_time", "buckets": [{"upper_bound": 5, "cumulative": count}]}

    stats = {
        "stats": [
            stat("http-b", "upstream_rq_total", 10),
            stat("http-b", "upstream_rq_completed", 8),  # 2 in flight
            stat("preview-b", "upstream_rq_completed", 47),
            stat("http-b", "upstream_rq_5xx", 1),
            stat("http-b", "upstream_rq_active", 2),
            stat("preview-b", "upstream_rq_total", 50),
            stat("preview-b", "upstream_rq_5xx", 40),
            stat("preview-b", "upstream_rq_active", 3),
            stat("preview-b", "upstream_rq_pending_active", 1),
            # A backend named "preview-b" is a backend like any other.
            stat("http-preview-b", "upstream_rq_total", 7),
            {"histograms": [histogram("http-b", 10), histogram("preview-b", 50), histogram("http-preview-b", 7)]},
        ]
    }
    counters = parse_stats(stats)
    assert set(counters) == {"b", "preview-b"}
    totals = sum_backend_stats([counters, counters])  # two processes
    assert (totals["b"].rq_total, totals["b"].rq_5xx, totals["b"].latency_ms_buckets) == (20, 2, {5.0: 20})
    assert totals["b"].rq_active == 12  # in flight: the preview port's requests are on the backend too
    # Completed: the main clusters' own, never the preview port's.
    assert totals["b"].rq_completed == 16
    assert (totals["preview-b"].rq_total, totals["preview-b"].latency_ms_buckets) == (14, {5.0: 14})

    weights = {"http-hello": {"http-b": 100, "http-preview-b": 0}}
    observed = observe_routes([(ProcessConfig(route_weights=weights), counters)] * 2)["hello"]
    assert observed.weights == {"b": 100, "preview-b": 0}
    assert observed.inflight == {"b": 12, "preview-b": 0}
    # A backend seen only through its preview cluster has no request counters to report.
    assert sum_backend_stats([parse_stats({"stats": [stat("preview-c", "upstream_rq_total", 3)]})]) == {}
