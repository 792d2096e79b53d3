#!/usr/bin/env bash
# The attention GPU suite on both backends and the CuTe compute-sanitizer grid, one job per GPU
# where there are several (on one GPU they run one after another). Logs and a summary in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/suites.sh [workers per suite]
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
workers=${1:-12}
ngpu=$(nvidia-smi -L | wc -l)
suite=(tests/ops/dynamic_mask_attention tests/layers tests/test_autograd.py tests/test_cuda_graphs.py
       tests/test_large_offsets.py -k "not gdn and not gated" -q -m gpu -p no:cacheprovider)
jobs=(
  "FLASH_DMA_BACKEND=auto python3 -m pytest ${suite[*]@Q} -n $workers"
  "FLASH_DMA_BACKEND=triton python3 -m pytest ${suite[*]@Q} -n $workers"
  "compute-sanitizer --tool memcheck --report-api-errors no python3 bench/cute_sanitize_grid.py --cute-bias"
  "compute-sanitizer --tool racecheck python3 bench/cute_sanitize_grid.py --cute-bias"
)
names=(auto triton memcheck racecheck)
pids=()
for i in "${!jobs[@]}"; do
  gpu=$(( i % ngpu ))
  if [ "$ngpu" -ge "${#jobs[@]}" ]; then
    (CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-560} bash -c "${jobs[$i]}" > "$out/${names[$i]}.log" 2>&1; echo "rc=$?" >> "$out/${names[$i]}.log") &
    pids+=($!)
  else
    CUDA_VISIBLE_DEVICES=$gpu bash -c "${jobs[$i]}" > "$out/${names[$i]}.log" 2>&1; echo "rc=$?" >> "$out/${names[$i]}.log"
  fi
done
wait "${pids[@]}" 2>/dev/null
for n in "${names[@]}"; do echo "== $n"; grep -E "passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|rc=" "$out/$n.log" | tail -4; done | tee "$out/summary.txt"
