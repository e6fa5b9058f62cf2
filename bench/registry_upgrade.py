"""Model-registry upgrade: failed requests with and without the /router/ready probe, and the time
from apply to switch, under 32 concurrent clients calling several models through the ingress.

    .venv/bin/python -m bench.registry_upgrade [--clients 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.testing.harness import (
    MODELS,
    Servekeeper,
    free_port,
    model_urls,
    models_answer,
    registry_spec,
    wait_until,
)
from servekeeper.testing.load import Load

RESULTS = Path(__file__).parent / "results"


def run_case(probes: bool, clients: int) -> dict[str, Any]:
    """One upgrade of the registry under load, on a daemon of its own."""
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    port = free_port()
    leftovers: list[str] = []
    try:
        sk.up()
        sk.apply(registry_spec(port, probes=probes))
        assert sk.wait("registry") == 0
        report = upgrade_under_load(sk, port, probes, clients)
    finally:
        leftovers = sk.down_and_check_nothing_left()
    return {**report, "leftover_processes": leftovers}


def upgrade_under_load(sk: Servekeeper, port: int, probes: bool, clients: int) -> dict[str, Any]:
    """The registry service running on `sk` upgraded to v2 (a new cluster: more CPUs) under
    `clients` callers of every model (also what tests/integration/test_dynamic_apps.py runs, on
    its module's daemon, so this benchmark cannot rot)."""
    wait_until(lambda: models_answer(port), 120, "every model to answer")
    with Load(model_urls(port), clients=clients, post_share=0) as load:
        wait_until(lambda: load.result.ok > 50, 30, "load to start")
        applied = time.time()
        sk.apply(registry_spec(port, version="v2", cpus=2, probes=probes))
        assert sk.wait("registry") == 0
        wait_until(lambda: sum(n for b, n in load.result.bodies.items() if '"v2"' in b) > 100, 90, "v2")
    with sk.db() as db:
        switched = db.execute(
            "SELECT time FROM events WHERE reason = 'TrafficSwitched' ORDER BY id DESC LIMIT 1"
        ).fetchone()[0]
    bodies = load.result.bodies
    return {
        "probe": probes,
        "requests_ok": load.result.ok,
        "failed": load.result.failed,
        "failures_by_kind": dict(load.result.failures),
        "apply_to_switch_s": round(switched - applied, 2),
        "models_answering_v2": [m for m in MODELS if any(f'"{m}"' in b and '"v2"' in b for b in bodies)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "registry_upgrade.json")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    report = {
        "benchmark": "registry_upgrade",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "clients": args.clients,
        "with_probe": run_case(True, args.clients),
        "without_probe": run_case(False, args.clients),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
