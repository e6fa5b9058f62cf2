"""The client's rollout commands (promote, abort, undo, history) against the real API app and a
real store, sync and async, and their errors: Conflict (409) and RevisionNotFound."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from servekeeper import AsyncClient, Client, Conflict, RevisionNotFound, ServiceNotFound
from servekeeper.api import build_app
from servekeeper.status import ClusterRecord
from servekeeper.store import Store
from tests.unit.test_client import TOKEN, URL, FakeController, document, through
from tests.unit.test_store import cluster


def pending_cluster() -> ClusterRecord:
    return cluster("hello-g2-bbbbbb").with_changes(service="hello", generation=2)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "store.db")
    yield store
    store.close()


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
