"""WebSocket, server-sent events and gRPC through the Envoy ingress on real Ray clusters (the app
is `examples/protocols`). Envoy's own failures under load (a killed Envoy process restarted with
its route, a killed daemon's Envoys adopted) are tests/dataplane/test_resilience.py's; a daemon
killed under load on real Ray is test_crash_matrix.py's and test_standby.py's."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any

import grpc
import httpx
import pytest
import yaml
from ray.serve.generated import serve_pb2, serve_pb2_grpc
from websockets.sync.client import ClientConnection, connect

from servekeeper.testing.harness import REPO, Servekeeper, free_port, pid_alive, wait_until

pytestmark = pytest.mark.ray

PROTOCOLS_EXAMPLE = REPO / "examples" / "protocols"
NO_PROXY_GRPC = [("grpc.enable_http_proxy", 0)]
GRPC_THREADS = 4


def protocols_spec(
    name: str, port: int, version: str, head_cpus: float, grpc_port: int | None = None
) -> dict[str, Any]:
    document = yaml.safe_load((PROTOCOLS_EXAMPLE / "service.yaml").read_text())
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec["ingress"] = {"port": port} if grpc_port is None else {"port": port, "grpcPort": grpc_port}
    spec["rayClusterConfig"]["workingDir"] = str(PROTOCOLS_EXAMPLE / "app")
    spec["rayClusterConfig"]["head"]["numCpus"] = head_cpus
    spec["serveConfig"]["applications"][0]["args"]["version"] = version
    spec["rayClusterDeletionDelaySeconds"] = 40
    spec["readinessTimeoutSeconds"] = 300
    return dict(document)


def _cluster_roles(sk: Servekeeper) -> dict[str, str]:
    return {c["name"]: c["role"] for c in sk.clusters()}


# -- WebSocket and streaming ----------------------------------------------------------------------


def _ws_connect(url: str) -> ClientConnection:
    return connect(url, proxy=None, open_timeout=10, compression=None)


class HeldSocket:
    """One WebSocket that echoes a numbered message every `period_s` in a thread of its own,
    recording (time, answer) or the error that ended it, until closed."""

    def __init__(self, url: str, period_s: float = 0.2) -> None:
        self.socket = _ws_connect(url)
        self.period_s = period_s
        self.answers: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            sent = f"m{index}"
            try:
                self.socket.send(sent)
                answer = self.socket.recv(timeout=10)
            except Exception as exc:  # recorded, checked by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            version, _, echoed = str(answer).partition(":")
            if echoed != sent:
                self.errors.append(f"sent {sent!r}, got {answer!r}")
                return
            self.answers.append((time.monotonic(), version))
            index += 1
            self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self.socket.close()


def _first_chunk_timing(url: str) -> tuple[float, float, str]:
    """(time to first chunk, time to the end of the stream, body), over a new connection."""
    first: float | None = None
    body = b""
    with httpx.Client(timeout=10, trust_env=False) as client:
        started = time.perf_counter()
        with client.stream("GET", url) as response:
            assert response.status_code == 200, response.status_code
            assert response.headers["content-type"].startswith("text/event-stream")
            for chunk in response.iter_raw():
                if first is None:
                    first = time.perf_counter() - started
                body += chunk
        total = time.perf_counter() - started
    assert first is not None
    return first, total, body.decode()


# -- gRPC -----------------------------------------------------------------------------------------


class GrpcLoad:
    """Threads calling Method1 in a loop over a channel each; failures counted by status code."""

    def __init__(self, port: int, threads: int = 4) -> None:
        self.port = port
        self.ok: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.timeline: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> GrpcLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=15)

    def _run(self, index: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}", options=NO_PROXY_GRPC) as channel:
            stub = serve_pb2_grpc.UserDefinedServiceStub(channel)
            while not self._stop.is_set():
                name = f"t{index}"
                try:
                    answer = stub.Method1(serve_pb2.UserDefinedMessage(name=name), timeout=10)
                    version, _, echoed = answer.greeting.partition(":")
                    label = version if echoed == name else f"mismatch {answer.greeting!r}"
                except grpc.RpcError as exc:
                    label = f"status {exc.code().name}"
                with self._lock:
                    (self.ok if label in ("v1", "v2") else self.failures)[label] += 1
                    self.timeline.append((time.monotonic(), label))
                if label not in ("v1", "v2"):
                    time.sleep(0.01)


def _grpc_call(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=NO_PROXY_GRPC) as channel:
        answer = serve_pb2_grpc.UserDefinedServiceStub(channel).Method1(
            serve_pb2.UserDefinedMessage(name="probe"), timeout=10
        )
    return str(answer.greeting)


# -- One upgrade under every protocol -------------------------------------------------------------


def test_streaming_then_a_held_websocket_and_grpc_calls_across_one_upgrade_drop_nothing(sk: Servekeeper) -> None:
    """One upgrade for both: a WebSocket held across it and gRPC calls under load through it."""
    port, grpc_port = free_port(), free_port()
    sk.up()
    sk.apply(protocols_spec("proto", port, "v1", head_cpus=1, grpc_port=grpc_port))
    assert sk.wait("proto") == 0
    old = sk.clusters()[0]
    assert _grpc_call(grpc_port) == "v1:probe"
    direct_url = sk.get("proto")["activeCluster"]["serveUrl"]
    ingress_url = f"http://127.0.0.1:{port}"

    # Streaming: time to first chunk through Envoy vs straight to the cluster's Serve proxy,
    # alternated so that drift on the machine hits both alike.
    stream_path = "/stream?chunks=2&interval_s=1"
    _first_chunk_timing(ingress_url + stream_path)  # warm both paths (upstream connection, replica)
    _first_chunk_timing(direct_url + stream_path)
    through, direct = [], []
    for _ in range(5):
        for base, into in ((ingress_url, through), (direct_url, direct)):
            first, total, body = _first_chunk_timing(base + stream_path)
            assert body == "data: v1 token 0\n\ndata: v1 token 1\n\n", body
            assert first < total - 0.8, f"first chunk at {first:.3f}s of a {total:.3f}s stream: buffered"
            into.append(first)
    print(
        f"time to first chunk, median of 5: through the ingress {statistics.median(through) * 1000:.1f} ms, "
        f"direct {statistics.median(direct) * 1000:.1f} ms"
    )
    assert statistics.median(through) - statistics.median(direct) < 0.05, (through, direct)

    # WebSocket: one socket held across a cluster-shape upgrade, gRPC calls in a loop through it.
    held = HeldSocket(f"ws://127.0.0.1:{port}/ws")
    with GrpcLoad(grpc_port, threads=GRPC_THREADS) as grpc_load:
        try:
            wait_until(lambda: len(held.answers) >= 3 or held.errors, 10, "the held socket to echo")
            wait_until(lambda: grpc_load.ok["v1"] > 50, 30, "gRPC load to start")
            applied_at = time.monotonic()
            sk.apply(protocols_spec("proto", port, "v2", head_cpus=2, grpc_port=grpc_port))
            assert sk.wait("proto") == 0
            switched_at = time.monotonic()
            new_cluster = sk.get("proto")["activeCluster"]["name"]
            assert new_cluster != old["name"]

            with _ws_connect(f"ws://127.0.0.1:{port}/ws") as fresh:
                fresh.send("new")
                assert fresh.recv(timeout=10) == "v2:new"
            assert httpx.get(ingress_url + "/", trust_env=False, timeout=10).text == "v2"
            wait_until(lambda: grpc_load.ok["v2"] > 50, 30, "v2 gRPC answers")

            # The open socket keeps the old cluster draining well past the 2 s minimum drain.
            time.sleep(max(0.0, switched_at + 6 - time.monotonic()))
            assert _cluster_roles(sk).get(old["name"]) == "draining", sk.clusters()
            assert not held.errors, held.errors
        finally:
            held.close()
        closed_at = time.monotonic()
        wait_until(lambda: old["name"] not in _cluster_roles(sk), 10, "the old cluster to go once its socket closed")
        gone_after = time.monotonic() - closed_at
        # The old cluster drained (no call in flight) and was deleted with the gRPC load still running.
        calls_at_deletion = sum(grpc_load.ok.values())
        wait_until(lambda: sum(grpc_load.ok.values()) > calls_at_deletion + 50, 30, "gRPC calls after the deletion")
    print(f"gRPC across the upgrade: {dict(grpc_load.ok)} answered, failures {dict(grpc_load.failures)}")
    assert not grpc_load.failures, dict(grpc_load.failures)
    first_v2 = min(t for t, label in grpc_load.timeline if label == "v2")
    # The switch is atomic: after the first v2 only calls already in flight (one per thread) answer v1.
    assert sum(1 for t, label in grpc_load.timeline if label == "v1" and t > first_v2) <= GRPC_THREADS
    assert _grpc_call(grpc_port) == "v2:probe"
    print(
        f"held socket: {len(held.answers)} echoes over {closed_at - applied_at:.1f}s "
        f"(switch after {switched_at - applied_at:.1f}s); old cluster gone {gone_after:.1f}s after the close"
    )

    assert not held.errors, held.errors
    assert {version for _, version in held.answers} == {"v1"}
    assert max(t for t, _ in held.answers) > switched_at + 5  # it echoed past the switch, not just before
    assert "ClusterDrained" in sk.events("proto")
    wait_until(lambda: not pid_alive(old["head_pid"]), 30, "the old cluster's head to exit")
