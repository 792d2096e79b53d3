"""A tiny correctness check of each op against its fp64 reference, for machines without a GPU.

Run as `TRITON_INTERPRET=1 python -m flash_dma.benchmarks.selfcheck`: the real Triton kernels
execute in Triton's CPU interpreter (fp16: the interpreter's bf16 dot is wrong in Triton 3.6).
Exits non-zero if a check fails.
"""
import sys
import warnings

import torch

# numpy in the interpreter warns on log2(0) for rows that see no key; the kernel replaces that
# value (lse = +inf), so the warning is noise here
warnings.filterwarnings("ignore", message="divide by zero", category=RuntimeWarning)


def check_attention() -> float:
    from flash_dma import flash_dma_func
    from flash_dma.ops.dynamic_mask_attention import attention_reference
    torch.manual_seed(0)
    q = torch.randn(1, 19, 2, 32, dtype=torch.float16)
    k = torch.randn(1, 23, 1, 32, dtype=torch.float16)
    v = torch.randn(1, 23, 1, 32, dtype=torch.float16)
    mask = torch.rand(1, 1, 19, 23) < 0.7
    bias = torch.randn(1, 2, 19, 23, dtype=torch.float16)
    out = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
    ref, _ = attention_reference(q, k, v, mask, bias, True)
    return ((out.double() - ref).norm() / ref.norm()).item()


def _gdn_inputs():
    torch.manual_seed(0)
    B, T, H, K, V = 1, 75, 2, 64, 64  # two chunks of 64, the second ragged
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).half()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).half()
    v = torch.randn(B, T, H, V).half()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 2)
    beta = torch.rand(B, T, H).sigmoid().half()
    h0 = torch.randn(B, H, K, V) * 0.1
    return q, k, v, g, beta, h0


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_gdn() -> float:
    """chunk_gated_delta_rule (with h0 and the final state) against the fp64 recurrence:
    worst relative error over o, the final state and the gradients of q, k, v, g, beta, h0."""
    from flash_dma import chunk_gated_delta_rule
    from flash_dma.benchmarks.gdn import recurrence_reference
    inputs = _gdn_inputs()
    leaves = [t.clone().requires_grad_() for t in inputs]
    o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    ref_leaves = [t.detach().double().requires_grad_() for t in inputs]
    ro, rht = recurrence_reference(*ref_leaves[:5], initial_state=ref_leaves[5], output_final_state=True)
    do, dht = torch.randn_like(ro), torch.randn_like(rht)
    grads = torch.autograd.grad([o, ht], leaves, [do.to(o.dtype), dht.to(ht.dtype)])
    ref_grads = torch.autograd.grad([ro, rht], ref_leaves, [do, dht])
    return max([_rel(o, ro), _rel(ht, rht)] + [_rel(a, b) for a, b in zip(grads, ref_grads)])


def check_gdn_dhu() -> float:
    """chunk_gated_delta_rule_bwd_dhu in mode E with states (g, gk, h0, dht) on two sequences
    packed (one spans two chunks) against the spec's loop: worst relative error of dh, dh0, dv2."""
    from flash_dma import chunk_gated_delta_rule_bwd_dhu
    from flash_dma.benchmarks.gdn import (
        DhuShape,
        dhu_mode_inputs,
        dhu_reference,
        make_dhu_base,
    )
    shape = DhuShape(1, 100, 2, 64, 64, seqlens=(70, 30))
    base = make_dhu_base(shape, "cpu", seed=0, dtype=torch.float16)
    args = dhu_mode_inputs(base, shape, "E", flags=("g", "gk", "dht", "h0"))
    ours = chunk_gated_delta_rule_bwd_dhu(**args)
    ref = dhu_reference(**args)
    return max(_rel(a, b) for a, b in zip(ours, ref) if b is not None)


def check_decode() -> float:
    """flash_dma_with_kvcache with two appended tokens, a key-wise mask, a bias and two splits
    against the fp64 reference: the output's relative error, or inf when the cache after the
    call is not the expected one."""
    from flash_dma import flash_dma_with_kvcache
    from flash_dma.ops.decode import decode_reference
    torch.manual_seed(0)
    q = torch.randn(2, 2, 4, 32, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(2, 2, 2, 32, dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([5, 33], dtype=torch.int32)
    mask = torch.rand(2, 2, 1, 40) < 0.6
    bias = torch.randn(2, 4, 1, 40, dtype=torch.float16)
    ref, _, ref_k, ref_v = decode_reference(q, k_cache.clone(), v_cache.clone(), k, v, lengths,
                                            attn_mask=mask, attn_bias=bias)
    out = flash_dma_with_kvcache(q, k_cache, v_cache, k, v, lengths, attn_mask=mask,
                                 attn_bias=bias, num_splits=2)
    if not (torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)):
        return float("inf")
    return _rel(out, ref)


CHECKS = {"attention": (check_attention, 5e-3),
          "gdn (fwd and grads)": (check_gdn, 2e-2),
          "gdn bwd_dhu": (check_gdn_dhu, 1e-2),
          "decode with a KV cache": (check_decode, 5e-3)}


def main() -> int:
    failed = 0
    for name, (check, bound) in CHECKS.items():
        try:
            err = check()
        except Exception as exc:  # noqa: BLE001 - a crash is a failed check, the others still run
            failed += 1
            print(f"{name}: FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")
            continue
        ok = err <= bound
        failed += not ok
        print(f"{name}: relative error {err:.1e} against the fp64 reference ({'ok' if ok else 'FAILED'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
