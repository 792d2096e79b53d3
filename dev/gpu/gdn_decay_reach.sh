#!/usr/bin/env bash
# Decayed segments (segments.py) and strong decays: the segmented-states tests and the strong
# decay tests (GPU ones included), then bench/gdn_decay_reach.py. Logs in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 300 python3 -m pytest tests/ops/gated_delta_rule/test_segmented_states.py \
  "tests/ops/gated_delta_rule/test_gated_delta_rule.py::test_strong_scalar_decay_with_a_short_last_chunk" \
  "tests/ops/gated_delta_rule/test_gated_delta_rule.py::test_gpu_strong_scalar_decay_with_a_short_last_chunk" \
  -q -p no:cacheprovider -n 8 -rA > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
grep -E "passed|failed|rc=" "$out/tests.log" | tail -2; grep -E "^FAILED" "$out/tests.log" | head -8
[ "${BENCH:-1}" = 1 ] || exit 0
timeout 280 python3 bench/gdn_decay_reach.py --out "$out" > "$out/bench.log" 2>&1
echo "bench rc=$?"; grep "^| B" "$out/bench.log" | sort -u
