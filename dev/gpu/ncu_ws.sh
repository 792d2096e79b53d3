#!/usr/bin/env bash
# ncu of the warp-role backward kernel at one shape (default B8 T4096 H32): the details page and
# the per-SASS-instruction source page (stall reasons by instruction) in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
cat > /tmp/drv.py <<'PY'
import sys, torch
sys.path.insert(0, ".")
from bench.gdn_backward_forms import make
from flash_dma import chunk_gated_delta_rule
from flash_dma.runtime.config import overrides
B, T, H = (int(a) for a in sys.argv[1:4])
x, cu, do = make(B, T, H, None)
leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
with overrides(gdn_chunks_per_segment=0, gdn_backward_warp_roles=True):
    for _ in range(2):
        torch.autograd.grad(chunk_gated_delta_rule(*leaves.values())[0], list(leaves.values()), do)
torch.cuda.synchronize()
PY
timeout 400 ncu -k regex:gdn_bwd_ws_kernel -s 1 -c 1 --set full -o "$out/bws" python3 /tmp/drv.py ${SHAPE:-8 4096 32} > "$out/ncu.log" 2>&1
echo "ncu rc=$?"; tail -3 "$out/ncu.log"
ncu --import "$out/bws.ncu-rep" --page details > "$out/details.txt" 2>&1
ncu --import "$out/bws.ncu-rep" --page source --csv --print-source sass > "$out/source.csv" 2>&1
ls -la "$out"; grep -E "Duration|Registers|Warp Cycles Per Issued|Issue Slots Busy|Tensor|L1/TEX Hit|Local" "$out/details.txt" | head -30
