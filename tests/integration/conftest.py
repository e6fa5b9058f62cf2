from __future__ import annotations

import pytest

from tests.integration.observed_upgrade import Observed, run_observed_upgrade


@pytest.fixture(scope="session")
def observed_upgrade(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    """One upgrade watched by the live view, a piped watcher and the dashboard in a browser;
    the daemon is down again before any test looks at the records (test_live_view.py and
    test_dashboard.py share it)."""
    return run_observed_upgrade(tmp_path_factory.mktemp("observed-upgrade"))
