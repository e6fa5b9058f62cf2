"""The push, stage by stage, against processes faked by reading back their own xDS files. No Envoy here."""

from __future__ import annotations

from pathlib import Path

import pytest

from servekeeper.dataplane import Backend, DataPlaneError, Endpoint, ServiceRoute
from servekeeper.dataplane.admin import ProcessConfig
from servekeeper.dataplane.push import ConfigPusher
from servekeeper.dataplane.xds import XdsFiles

OLD = Backend("hello-g1", (Endpoint("127.0.0.1", 9001),))
NEW = Backend("hello-g2", (Endpoint("127.0.0.1", 9002),))


def route(*backends: Backend) -> ServiceRoute:
    return ServiceRoute("hello", 8000, backends, {backends[-1].name: 100})


def applied(files: XdsFiles) -> ProcessConfig:
    """A process that has applied exactly what its files hold."""
    cds_version, clusters = XdsFiles.read(files.cds)
    lds_version, listeners = XdsFiles.read(files.lds)
    return ProcessConfig(
        cds_version=cds_version,
        lds_version=lds_version,
        active_clusters=frozenset(clusters),
        active_listeners=frozenset(listeners),
        route_versions={name: str(XdsFiles.read(files.route_path(name))[0]) for name in files.route_names()},
    )


class FakeProcesses:
    """Every read answers with the files as they are; records the clusters each read saw."""

    def __init__(self, tmp_path: Path, count: int = 2) -> None:
        self.files = {i: XdsFiles(tmp_path / f"envoy-{i}") for i in range(count)}
        self.seen_clusters: list[frozenset[str]] = []
        self.silent: set[int] = set()

    async def read(self, index: int) -> ProcessConfig:
        if index in self.silent:
            raise DataPlaneError("not running")
        config = applied(self.files[index])
        self.seen_clusters.append(config.active_clusters)
        return config

    def pusher(self, tmp_path: Path, ack_timeout_s: float = 1.0) -> ConfigPusher:
        return ConfigPusher(tmp_path, self.files, self.read, ack_timeout_s)


async def test_push_makes_before_it_breaks(tmp_path: Path) -> None:
    fake = FakeProcesses(tmp_path)
    pusher = fake.pusher(tmp_path)
    await pusher.push({"hello": route(OLD)})
    old_clusters = fake.seen_clusters[-1]
    fake.seen_clusters.clear()

    await pusher.push({"hello": route(NEW)})

    new_clusters = fake.seen_clusters[-1]
    assert old_clusters and new_clusters and not old_clusters & new_clusters
    # Between the two, every process had the old and the new clusters side by side.
    assert old_clusters | new_clusters in fake.seen_clusters
    for index in fake.files:
        assert pusher.in_step(index, applied(fake.files[index]))


async def test_push_removes_route_files_of_a_removed_service(tmp_path: Path) -> None:
    fake = FakeProcesses(tmp_path, count=1)
    pusher = fake.pusher(tmp_path)
    await pusher.push({"hello": route(OLD)})
    assert fake.files[0].route_names()

    await pusher.push({})

    assert fake.files[0].route_names() == []
    assert fake.seen_clusters[-1] == frozenset()


async def test_desired_routes_outlive_the_pusher_and_versions_never_repeat(tmp_path: Path) -> None:
    fake = FakeProcesses(tmp_path)
    await fake.pusher(tmp_path).push({"hello": route(OLD)})
    highest = max(files.max_version() for files in fake.files.values())

    later = fake.pusher(tmp_path)
    later.load_desired()

    assert later.routes == {"hello": route(OLD)}
    later.write_final(0, later.routes)
    assert fake.files[0].max_version() > highest
    later.forget()
    assert later.routes == {}
    assert not (tmp_path / "desired.json").exists()


async def test_a_process_that_never_acknowledges_fails_the_stage(tmp_path: Path) -> None:
    fake = FakeProcesses(tmp_path)
    fake.silent.add(1)
    pusher = fake.pusher(tmp_path, ack_timeout_s=0.1)

    with pytest.raises(DataPlaneError, match=r"clusters: Envoy processes \[1\] did not acknowledge.*not running"):
        await pusher.push({"hello": route(OLD)})
    # Intent was written first: a later pusher finishes this push.
    assert "hello" in (tmp_path / "desired.json").read_text()
