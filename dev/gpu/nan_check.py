"""Which backward choice gives NaN gradients under strong decays (debug, GPU)."""
import sys, torch
sys.path.insert(0, '.'); sys.path.insert(0, 'tests')
from ops.gated_delta_rule.cases import make_inputs
from ops.gated_delta_rule.test_segmented_states import _results
from flash_dma.runtime.config import overrides
CHOICES = [{}, {"gdn_dhu_local_dv": False}, {"gdn_dhu_local_dv": True}, {"gdn_dhu_w_from_t": False},
           {"gdn_dhu_w_from_t": True}, {"gdn_backward_states_from_inverse": False},
           {"gdn_backward_states_from_inverse": True}, {"gdn_split_prepare": False}]
for (B, T, H, HV, K, dtype) in [(2, 300, 1, 2, 16, torch.float32), (1, 4096, 4, 4, 128, torch.bfloat16)]:
    for gate in ("shift-1.5", "gdn-worst"):
        torch.manual_seed(3)
        x = make_inputs(B, T, H, HV, K, K, dtype, "g", True, shifts=(-1.5, 5.0))
        if gate == "gdn-worst":
            x["g"] = -16 * torch.nn.functional.softplus(torch.randn_like(x["g"]))
        cot = [torch.randn(B, T, HV, K, device="cuda", dtype=dtype), torch.randn_like(x["initial_state"])]
        for over in CHOICES:
            try:
                with overrides(gdn_chunks_per_segment=0, **over):
                    r = _results(x, cot, True)
                bad = {k: int(torch.isnan(v).sum() + torch.isinf(v).sum()) for k, v in r.items()
                       if not torch.isfinite(v).all()}
            except Exception as e:
                bad = f"error {type(e).__name__}: {str(e)[:80]}"
            print(f"K{K} {gate} {over} {bad}", flush=True)
