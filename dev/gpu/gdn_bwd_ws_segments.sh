#!/usr/bin/env bash
# The warp-role backward over segments: its GPU tests, then B1 T32768 H16 with the rule's cut
# (passes, warp-role backward), then forced cuts of 32 and 16 chunks on the rows where sequences x
# heads leave SMs idle. Logs in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pytest tests/ops/gated_delta_rule/test_backward_warp_roles.py tests/ops/gated_delta_rule/test_segmented_states.py \
  -q -p no:cacheprovider -n 12 -rA > "$out/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$out/tests.log"
run() {  # log name, then bench arguments
  local log=$1; shift
  timeout 200 python3 bench/gdn_backward_forms.py --out "$out/$log" "$@" > "$out/$log.log" 2>&1
  echo "$log rc=$?"; grep "^| [Bv]" "$out/$log.log" | sort -u
}
run rule --segments rule --shapes 8 --forms passes,backward_ws
run seg32 --segments 32 --shapes 8,3 --forms passes,backward_ws
run seg16 --segments 16 --shapes 3,0,2 --forms passes,backward_ws
