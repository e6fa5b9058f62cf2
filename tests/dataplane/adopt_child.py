"""A stand-in for the daemon, run as its own process so a test can kill it with SIGKILL:
it starts the data plane, routes one service, says so, and waits to be killed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from servekeeper.dataplane import Backend, DataPlane, Endpoint, ServiceRoute


async def main(state_dir: Path, port: int, upstream_port: int) -> None:
    plane = DataPlane(state_dir)
    await plane.start_or_adopt()
    backend = Backend("a", (Endpoint("127.0.0.1", upstream_port),))
    await plane.set_route(ServiceRoute("svc", port, (backend,), {"a": 100}))
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
