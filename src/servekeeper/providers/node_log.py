"""What a node's log says of its exit: its last few lines, bounded, for an event's message (the
cause an operator needs when a node exits: `WorkerRestarting`, `RolloutFailed HeadDied`).

A node's log is the app's and Ray's free text: before any of it goes into an event, every value
of the cluster's env (secrets resolved into it among them) is blanked out."""

from __future__ import annotations

from collections.abc import Collection

from servekeeper.model.cluster_spec import RayClusterConfigSpec

LAST_LINES = 5
LAST_CHARS = 600
TAIL_BYTES = 4096  # read from the end of a log: enough for LAST_LINES lines of LAST_CHARS
# Env values shorter than this are left in the text ("1", "true", a port): blanking them would
# garble the message, and a credential is longer.
MIN_HIDDEN_CHARS = 6
HIDDEN = "***"


def env_values(cluster_spec_json: str) -> list[str]:
    """Every value of the env of the cluster's head and worker groups."""
    config = RayClusterConfigSpec.model_validate_json(cluster_spec_json)
    groups = [config.head, *config.workerGroups]
    return [value for group in groups for value in group.env.values()]


def last_lines(text: str, lines: int = LAST_LINES, chars: int = LAST_CHARS, hide: Collection[str] = ()) -> str:
    """The last `lines` non-empty lines of `text`, joined by " | ", cut to their last `chars`
    characters; "empty log" when there are none. Each of `hide` (of MIN_HIDDEN_CHARS or more)
    is blanked out first."""
    for value in sorted({value for value in hide if len(value) >= MIN_HIDDEN_CHARS}, key=len, reverse=True):
        text = text.replace(value, HIDDEN)
    meaningful = [line.strip() for line in text.splitlines() if line.strip()]
    joined = " | ".join(meaningful[-lines:])
    if len(joined) > chars:
        joined = "..." + joined[-(chars - 3) :]
    return joined or "empty log"
