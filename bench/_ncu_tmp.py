import os, sys, torch
sys.path.insert(0, os.getcwd())
from flash_dma import chunk_gated_delta_rule
from flash_dma.runtime.config import overrides
B, T, H = int(sys.argv[1]), 4096, int(sys.argv[2])
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g, device="cuda")
n = torch.nn.functional.normalize
x = [n(r(B, T, H, 128), dim=-1).bfloat16(), n(r(B, T, H, 128), dim=-1).bfloat16(), r(B, T, H, 128).bfloat16(),
     torch.nn.functional.logsigmoid(r(B, T, H) + 2), torch.rand(B, T, H, device="cuda").bfloat16()]
x = [t.requires_grad_() for t in x]
for on in (True, False):
    with overrides(gdn_backward_warp_roles=on, gdn_chunks_per_segment=0):
        o = chunk_gated_delta_rule(*x)[0]
        torch.autograd.grad(o, x, torch.randn_like(o))
torch.cuda.synchronize()
