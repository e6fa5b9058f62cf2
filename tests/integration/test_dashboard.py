"""The web dashboard in a real browser (Debian's chromium through Playwright) during a real
upgrade: log in through the URL `servekeeper dashboard` prints, see the service and its active
cluster, watch the pending cluster's traffic go from 0 to 100; nothing without the session.
Screenshots go to tests/artifacts/. (The upgrade is shared with test_live_view.py.)"""

from __future__ import annotations

import pytest

from tests.integration.observed_upgrade import Observed

pytestmark = pytest.mark.ray


def test_login_url_gives_a_session_cookie_and_leaves_no_secret_in_the_url(observed_upgrade: Observed) -> None:
    # Under the daemon's secret path key, which is also the cookie's Path: browsers send a cookie
    # to every port of 127.0.0.1, so a plain /ui would reach a server on another port too.
    dashboard = observed_upgrade.dashboard
    assert observed_upgrade.login_url.startswith(f"{dashboard}/login?code=")
    key = dashboard.split("/ui/")[1]
    assert len(key) >= 22 and "/" not in key
    assert observed_upgrade.landed_url.endswith(f"/ui/{key}") and "code=" not in observed_upgrade.landed_url
    cookie = observed_upgrade.cookie
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == f"/ui/{key}"
    assert observed_upgrade.active_before in observed_upgrade.services_row


def test_without_the_session_everything_is_401(observed_upgrade: Observed) -> None:
    assert observed_upgrade.unauthenticated == {
        "browser /ui": 401,
        "spent login url": 401,
        "http /ui/KEY/services/hello": 401,
        "api with the session cookie only": 401,
    }


def test_traffic_column_moves_from_0_to_100_on_the_pending_cluster(observed_upgrade: Observed) -> None:
    before, after = observed_upgrade.active_before, observed_upgrade.active_after
    assert before != after
    seen: dict[str, list[tuple[str, int]]] = {}
    for _, rows in observed_upgrade.rows:
        for name, role, percent in rows:
            if not seen.get(name) or seen[name][-1] != (role, percent):
                seen.setdefault(name, []).append((role, percent))
    print(seen)
    assert seen[after][0] == ("pending", 0)
    assert seen[after][-1] == ("active", 100)
    assert seen[before][0] == ("active", 100)
    assert any(role in ("draining", "deleting") and percent == 0 for role, percent in seen[before])
    assert before not in dict((n, r) for n, r, _ in observed_upgrade.rows[-1][1])  # deleted at the end


def test_charts_and_screenshots(observed_upgrade: Observed) -> None:
    assert observed_upgrade.chart_svgs == 3
    assert observed_upgrade.chart_lines >= 3  # request rate, errors and p99 of at least one cluster
    for path in observed_upgrade.screenshots:
        assert path.exists() and path.stat().st_size > 10_000
        print(f"screenshot: {path}")
    print(f"the observed upgrade took {observed_upgrade.seconds:.0f}s")
