"""The API's wire types (`model/wire.py`) and both of their sides agree: every key a view emits
is declared in its TypedDict with a value of the declared type, every required key is emitted,
and a view built from records reaches a caller of the client unchanged. Records cover a plain
service, a canary, a pending cluster still starting, draining and deleting clusters, events, the
history, a KubeRay import and host pools (the API's own answers through the real app)."""

from __future__ import annotations

import importlib.metadata
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from typing_extensions import get_type_hints, is_typeddict

from servekeeper.client import Client
from servekeeper.kuberay.translate import import_documents
from servekeeper.model import wire
from servekeeper.model.enums import AppSource, AppStatus, ClusterRole, ConditionType
from servekeeper.model.observation import AppState, ClusterObservation, IngressRouteObservation, Observation, ProbeState
from servekeeper.model.records import (
    AnalysisFigures,
    CanaryState,
    ClusterPorts,
    ClusterRecord,
    Condition,
    Event,
    NodePorts,
    ServiceRecord,
)
from servekeeper.model.spec import parse_spec
from servekeeper.model.wire import ClusterView, EventView, ServiceView
from servekeeper.views.service import event_view, service_view
from tests.unit.test_api_hosts import local_pool
from tests.unit.test_client import TOKEN, URL, document
from tests.unit.test_kuberay_import import SAMPLES, sample_documents

RAY = importlib.metadata.version("ray")

# -- the checker --------------------------------------------------------------------------------


def shape_problems(kind: Any, value: Any, where: str = "$") -> list[str]:
    """What of `value` (decoded JSON, or a view before encoding) does not fit the type `kind`."""
    if kind is Any:
        return []
    if is_typeddict(kind):
        return _typeddict_problems(kind, value, where)
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        found = [shape_problems(option, value, where) for option in get_args(kind)]
        return [] if any(not problems for problems in found) else [f"{where}: {value!r} is not {kind}"]
    if origin is Literal:
        return [] if value in get_args(kind) else [f"{where}: {value!r} is not one of {get_args(kind)}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not a list"]
        (item,) = get_args(kind)
        return [
            problem for i, element in enumerate(value) for problem in shape_problems(item, element, f"{where}[{i}]")
        ]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not an object"]
        _, item = get_args(kind)
        return [
            problem for key, element in value.items() for problem in shape_problems(item, element, f"{where}.{key}")
        ]
    return _scalar_problems(kind, value, where)


