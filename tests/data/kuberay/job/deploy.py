"""A driver for `servekeeper job submit`: deploys an app at run time (`serve.run`), which Ray then
reports with `"source": "imperative"`."""

from __future__ import annotations

from ray import serve
from starlette.requests import Request


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class JobApp:
    async def __call__(self, request: Request) -> str:
        return "deployed by a job"


if __name__ == "__main__":
    serve.run(JobApp.bind(), name="jobapp", route_prefix="/job")
    print("jobapp deployed")
