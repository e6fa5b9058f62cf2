"""Control-plane cost and scale.

real: the controller's CPU and RSS, idle and during upgrades, with 1 and 4 real services;
sim:  reconcile cost per tick per service on the simulated provider with a fake clock, for
      10, 100, 1,000 and 10,000 services, and the memory they hold (plotted).

  .venv/bin/python -m bench.control_plane [--sizes 10 100 1000 10000] [--real-services 1 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil

from bench.loadgen import exit_cleanly_on_sigterm
from servekeeper.model.spec import parse_spec
from servekeeper.testing.harness import Servekeeper, free_port, hello_spec
from servekeeper.testing.sim import SimWorld

RESULTS = Path(__file__).parent / "results"


def sim_scale(size: int, ticks: int) -> dict[str, Any]:
    """`size` services, each rolled out, then `ticks` steady-state reconcile passes over all."""
    tracemalloc.start()
    worlds = []
    for index in range(size):
        spec = parse_spec(hello_spec(f"svc-{index}", 8000, ready_delay_s=0))
        world = SimWorld(spec)
        world.run_for(12, step=1.0)  # first rollout: create, submit, switch
        worlds.append(world)
    gc.collect()
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # Half of the services are mid-upgrade, so the cost covers both steady and busy ticks.
    for world in worlds[::2]:
        world.apply(parse_spec(hello_spec(world.service.name, 8000, head_cpus=2)))
    started = time.perf_counter()
    for _ in range(ticks):
        for world in worlds:
            world.tick()
            world.advance(0.5)
    elapsed = time.perf_counter() - started
    assert all(w.condition("Ready") for w in worlds)
    return {
        "services": size,
        "ticks_per_service": ticks,
        "us_per_tick_per_service": round(elapsed / (ticks * size) * 1e6, 1),
        "memory_bytes_per_service": round(memory / size),
        "memory_mb_total": round(memory / 1e6, 1),
    }


def controller_usage(pid: int, seconds: float) -> dict[str, float]:
    process = psutil.Process(pid)
    before = process.cpu_times()
    started = time.monotonic()
    time.sleep(seconds)
    after = process.cpu_times()
    cpu = (after.user + after.system - before.user - before.system) / (time.monotonic() - started)
    return {"cpu_percent_of_a_core": round(cpu * 100, 2), "rss_mb": round(process.memory_info().rss / 1e6, 1)}


def real_cost(services: int, idle_seconds: float) -> dict[str, Any]:
    sk = Servekeeper(Path(tempfile.mkdtemp(prefix="skbench-")), Path(tempfile.mkdtemp()))
    ports = [free_port() for _ in range(services)]
    try:
        sk.up()
        for index, port in enumerate(ports):
            sk.apply(hello_spec(f"cost-{index}", port, ready_delay_s=0))
        for index in range(services):
            assert sk.wait(f"cost-{index}", timeout=600) == 0
        time.sleep(3)
        pid = sk.controller_pid()
        idle = controller_usage(pid, idle_seconds)
        process = psutil.Process(pid)
        before = process.cpu_times()
        started = time.monotonic()
        for index, port in enumerate(ports):
            sk.apply(hello_spec(f"cost-{index}", port, ready_delay_s=0, head_cpus=2))
        peak_rss = 0.0
        for index in range(services):
            assert sk.wait(f"cost-{index}", timeout=900) == 0
            peak_rss = max(peak_rss, process.memory_info().rss / 1e6)
        after = process.cpu_times()
        window = time.monotonic() - started
        upgrading = {
            "cpu_percent_of_a_core": round((after.user + after.system - before.user - before.system) / window * 100, 2),
            "rss_mb": round(max(peak_rss, process.memory_info().rss / 1e6), 1),
            "seconds": round(window, 1),
        }
        return {"services": services, "idle": idle, "during_upgrades": upgrading}
    finally:
        sk.down_and_check_nothing_left()


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["services"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [r["us_per_tick_per_service"] for r in rows], marker="o")
    left.set_xscale("log")
    left.set_ylim(bottom=0)
    left.set_xlabel("services")
    left.set_ylabel("µs per tick per service")
    left.set_title("reconcile cost (simulated provider)")
    right.plot(sizes, [r["memory_mb_total"] for r in rows], marker="o", color="tab:orange")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("services")
    right.set_ylabel("MB held")
    right.set_title("memory")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10, 100, 1000, 10000])
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--real-services", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--idle-seconds", type=float, default=20)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sim = [sim_scale(size, args.ticks) for size in args.sizes]
    for row in sim:
        print(row, flush=True)
    if sim:
        plot(sim, args.out_dir / "control_plane_scale.png")
    real = [real_cost(n, args.idle_seconds) for n in args.real_services]
    for row in real:
        print(row, flush=True)
    report = {
        "benchmark": "control_plane",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sim_scale": sim,
        "real_controller": real,
        "plot": "bench/results/control_plane_scale.png",
    }
    (args.out_dir / "control_plane.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
