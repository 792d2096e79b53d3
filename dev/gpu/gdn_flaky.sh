#!/usr/bin/env bash
# The delta rule's GPU tests with full logs, then the once-seen intermittent case in a loop and
# under initcheck with the caching allocator off (every torch.empty fresh, so a read of an
# unwritten element is reported).
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
case_id="tests/ops/gated_delta_rule/test_fused_backward.py::test_gpu_fused_backward[K128-V64-gqa-0-1]"
timeout 240 python3 -m pytest tests/ops/gated_delta_rule tests/test_cuda_graphs.py tests/runtime -q -p no:cacheprovider -n 12 -rA > "$out/gdn.log" 2>&1
echo "suite rc=$?" >> "$out/gdn.log"
for i in 1 2 3; do
  timeout 100 python3 -m pytest tests/ops/gated_delta_rule/test_fused_backward.py -q -p no:cacheprovider -n 8 -rf >> "$out/loop_file.log" 2>&1
done
for i in $(seq 10); do
  timeout 60 python3 -m pytest "$case_id" -q -p no:cacheprovider -rf >> "$out/loop_case.log" 2>&1
done
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool initcheck --report-api-errors no \
  python3 -m pytest "$case_id" -q -p no:cacheprovider > "$out/initcheck.log" 2>&1
echo "== suite"; grep -E "passed|failed" "$out/gdn.log" | tail -2; grep -E "^FAILED" "$out/gdn.log" | head
echo "== file x3"; grep -E "passed|failed" "$out/loop_file.log"; grep -E "^FAILED" "$out/loop_file.log" | head
echo "== case x10"; grep -cE " passed" "$out/loop_case.log"; grep -E "failed" "$out/loop_case.log" | head -3
echo "== initcheck"; grep -E "ERROR SUMMARY|passed|failed" "$out/initcheck.log" | tail -3; grep -m5 -A6 "Uninitialized" "$out/initcheck.log"
