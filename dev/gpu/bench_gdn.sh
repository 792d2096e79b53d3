#!/usr/bin/env bash
# The gated delta rule's op report beside FLA and FlashQLA, one group of cases per GPU at once
# (each group one process: ours and the peers in the same run). Reports in $OUT.
# Usage: . dev/gpu/env.sh && bash dev/gpu/bench_gdn.sh ["LABEL[,LABEL]@GPU" ...]
# (default: the five K = V = 128 shapes on GPUs 0-3, two on the last)
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
[ $# -gt 0 ] || set -- "B4 T4096 H16@0" "B1 T8192 H16@1" "B1 T32768 H16@2" \
  "B8 T4096 H32@3" "varlen N20 B1 T32768 H16@3"
declare -A lane
for arg in "$@"; do lane[${arg##*@}]+="${arg%@*};"; done
start=$(date +%s)
for gpu in "${!lane[@]}"; do
  (IFS=';'; n=0
   for cases in ${lane[$gpu]}; do
     [ -n "$cases" ] || continue
     left=$(( ${LIMIT:-560} - ($(date +%s) - start) ))
     [ "$left" -gt 0 ] || break
     tag="g${gpu}n${n}"; n=$((n + 1))
     CUDA_VISIBLE_DEVICES=$gpu timeout "$left" python3 bench/bench_gdn.py --only gdn --cases "$cases" \
       --tag "$tag" > "/tmp/gdn-$tag.log" 2>&1
     echo "rc=$? after $(( $(date +%s) - start )) s" >> "/tmp/gdn-$tag.log"
     cp bench/results/gdn-*-"$tag".txt "$out/" 2>/dev/null
   done) &
done
wait
tail -n 3 /tmp/gdn-*.log
