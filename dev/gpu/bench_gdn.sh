#!/usr/bin/env bash
# The gated delta rule's op report beside FLA and FlashQLA, one group of cases per GPU at once
# (each group one process: ours and the peers in the same run). Reports in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/bench_gdn.sh ["LABEL[,LABEL]@GPU" ...]
# (default: the issue's five K = V = 128 shapes on GPUs 0-3, two on the last)
set -uo pipefail
. "$(dirname "$0")/lanes.sh"
out=${OUT:-/tmp/out}; mkdir -p "$out"
[ $# -gt 0 ] || set -- "B4 T4096 H16@0" "B1 T8192 H16@1" "B1 T32768 H16@2" \
  "B8 T4096 H32@3" "varlen N20 B1 T32768 H16@3"
report() {  # report CASES GPU SECONDS
  local tag; tag="g$2-$(echo "$1" | tr -c 'A-Za-z0-9' '_' | cut -c1-40)"
  if [ "$3" -le 0 ]; then echo "skipped: no time left ($1)"; return; fi
  CUDA_VISIBLE_DEVICES=$2 timeout -k 10 "$3" python3 bench/bench_gdn.py --only gdn --cases "$1" \
    --tag "$tag" > "/tmp/gdn-$tag.log" 2>&1
  echo "rc=$? on GPU $2: $1"
  cp bench/results/gdn-*-"$tag".txt "$out/" 2>/dev/null
}
run_lanes report "$@"