def _typeddict_problems(kind: Any, value: Any, where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: {type(value).__name__}, not a {kind.__name__}"]
    hints = get_type_hints(kind)
    problems = [f"{where}.{key}: emitted, not declared in {kind.__name__}" for key in value if key not in hints]
    problems += [
        f"{where}.{key}: required by {kind.__name__}, not emitted" for key in kind.__required_keys__ if key not in value
    ]
    for key, element in value.items():
        if key in hints:
            problems += shape_problems(hints[key], element, f"{where}.{key}")
    return problems


def _scalar_problems(kind: Any, value: Any, where: str) -> list[str]:
    if kind is type(None):
        fits = value is None
    elif kind is float:
        fits = isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON has one number type
    elif kind is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    else:
        fits = isinstance(value, kind)
    return [] if fits else [f"{where}: {value!r} is not {getattr(kind, '__name__', kind)}"]


def test_the_checker_catches_an_undeclared_a_missing_and_a_mistyped_key() -> None:
    event = event_view(Event("svc", 1.0, "Normal", "Applied", "generation 1"))
    assert shape_problems(EventView, event) == []
    assert shape_problems(EventView, {**event, "extra": 1}) == ["$.extra: emitted, not declared in EventView"]
    missing = {key: value for key, value in event.items() if key != "reason"}
    assert shape_problems(EventView, missing) == ["$.reason: required by EventView, not emitted"]
    assert shape_problems(EventView, {**event, "time": "now"}) == ["$.time: 'now' is not float"]
    assert shape_problems(ClusterView, {}) != []


@pytest.mark.parametrize(
    "kind", [value for value in vars(wire).values() if is_typeddict(value)], ids=lambda kind: kind.__name__
)
def test_every_wire_type_resolves(kind: Any) -> None:
    """A misspelt or undefined name inside a TypedDict fails here, not in a caller's mypy run."""
    assert get_type_hints(kind)


# -- views of records -------------------------------------------------------------------------

NODE_PORTS = NodePorts(
    node_manager=1, object_manager=2, metrics_export=3, agent_listen=4, agent_grpc=5, runtime_env_agent=6,
    min_worker=100, max_worker=147,
)  # fmt: skip
CANARY_STEPS: list[dict[str, Any]] = [{"setWeight": 10}, {"pause": {"duration": "30s"}}, {"setWeight": 50}]


def spec_json(name: str, **spec: Any) -> str:
    body = document(name)
    body["spec"].update(spec)
    return parse_spec(body).to_json()


def cluster(name: str, role: ClusterRole, created_at: float, **changes: Any) -> ClusterRecord:
    config = json.loads(parse_spec(document()).spec.rayClusterConfig.model_dump_json())
    record = ClusterRecord(
        name=name,
        service="svc",
        generation=1,
        cluster_spec_hash="h",
        cluster_spec_json=json.dumps(config),
        role=role,
        ports=ClusterPorts(10, 11, 12, 13, 14, (NODE_PORTS,)),
        temp_dir="/tmp/sk-x",
        log_dir="/tmp/sk-x-logs",
        created_at=created_at,
    )
    return record.with_changes(**changes)


def observed(name: str) -> ClusterObservation:
    apps = {
        "hello": AppState("hello", AppStatus.RUNNING, AppSource.DECLARATIVE),
        "adhoc": AppState("adhoc", AppStatus.DEPLOYING, AppSource.IMPERATIVE, "made by serve.run"),
    }
    probes = (ProbeState("/healthz", True, 3, 3, True, "200", 9.5), ProbeState("/ready", False, 0, 2))
    return ClusterObservation(name, True, True, apps, probes=probes, deployed_config_hash="c1")


ANALYSIS = AnalysisFigures(10.0, 20.0, 120, 0.99, 45.0, 1080, None, None, "passed", "")
READY = Condition(ConditionType.READY, True, "Ready", "every app RUNNING", 3.0)
UPGRADING = Condition(ConditionType.UPGRADE_IN_PROGRESS, True, "Canary", "step 2/3", 4.0)


Records = tuple[ServiceRecord, list[ClusterRecord], Observation | None]


def view_of(records: Records, now: float | None = 20.0) -> ServiceView:
    service, clusters, observation = records
    return service_view(service, 8000, clusters, observation, now)


def active_only() -> Records:
    service = ServiceRecord("svc", spec_json("svc"), 1, 1, conditions=(READY,))
    active = cluster("svc-g1", ClusterRole.ACTIVE, 1.0, head_pid=41, worker_pids=(42,), applied_config_hash="c1")
    route = IngressRouteObservation("svc-g1", frozenset({"svc-g1"}), inflight={"svc-g1": 3})
    return service, [active], Observation({"svc-g1": observed("svc-g1")}, route)


def canary(strategy: bool = True) -> Records:
    upgrade = {"type": "Canary", "canary": {"steps": CANARY_STEPS}} if strategy else {"type": "NewCluster"}
    service = ServiceRecord("svc", spec_json("svc", upgradeStrategy=upgrade), 2, 1, conditions=(READY, UPGRADING))
    state = CanaryState(step=1, step_started_at=15.0, weight=10, passed_intervals=1, last_analysis=ANALYSIS)
    stable = cluster("svc-g1", ClusterRole.ACTIVE, 1.0, head_pid=41)
    pending = cluster("svc-g2", ClusterRole.PENDING, 2.0, generation=2, head_pid=51, canary=state, ready_at=12.0)
    weights = {"svc-g1": 90, "svc-g2": 10}
    route = IngressRouteObservation("svc-g1", frozenset(weights), inflight={"svc-g1": 1, "svc-g2": 0}, weights=weights)
    return service, [stable, pending], Observation({"svc-g1": observed("svc-g1"), "svc-g2": observed("svc-g2")}, route)


def pending_starting() -> Records:
    """A new cluster with no process yet, an old one draining and an older one being deleted;
    the pending record was stored by an older version (its cluster spec does not parse)."""
    service = ServiceRecord("svc", spec_json("svc"), 3, 2, failed_generation=3, failure_reason="boom")
    clusters = [
        cluster("svc-g2", ClusterRole.ACTIVE, 2.0, head_pid=51),
        cluster("svc-g3", ClusterRole.PENDING, 3.0, generation=3, cluster_spec_json="{not json"),
        cluster("svc-g1", ClusterRole.DRAINING, 1.0, drain_started_at=30.0),
        cluster("svc-g0", ClusterRole.DELETING, 0.5),
    ]
    route = IngressRouteObservation("svc-g2", frozenset({"svc-g2", "svc-g1"}), inflight={"svc-g1": 4})
    return service, clusters, Observation({"svc-g2": observed("svc-g2")}, route)


def unobserved() -> Records:
    """Right after a restart of the daemon: records, nothing observed yet."""
    service = ServiceRecord("svc", spec_json("svc"), 1, 0, deleting=True)
    return service, [cluster("svc-g1", ClusterRole.ACTIVE, 1.0)], None


CASES = [
    pytest.param(active_only, id="plain-service"),
    pytest.param(canary, id="canary"),
    pytest.param(lambda: canary(strategy=False), id="canary-state-without-a-canary-spec"),
    pytest.param(pending_starting, id="pending-starting-draining-deleting"),
    pytest.param(unobserved, id="not-observed"),
]


@pytest.mark.parametrize("records", CASES)
def test_a_view_of_records_fits_service_view_before_and_after_json(records: Any) -> None:
    view = view_of(records())
    assert shape_problems(ServiceView, view) == []
    assert shape_problems(ServiceView, json.loads(json.dumps(view))) == []


def test_the_canary_case_fills_every_optional_part() -> None:
    view = view_of(canary())
    pending = view["pendingCluster"]
    assert pending is not None and "canary" in pending
    assert pending["canary"]["stepDescription"] and pending["canary"]["lastAnalysis"] is not None
    assert [c["role"] for c in view_of(pending_starting()).get("otherClusters", [])] == ["draining", "deleting"]


def serving(views: dict[str, Any]) -> httpx.MockTransport:
    """Answers each GET path with the JSON of the view stored for it, as the API does."""

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=json.dumps(views[request.url.path]).encode())

    return httpx.MockTransport(handle)


