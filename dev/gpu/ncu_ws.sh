#!/usr/bin/env bash
# ncu of a warp-role kernel of the gated delta rule at one shape: KERNEL=fwd (gdn_fwd_ws_kernel)
# or bwd (gdn_bwd_ws_kernel, the default), SHAPE="B T H" (default 8 4096 32), CUT=chunks per
# segment (0: whole sequences; default: the plan's rule). The details page, the per-SASS-instruction source page and
# a stall summary (dev/gpu/ncu_stalls.py) land in $OUT/<kernel>-<B>-<T>-<H>.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
kernel=${KERNEL:-bwd}; shape=${SHAPE:-8 4096 32}; cut=${CUT:-rule}
out=${OUT:-/tmp/out}/$kernel-${shape// /-}; mkdir -p "$out"
cat > /tmp/ncu_driver.py <<'PY'
import sys, torch
sys.path.insert(0, ".")
from bench.gdn_backward_forms import make
from flash_dma import chunk_gated_delta_rule
from flash_dma.runtime.config import overrides
kernel, cut = sys.argv[1], sys.argv[2]
choices = dict(gdn_backward_warp_roles=True)
if cut != "rule":
    choices["gdn_chunks_per_segment"] = int(cut)
B, T, H = (int(a) for a in sys.argv[3:6])
x, cu, do = make(B, T, H, None)
leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
with overrides(**choices):
    for _ in range(2):
        o = chunk_gated_delta_rule(*leaves.values())[0]
        if kernel == "bwd":
            torch.autograd.grad(o, list(leaves.values()), do)
torch.cuda.synchronize()
PY
timeout 400 ncu -k regex:gdn_${kernel}_ws_kernel -s 1 -c 1 --set full --import-source yes -o "$out/k" \
    python3 /tmp/ncu_driver.py "$kernel" "$cut" $shape > "$out/ncu.log" 2>&1
echo "ncu rc=$?"; tail -3 "$out/ncu.log"
ncu --import "$out/k.ncu-rep" --page details > "$out/details.txt" 2>&1
ncu --import "$out/k.ncu-rep" --page source --csv --print-source sass > "$out/source.csv" 2>&1
grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Tensor|L1/TEX Hit|L2 Hit|DRAM Throughput|Memory Throughput|Achieved Occupancy|Local" "$out/details.txt" | head -30
python3 dev/gpu/ncu_stalls.py "$out/source.csv" | tee "$out/stalls.txt"
