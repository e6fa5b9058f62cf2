#!/usr/bin/env bash
# The main job: install, start servekeeper on the embedded default (real local Ray clusters),
# bring the example service up, and print where to send requests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export SERVEKEEPER_STATE_DIR="${SERVEKEEPER_STATE_DIR:-$PWD/.servekeeper}"
servekeeper up --detach
servekeeper apply -f examples/hello/service.yaml
servekeeper wait hello --timeout 600
servekeeper get hello
cat <<MSG

hello is serving. Send requests through the stable ingress port:
  curl http://127.0.0.1:8000/

Watch a zero-downtime cluster upgrade (new cluster shape, new response):
  export SERVEKEEPER_STATE_DIR=$SERVEKEEPER_STATE_DIR PATH=$PWD/.venv/bin:\$PATH
  servekeeper apply -f examples/hello/service-v2.yaml && servekeeper wait hello
  servekeeper describe hello

Stop everything (daemon, ingress, every Ray cluster):
  servekeeper down
MSG
