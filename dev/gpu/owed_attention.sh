#!/usr/bin/env bash
# The attention pieces built on the CPU and not yet run on a GPU: the key-wise compaction, the
# per-key dbias summed from shared dS, the CUDA-graph replays; their GPU tests, then their timings
# beside the defaults. Logs in $OUT. Usage: . dev/gpu/env.sh && bash dev/gpu/owed_attention.sh
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/dynamic_mask_attention/test_compaction.py \
  tests/test_cuda_graphs.py "tests/ops/dynamic_mask_attention/test_attention.py" -k "compact or from_shared or graph or replay" \
  > "$out/owed-tests.log" 2>&1
echo "rc=$?" >> "$out/owed-tests.log"
tail -3 "$out/owed-tests.log"
timeout 200 python3 bench/cute_bias.py --cases "D64 key,D128 key" --variants "auto,auto-key-sums-shared,flex" \
  --out "$out" > "$out/owed-bias.log" 2>&1
echo "rc=$?" >> "$out/owed-bias.log"; tail -12 "$out/owed-bias.log"
timeout 240 python3 -m flash_dma.cli bench attention --cases "B1 H16 S16384 D128 top-1024 keys bias[B,H,1,S]" \
  --report "$out/attention-topk.txt" --json "$out/attention-topk.json" > "$out/owed-topk.log" 2>&1
echo "rc=$?" >> "$out/owed-topk.log"; tail -15 "$out/attention-topk.txt"
