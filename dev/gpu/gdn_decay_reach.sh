#!/usr/bin/env bash
# Decayed segments (segments.py): the segmented-states tests (GPU ones included), then
# bench/gdn_decay_reach.py. Logs in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 300 python3 -m pytest tests/ops/gated_delta_rule/test_segmented_states.py -q -p no:cacheprovider -n 8 -rA \
  > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
grep -E "passed|failed|rc=" "$out/tests.log" | tail -2; grep -E "^FAILED" "$out/tests.log" | head -8
timeout 280 python3 bench/gdn_decay_reach.py --out "$out" > "$out/bench.log" 2>&1
echo "bench rc=$?"; grep "^| B" "$out/bench.log" | sort -u
