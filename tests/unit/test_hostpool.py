"""HostPool validation: every problem by field path; unique hosts; paths that no shell expands."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from servekeeper.model.hostpool import is_host_pool, load_host_pool_file, parse_host_pool
from servekeeper.model.spec import SpecError


def host(name: str, address: str) -> dict[str, Any]:
    return {
        "name": name,
        "address": address,
        "ssh": {"user": "ray", "port": 22, "identityFile": "~/.ssh/id_ed25519", "knownHostsFile": "/etc/sk/known"},
        "python": "/opt/ray-env/bin/python",
        "resources": {"cpus": 16, "gpus": 2, "memoryGiB": 64},
    }


VALID: dict[str, Any] = {
    "apiVersion": "servekeeper/v1alpha1",
    "kind": "HostPool",
    "metadata": {"name": "fleet"},
    "spec": {"hosts": [host("gpu-a", "10.0.0.11"), host("gpu-b", "gpu-b.example.internal")]},
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    document = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return document


def test_valid_pool_parses_with_defaults() -> None:
    pool = parse_host_pool(VALID)
    assert pool.name == "fleet"
    first = pool.spec.hosts[0]
    assert first.ssh.identity_path() == Path.home() / ".ssh/id_ed25519"
    assert first.resources.gpus == 2
    assert first.workDir == "/tmp/servekeeper-ray"  # per SSH user: a shared /tmp dir anyone could take
    assert pool.host("gpu-b") is not None and pool.host("gpu-b").address == "gpu-b.example.internal"  # type: ignore[union-attr]
    assert pool.host("nope") is None
    assert parse_host_pool(yaml.safe_load(pool.to_json())) == pool


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        pytest.param("metadata.name", "Fleet_1", "metadata.name", id="pool-name-not-dns-label"),
        pytest.param("spec.hosts.0.name", "GPU A", "spec.hosts.0.name", id="host-name"),
        pytest.param("spec.hosts.0.address", "10.0.0.300", "spec.hosts.0.address", id="bad-ip"),
        pytest.param("spec.hosts.0.address", "a b", "spec.hosts.0.address", id="address-with-space"),
        pytest.param("spec.hosts.0.address", "-x.example", "spec.hosts.0.address", id="hostname-leading-dash"),
        pytest.param("spec.hosts.0.address", "10.0.0.1; rm -rf /", "spec.hosts.0.address", id="shell-in-address"),
        pytest.param("spec.hosts.0.ssh.port", 0, "spec.hosts.0.ssh.port", id="port-zero"),
        pytest.param("spec.hosts.0.ssh.port", 65536, "spec.hosts.0.ssh.port", id="port-too-high"),
        pytest.param("spec.hosts.0.ssh.user", "$(id)", "spec.hosts.0.ssh.user", id="user-shell"),
        pytest.param("spec.hosts.0.ssh.identityFile", "keys/id", "spec.hosts.0.ssh.identityFile", id="relative-key"),
        pytest.param("spec.hosts.0.ssh.knownHostsFile", "~root/kh", "spec.hosts.0.ssh.knownHostsFile", id="tilde-user"),
        pytest.param("spec.hosts.0.python", "~/env/bin/python", "spec.hosts.0.python", id="python-tilde"),
        pytest.param("spec.hosts.0.python", "python3", "spec.hosts.0.python", id="python-relative"),
        pytest.param("spec.hosts.0.resources.cpus", 0, "spec.hosts.0.resources.cpus", id="no-cpus"),
        pytest.param("spec.hosts.0.resources.gpus", -1, "spec.hosts.0.resources.gpus", id="negative-gpus"),
        pytest.param("spec.hosts.0.workDir", "/" + "x" * 60, "spec.hosts.0.workDir", id="work-dir-too-long"),
        pytest.param("spec.hosts.0.color", "blue", "spec.hosts.0.color", id="unknown-field"),
        pytest.param("spec.hosts", [], "spec.hosts", id="no-hosts"),
        pytest.param("kind", "RayService", "kind", id="wrong-kind"),
    ],
)
def test_bad_field_is_reported_by_path(path: str, value: Any, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_host_pool(with_change(path, value))
    assert any(problem.startswith(expected) for problem in caught.value.problems), caught.value.problems


def test_duplicate_names_and_addresses_are_refused() -> None:
    document = with_change("spec.hosts.1", host("gpu-a", "10.0.0.11"))
    with pytest.raises(SpecError) as caught:
        parse_host_pool(document)
    text = "\n".join(caught.value.problems)
    assert "host names must be unique; repeated: ['gpu-a']" in text
    assert "host addresses must be unique; repeated: ['10.0.0.11']" in text


def test_every_problem_at_once() -> None:
    document = with_change("spec.hosts.0.ssh.port", -1)
    document["spec"]["hosts"][1]["python"] = "python"
    with pytest.raises(SpecError) as caught:
        parse_host_pool(document)
    assert {p.split(":")[0] for p in caught.value.problems} == {"spec.hosts.0.ssh.port", "spec.hosts.1.python"}


def test_ipv6_address_is_normalised() -> None:
    pool = parse_host_pool(with_change("spec.hosts.0.address", "FD00::0011"))
    assert pool.spec.hosts[0].address == "fd00::11"


def test_file_loading_and_kind(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(VALID))
    assert load_host_pool_file(path).name == "fleet"
    assert is_host_pool(VALID) and not is_host_pool({"kind": "RayService"}) and not is_host_pool([])
    path.write_text("a: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_host_pool_file(path)
    with pytest.raises(SpecError, match="cannot read"):
        load_host_pool_file(tmp_path / "missing.yaml")
