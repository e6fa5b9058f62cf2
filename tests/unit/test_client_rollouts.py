"""The rollout commands (promote, abort, undo, history) of the client, sync and async, and of
the CLI on it, against the real API app and a real store; their errors: Conflict (409) and
RevisionNotFound; the canary block of `describe`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from click.testing import Result
from fastapi.testclient import TestClient
from rich.console import Console
from typer.testing import CliRunner

from servekeeper import AsyncClient, Client, Conflict, RevisionNotFound, ServiceNotFound
from servekeeper.api.app import build_app
from servekeeper.cli import common as cli_common
from servekeeper.cli import main as cli_module
from servekeeper.model.records import AnalysisFigures, CanaryState, ClusterRecord
from servekeeper.store.store import Store
from tests.unit.test_client import TOKEN, URL, FakeController, document, through
from tests.unit.test_store import cluster


def pending_cluster() -> ClusterRecord:
    return cluster("hello-g2-bbbbbb").with_changes(service="hello", generation=2)


@pytest.fixture
def app_client(store: Store) -> Iterator[TestClient]:
    async def shutdown(stop_clusters: bool) -> None:
        return None

    with TestClient(build_app(FakeController(), store, TOKEN, shutdown)) as client:  # type: ignore[arg-type]
        yield client


@pytest.fixture
def client(app_client: TestClient) -> Iterator[Client]:
    with Client(url=URL, token=TOKEN, transport=through(app_client)) as sync_client:
        yield sync_client


def two_revisions(client: Client, store: Store) -> None:
    """hello at generation 2, generation 1 rolled out successfully."""
    client.apply(document(msg="v1"))
    store.end_revision("hello", 1, "Succeeded", "controller", "rolled out", now=10.0)
    client.apply(document(msg="v2"))


def test_promote_and_abort_count_on_the_pending_cluster(client: Client, store: Store) -> None:
    two_revisions(client, store)
    store.put_cluster(pending_cluster())
    assert client.promote("hello") == {
        "name": "hello",
        "cluster": "hello-g2-bbbbbb",
        "full": False,
        "promoteRequests": 1,
    }
    assert client.promote("hello")["promoteRequests"] == 2
    assert client.promote("hello", full=True)["full"] is True
    assert client.abort("hello") == {"name": "hello", "cluster": "hello-g2-bbbbbb", "aborting": True}
    stored = store.get_cluster("hello-g2-bbbbbb")
    assert stored is not None and stored.promote_requests == 2 and stored.promote_full and stored.abort_requested


def test_promote_or_abort_without_a_rollout_is_a_conflict(client: Client, store: Store) -> None:
    client.apply(document())
    with pytest.raises(Conflict, match="no rollout in progress to promote") as conflict:
        client.promote("hello")
    assert conflict.value.status == 409
    with pytest.raises(Conflict, match="no rollout in progress to abort"):
        client.abort("hello")
    with pytest.raises(ServiceNotFound):
        client.promote("nope")
    with pytest.raises(ServiceNotFound):
        client.abort("nope")


def test_history_and_undo(client: Client, store: Store) -> None:
    two_revisions(client, store)
    revisions = client.history("hello")
    assert [(r["revision"], r["current"], r["outcome"]) for r in revisions] == [
        (1, False, "Succeeded"),
        (2, True, "Progressing"),
    ]
    assert revisions[0]["cause"] == "apply" and revisions[0]["endedBy"] == "controller"
    assert len(revisions[0]["specHash"]) > 0 and revisions[1]["endedAt"] is None
    assert client.undo("hello") == {"name": "hello", "generation": 3, "changed": True, "toRevision": 1}
    latest = client.history("hello")[-1]
    assert latest["revision"] == 3 and latest["current"] and latest["cause"] == "undo to revision 1"
    assert client.get("hello")["generation"] == 3
    assert client.undo("hello", to_revision=2)["generation"] == 4


def test_undo_errors(client: Client, store: Store) -> None:
    client.apply(document(msg="v1"))
    with pytest.raises(Conflict, match="nothing to undo to"):
        client.undo("hello")  # revision 1 never rolled out, and it is the current one anyway
    with pytest.raises(Conflict, match="revision 1 is the current one"):
        client.undo("hello", to_revision=1)
    with pytest.raises(RevisionNotFound, match=r"revision 7 is not in the history \(kept: \[1\]\)") as missing:
        client.undo("hello", to_revision=7)
    assert missing.value.status == 404 and not isinstance(missing.value, ServiceNotFound)
    with pytest.raises(ServiceNotFound):
        client.undo("nope")
    with pytest.raises(ServiceNotFound):
        client.history("nope")


async def test_the_async_rollout_commands(app_client: TestClient, store: Store) -> None:
    async with AsyncClient(url=URL, token=TOKEN, transport=through(app_client)) as client:
        await client.apply(document(msg="v1"))
        store.end_revision("hello", 1, "Succeeded", "controller", "rolled out", now=10.0)
        await client.apply(document(msg="v2"))
        with pytest.raises(Conflict):
            await client.promote("hello")
        store.put_cluster(pending_cluster())
        assert (await client.promote("hello", full=True))["full"] is True
        assert (await client.abort("hello"))["aborting"] is True
        assert [r["revision"] for r in await client.history("hello")] == [1, 2]
        assert (await client.undo("hello", to_revision=1))["generation"] == 3
        with pytest.raises(RevisionNotFound):
            await client.undo("hello", to_revision=9)


# -- the CLI on the same client ------------------------------------------------------------


@pytest.fixture
def cli(client: Client, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """`servekeeper ARGS...` against the in-process API; returns Typer's result."""
    monkeypatch.setattr(cli_common, "client", lambda state_dir: client)
    monkeypatch.setattr(cli_common, "console", Console(width=200))
    monkeypatch.setattr(cli_common, "errors", Console(width=200, stderr=True))
    runner = CliRunner()

    def run(*args: str) -> Result:
        return runner.invoke(cli_module.app, list(args))

    return run


