"""The Envoy data plane: Envoy processes of servekeeper's own, driven by file-based xDS.

plane = DataPlane(state_dir)
await plane.start_or_adopt()
await plane.set_route(ServiceRoute("hello", 8000, (Backend("hello-g1", (Endpoint("127.0.0.1", 8100),)),),
                                   {"hello-g1": 100}))
"""

from servekeeper.dataplane.model import (
    Backend,
    BackendStats,
    DataPlaneError,
    RouteObservation,
    ServiceRoute,
)
from servekeeper.dataplane.plane import DataPlane
from servekeeper.dataplane.process import ProcessInfo
from servekeeper.model.endpoint import Endpoint  # part of the data plane's API (Backend holds them)

__all__ = [
    "Backend",
    "BackendStats",
    "DataPlane",
    "DataPlaneError",
    "Endpoint",
    "ProcessInfo",
    "RouteObservation",
    "ServiceRoute",
]
