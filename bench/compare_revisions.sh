#!/usr/bin/env bash
# Two revisions of servekeeper side by side, alternating, in one run (BENCHMARKS.md section 10):
# the zero-downtime upgrade smoke and the ingress overhead, each twice per revision.
#   git worktree add --detach /tmp/sk-before <commit>
#   bash bench/compare_revisions.sh /tmp/sk-before "$PWD" /tmp/compare
set -u
BEFORE=$1 AFTER=$2 OUT=${3:-/tmp/compare}
PY=${PY:-$AFTER/.venv/bin/python}
mkdir -p "$OUT"
run() { # label checkout args...
  local label=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH="$dir/src" timeout 900 "$PY" "$@") > "$OUT/$label.log" 2>&1
  echo "$label rc=$?" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"
for round in 1 2; do
  for side in before after; do
    dir=$BEFORE; [ $side = after ] && dir=$AFTER
    run "zd-$side-$round" "$dir" -m bench.zero_downtime --users 20 --spawn-rate 20 --upgrades 2 --ready-delay 2 \
      --replicas 1 --settle 3 --deletion-delay 10 --no-plot --out-dir "$OUT/zd-$side-$round"
  done
done
for round in 1 2; do
  for side in before after; do
    dir=$BEFORE; [ $side = after ] && dir=$AFTER
    run "io-$side-$round" "$dir" -m bench.ingress_overhead --seconds 5 --rounds 2 --out "$OUT/io-$side-$round.json"
  done
done
