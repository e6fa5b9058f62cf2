"""The controller against Ray release after release (issue 21: "tested against every Ray version
it supports"), outside CI: CI builds two environments (2.52.0 for the KubeRay samples, 2.59.0 for
upgrades), this walks the whole range on one daemon, one service at a time.

For each release the service is applied on that `rayVersion` (its own environment, built with uv
from the index as it was the day the release came out) and must:

- come up Ready (the dashboard's and Serve's REST APIs of that release);
- answer a GET and a POST (echoed) through Envoy;
- run that release: read from the raylet process, not from the spec;
- run a job (the Jobs REST API) whose `ray.init()` driver sees that release;
- take a Serve-config change in place (Serve's PUT of that release), on the same cluster;
- be deleted with nothing left.

A release that fails any step is reported with the step and the error; the walk goes on.

    .venv/bin/python -m bench.ray_versions [--versions 2.46.0,2.47.0,...]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import exit_cleanly_on_sigterm
from bench.ray_upgrade import raylet_release
from bench.standby_failover import alternate_on_one_daemon
from bench.zero_downtime import RESULTS
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec, wait_until

NAME = "rayver"
DEFAULT_VERSIONS = ",".join(f"2.{minor}.0" for minor in range(46, 61))
DRIVER = "import ray; ray.init(); print('driver on Ray', ray.__version__)"


def spec(port: int, msg: str, ray_version: str) -> dict[str, Any]:
    document = hello_spec(NAME, port, msg=msg, rayClusterDeletionDelaySeconds=0)
    document["spec"]["rayClusterConfig"]["rayVersion"] = ray_version
    return document


def answers(port: int, ray_version: str, msg: str) -> None:
    """A GET answers `msg`; a POST echoes its body under it."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as client:
        got = client.get("/")
        assert got.status_code == 200 and got.text == msg, (got.status_code, got.text[:300])
        body = f"posted to Ray {ray_version}"
        posted = client.post("/", content=body)
        assert posted.status_code == 200 and posted.text == f"{msg}\n{body}", (posted.status_code, posted.text[:300])


def one_release(sk: Servekeeper, ray_version: str) -> dict[str, Any]:
    """Every step on one release; the first that fails ends it (the service is deleted anyway)."""
    port, step, times = free_port(), "apply", {}
    started = time.perf_counter()
    try:
        sk.api_apply(spec(port, f"v1 on {ray_version}", ray_version))
        step = "ready"
        assert sk.wait(NAME, timeout=900) == 0, sk.cli("events", NAME, check=False).stdout[-2000:]
        times["apply_to_ready_s"] = round(time.perf_counter() - started, 1)
        step = "answers"
        answers(port, ray_version, f"v1 on {ray_version}")
        step = "raylet release"
        view = sk.api_get(NAME)
        cluster = view["activeCluster"]["name"]
        running = raylet_release(view["activeCluster"]["headPid"])
        assert running == ray_version, f"the raylet runs Ray {running}"
        step = "job"
        job = sk.cli("job", "submit", NAME, "--", "python", "-c", DRIVER, check=False)
        assert job.returncode == 0 and f"driver on Ray {ray_version}" in job.stdout, job.stdout[-1500:] + job.stderr
        step = "in-place change"
        changed_at = time.perf_counter()
        sk.api_apply(spec(port, f"v2 on {ray_version}", ray_version))
        wait_until(lambda: _answer(port) == f"v2 on {ray_version}", 300, "the changed config answers")
        times["in_place_change_s"] = round(time.perf_counter() - changed_at, 1)
        assert sk.api_get(NAME)["activeCluster"]["name"] == cluster, "changed in place, on the same cluster"
        step = "delete"
        sk.cli("delete", NAME)
        wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
        return {"ray": ray_version, "ok": True, **times}
    except Exception as failure:  # a sweep reports each release's failure and goes on
        traceback.print_exc()
        sk.cli("delete", NAME, check=False)
        wait_until(lambda: not sk.clusters(), 180, "the service's clusters stopped")
        return {"ray": ray_version, "ok": False, "failed_at": step, "error": str(failure)[-1500:], **times}


def _answer(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=10, trust_env=False).text
    except httpx.HTTPError as error:
        return repr(error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", default=DEFAULT_VERSIONS, help="comma-separated Ray releases")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    releases = [v.strip() for v in args.versions.split(",") if v.strip()]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    # One "round" whose modes are the releases: one daemon, each release in turn.
    results, leftovers = alternate_on_one_daemon(1, releases, one_release)
    report = {
        "benchmark": "ray_versions",
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "controller_ray": version("ray"),
        "passed": [r["ray"] for r in results if r["ok"]],
        "failed": {r["ray"]: f"{r['failed_at']}: {r['error'][:300]}" for r in results if not r["ok"]},
        "leftover_processes": leftovers,
        "releases": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "ray_versions.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "releases"}, indent=2))


if __name__ == "__main__":
    main()
