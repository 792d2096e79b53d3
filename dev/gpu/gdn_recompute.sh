#!/usr/bin/env bash
# The backward's fused recompute (gdn_fused_recompute): its GPU tests, then the backward beside
# the Triton state pass + local_dv pass at the shapes. No peers needed. Logs in $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/gated_delta_rule/test_fused_forward.py \
  tests/ops/gated_delta_rule/test_fused_backward.py > "$out/recompute-tests.log" 2>&1
echo "rc=$?" >> "$out/recompute-tests.log"; tail -4 "$out/recompute-tests.log"
OUT=$out timeout 300 python3 bench/gdn_fused_backward.py --shapes "${SHAPES:-8x4096x32,4x4096x16,1x32768x16,1x8192x16}" \
  --variants "triton-recompute:gdn_fused_recompute=0;recompute-128:gdn_fused_recompute=128;recompute-64:gdn_fused_recompute=64" \
  > "$out/recompute-bench.log" 2>&1
echo "rc=$?" >> "$out/recompute-bench.log"; tail -16 "$out/recompute-bench.log"
