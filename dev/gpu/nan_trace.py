"""The first kernel whose tensor arguments hold NaN/inf after it runs (debug, GPU): strong decays,
K = 16, fp32 and others, unsplit."""
import sys, torch
sys.path.insert(0, '.'); sys.path.insert(0, 'tests')
import flash_dma.runtime.launch as L
from ops.gated_delta_rule.cases import make_inputs
from ops.gated_delta_rule.test_segmented_states import _results
from flash_dma.runtime.config import overrides

real = L.launch
state = {"bad": None}


def traced(kernel, grid, *args, **kwargs):
    before = {i: bool(torch.isfinite(a).all()) for i, a in enumerate(args)
              if isinstance(a, torch.Tensor) and a.is_floating_point()}
    real(kernel, grid, *args, **kwargs)
    torch.cuda.synchronize()
    if state["bad"] is None:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point() and before.get(i) and not torch.isfinite(a).all():
                state["bad"] = f"{getattr(kernel, '__name__', kernel)} arg {i} shape {tuple(a.shape)} " \
                               f"nan {int(torch.isnan(a).sum())} inf {int(torch.isinf(a).sum())} " \
                               f"consts { {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str))} }"
                break


import importlib, pkgutil
import flash_dma
for m in list(sys.modules):
    mod = sys.modules[m]
    if m.startswith("flash_dma") and getattr(mod, "launch", None) is real:
        mod.launch = traced
for (K, dtype) in [(16, torch.float32), (16, torch.float16), (32, torch.float32), (64, torch.float32),
                   (64, torch.bfloat16), (128, torch.float32)]:
    torch.manual_seed(3)
    x = make_inputs(2, 300, 1, 2, K, K, dtype, "g", True, shifts=(-1.5, 5.0))
    cot = [torch.randn(2, 300, 2, K, device="cuda", dtype=dtype), torch.randn_like(x["initial_state"])]
    state["bad"] = None
    with overrides(gdn_chunks_per_segment=0):
        r = _results(x, cot, True)
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in r.items() if not torch.isfinite(v).all()}
    print(f"K{K} {dtype} {bad} first: {state['bad']}", flush=True)
