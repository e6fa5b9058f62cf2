"""Node autoscaling on this machine (issue 22): how fast Ray's autoscaler, through servekeeper,
gives a pending replica a node, and how long an idle node is kept, under mixed load.

Each round changes a deployment's `num_replicas` in place on a cluster whose head has no CPU:
- up (1 -> 2 replicas): from the apply to Serve showing the new replica pending, to Ray's
  `NodeAdded`, to the node's process running (recorded), to the replica RUNNING;
- down (2 -> 1): from the apply to `NodeRemoved` (Ray waits `idleTimeoutSeconds` first).
The report sets them beside the defaults users compare with: Ray Serve's replica autoscaling
(upscale_delay_s 30, downscale_delay_s 600) and SkyServe's (300 s up, 1,200 s down).

    .venv/bin/python -m bench.node_autoscaling [--rounds 2] [--idle-seconds 10] [--clients 8]

tests/integration/test_autoscaling.py measures with the same functions, so this cannot rot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec
from servekeeper.testing.load import Load

RESULTS = Path(__file__).parent / "results"
NAME = "scaled"
POLL_S = 0.1
DEFAULTS = {
    "ray_serve_replicas": {"upscale_delay_s": 30, "downscale_delay_s": 600},
    "skyserve": {"upscale_delay_s": 300, "downscale_delay_s": 1200},
}


def spec(
    port: int, replicas: int, msg: str = "v1", idle_seconds: float = 10, max_nodes: int = 2, min_nodes: int = 0
) -> dict[str, Any]:
    """A hello service whose replicas need the workers' CPUs (none on the head); a new `msg` is a
    new cluster (it is in the head's env too: a cluster change), a new `replicas` an in-place
    change of the Serve config, new `min_nodes`/`max_nodes` an in-place change of Ray's
    autoscaler's bounds."""
    document = hello_spec(NAME, port, msg=msg, head_cpus=0)
    config = document["spec"]["rayClusterConfig"]
    config["head"]["env"] = {"HELLO_RELEASE": msg}
    config["enableInTreeAutoscaling"] = True
    config["autoscalerOptions"] = {"idleTimeoutSeconds": idle_seconds}
    config["workerGroups"] = [
        {"name": "cpu", "replicas": min_nodes, "minReplicas": min_nodes, "maxReplicas": max_nodes, "numCpus": 1}
    ]
    app = document["spec"]["serveConfig"]["applications"][0]
    app["deployments"] = [{"name": "Hello", "num_replicas": replicas, "ray_actor_options": {"num_cpus": 1}}]
    return document


def running_workers(sk: Servekeeper) -> int:
    """Worker nodes of the service's active cluster whose process runs (as recorded)."""
    name = sk.api_get(NAME)["activeCluster"]["name"]
    (cluster,) = [c for c in sk.clusters() if c["name"] == name]
    nodes = json.loads(cluster["nodes_json"])
    return sum(1 for n in nodes if n["role"] == "worker" and not n["stopped"] and n["pid"] is not None)


def replica_states(sk: Servekeeper) -> list[str]:
    """The states Serve reports for the deployment's replicas, from the active cluster's dashboard."""
    url = sk.api_get(NAME)["activeCluster"]["dashboardUrl"] + "/api/serve/applications/"
    apps = httpx.get(url, timeout=5).json()["applications"]
    deployment = apps.get("hello", {}).get("deployments", {}).get("Hello", {})
    return [replica["state"] for replica in deployment.get("replicas", [])]


def event_after(sk: Servekeeper, reason: str, since: float) -> float | None:
    with sk.db() as db:
        row = db.execute(
            "SELECT MIN(time) FROM events WHERE service = ? AND reason = ? AND time >= ?", (NAME, reason, since)
        ).fetchone()
    return row[0] if row and row[0] is not None else None


def scale_up(
    sk: Servekeeper, port: int, replicas: int, msg: str, timeout: float = 240, **options: Any
) -> dict[str, float]:
    """Apply `replicas` in place (one node more than now); seconds from the apply to each step."""
    applied = time.time()
    sk.api_apply(spec(port, replicas, msg, **options))
    moments: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = replica_states(sk)
        now = time.time()
        if "pending" not in moments and any(state != "RUNNING" for state in states):
            moments["pending"] = now
        asked = event_after(sk, "NodeAdded", applied)
        if asked is not None:
            moments.setdefault("node_asked", asked)
        if "node_alive" not in moments and running_workers(sk) >= replicas:
            moments["node_alive"] = now
        if states.count("RUNNING") >= replicas and len(states) == replicas:
            moments["replica_running"] = now
            break
        time.sleep(POLL_S)
    else:
        raise AssertionError(f"{replicas} replicas not RUNNING after {timeout:g} s: {moments}, {replica_states(sk)}")
    return {
        f"{step}_s": round(moments[step] - applied, 2)
        for step in ("pending", "node_asked", "node_alive", "replica_running")
        if step in moments
    }


def scale_down(
    sk: Servekeeper, port: int, replicas: int, msg: str, timeout: float = 240, **options: Any
) -> dict[str, float]:
    """Apply `replicas` in place (one node fewer needed); seconds from the apply to Ray's release."""
    applied = time.time()
    sk.api_apply(spec(port, replicas, msg, **options))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        released = event_after(sk, "NodeRemoved", applied)
        if released is not None and running_workers(sk) == replicas:
            return {"node_released_s": round(released - applied, 2)}
        time.sleep(POLL_S)
    raise AssertionError(f"no node released {timeout:g} s after the change to {replicas} replica(s)")


def run(rounds: int, idle_seconds: float, clients: int) -> dict[str, Any]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    port = free_port()
    ups: list[dict[str, float]] = []
    downs: list[dict[str, float]] = []
    try:
        sk.up()
        sk.apply(spec(port, 1, idle_seconds=idle_seconds))
        assert sk.wait(NAME, timeout=300) == 0, sk.cli("events", NAME).stdout[-3000:]
        with Load(f"http://127.0.0.1:{port}/", clients=clients) as load:
            for _ in range(rounds):
                ups.append(scale_up(sk, port, 2, "v1", idle_seconds=idle_seconds))
                downs.append(scale_down(sk, port, 1, "v1", idle_seconds=idle_seconds))
            result = load.stop()
    finally:
        leftovers = sk.down_and_check_nothing_left()
    medians = {key: statistics.median(r[key] for r in ups + downs if key in r) for key in {*ups[0], *downs[0]}}
    return {
        "rounds": rounds,
        "idle_timeout_s": idle_seconds,
        "clients": clients,
        "up": ups,
        "down": downs,
        "median": dict(sorted(medians.items())),
        "defaults_for_comparison": DEFAULTS,
        "requests_ok": result.ok,
        "failed": result.failed,
        "failures_by_kind": dict(result.failures),
        "leftover_processes": leftovers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "node_autoscaling.json")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    report = {"benchmark": "node_autoscaling", "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    report.update(run(args.rounds, args.idle_seconds, args.clients))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
