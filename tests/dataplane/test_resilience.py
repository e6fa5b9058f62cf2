"""Failures: dead endpoints, a killed Envoy process, a killed daemon; and where admin listens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from servekeeper.dataplane import Backend, DataPlane
from servekeeper.dataplane.names import CLUSTER_TYPE
from tests.dataplane.conftest import PlaneFactory, UpstreamFactory, admin_get, free_port, process_configs, route


async def test_retry_on_refused_connection_then_fast_503(make_plane: PlaneFactory, upstream: UpstreamFactory) -> None:
    a1, a2 = await upstream("a1"), await upstream("a2")
    plane = await make_plane(processes=1)
    port = free_port()
    await plane.set_route(route("svc", port, [Backend("a", (a1.endpoint, a2.endpoint))], {"a": 100}))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert {(await client.get("/")).text for _ in range(10)} == {"a1", "a2"}
        # a1 now refuses connections; health checks have not noticed yet: retries on the other host.
        await a1.stop()
        answers = [await client.get("/") for _ in range(20)]
        assert [r.text for r in answers] == ["a2"] * 20
        retried = (await plane.backend_stats())["a"]
        assert retried.rq_2xx >= 30

        await a2.stop()
        # Three failed health checks (a refused connect fails one at once) eject both endpoints.
        deadline = time.perf_counter() + 8
        while time.perf_counter() < deadline:
            probe = await client.get("/")
            if probe.status_code == 503 and "no healthy upstream" in probe.text:
                break
            await asyncio.sleep(0.25)
        started = time.perf_counter()
        answer = await client.get("/")
        assert answer.status_code == 503 and time.perf_counter() - started < 1


async def test_killed_envoy_is_restarted_and_the_other_keeps_serving(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    a = await upstream("a")
    plane = await make_plane()
    port = free_port()
    await plane.set_route(route("svc", port, [Backend("a", (a.endpoint,))], {"a": 100}))
    stop = asyncio.Event()
    supervisor = asyncio.create_task(plane.supervise(stop))
    url = f"http://127.0.0.1:{port}/?sleep=0.005"
    failures: list[float] = []
    successes = 0
    running = True

    async def keepalive_worker() -> None:
        nonlocal successes
        async with httpx.AsyncClient(timeout=5) as client:
            while running:
                try:
                    (await client.get(url)).raise_for_status()
                    successes += 1
                except httpx.HTTPError:
                    failures.append(time.monotonic())

    async def new_connection_worker() -> None:
        nonlocal successes
        while running:
            try:
                async with httpx.AsyncClient(timeout=5) as client:
                    (await client.get(url)).raise_for_status()
                successes += 1
            except httpx.HTTPError:
                failures.append(time.monotonic())

    workers = [asyncio.create_task(keepalive_worker()) for _ in range(3)]
    workers += [asyncio.create_task(new_connection_worker()) for _ in range(2)]
    try:
        await asyncio.sleep(1)
        victim = plane.processes()[0]
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        # Restarted (no backoff for a first death) and serving the current routes within a second.
        while True:
            current = plane.processes()[0]
            if current.pid != victim.pid:
                with contextlib.suppress(Exception):
                    if (await admin_get(current.admin_port, "/ready")).strip() == "LIVE":
                        break
            assert time.monotonic() - killed_at < 1, "envoy-0 not back within 1 s"
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.5)
    finally:
        running = False
        await asyncio.gather(*workers)
        stop.set()
        await supervisor
    print(f"kill -9 of one Envoy: {len(failures)} failed, {successes} succeeded")
    # Only what the killed process had in flight may fail: at most one request per worker.
    assert len(failures) <= len(workers), failures
    assert all(killed_at <= moment < killed_at + 1 for moment in failures)
    assert successes > 100
    configs = await process_configs(plane)
    assert all(c.route_weights == {"http-svc": {"http-a": 100}} for c in configs)


async def test_envoy_outlives_a_killed_daemon_and_is_adopted(
    make_plane: PlaneFactory, upstream: UpstreamFactory, tmp_path: Path
) -> None:
    a = await upstream("a")
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.dataplane.adopt_child", str(tmp_path), str(port), str(a.port)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)  # type: ignore[union-attr]
        assert line.strip() == b"ready"
    finally:
        child.kill()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "a"

    plane = await make_plane(start=False)
    await plane.start_or_adopt()
    recorded = {p["pid"] for p in json.loads((tmp_path / "dataplane" / "processes.json").read_text())}
    assert {info.pid for info in plane.processes()} == recorded
    assert (await plane.routes())["svc"].weights == {"a": 100}
    assert await plane.healthy()


async def test_admin_listens_on_loopback_only(make_plane: PlaneFactory) -> None:
    plane: DataPlane = await make_plane()
    for info in plane.processes():
        listening = [c for c in psutil.Process(info.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening
        assert any(c.laddr.port == info.admin_port for c in listening)


async def test_supervisor_resyncs_a_process_that_rejected_its_files(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    a = await upstream("a")
    plane = await make_plane()
    port = free_port()
    await plane.set_route(route("svc", port, [Backend("a", (a.endpoint,))], {"a": 100}))
    # Someone (a bug, a hand edit) gave envoy-1 a file it rejects: its files and state now differ.
    cds = plane.dir / "envoy-1" / "cds.json"
    bogus = {
        "version_info": "999999",
        "resources": [{"@type": CLUSTER_TYPE, "name": "http-a", "connect_timeout": "-5s"}],
    }
    tmp = cds.with_name("bogus.tmp")
    tmp.write_text(json.dumps(bogus))
    os.replace(tmp, cds)
    stop = asyncio.Event()
    supervisor = asyncio.create_task(plane.supervise(stop, sync_interval_s=0.2))
    try:
        deadline = time.monotonic() + 5
        while json.loads(cds.read_text())["version_info"] == "999999":
            assert time.monotonic() < deadline, "envoy-1 was not re-synced"
            await asyncio.sleep(0.05)
        applied = (await process_configs(plane))[1]
        assert applied.cds_version == json.loads(cds.read_text())["version_info"]
        assert applied.active_clusters == {"http-a"}
    finally:
        stop.set()
        await supervisor
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "a"


async def test_a_hung_envoy_is_replaced(make_plane: PlaneFactory, upstream: UpstreamFactory) -> None:
    """Alive but silent (SIGSTOP): it can be neither read nor re-synced, and drains would wait on
    it forever; the supervisor kills it and starts another on the same routes."""
    a = await upstream("a")
    plane = await make_plane()
    port = free_port()
    await plane.set_route(route("svc", port, [Backend("a", (a.endpoint,))], {"a": 100}))
    stop = asyncio.Event()
    supervisor = asyncio.create_task(plane.supervise(stop, sync_interval_s=0.2))
    try:
        victim = plane.processes()[0]
        os.kill(victim.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 15
        while plane.processes()[0].pid == victim.pid:
            assert time.monotonic() < deadline, "the hung envoy-0 was not replaced"
            await asyncio.sleep(0.1)
        replacement = plane.processes()[0]
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if (await admin_get(replacement.admin_port, "/ready")).strip() == "LIVE":
                    break
            await asyncio.sleep(0.1)
        assert (await plane.routes())["svc"].in_sync
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/")).text == "a"
    finally:
        stop.set()
        await supervisor
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.pid, signal.SIGKILL)


async def test_an_upload_its_upstream_stops_reading_fails_only_past_silent_upstream_seconds(
    make_plane: PlaneFactory, upstream: UpstreamFactory
) -> None:
    # TCP_USER_TIMEOUT ends requests on a silent host, and the kernel applies it as well to a
    # live peer whose window stays shut: an upload not read for 6 s fails at the default 4 s
    # and passes where the service allows 10 s.
    strict, lenient = await upstream("strict"), await upstream("lenient")
    plane = await make_plane(processes=1)
    strict_port, lenient_port = free_port(), free_port()
    await plane.set_route(route("strict", strict_port, [Backend("strict", (strict.endpoint,))], {"strict": 100}))
    lenient_route = route(
        "lenient", lenient_port, [Backend("lenient", (lenient.endpoint,))], {"lenient": 100}, silent_upstream_s=10
    )
    await plane.set_route(lenient_route)
    body = b"x" * (32 * 1024 * 1024)  # far more than the socket buffers on both sides hold
    async with httpx.AsyncClient(timeout=30) as http:
        started = time.monotonic()
        cut = await http.post(f"http://127.0.0.1:{strict_port}/slow-reader?stall=6", content=body)
        cut_after = time.monotonic() - started
        kept = await http.post(f"http://127.0.0.1:{lenient_port}/slow-reader?stall=6", content=body)
    assert cut.status_code == 503 and 3.5 < cut_after < 6, (cut.status_code, cut.text, cut_after)
    assert (kept.status_code, kept.text) == (200, str(len(body)))
