#!/usr/bin/env bash
# The test command: install what is needed, then run every check and test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
bash scripts/check.sh "$@"
