#!/usr/bin/env bash
# GPU suites side by side: each argument is JOB@GPU; jobs on one GPU run one after another, GPUs
# run at once. Jobs: auto, triton (the attention suite on that backend), memcheck, racecheck (the
# CuTe compute-sanitizer grid with biases), gdn (the delta rule's GPU tests). Logs in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/suites.sh auto@0 triton@1 memcheck@2 racecheck@3
# Each job stops at LIMIT seconds from the start (default 560).
set -uo pipefail
. "$(dirname "$0")/lanes.sh"
out=${OUT:-/tmp/out}; mkdir -p "$out"
workers=${WORKERS:-12}
attention="tests/ops/dynamic_mask_attention tests/layers tests/test_autograd.py tests/test_cuda_graphs.py tests/test_large_offsets.py tests/ops/test_rows_outside_sequences.py -k 'not gdn and not gated'"
declare -A cmd=(
  [auto]="FLASH_DMA_BACKEND=auto python3 -m pytest $attention -q -p no:cacheprovider -n $workers"
  [triton]="FLASH_DMA_BACKEND=triton python3 -m pytest $attention -q -p no:cacheprovider -n $workers"
  [gdn]="python3 -m pytest tests/ops/gated_delta_rule tests/layers -k 'gdn or gated or delta' -q -p no:cacheprovider -n $workers"
  [memcheck]="compute-sanitizer --tool memcheck --report-api-errors no python3 bench/cute_sanitize_grid.py --cute-bias"
  [racecheck]="compute-sanitizer --tool racecheck python3 bench/cute_sanitize_grid.py --cute-bias"
)
job() {  # job NAME GPU SECONDS
  local log="$out/$1.log"
  if [ -z "${cmd[$1]:-}" ]; then echo "unknown job $1 (jobs: ${!cmd[*]})" > "$log"; return; fi
  if [ "$3" -le 0 ]; then echo "skipped: no time left" > "$log"; return; fi
  CUDA_VISIBLE_DEVICES=$2 timeout -k 10 "$3" bash -c "${cmd[$1]}" > "$log" 2>&1
  echo "rc=$? on GPU $2" >> "$log"
}
run_lanes job "$@"
for arg in "$@"; do j=${arg%@*}; echo "== $j"; grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|cases ok|rc=|skipped:|unknown job" "$out/$j.log" | tail -4; done | tee -a "$out/summary.txt"
