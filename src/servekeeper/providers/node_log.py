"""What a node's log says of its exit: its last few lines, bounded, for an event's message (the
cause an operator needs when a node exits: `WorkerRestarting`, `RolloutFailed HeadDied`)."""

from __future__ import annotations

LAST_LINES = 5
LAST_CHARS = 600
TAIL_BYTES = 4096  # read from the end of a log: enough for LAST_LINES lines of LAST_CHARS


def last_lines(text: str, lines: int = LAST_LINES, chars: int = LAST_CHARS) -> str:
    """The last `lines` non-empty lines of `text`, joined by " | ", cut to their last `chars`
    characters; "empty log" when there are none."""
    meaningful = [line.strip() for line in text.splitlines() if line.strip()]
    joined = " | ".join(meaningful[-lines:])
    if len(joined) > chars:
        joined = "..." + joined[-(chars - 3) :]
    return joined or "empty log"