def test_a_view_of_records_reaches_a_client_caller_unchanged() -> None:
    view = view_of(canary())
    events = [
        event_view(Event("svc", 1.0, "Normal", "Applied", "generation 2")),
        event_view(Event("svc", 2.0, "Warning", "Slow", "x")),
    ]
    paths = {"/api/v1/services/svc": view, "/api/v1/events": events}
    with Client(url=URL, token=TOKEN, transport=serving(paths)) as client:
        got = client.get("svc")
        got_events = client.events("svc")
    assert got == view and got_events == events
    # Typed access, as mypy checks it in the client's callers.
    pending = got["pendingCluster"]
    assert pending is not None
    assert pending["canary"]["weight"] == 10 and pending["trafficPercent"] == 10
    last = pending["canary"]["lastAnalysis"]
    assert last is not None and last["verdict"] == "passed"
    assert pending["applications"]["hello"]["status"] == "RUNNING"
    assert [probe["passing"] for probe in pending["probes"]] == [True, False]
    assert [event["type"] for event in got_events] == ["Normal", "Warning"]
    assert all(shape_problems(EventView, event) == [] for event in got_events)


# -- the API's own answers, through the real app --------------------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    from servekeeper.api.app import build_app
    from servekeeper.store.store import Store
    from tests.unit.test_client import FakeController, through

    store = Store(tmp_path / "store.db")

    async def shutdown(stop_clusters: bool) -> None:
        return None

    app = build_app(FakeController(), store, TOKEN, shutdown)  # type: ignore[arg-type]
    with TestClient(app) as app_client, Client(url=URL, token=TOKEN, transport=through(app_client)) as sync_client:
        yield sync_client
    store.close()


def test_service_commands_and_history_fit_their_types(client: Client) -> None:
    assert shape_problems(wire.ApplyResult, client.apply(document())) == []
    assert shape_problems(wire.ApplyResult, client.apply(document(msg="v2"))) == []
    assert shape_problems(ServiceView, client.get("hello")) == []
    revisions = client.history("hello")
    assert [r["revision"] for r in revisions] == [1, 2]
    assert shape_problems(list[wire.RevisionView], revisions) == []
    assert shape_problems(wire.DeleteResult, client.delete("hello")) == []


def test_an_imported_kuberay_service_fits_with_its_notes(client: Client) -> None:
    """The API adds `importedFrom` and `importNotes` (the translation's notes, as it stored them)."""
    documents = sample_documents("ray-service.different-port.yaml", ray_version=RAY)
    imported = import_documents(documents, RAY, {}, str(SAMPLES))
    view = view_of(active_only())
    view["importedFrom"] = imported.source
    view["importNotes"] = [note.to_json() for note in imported.notes]
    assert view["importNotes"] and shape_problems(ServiceView, json.loads(json.dumps(view))) == []
    client.apply(document())
    (plain,) = client.list()
    assert plain.get("importedFrom", "absent") is None and plain.get("importNotes") == []


def test_host_pool_answers_fit_their_types(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(local_pool(tmp_path)))
    assert shape_problems(wire.ApplyResult, client.apply(path)) == []
    pools = client.host_pools()
    assert shape_problems(list[wire.HostPoolView], pools) == [] and pools[0]["hosts"]
    check = client.check_hosts("fleet")  # nothing listens: every host unreachable or refused
    assert shape_problems(wire.PoolCheckView, check) == [] and not check["ok"]
