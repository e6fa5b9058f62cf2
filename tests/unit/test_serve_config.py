"""Which submitted config Ray runs, judged from its deployed_app_config: both ways, never by names."""

from __future__ import annotations

from typing import Any

import pytest

from servekeeper.core.serve_config import config_deployed, package_hash_of
from servekeeper.model.enums import AppSource, AppStatus
from servekeeper.model.observation import AppState


def app(name: str = "a", **args: Any) -> dict[str, Any]:
    return {"name": name, "route_prefix": f"/{name}", "import_path": "m:app", "args": args}


def ray_has(*configs: dict[str, Any], source: AppSource = AppSource.DECLARATIVE, **extra: Any) -> dict[str, AppState]:
    return {
        c["name"]: AppState(
            name=c["name"],
            status=AppStatus.RUNNING,
            source=source,
            deployed_config={**c, **extra},
        )
        for c in configs
    }


@pytest.mark.parametrize(
    ("sent", "running", "deployed"),
    [
        pytest.param([app(x=1)], ray_has(app(x=1)), True, id="same"),
        pytest.param([app(x=1)], ray_has(app(x=1, debug=True)), False, id="key-removed-in-the-new-config"),
        pytest.param([app(x=1, debug=True)], ray_has(app(x=1)), False, id="key-added-in-the-new-config"),
        pytest.param([app(x=1)], ray_has(app(x=2)), False, id="value-changed"),
        pytest.param([app(x=1)], ray_has(app(x=1), app("b")), False, id="app-removed-not-deleted-yet"),
        pytest.param([app(x=1), app("b")], ray_has(app(x=1)), False, id="app-added-not-there-yet"),
        pytest.param([app(x=1)], ray_has(app(x=1), logging_config={"log_level": "INFO"}), True, id="ray-adds-logging"),
        pytest.param([app(x=1)], ray_has(app(x=1), source=AppSource.IMPERATIVE), False, id="imperative-name-taken"),
        pytest.param([app(x=1)], {}, False, id="nothing-deployed"),
    ],
)
def test_config_deployed(sent: list[dict[str, Any]], running: dict[str, AppState], deployed: bool) -> None:
    assert config_deployed({"applications": sent}, running) is deployed


def test_imperative_and_deleting_apps_do_not_make_a_config_look_outdated() -> None:
    running = ray_has(app(x=1))
    running["model-1"] = AppState("model-1", AppStatus.RUNNING, AppSource.IMPERATIVE, deployed_config=None)
    running["old"] = AppState("old", AppStatus.DELETING, AppSource.DECLARATIVE, deployed_config=app("old"))
    assert config_deployed({"applications": [app(x=1)]}, running)


def test_package_hash_of_a_document() -> None:
    digest = "ab" * 32
    document = {"applications": [{**app(), "runtime_env": {"working_dir": f"gcs://_ray_pkg_{digest}.zip"}}]}
    assert package_hash_of(document) == digest
    assert package_hash_of({"applications": [{**app(), "runtime_env": {"working_dir": "https://x/y.zip"}}]}) is None
    assert package_hash_of({"applications": [app()]}) is None
