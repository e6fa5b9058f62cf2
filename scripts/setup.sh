#!/usr/bin/env bash
# Create .venv (if missing) and install servekeeper with its pinned dependencies and test tools.
# With --tests, also what only the test suite needs: Debian's tmux and chromium, and .venv310
# (the same on Python 3.10, the oldest version we claim) for the unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${1:-}" != "--tests" ]; then
  if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
  fi
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test,bench]"
  exit 0
fi

# Debian packages the observability tests drive: tmux (the live rollout view on a terminal) and
# chromium (the web dashboard in a real browser, through Playwright; never `playwright install`);
# openssh-server, whose sshd runs on each host of the multihost tests' fleet (tests/fleet.py); and
# redis-server, the Redis servekeeper runs for GCS fault tolerance (and the tests' own Redis).
missing=()
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
[ -x /usr/bin/redis-server ] || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup.sh: missing Debian packages: ${missing[*]} (run as root, or: sudo apt-get install -y ${missing[*]})" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test,bench]"

# Python 3.10: pyenv's build first, else one on PATH. No 3.10 is a failure, not a skip:
# a green CI without it would claim a version it never ran.
PYTHON310=${PYTHON310:-/root/.pyenv/versions/3.10.13/bin/python3.10}
if [ ! -x "$PYTHON310" ]; then
  PYTHON310=$(command -v python3.10 || true)
fi
if [ -z "$PYTHON310" ] || ! "$PYTHON310" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
  echo "setup.sh: no Python 3.10 found (tried /root/.pyenv/versions/3.10.13/bin/python3.10 and python3.10 on PATH);" \
    "the unit tests must run on 3.10 too. Install it, or point PYTHON310 at one." >&2
  exit 1
fi
if [ ! -x .venv310/bin/python ]; then
  "$PYTHON310" -m venv .venv310
fi
started=$SECONDS
.venv310/bin/python -m pip install --quiet --upgrade pip
if ! .venv310/bin/python -m pip install --quiet -e ".[test]"; then
  echo "setup.sh: servekeeper does not install on $("$PYTHON310" --version 2>&1) although requires-python" \
    "says >=3.10; pip's error above names the pin." >&2
  exit 1
fi
echo "setup.sh: .venv310 ($("$PYTHON310" --version)) installed in $((SECONDS - started))s"
