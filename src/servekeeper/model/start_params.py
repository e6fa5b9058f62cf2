"""A node's `rayStartParams`: which are servekeeper's own, and the custom resources one gives."""

from __future__ import annotations

import json
import re

START_PARAM_KEY = re.compile(r"^[a-z][a-z0-9-]*$")

# Ports, addresses and directories of a cluster are servekeeper's: it allocates them so that
# clusters side by side never collide, and records them so that it can re-adopt them.
OWNED_START_PARAMS = frozenset(
    {
        "head",
        "block",
        "address",
        "port",
        "node-ip-address",
        "dashboard-host",
        "dashboard-port",
        "ray-client-server-port",
        "min-worker-port",
        "max-worker-port",
        "worker-port-list",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "runtime-env-agent-port",
        "temp-dir",
        "num-cpus",
        "num-gpus",  # numGpus
        "memory",  # memory
        "disable-usage-stats",
        "include-dashboard",
        "gcs-server-port",
        "redis-password",
        "redis-username",
    }
)

StartParamValue = str | int | float | bool


def custom_resources(params: dict[str, StartParamValue]) -> dict[str, float]:
    """The custom resources `rayStartParams.resources` gives a node: a JSON object of names to
    numbers (KubeRay's shell-escaped forms, `{\\"acc\\": 1}` or a quoted JSON string, accepted)."""
    given = params.get("resources")
    if given is None or (isinstance(given, str) and not given.strip()):
        return {}
    if isinstance(given, str):
        for candidate in (given, given.replace('\\"', '"')):
            try:
                value = json.loads(candidate)
                value = json.loads(value) if isinstance(value, str) else value
            except ValueError:
                continue
            if isinstance(value, dict) and all(_is_amount(amount) for amount in value.values()):
                return {str(name): amount for name, amount in value.items()}
    raise ValueError(
        f'rayStartParams resources must be a JSON object of names to numbers, like {{"acc": 1}}: {given!r}'
    )


def _is_amount(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def check_start_params(params: dict[str, StartParamValue]) -> dict[str, StartParamValue]:
    custom_resources(params)  # refused at apply, not by `ray start` on a node
    for key, value in params.items():
        if not START_PARAM_KEY.match(key):
            raise ValueError(f"rayStartParams key {key!r} must look like 'object-store-memory'")
        if key in OWNED_START_PARAMS:
            raise ValueError(f"rayStartParams {key!r} is set by servekeeper and cannot be overridden")
        if isinstance(value, str) and any(ch in value for ch in "\x00\n\r"):
            raise ValueError(f"rayStartParams {key!r} contains a control character")
    return params
