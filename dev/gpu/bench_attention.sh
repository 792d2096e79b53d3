#!/usr/bin/env bash
# `flash-dma bench attention` split into groups of cases, one group per GPU, side by side (each
# case still times ours and its peers in one process on one GPU). Reports and JSON in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/bench_attention.sh [GROUP@GPU ...] (default below)
# A group is an index into `groups`; flash-sparse-attn autotunes 30-60 s per plain shape.
set -uo pipefail
. "$(dirname "$0")/lanes.sh"
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
group() {  # group INDEX GPU SECONDS
  local log="$out/bench-$1.log"
  if [ "$3" -le 0 ]; then echo "skipped: no time left" > "$log"; return; fi
  CUDA_VISIBLE_DEVICES=$2 timeout -k 10 "$3" python3 -m flash_dma.cli bench attention --cases "${groups[$1]%,}" \
    --report "$out/attention-$1.txt" --json "$out/attention-$1.json" > "/tmp/bench-$1.log" 2>&1
  echo "rc=$? on GPU $2" >> "/tmp/bench-$1.log"
  tail -n 2 "/tmp/bench-$1.log" > "$log"
}
run_lanes group "$@"
cat "$out"/bench-*.log
rm -f "$out"/bench-*.log  # (what comes back is limited to 8 files: the reports and JSON)
