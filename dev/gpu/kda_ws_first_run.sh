#!/usr/bin/env bash
# The KDA warp-role forward's first GPU run (gluon/forward_ws_gk.py, off by default): its GPU tests
# against fp64, then each kernel's time in one KDA fwd+bwd with and without it (about 2 minutes on
# a warm H200). Logs in $OUT.
#   bash dev/gpu/kda_ws_first_run.sh
set -u
OUT=${OUT:-/tmp}
python3 -m pytest tests/ops/gated_delta_rule/test_fused_forward.py -k gk -q -p no:cacheprovider -n 8 -rfE \
    > "$OUT/kda-ws-tests.log" 2>&1
tail -12 "$OUT/kda-ws-tests.log"
for shape in "B2 T4096 H16 kda" "B8 T4096 H16 kda"; do
    for choice in "" "--choice gdn_fused_forward_gk=True"; do
        # shellcheck disable=SC2086
        python3 dev/gpu/kernel_times.py --backward $choice "$shape" 2>/dev/null >> "$OUT/kda-ws-kernels.txt"
    done
done
# the summary and the per-kernel lines (" us  x"), not the timelines
grep -E "^==| us  x" "$OUT/kda-ws-kernels.txt" | grep -E "^==|fwd_h|intra|fwd_ws_gk|gated_pairs_kernel|prepare"
