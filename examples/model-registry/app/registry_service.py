"""A model registry served with Ray Serve: two declared apps, and one app per model at run time.

- `controller` (declared) watches the registry directory and creates one Serve app per model
  file with `serve.run_many` (Ray reports those apps as `"source": "imperative"`). It never
  redeploys a model app that already runs, so a restart of the controller, or an in-place
  change of the declared config, leaves the models alone.
- `router` (declared, the public API) forwards `/router/models/<name>` to the model's app with
  `serve.get_app_handle`, and answers `/router/ready` with 200 only when every well-formed model
  in the registry is RUNNING. A malformed model file is still deployed (and fails), but it is
  left out of readiness: one bad upload must not take the service down.

The models are tiny linear models this example defines itself: nothing is fetched at run time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from ray import serve
from ray.serve.schema import ApplicationStatus

logger = logging.getLogger("ray.serve")
MODEL_APP_PREFIX = "model-"


def read_model(path: Path) -> dict[str, Any]:
    """Parse and check a model file; raise ValueError if it is malformed."""
    try:
        model = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path.name}: not readable JSON: {exc}") from exc
    weights = model.get("weights") if isinstance(model, dict) else None
    if not isinstance(weights, list) or not all(isinstance(w, (int, float)) for w in weights):
        raise ValueError(f"{path.name}: 'weights' must be a list of numbers")
    if not isinstance(model.get("bias", 0), (int, float)):
        raise ValueError(f"{path.name}: 'bias' must be a number")
    return model


@serve.deployment(ray_actor_options={"num_cpus": 0})
class LinearModel:
    def __init__(self, model_path: str) -> None:
        model = read_model(Path(model_path))  # a malformed file fails here: DEPLOY_FAILED
        time.sleep(float(model.get("load_seconds", 0)))  # "loading weights"
        self.name = Path(model_path).stem
        self.weights = [float(w) for w in model["weights"]]
        self.bias = float(model.get("bias", 0))

    def __call__(self, features: list[float]) -> dict[str, Any]:
        padded = (list(features) + [0.0] * len(self.weights))[: len(self.weights)]
        score = sum(w * x for w, x in zip(self.weights, padded, strict=True)) + self.bias
        return {"model": self.name, "score": round(score, 6)}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class ModelController:
    def __init__(self, registry_dir: str, poll_seconds: float = 2.0) -> None:
        self.registry = Path(registry_dir).resolve()
        self.poll_seconds = poll_seconds
        self._task = asyncio.get_event_loop().create_task(self._watch())

    def _model_files(self) -> dict[str, Path]:
        return {path.stem: path for path in sorted(self.registry.glob("*.json"))}

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self._reconcile)
            except Exception:  # keep watching whatever one pass did
                logger.exception("model reconcile failed")
            await asyncio.sleep(self.poll_seconds)

    def _reconcile(self) -> None:
        existing = serve.status().applications
        for name, path in self._model_files().items():
            app_name = MODEL_APP_PREFIX + name
            if app_name in existing:
                continue  # never redeploy a model app that exists: it may be serving
            app = LinearModel.options(name="LinearModel").bind(str(path))
            logger.info("deploying %s from %s", app_name, path)
            serve.run_many(
                [serve.RunTarget(target=app, name=app_name, route_prefix=None)],
                wait_for_applications_running=False,
            )

    def status(self) -> dict[str, Any]:
        applications = serve.status().applications
        models = {}
        for name, path in self._model_files().items():
            try:
                read_model(path)
                well_formed = True
            except ValueError:
                well_formed = False
            app = applications.get(MODEL_APP_PREFIX + name)
            models[name] = {"wellFormed": well_formed, "status": app.status if app else "NOT_DEPLOYED"}
        ready = all(m["status"] == ApplicationStatus.RUNNING for m in models.values() if m["wellFormed"])
        return {"ready": ready, "models": models}


router_api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(router_api)
class Router:
    def __init__(self, version: str = "v1") -> None:
        self.version = version
        self._running: set[str] = set()
        self._checked_at = float("-inf")

    async def _is_running(self, app_name: str) -> bool:
        """Answer fast instead of queueing on a model that is not up: refresh at most once a second."""
        if app_name not in self._running and time.monotonic() - self._checked_at > 1.0:
            applications = await asyncio.to_thread(lambda: serve.status().applications)
            self._running = {n for n, a in applications.items() if a.status == ApplicationStatus.RUNNING}
            self._checked_at = time.monotonic()
        return app_name in self._running

    @router_api.get("/ready")
    async def ready(self) -> Any:
        status = await serve.get_app_handle("controller").status.remote()
        if not status["ready"]:
            raise HTTPException(status_code=503, detail=status)
        return status

    @router_api.get("/models/{name}")
    async def predict(self, name: str, x: str = "1,2,3") -> dict[str, Any]:
        features = [float(v) for v in x.split(",") if v]
        if not await self._is_running(MODEL_APP_PREFIX + name):
            raise HTTPException(status_code=503, detail=f"model {name!r} is not running here")
        result = await serve.get_app_handle(MODEL_APP_PREFIX + name).remote(features)
        return {**result, "router": self.version}


def controller_app(args: dict[str, Any]) -> serve.Application:
    return ModelController.bind(str(args.get("registry_dir", "registry")), float(args.get("poll_seconds", 2)))


def router_app(args: dict[str, Any]) -> serve.Application:
    return Router.bind(str(args.get("version", "v1")))
