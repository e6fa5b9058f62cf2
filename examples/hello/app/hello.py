"""A tiny Serve app whose replicas take a configurable time to become ready.

`ready_delay_s` sleeps in the constructor, like a model that loads its weights: Ray reports the
app DEPLOYING (healthy, not ready) until every replica has finished it.

A GET answers the version (`msg`); a POST answers the version on the first line, then the request
body verbatim, so a load client can tell a complete answer from a truncated or mixed-up one.
Under `/node` the node's address takes the version's place (which node answered: multi-host tests).
`error_rate` and `delay_s` make a bad release for canary tests: that share of requests answers
500, and every answer takes that long.
"""

import asyncio
import random
import time

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import PlainTextResponse


@serve.deployment
class Hello:
    def __init__(
        self, msg: str, ready_delay_s: float, fail_on_start: bool = False, error_rate: float = 0, delay_s: float = 0
    ) -> None:
        time.sleep(ready_delay_s)
        if fail_on_start:  # a broken release: the constructor raises, the app ends DEPLOY_FAILED
            raise RuntimeError("hello: this release fails on start")
        self.msg = msg
        self.error_rate = error_rate
        self.delay_s = delay_s

    async def __call__(self, request: Request) -> str | PlainTextResponse:
        if request.url.path.rstrip("/").endswith("/node"):  # which node answered (multi-host tests)
            node = ray.util.get_node_ip_address()
            return f"{node}\n{(await request.body()).decode()}" if request.method == "POST" else node
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error_rate and random.random() < self.error_rate:
            return PlainTextResponse(f"{self.msg}: injected failure", status_code=500)
        if request.method == "POST":
            body = await request.body()
            return f"{self.msg}\n{body.decode()}"
        return self.msg


def app(args: dict) -> serve.Application:
    options = {"num_replicas": int(args.get("replicas", 1)), "ray_actor_options": {"num_cpus": 0}}
    if "max_replicas_per_node" in args:
        options["max_replicas_per_node"] = int(args["max_replicas_per_node"])
    return Hello.options(**options).bind(
        str(args.get("msg", "v1")),
        float(args.get("ready_delay_s", 0)),
        bool(args.get("fail_on_start", False)),
        float(args.get("error_rate", 0)),
        float(args.get("delay_s", 0)),
    )
