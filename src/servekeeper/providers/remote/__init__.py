"""Code that runs on the hosts of a pool, not in servekeeper: shipped as text, run by the host's python."""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def node_agent_source() -> str:
    """The node agent's source (`node_agent.py`, package data), as sent to `python -c` on a host."""
    return files(__name__).joinpath("node_agent.py").read_text(encoding="utf-8")
