"""The domain commands called directly, without HTTP: each refusal is a domain error that names
what is wrong, and a refused command changes nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from servekeeper.commands import apply as apply_module
from servekeeper.commands.apply import ApplyCommand
from servekeeper.commands.context import CommandContext
from servekeeper.commands.errors import (
    Conflict,
    HostPoolNotFound,
    Invalid,
    InvalidSpec,
    RevisionNotFound,
    ServiceNotFound,
)
from servekeeper.commands.hosts import HostPoolCommands
from servekeeper.commands.rollouts import RolloutCommands
from servekeeper.commands.services import ServiceCommands, ray_version
from servekeeper.core.placement import Capacity
from servekeeper.store.store import Store
from tests.unit.test_api import SPEC, FakeController
from tests.unit.test_hostpool import VALID as POOL
from tests.unit.test_kuberay_import import SAMPLES, sample_documents


@pytest.fixture
def controller() -> FakeController:
    return FakeController()


@pytest.fixture
def context(store: Store, controller: FakeController) -> CommandContext:
    return CommandContext(store, controller)  # type: ignore[arg-type]


def spec(name: str = "hello", port: int = 8000) -> dict[str, Any]:
    document = copy.deepcopy(SPEC)
    document["metadata"]["name"] = name
    document["spec"]["ingress"]["port"] = port
    return document


async def test_apply_stores_the_spec_and_wakes_the_controller(
    context: CommandContext, store: Store, controller: FakeController
) -> None:
    assert await ApplyCommand(context).apply([spec()], None) == {"name": "hello", "generation": 1, "changed": True}
    assert await ApplyCommand(context).apply([spec()], None) == {"name": "hello", "generation": 1, "changed": False}
    assert controller.woken == ["hello", "hello"]
    assert store.get_service("hello") is not None


async def test_apply_of_an_invalid_spec_raises_invalid_spec_naming_the_field(
    context: CommandContext, store: Store
) -> None:
    with pytest.raises(InvalidSpec) as refused:
        await ApplyCommand(context).apply([spec(port="eighty")], None)  # type: ignore[arg-type]
    assert any(problem.startswith("spec.ingress.port") for problem in refused.value.problems)
    assert store.list_services() == []


async def test_apply_of_two_documents_is_invalid(context: CommandContext) -> None:
    with pytest.raises(InvalidSpec, match="expected exactly one YAML document, found 2"):
        await ApplyCommand(context).apply([spec(), spec("other")], None)


async def test_apply_refuses_a_port_another_service_holds(context: CommandContext, store: Store) -> None:
    await ApplyCommand(context).apply([spec()], None)
    with pytest.raises(InvalidSpec) as refused:
        await ApplyCommand(context).apply([spec("other")], None)
    assert refused.value.problems == ["spec.ingress.port: port 8000 is used by service 'hello'"]
    assert store.get_service("other") is None


async def test_apply_refuses_what_this_machine_cannot_hold(
    context: CommandContext, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(apply_module, "machine_capacity", lambda: Capacity(gpus=0, memory_bytes=2**30))
    greedy = spec()
    greedy["spec"]["rayClusterConfig"] = {"head": {"numGpus": 1}}
    with pytest.raises(InvalidSpec) as refused:
        await ApplyCommand(context).apply([greedy], None)
    assert refused.value.problems == [
        "spec.rayClusterConfig.head.numGpus: InsufficientCapacity: "
        "the cluster needs 1 GPU in all, this machine has 0 GPU"
    ]
    assert store.list_services() == []


async def test_apply_of_a_kuberay_manifest_keeps_how_it_was_imported(
    context: CommandContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(apply_module, "machine_capacity", lambda: Capacity(gpus=0, memory_bytes=64 * 2**30))
    documents = sample_documents("ray-service.different-port.yaml", ray_version=ray_version())
    result = await ApplyCommand(context).apply(documents, str(SAMPLES))
    view = ServiceCommands(context).view(result["name"])
    assert view["importedFrom"] == "ray.io/v1 RayService" and view["importNotes"]


def test_service_commands_refuse_an_unknown_service(context: CommandContext) -> None:
    services = ServiceCommands(context)
    with pytest.raises(ServiceNotFound, match="service 'nope' not found"):
        services.view("nope")
    with pytest.raises(ServiceNotFound):
        services.delete("nope")
    with pytest.raises(ServiceNotFound):
        services.export("nope", "kuberay")
    assert services.find("nope") is None


async def test_export_names_a_wrong_format_before_looking_the_service_up(context: CommandContext) -> None:
    with pytest.raises(Invalid) as refused:
        ServiceCommands(context).export("nope", "helm")
    assert refused.value.problems == ["format: 'helm' is not 'kuberay'"]


async def test_delete_marks_the_service_and_wakes_the_controller(
    context: CommandContext, store: Store, controller: FakeController
) -> None:
    await ApplyCommand(context).apply([spec()], None)
    assert ServiceCommands(context).delete("hello") == {"name": "hello", "deleting": True}
    assert store.get_service("hello").deleting  # type: ignore[union-attr]
    assert controller.woken[-1] == "hello"


async def test_rollout_commands_refuse_with_domain_errors(context: CommandContext, store: Store) -> None:
    rollouts = RolloutCommands(context)
    with pytest.raises(ServiceNotFound):
        await rollouts.promote("hello", full=False)
    await ApplyCommand(context).apply([spec()], None)
    with pytest.raises(Conflict, match="no rollout in progress to promote"):
        await rollouts.promote("hello", full=False)
    with pytest.raises(Conflict, match="no rollout in progress to abort"):
        await rollouts.abort("hello")
    with pytest.raises(RevisionNotFound, match=r"revision 9 is not in the history \(kept: \[1\]\)"):
        await rollouts.undo("hello", 9)
    with pytest.raises(Conflict, match="revision 1 is the current one"):
        await rollouts.undo("hello", 1)
    with pytest.raises(Conflict, match="nothing to undo to"):
        await rollouts.undo("hello", None)
    assert [r["revision"] for r in rollouts.history("hello")["revisions"]] == [1]


async def test_undo_stores_the_earlier_spec_as_a_new_generation(context: CommandContext, store: Store) -> None:
    await ApplyCommand(context).apply([spec()], None)
    store.end_revision("hello", 1, "Succeeded", "controller", "rolled out", now=10.0)
    changed = spec()
    changed["spec"]["serveConfig"]["applications"][0]["import_path"] = "hello:other"
    await ApplyCommand(context).apply([changed], None)
    result = await RolloutCommands(context).undo("hello", None)
    assert result == {"name": "hello", "generation": 3, "changed": True, "toRevision": 1}
    assert store.list_revisions("hello")[-1].cause == "undo to revision 1"


async def test_host_pool_commands(store: Store) -> None:
    pools = HostPoolCommands(store)
    bad = copy.deepcopy(POOL)
    bad["spec"]["hosts"][0]["address"] = ""
    with pytest.raises(InvalidSpec) as refused:
        pools.apply(bad)
    assert any(problem.startswith("spec.hosts") for problem in refused.value.problems)
    assert pools.apply(POOL) == {"name": "fleet", "generation": 0, "changed": True, "kind": "HostPool"}
    assert [host["name"] for host in pools.view("fleet")["hosts"]] == ["gpu-a", "gpu-b"]
    for unknown in (pools.view, pools.delete):
        with pytest.raises(HostPoolNotFound, match="host pool 'nope' not found"):
            unknown("nope")
    with pytest.raises(HostPoolNotFound):
        await pools.check("nope")
    assert pools.delete("fleet") == {"name": "fleet", "deleted": True}
    assert pools.views() == []
