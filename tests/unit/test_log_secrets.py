"""No secret reaches an event through a node's log (issue 19, item 3, follow-up): an env value
that came from a secret (a KubeRay manifest's `secretKeyRef`, listed by the service's import
fact) is blanked out of a node's last lines whatever its length; where the provider cannot read
the facts, every env value of 4 characters or more is. Each also in the escaped forms a program
prints it in (JSON, a Python repr, URL-quoted)."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

from servekeeper.commands.apply import store_spec
from servekeeper.model.enums import ClusterRole
from servekeeper.providers.local import LocalProvider
from tests.unit.test_controller import NAME, make_spec
from tests.unit.test_pool_clusters import PoolWorld, draft, pool_spec, world

__all__ = ["world"]  # the fixture, imported for pytest

SECRET = 'p"w/1 x'  # short, and changed by each escaping


def escaped_forms(value: str) -> list[str]:
    return [value, json.dumps(value)[1:-1], repr(value)[1:-1], urllib.parse.quote(value)]


async def test_a_short_secret_is_blanked_from_a_pool_nodes_last_lines_in_every_form(world: PoolWorld) -> None:
    group = {"name": "w", "numCpus": 2, "env": {"DB_PASS": "pw7", "PHRASE": SECRET, "DEBUG": "1"}}
    spec = make_spec(rayClusterConfig={"hostPool": "fleet", "head": {"numCpus": 2}, "workerGroups": [group]})
    refs = [{"group": "w", "env": env, "secret": "db", "key": env.lower()} for env in ("DB_PASS", "PHRASE")]
    imported = {"source": "ray.io/v1 RayService", "notes": [], "secretRefs": refs}
    store_spec(world.store, NAME, spec.to_json(), None, imported, history_limit=10)
    await world.tick()
    await world.background_settled()
    worker = world.only(ClusterRole.PENDING).nodes[1]
    del world.fleet.running[worker.temp_dir]
    printed = " ".join(escaped_forms(SECRET))
    world.fleet.logs[worker.temp_dir] = f"DEBUG=1\nlogin with pw7 refused\nphrase {printed}\n"
    world.pools._liveness.clear()
    await world.tick()
    [restarting] = [e.message for e in world.events() if e.reason == "WorkerRestarting"]
    assert restarting.endswith("DEBUG=1 | login with *** refused | phrase *** *** *** ***"), restarting
    assert all("pw7" not in e.message and "%22" not in e.message for e in world.events())
    await world.background_settled()


def test_without_the_facts_every_env_value_of_four_characters_or_more_is_blanked(tmp_path: Path) -> None:
    env = {"PIN": "4321", "PHRASE": SECRET, "DEBUG": "1"}
    config = pool_spec(workers=0, head={"numCpus": 1, "env": env}).spec.rayClusterConfig
    cluster = draft("c", config).with_changes(log_dir=str(tmp_path))
    (tmp_path / "head.log").write_text(f"DEBUG=1 pin 4321\n{' '.join(escaped_forms(SECRET))}\n")
    # A LocalProvider has no store: which values came from secrets is not known to it.
    assert LocalProvider().exit_reason(cluster) == "DEBUG=1 pin *** | *** *** *** ***"
