"""Spec validation: every problem listed by field path; owned fields rejected; never a crash."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servekeeper.model.spec import ServiceSpec, SpecError, load_spec_file, load_spec_text, parse_spec

VALID: dict[str, Any] = {
    "apiVersion": "servekeeper/v1alpha1",
    "kind": "RayService",
    "metadata": {"name": "hello"},
    "spec": {
        "ingress": {"port": 8000},
        "rayClusterConfig": {
            "head": {"numCpus": 1, "env": {"A": "1"}, "rayStartParams": {"object-store-memory": 1}},
            "workerGroups": [{"name": "cpu", "replicas": 1, "numCpus": 1}],
        },
        "serveConfig": {"applications": [{"name": "hello", "route_prefix": "/", "import_path": "hello:app"}]},
    },
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    document = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return document


def test_valid_spec_parses_with_defaults() -> None:
    spec = parse_spec(VALID)
    assert spec.name == "hello"
    assert spec.spec.upgradeStrategy.type == "NewCluster"
    assert spec.spec.rayClusterDeletionDelaySeconds == 60
    assert spec.spec.readinessTimeoutSeconds == 600
    assert spec.spec.serviceUnhealthySecondThreshold == 300
    assert spec.declared_apps() == {"hello": "/"}


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        pytest.param("metadata.name", "Hello_World", "metadata.name", id="name-not-dns-label"),
        pytest.param("spec.ingress.port", 70000, "spec.ingress.port", id="port-out-of-range"),
        pytest.param("spec.ingress.port", "http", "spec.ingress.port", id="port-wrong-type"),
        pytest.param(
            "spec.ingress.silentUpstreamSeconds", 0.5, "spec.ingress.silentUpstreamSeconds", id="silent-below-a-second"
        ),
        pytest.param("spec.serveConfig.http_options", {"port": 9000}, "http_options", id="owned-serve-port"),
        pytest.param(
            "spec.rayClusterConfig.head.rayStartParams", {"port": 1}, "set by servekeeper", id="owned-start-param"
        ),
        pytest.param(
            "spec.rayClusterConfig.head.rayStartParams",
            {"x; rm -rf /": 1},
            "rayStartParams key",
            id="shell-looking-param",
        ),
        pytest.param("spec.rayClusterConfig.head.env", {"BAD-KEY": "1"}, "env key", id="bad-env-key"),
        pytest.param("spec.upgradeStrategy", {"type": "Rolling"}, "spec.upgradeStrategy.type", id="bad-strategy"),
        pytest.param("spec.surprise", 1, "spec.surprise", id="unknown-field"),
        pytest.param("kind", "Deployment", "kind", id="wrong-kind"),
        pytest.param("spec.serveConfig.applications", [], "applications", id="no-apps"),
        pytest.param("spec.serveConfig.applications.0.import_path", "not a path", "import_path", id="bad-import"),
        pytest.param("spec.serveConfig.applications.0.route_prefix", "api", "route_prefix", id="bad-prefix"),
        pytest.param(
            "spec.rayClusterConfig.workerGroups",
            [{"name": "a", "replicas": 1}, {"name": "a", "replicas": 1}],
            "unique",
            id="dup-groups",
        ),
    ],
)
def test_invalid_specs_name_the_field(path: str, value: Any, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(with_change(path, value))
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


def test_every_problem_is_listed_at_once() -> None:
    document = with_change("metadata.name", "BAD")
    document["spec"]["ingress"]["port"] = -1
    document["spec"]["extra"] = True
    with pytest.raises(SpecError) as caught:
        parse_spec(document)
    assert len(caught.value.problems) == 3


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("a: [unclosed", id="invalid-yaml"),
        pytest.param("", id="empty"),
        pytest.param("- 1\n- 2\n", id="not-a-mapping"),
        pytest.param("a: 1\n---\nb: 2\n", id="two-documents"),
        pytest.param("x: " + "y" * 1_100_000, id="enormous"),
    ],
)
def test_bad_documents_are_rejected_cleanly(text: str) -> None:
    with pytest.raises(SpecError):
        load_spec_text(text)


def test_relative_working_dir_resolves_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    document = copy.deepcopy(VALID)
    document["spec"]["rayClusterConfig"]["workingDir"] = "./app"
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(document))
    assert load_spec_file(path).spec.rayClusterConfig.workingDir == str(tmp_path / "app")
    document["spec"]["rayClusterConfig"]["workingDir"] = "./missing"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(SpecError, match="workingDir"):
        load_spec_file(path)


def test_hashes_split_cluster_changes_from_serve_changes() -> None:
    base = parse_spec(VALID)
    serve_change = parse_spec(with_change("spec.serveConfig.applications.0.import_path", "hello:other"))
    cluster_change = parse_spec(with_change("spec.rayClusterConfig.head.numCpus", 2))
    assert serve_change.cluster_spec_hash() == base.cluster_spec_hash()
    assert serve_change.serve_config_hash() != base.serve_config_hash()
    assert cluster_change.cluster_spec_hash() != base.cluster_spec_hash()
    assert cluster_change.serve_config_hash() == base.serve_config_hash()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
paths = st.sampled_from(
    [
        "metadata.name",
        "spec.ingress.port",
        "spec.ingress",
        "spec.rayClusterConfig.head.numCpus",
        "spec.rayClusterConfig.head.env",
        "spec.rayClusterConfig.head.rayStartParams",
        "spec.rayClusterConfig",
        "spec.serveConfig",
        "spec.serveConfig.applications",
        "spec.upgradeStrategy",
        "spec.readinessTimeoutSeconds",
        "spec.rayClusterConfig.workerGroups",
        "spec",
    ]
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(path=paths, value=json_values)
def test_validation_accepts_or_rejects_with_a_message_never_crashes(path: str, value: Any) -> None:
    try:
        spec = parse_spec(with_change(path, value))
    except SpecError as exc:
        assert exc.problems and all(isinstance(p, str) and ": " in p for p in exc.problems)
    else:
        assert spec.name and spec.cluster_spec_hash() and spec.serve_config_hash()


def test_a_fraction_of_a_cpu_or_gpu_per_node_is_refused_at_apply_by_field() -> None:
    """`ray start --num-cpus/--num-gpus` take integers: a node given 0.5 would never start."""
    document = with_change("spec.rayClusterConfig.head.numCpus", 0.5)
    document["spec"]["rayClusterConfig"]["workerGroups"][0]["numGpus"] = 1.5
    with pytest.raises(SpecError) as raised:
        parse_spec(document)
    assert [problem.split(":")[0] for problem in raised.value.problems] == [
        "spec.rayClusterConfig.head.numCpus",
        "spec.rayClusterConfig.workerGroups.0.numGpus",
    ]
    assert "use 1 " in raised.value.problems[0] and "use 2 " in raised.value.problems[1]
    assert parse_spec(with_change("spec.rayClusterConfig.head.numCpus", 0)).spec.rayClusterConfig.head.numCpus == 0


def test_a_stored_spec_with_a_fraction_still_loads() -> None:
    """Stored before the check: the controller must still read it (to replace or delete it)."""
    stored = ServiceSpec.model_validate(with_change("spec.rayClusterConfig.head.numCpus", 0.5)).to_json()
    assert ServiceSpec.model_validate_json(stored).spec.rayClusterConfig.head.numCpus == 0.5
