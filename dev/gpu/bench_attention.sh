#!/usr/bin/env bash
# `flash-dma bench attention` split into groups of cases, one group per GPU, side by side (each
# case still times ours and its peers in one process on one GPU). Reports and JSON in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/bench_attention.sh
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
plain() { for c in "$@"; do printf 'B4 H%s S4096 D%s,B4 H%s S4096 D%s causal,' ${c/x/ } ${c/x/ }; done; }
groups=(
  "B2 H16 S4096 D128 bias[B,H,S,S],B2 H16 S4096 D128 bias[B,H,S,S] causal,B2 H16 S4096 D64 bias[B,H,S,S],B2 H8 S4096 D256 bias[B,H,S,S],B2 H16 S4096 D128 bias[B,H,1,S]"
  "B16 H16 S1024 D128 bias[B,H,S,S],B8 H16 S2048 D128 bias[B,H,S,S],B4 H16 S4096 D128 bias[B,H,S,S],B2 H16 S8192 D128 bias[B,H,S,S],B2 H16 S4096 D128 1/8 tiles,B2 H16 S4096 D128 1/8 tiles bias[B,H,S,S],B1 H16 S16384 D128 top-1024 keys bias[B,H,1,S]"
  "$(plain 16x64 16x128)"
  "$(plain 8x256)"
)
for i in "${!groups[@]}"; do
  gpu=$(( i % ngpu ))
  cmd=(python3 -m flash_dma.cli bench attention --cases "${groups[$i]%,}" --report "$out/attention-$i.txt" --json "$out/attention-$i.json")
  if [ "$ngpu" -ge "${#groups[@]}" ]; then
    (CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-560} "${cmd[@]}" > "/tmp/bench-$i.log" 2>&1; echo "rc=$?" >> "/tmp/bench-$i.log") &
  else
    CUDA_VISIBLE_DEVICES=$gpu timeout ${LIMIT:-560} "${cmd[@]}" > "/tmp/bench-$i.log" 2>&1; echo "rc=$?" >> "/tmp/bench-$i.log"
  fi
done
wait
tail -n 5 /tmp/bench-*.log
