"""A tiny stand-in, written for servekeeper's tests, for `conditional_dag.py` of
github.com/ray-project/test_dag (deployed by KubeRay's RayService sample as
`conditional_dag.serve_dag`): the same import path and deployment names.

POST ["ADD", 1] answers "4 pizzas please!" with user_config increment 3; ["MUL", 3] with factor 5
answers "15 pizzas please!"."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request


@serve.deployment
class Adder:
    def __init__(self) -> None:
        self.increment = 0.0

    def reconfigure(self, config: dict[str, Any]) -> None:
        self.increment = float(config.get("increment", 0))

    def apply(self, value: float) -> float:
        return value + self.increment


@serve.deployment
class Multiplier:
    def __init__(self) -> None:
        self.factor = 1.0

    def reconfigure(self, config: dict[str, Any]) -> None:
        self.factor = float(config.get("factor", 1))

    def apply(self, value: float) -> float:
        return value * self.factor


@serve.deployment
class Router:
    def __init__(self, multiplier: DeploymentHandle, adder: DeploymentHandle) -> None:
        self.operations = {"MUL": multiplier, "ADD": adder}

    async def __call__(self, request: Request) -> str:
        operation, value = await request.json()
        handle = self.operations.get(str(operation).upper())
        if handle is None:
            return f"unknown operation {operation!r}"
        result = await handle.apply.remote(float(value))
        return f"{result:g} pizzas please!"


serve_dag = Router.bind(Multiplier.bind(), Adder.bind())
