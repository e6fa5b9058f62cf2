"""A tiny stand-in, written for servekeeper's tests, for `fruit.py` of github.com/ray-project/test_dag
(the app KubeRay's RayService samples deploy as `fruit.deployment_graph`): the same import path and
deployment names, so the samples' serveConfigV2 applies unchanged.

POST ["MANGO", 2] to the app's route answers the price of 2 mangoes (user_config price * amount)."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request


class _Stand:
    def __init__(self) -> None:
        self.price = 0.0

    def reconfigure(self, config: dict[str, Any]) -> None:
        self.price = float(config.get("price", 0))

    def check_price(self, amount: float) -> float:
        return self.price * amount


@serve.deployment
class MangoStand(_Stand):
    pass


@serve.deployment
class OrangeStand(_Stand):
    pass


@serve.deployment
class PearStand(_Stand):
    pass


@serve.deployment
class FruitMarket:
    def __init__(self, mango: DeploymentHandle, orange: DeploymentHandle, pear: DeploymentHandle) -> None:
        self.stands = {"MANGO": mango, "ORANGE": orange, "PEAR": pear}

    async def __call__(self, request: Request) -> float:
        fruit, amount = await request.json()
        stand = self.stands.get(str(fruit).upper())
        if stand is None:
            return -1.0
        return float(await stand.check_price.remote(float(amount)))


deployment_graph = FruitMarket.bind(MangoStand.bind(), OrangeStand.bind(), PearStand.bind())
