#!/usr/bin/env bash
# `flash-dma bench attention` split into groups of cases, one group per GPU, side by side (each
# case still times ours and its peers in one process on one GPU). Reports and JSON in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/bench_attention.sh [GROUP@GPU ...] (default: 0@0 ... 4@3)
# A group is one or more cases; flash-sparse-attn autotunes 30-60 s per plain shape.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
plain() { for c in "$@"; do printf 'B4 H%s S4096 D%s,B4 H%s S4096 D%s causal,' ${c/x/ } ${c/x/ }; done; }
groups=(
  "B2 H16 S4096 D128 bias[B,H,S,S],B2 H16 S4096 D128 bias[B,H,S,S] causal,B2 H16 S4096 D64 bias[B,H,S,S],B2 H8 S4096 D256 bias[B,H,S,S],B2 H16 S4096 D128 bias[B,H,1,S]"
  "B16 H16 S1024 D128 bias[B,H,S,S],B8 H16 S2048 D128 bias[B,H,S,S],B4 H16 S4096 D128 bias[B,H,S,S],B2 H16 S8192 D128 bias[B,H,S,S],B2 H16 S4096 D128 1/8 tiles,B2 H16 S4096 D128 1/8 tiles bias[B,H,S,S],B1 H16 S16384 D128 top-1024 keys bias[B,H,1,S]"
  "$(plain 16x64)"
  "$(plain 16x128)"
  "$(plain 8x256)"
)
[ $# -gt 0 ] || set -- 0@0 1@1 2@2 3@2 4@3
declare -A lane
for arg in "$@"; do lane[${arg#*@}]+="${arg%@*} "; done
start=$(date +%s)
for gpu in "${!lane[@]}"; do
  (for i in ${lane[$gpu]}; do
     left=$(( ${LIMIT:-560} - ($(date +%s) - start) ))
     if [ "$left" -le 0 ]; then echo "skipped: no time left" > "/tmp/bench-$i.log"; break; fi  # (timeout 0: no limit)
     CUDA_VISIBLE_DEVICES=$gpu timeout $left python3 -m flash_dma.cli bench attention --cases "${groups[$i]%,}" \
       --report "$out/attention-$i.txt" --json "$out/attention-$i.json" > "/tmp/bench-$i.log" 2>&1
     echo "rc=$? after $(( $(date +%s) - start )) s" >> "/tmp/bench-$i.log"
   done) &
done
wait
tail -n 4 /tmp/bench-*.log