def test_cli_promote_abort_and_their_refusals(cli: Callable[..., Result], client: Client, store: Store) -> None:
    two_revisions(client, store)
    refused = cli("promote", "hello")
    assert refused.exit_code == 1 and "has no rollout in progress to promote" in refused.output
    assert cli("abort", "nope").exit_code == 1
    store.put_cluster(pending_cluster())
    promoted = cli("promote", "hello")
    assert promoted.exit_code == 0 and "service/hello promoting hello-g2-bbbbbb (promote #1)" in promoted.output
    assert "every remaining step skipped" in cli("promote", "hello", "--full").output
    aborted = cli("abort", "hello")
    assert aborted.exit_code == 0 and "service/hello aborting the rollout of hello-g2-bbbbbb" in aborted.output


def test_cli_history_and_undo(cli: Callable[..., Result], client: Client, store: Store) -> None:
    two_revisions(client, store)
    store.end_revision("hello", 2, "Failed", "analysis", "AnalysisFailed: [bold]not markup[/bold]", now=20.0)
    table = cli("history", "hello")
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == ["REVISION", "TIME", "SPEC", "PACKAGE", "CAUSE", "OUTCOME", "ENDED", "BY", "MESSAGE"]
    assert lines[1].split()[0] == "1" and "Succeeded" in lines[1] and "controller" in lines[1]
    assert lines[2].strip().startswith("2 (current)") and "[bold]not markup[/bold]" in lines[2]
    undone = cli("undo", "hello")
    assert undone.exit_code == 0 and "service/hello rolling back to revision 1 (generation 3)" in undone.output
    assert "undo to revision 1" in cli("history", "hello").output
    as_json = cli("history", "hello", "-o", "json")
    assert [r["revision"] for r in json.loads(as_json.output)] == [1, 2, 3]
    missing = cli("undo", "hello", "--to-revision", "9")
    assert missing.exit_code == 1 and "revision 9 is not in the history" in missing.output
    current = cli("undo", "hello", "--to-revision", "3")
    assert current.exit_code == 1 and "revision 3 is the current one" in current.output
    assert cli("history", "nope").exit_code == 1


def test_cli_describe_shows_the_canary(cli: Callable[..., Result], client: Client, store: Store) -> None:
    two_revisions(client, store)
    figures = AnalysisFigures(100.0, 110.0, 120, 0.9916, 45.2, 1080, 1.0, 40.0, "passed")
    state = CanaryState(step=1, step_started_at=100.0, weight=10, passed_intervals=1, last_analysis=figures)
    store.put_cluster(pending_cluster().with_changes(canary=state))
    described = cli("describe", "hello")
    assert described.exit_code == 0, described.output
    assert "canary step" in described.output and "weight 10%" in described.output
    assert "analysis 1 passed, 0 failed, 0 inconclusive" in described.output
    assert "99.2%" in described.output and "1080" in described.output
