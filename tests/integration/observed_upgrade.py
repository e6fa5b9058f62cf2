"""One real cluster-shape upgrade of the hello service, watched three ways at once: the live view
in tmux (`apply -f v2 --watch` starts the upgrade), `rollout status --watch` piped (plain lines),
and the web dashboard in Debian's chromium through Playwright (logged in through the URL that
`servekeeper dashboard` prints). Everything is recorded, then the daemon goes down, so the
tests of test_live_view.py and test_dashboard.py only look at the records (one upgrade, one
set of Ray clusters, for both)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from servekeeper.testing.harness import REPO, Servekeeper, free_port, hello_spec, wait_until

ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TERMINAL = (150, 45)  # columns, rows of the tmux window


@dataclass
class Observed:
    # the dashboard
    login_url: str = ""
    dashboard: str = ""  # the dashboard's URL: the API's, then /ui/<secret path key>
    landed_url: str = ""
    cookie: dict[str, Any] = field(default_factory=dict)
    services_row: str = ""
    active_before: str = ""
    rows: list[tuple[float, list[tuple[str, str, int]]]] = field(default_factory=list)  # (t, [(name, role, %)])
    unauthenticated: dict[str, int] = field(default_factory=dict)  # what -> HTTP status
    screenshots: list[Path] = field(default_factory=list)
    chart_svgs: int = 0
    chart_lines: int = 0
    # the live view (tmux) and the piped watcher
    screens: list[str] = field(default_factory=list)
    final_screen: str = ""
    live_exit: int | None = None
    piped_lines: list[str] = field(default_factory=list)
    piped_exit: int | None = None
    active_after: str = ""
    seconds: float = 0.0


class Tmux:
    """A tmux server of this test's own (its own socket): never touches anyone else's."""

    def __init__(self) -> None:
        self.socket = f"sk-live-{os.getpid()}"

    def run(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout

    def start(self, command: str) -> None:
        columns, rows = TERMINAL
        self.run("new-session", "-d", "-s", "live", "-x", str(columns), "-y", str(rows), command)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "live")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


class TrickleLoad:
    """A few requests a second through the ingress, so the charts and in-flight counts have data."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                try:
                    client.get(self.url)
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

    def __enter__(self) -> TrickleLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


ROWS_JS = """() => Array.from(document.querySelectorAll('tr.cluster')).map(r =>
    [r.dataset.cluster, r.dataset.role, Number(r.querySelector('td.traffic').dataset.percent)])"""


def run_observed_upgrade(workdir: Path) -> Observed:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="skstate-"))
    sk = Servekeeper(state_dir, workdir)
    tmux = Tmux()
    observed = Observed()
    started = time.monotonic()
    try:
        sk.up()
        port = free_port()
        sk.apply(hello_spec("hello", port))
        assert sk.wait("hello") == 0
        observed.active_before = sk.api_get("hello")["activeCluster"]["name"]
        api = str(json.loads((state_dir / "api.json").read_text())["url"])
        observed.login_url = sk.cli("dashboard").stdout.strip()
        observed.dashboard = observed.login_url.split("/login?")[0]

        with sync_playwright() as playwright, TrickleLoad(f"http://127.0.0.1:{port}/"):
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(observed.login_url)
            observed.landed_url = page.url
            observed.cookie = next(c for c in context.cookies() if c["name"] == "servekeeper_session")
            observed.services_row = page.inner_text('tr[data-service="hello"]')
            observed.screenshots.append(_shot(page, "dashboard-services.png"))

            # Nothing without the session: a fresh browser, the spent login URL, plain HTTP.
            stranger = browser.new_context()
            strange_page = stranger.new_page()
            observed.unauthenticated["browser /ui"] = _status(strange_page.goto(f"{api}/ui"))
            observed.unauthenticated["spent login url"] = _status(strange_page.goto(observed.login_url))
            stranger.close()
            observed.unauthenticated["http /ui/KEY/services/hello"] = httpx.get(
                f"{observed.dashboard}/services/hello"
            ).status_code
            session = {"servekeeper_session": observed.cookie["value"]}
            observed.unauthenticated["api with the session cookie only"] = httpx.get(
                f"{api}/api/v1/services", cookies=session
            ).status_code

            page.goto(f"{observed.dashboard}/services/hello")
            page.wait_for_selector("tr.cluster")

            # The upgrade: the live view in tmux starts it; the piped watcher and the page follow.
            v2 = workdir / "hello-v2.yaml"
            v2.write_text(yaml.safe_dump(hello_spec("hello", port, head_cpus=2)))
            command = shlex.join(
                ["env", f"SERVEKEEPER_STATE_DIR={state_dir}", sys.executable, "-m", "servekeeper.cli"]
                + ["apply", "-f", str(v2), "--watch", "--timeout", "240"]
            )
            tmux.start(f"{command}; echo EXIT=$?; sleep 600")
            wait_until(lambda: sk.api_get("hello")["generation"] == 2, 30, "generation 2 to be stored")
            piped = subprocess.Popen(
                [sys.executable, "-m", "servekeeper.cli", "rollout", "status", "hello", "--watch", "--timeout", "240"],
                env=sk.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            shot_upgrading = False
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                screen = tmux.screen()
                observed.screens.append(screen)
                rows = [(str(n), str(r), int(p)) for n, r, p in page.evaluate(ROWS_JS)]
                observed.rows.append((time.monotonic() - started, rows))
                if not shot_upgrading and any(role == "pending" for _, role, _ in rows):
                    observed.screenshots.append(_shot(page, "dashboard-upgrading.png"))
                    shot_upgrading = True
                if "EXIT=" in screen:
                    break
                time.sleep(0.3)
            observed.final_screen = tmux.screen()
            observed.live_exit = _exit_code(observed.final_screen)
            output, _ = piped.communicate(timeout=60)
            observed.piped_lines = output.splitlines()
            observed.piped_exit = piped.returncode
            # The page has followed the switch; the charts have samples of both clusters.
            time.sleep(4)
            observed.rows.append(
                (time.monotonic() - started, [(str(n), str(r), int(p)) for n, r, p in page.evaluate(ROWS_JS)])
            )
            page.wait_for_selector("#charts svg")
            observed.chart_svgs = page.locator("#charts svg").count()
            observed.chart_lines = page.locator("#charts polyline").count()
            observed.screenshots.append(_shot(page, "dashboard-rolled-out.png"))
            browser.close()
        observed.active_after = sk.api_get("hello")["activeCluster"]["name"]
        _save_text("live-view-screen.txt", observed.final_screen)
        _save_text("rollout-status-piped.txt", "\n".join(observed.piped_lines))
    finally:
        tmux.kill()
        observed.seconds = time.monotonic() - started
        leftovers = sk.down_and_check_nothing_left()
        assert not leftovers, f"processes left behind: {leftovers}"
    return observed


def _shot(page: Any, name: str) -> Path:
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def _status(response: Any) -> int:
    return int(response.status) if response is not None else -1


def _exit_code(screen: str) -> int | None:
    for line in screen.splitlines():
        if line.startswith("EXIT="):
            return int(line.removeprefix("EXIT=").strip())
    return None


def _save_text(name: str, text: str) -> None:
    (ARTIFACTS / name).write_text(text)
    print(f"artifact: {ARTIFACTS / name}")
