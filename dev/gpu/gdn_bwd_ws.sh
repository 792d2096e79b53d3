#!/usr/bin/env bash
# The warp-role backward's GPU tests (full log), then its timing beside the passes.
# Usage: bash dev/gpu/gdn_bwd_ws.sh [SHAPES]   (SHAPES: bench/gdn_backward_forms.py indices, default 0,1,4)
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 240 python3 -m pytest tests/ops/gated_delta_rule/test_backward_warp_roles.py -q -p no:cacheprovider -n 8 -rA > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
grep -E "passed|failed|rc=" "$out/tests.log" | tail -2; grep -E "^FAILED|Error|error" "$out/tests.log" | head -8
if grep -q " failed\|rc=124" "$out/tests.log"; then exit 1; fi
timeout 300 python3 bench/gdn_backward_forms.py --out "$out" --forms passes,backward_ws --shapes "${1:-0,1,4}" > "$out/forms.log" 2>&1
echo "forms rc=$?"; tail -20 "$out/forms.log"
