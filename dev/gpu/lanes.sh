# Sourced by the scripts here: run_lanes RUNNER ITEM@GPU ... calls `RUNNER ITEM GPU SECONDS_LEFT`
# for each item, the items of one GPU in turn and the GPUs at once, all under one limit of LIMIT
# seconds (default 560) from the start; an item with no time left gets `RUNNER ITEM GPU 0`, which
# should say it was skipped. Items may hold spaces and commas, not '@'.
run_lanes() {
  local runner=$1; shift
  local -A lane=()
  local arg gpu
  for arg in "$@"; do
    [[ $arg == *@* ]] || { echo "run_lanes: '$arg' is not ITEM@GPU" >&2; return 2; }
    lane[${arg##*@}]+="${arg%@*}"$'\n'
  done
  local start; start=$(date +%s)
  for gpu in "${!lane[@]}"; do
    (while IFS= read -r item; do
       [ -n "$item" ] || continue
       left=$(( ${LIMIT:-560} - ($(date +%s) - start) ))
       "$runner" "$item" "$gpu" $(( left > 0 ? left : 0 ))
     done <<< "${lane[$gpu]}") &
  done
  wait
}
