#!/usr/bin/env bash
# Lint, architecture contracts, then the whole test suite (unit first, on 3.10 too, then real-Ray tests).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
ruff check src tests bench scripts
lint-imports
mypy  # --strict over src, configured in pyproject.toml
python scripts/size_report.py src  # a report, not a gate: README's map names what stays long and why
# The pure core and adapters on both cores (no shared process or port), then real Envoy (no Ray)
# alone: its timing-bound tests (a failover under 32 clients) must not share the cores.
pytest -q -n 2 tests/unit "$@"
pytest -q tests/dataplane "$@"
# The oldest Python we claim (requires-python >=3.10); setup.sh makes .venv310 or fails.
.venv310/bin/python -m pytest -q -n 2 tests/unit "$@"
pytest -q --durations=30 tests/integration "$@"
pytest -q --durations=30 tests/multihost "$@"  # a fleet of sshd hosts in network namespaces (root), real Ray over SSH
