"""Host time per call: the eager path of the public ops (their autograd Functions, which plan once
and keep the plan for the backward) against a direct call of their torch.library custom ops (what
torch.compile traces: the backward op re-checks and re-plans from its tensors and flags), and the
whole step under torch.compile(fullgraph=True).

    python bench/host_time_custom_ops.py [--calls 300] [--device cuda]

Small shapes, so that the host and not the GPU sets the time: each sample is one forward and
backward, timed on the host from the call to the return of backward(), the device synchronised
after each sample (outside the timing) so that a full launch queue never blocks the host. Prints
the median and the 10-90 % range of the samples per op and path, in microseconds.
On the CPU (--device cpu, TRITON_INTERPRET=1) the kernels run in Triton's interpreter, whose time
dwarfs the host's: a rough indication at best; measure on the GPU.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def attention_cases(device, dtype):
    from flash_dma import flash_dma_func, flash_dma_varlen_func
    from flash_dma.ops.dynamic_mask_attention.custom_op import attention_fwd
    B, S, H, D = 2, 128, 4, 64
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.randn(B, H, S, S, device=device, dtype=dtype, requires_grad=True)
    mask = torch.rand(B, 1, S, S, device=device) < 0.5
    leaves = (q, k, v, bias)

    def eager():
        return flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)

    def custom_op():
        return attention_fwd(q, k, v, mask, bias, None, None, 0, 0, True, None, False, False)[0]

    lengths = [100, 28, 128]
    cu = torch.tensor([0, 100, 128, 256], device=device, dtype=torch.int32)
    qv, kv, vv = (torch.randn(256, H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def varlen_eager():
        return flash_dma_varlen_func(qv, kv, vv, cu, cu, max(lengths), max(lengths), is_causal=True)

    def varlen_custom_op():
        return attention_fwd(qv, kv, vv, None, None, cu, cu, max(lengths), max(lengths), True, None, True,
                             False)[0]

    return [("attention B=2 S=128 H=4 D=64 mask+bias causal", eager, custom_op, leaves),
            ("attention varlen 3 seqs 256 tokens causal", varlen_eager, varlen_custom_op, (qv, kv, vv))]


def gdn_cases(device, dtype):
    from flash_dma import chunk_gated_delta_rule
    from flash_dma.ops.gated_delta_rule.custom_op import gated_delta_rule_fwd
    B, T, H, K, V = 1, 256, 4, 64, 64
    q, k, v = (torch.randn(B, T, H, d, device=device, dtype=dtype, requires_grad=True) for d in (K, K, V))
    g = F.logsigmoid(torch.randn(B, T, H, device=device)).requires_grad_()
    beta = torch.rand(B, T, H, device=device, dtype=dtype).requires_grad_()
    leaves = (q, k, v, g, beta)

    def eager():
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]

    def custom_op():  # the public function's arguments as it hands them on (rows, gates in fp32)
        return gated_delta_rule_fwd(q, k, v, g, None, beta, K ** -0.5, None, False, None, True)[0]

    return [("gated delta rule B=1 T=256 H=4 K=V=64 g", eager, custom_op, leaves)]


def sample_us(fn, leaves, calls, device):
    """Host microseconds of forward + backward per call, after warm-up."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(calls + 10):
        for t in leaves:
            t.grad = None
        sync()
        start = time.perf_counter()
        fn().float().sum().backward()
        elapsed = time.perf_counter() - start
        sync()
        if i >= 10:
            times.append(elapsed * 1e6)
    times.sort()
    return statistics.median(times), times[len(times) // 10], times[(len(times) * 9) // 10]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter)"
    print(f"host time per forward+backward, {name}, torch {torch.__version__}, {args.calls} calls")
    cases = attention_cases(args.device, dtype) + gdn_cases(args.device, torch.float32 if args.device == "cpu" else dtype)
    for label, eager, custom_op, leaves in cases:
        rows = [("eager (autograd Function)", eager), ("custom op, called directly", custom_op)]
        if not args.no_compile:
            torch._dynamo.reset()
            rows.append(("torch.compile fullgraph", torch.compile(eager, fullgraph=True)))
        print(label)
        base = None
        for path, fn in rows:
            median, low, high = sample_us(fn, leaves, args.calls, args.device)
            base = base or median
            print(f"  {path:28s} {median:9.1f} us  (10-90 %: {low:.1f}-{high:.1f})  x{median / base:.2f}")


if __name__ == "__main__":
    main()
