"""What a cluster's own environment costs (issue 21): the time to prepare one cold (uv's cache
empty: every wheel downloaded from the package index), with uv's cache warm (a new state dir:
resolved and installed again, the wheels already here), and already built (a second cluster
of the same spec), side by side in one run; and the disk each takes.

Each round builds with `providers.environments.Environments`, as the controller does, into a
state dir of its own. The cold rounds use a fresh uv cache dir each (their download is the
index's speed as much as ours); the warm rounds share one cache, filled first.

    .venv/bin/python -m bench.environments [--rounds 2] [--ray 2.59.0] [--python 3.11] [--pip ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.zero_downtime import RESULTS
from servekeeper.model.cluster_spec import RayClusterConfigSpec
from servekeeper.providers.environments import EnvironmentRequest, environments_of, own_python

MODES = ("cold", "warm_cache", "built")


def disk_kb(*paths: Path) -> int:
    """Blocks used by `paths` together (du counts a file hard-linked twice among them once)."""
    found = [str(path) for path in paths if path.exists()]
    if not found:
        return 0
    out = subprocess.run(["du", "-sck", *found], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


@contextmanager
def uv_cache(path: Path) -> Iterator[None]:
    before = os.environ.get("UV_CACHE_DIR")
    os.environ["UV_CACHE_DIR"] = str(path)  # the controller's uv runs inherit it
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UV_CACHE_DIR", None)
        else:
            os.environ["UV_CACHE_DIR"] = before


async def prepare_seconds(state_dir: Path, request: EnvironmentRequest) -> tuple[float, bool, Path]:
    environments = environments_of(state_dir)
    started = time.perf_counter()
    environment, built_now = await environments.prepare(request)
    return time.perf_counter() - started, built_now, environment.path


def one_round(
    mode: str, request: EnvironmentRequest, scratch: Path, warm_cache: Path, built_dir: Path
) -> dict[str, Any]:
    if mode == "built":  # a second cluster of a spec already built: the lock and the marker read
        seconds, built_now, path = asyncio.run(prepare_seconds(built_dir, request))
        return {"mode": mode, "seconds": round(seconds, 3), "built_now": built_now}
    cache = Path(tempfile.mkdtemp(prefix="uvcache-", dir=scratch)) if mode == "cold" else warm_cache
    state_dir = Path(tempfile.mkdtemp(prefix="state-", dir=scratch))
    with uv_cache(cache):
        seconds, built_now, path = asyncio.run(prepare_seconds(state_dir, request))
    figures = {
        "mode": mode,
        "seconds": round(seconds, 2),
        "built_now": built_now,
        "environment_mb": round(disk_kb(path) / 1024, 1),
        # What the environment adds beside uv's cache: uv links files from it where it can.
        "beside_cache_mb": round((disk_kb(path, cache) - disk_kb(cache)) / 1024, 1),
    }
    if mode == "cold":
        figures["cache_mb"] = round(disk_kb(cache) / 1024, 1)
        shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="of each mode, alternating")
    parser.add_argument("--ray", default="2.59.0")
    parser.add_argument("--python", default=own_python())
    parser.add_argument("--pip", nargs="*", default=[], help="extra requirements, as rayClusterConfig.pip")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = RayClusterConfigSpec.model_validate(
        {"rayVersion": args.ray, "pythonVersion": args.python, "pip": args.pip}
    )
    request = EnvironmentRequest.of(config)
    assert request is not None
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    scratch = Path(tempfile.mkdtemp(prefix="skenv-"))
    rounds: list[dict[str, Any]] = []
    try:
        warm_cache, built_dir = scratch / "warm-cache", scratch / "built"
        with uv_cache(warm_cache):  # fills the warm cache, and builds the environment the "built" rounds find
            asyncio.run(prepare_seconds(built_dir, request))
        for _ in range(args.rounds):
            for mode in MODES:
                rounds.append(one_round(mode, request, scratch, warm_cache, built_dir))
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    means = {mode: round(statistics.mean(r["seconds"] for r in rounds if r["mode"] == mode), 3) for mode in MODES}
    report = {
        "benchmark": "environments",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "request": request.describe(),
        "mean_seconds": means,
        "rounds": rounds,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "environments.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
