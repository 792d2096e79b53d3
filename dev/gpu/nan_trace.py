"""Which kernel first leaves NaN or inf in its tensor arguments (debugging aid, GPU): every launch
through runtime.launch is synchronised and its floating-point arguments checked. Strong decays
(about -1.8 a token), a short last chunk, several K and dtypes, sequences whole. Edit the cases
as needed.

    python3 dev/gpu/nan_trace.py [number of cases]
"""
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
import flash_dma.runtime.launch as launch_module  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402
from ops.gated_delta_rule.cases import make_inputs  # noqa: E402
from ops.gated_delta_rule.test_segmented_states import _results  # noqa: E402

CASES = [(16, torch.float32), (16, torch.float16), (32, torch.float32), (64, torch.float32),
         (64, torch.bfloat16), (128, torch.float32)][:int(sys.argv[1]) if len(sys.argv) > 1 else None]
real_launch = launch_module.launch
first_bad = {"where": None}


def _float_tensors(args):
    return [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


def traced_launch(kernel, grid, *args, **kwargs):
    finite_before = {i: bool(torch.isfinite(a).all()) for i, a in _float_tensors(args)}
    real_launch(kernel, grid, *args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if first_bad["where"] is not None:
        return
    for i, a in _float_tensors(args):
        if finite_before[i] and not torch.isfinite(a).all():
            consts = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str))}
            first_bad["where"] = (f"{getattr(kernel, '__name__', kernel)} arg {i} shape {tuple(a.shape)} "
                                  f"nan {int(torch.isnan(a).sum())} inf {int(torch.isinf(a).sum())} {consts}")
            return


# the modules imported launch by name: swap it where they hold it
for name, module in list(sys.modules.items()):
    if name.startswith("flash_dma") and getattr(module, "launch", None) is real_launch:
        module.launch = traced_launch
for K, dtype in CASES:
    torch.manual_seed(3)
    x = make_inputs(2, 300, 1, 2, K, K, dtype, "g", True, shifts=(-1.5, 5.0))
    cotangents = [torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])]
    first_bad["where"] = None
    with overrides(gdn_chunks_per_segment=0):
        results = _results(x, cotangents, True)
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in results.items() if not torch.isfinite(v).all()}
    print(f"K{K} {dtype} non-finite {bad} first: {first_bad['where']}", flush=True)
