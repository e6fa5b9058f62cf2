"""The live rollout view on a real upgrade: `apply -f v2 --watch` in tmux redraws in place and
ends on a screen listing each phase in order, with exit code 0; `rollout status --watch` piped
prints plain lines, one per phase change. (The upgrade is shared with test_dashboard.py.)"""

from __future__ import annotations

import pytest

from tests.integration.observed_upgrade import Observed

pytestmark = pytest.mark.ray

PHASE_LINE = "phase  "


def _in_order(text: str, phases: list[str]) -> list[int]:
    positions = [text.find(phase) for phase in phases]
    assert all(p >= 0 for p in positions), f"missing phases {phases} in:\n{text}"
    return positions


def test_live_view_in_a_terminal_shows_each_phase_in_order(observed_upgrade: Observed) -> None:
    screen = observed_upgrade.final_screen
    print(screen)
    assert observed_upgrade.live_exit == 0, screen
    assert "service/hello configured (generation 2)" in screen
    # the final frame: the phase history table, oldest first
    history = screen[screen.index("PHASE") :]
    positions = _in_order(history, ["starting head", "draining old cluster", "rolled out"])
    assert positions == sorted(positions)
    deploy = [history.find(p) for p in ("submitting config", "config submitted", "deploying apps")]
    assert any(positions[0] < p < positions[1] for p in deploy if p >= 0), history
    assert f"phase  rolled out: generation 2 on {observed_upgrade.active_after}" in screen
    # in place: every look at the screen shows one frame (one phase line), never a scroll of them
    live = [s for s in observed_upgrade.screens if PHASE_LINE in s]
    assert live and all(s.count(PHASE_LINE) == 1 for s in live)
    current = [s.split(PHASE_LINE, 1)[1].split(":")[0].strip() for s in live]
    assert "starting head" in current and "draining old cluster" in current
    assert current.index("starting head") < current.index("draining old cluster")
    draining = next(s for s in live if "phase  draining old cluster" in s)
    assert f"{observed_upgrade.active_before} (" in draining and "in flight)" in draining


def test_piped_rollout_status_prints_plain_lines(observed_upgrade: Observed) -> None:
    lines = observed_upgrade.piped_lines
    print("\n".join(lines))
    assert observed_upgrade.piped_exit == 0
    assert lines and all(line.startswith("[") and "\x1b" not in line for line in lines)
    phases = [line.split("] ", 1)[1].split(":")[0] for line in lines]
    assert all(a != b for a, b in zip(phases, phases[1:], strict=False)), "one line per phase change"
    assert phases[-1] == "rolled out"
    assert phases.index("draining old cluster") < phases.index("rolled out")
