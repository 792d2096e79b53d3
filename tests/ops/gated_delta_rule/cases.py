"""Shared cases of the gated delta rule tests: realistic inputs, the op and the fp64 reference
side by side, error bounds, and the shapes the tests run."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, ON_GPU
from helpers import TOLERANCE, rel_err
from flash_dma import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.runtime.config import overrides
from flash_dma.ops.gated_delta_rule.reference import (bwd_dhu_reference, chunk_form_reference,
                                                      gated_delta_rule_reference)

# Error bounds as multiples of TOLERANCE[dtype] (relative norm error against fp64). The gate
# gradients are sums over many terms that cancel, so they get a little more room. The fp16
# interpreter run measured about 5e-4 for every output and gradient, fp32 about 3e-7.
ERR_SCALE = {
    torch.float16: {"o": 1.0, "final_state": 1.0, "grad": 1.0, "gate_grad": 1.5},
    torch.bfloat16: {"o": 0.75, "final_state": 0.75, "grad": 1.0, "gate_grad": 1.5},
    # fp32: the interpreter multiplies exactly; a GPU may use tf32 (checked at the fp16 bound)
    torch.float32: {"o": 1.0, "final_state": 1.0, "grad": 2.0, "gate_grad": 4.0},
}


def bound(name: str, dtype: torch.dtype) -> float:
    tol_dtype = torch.float16 if (dtype == torch.float32 and ON_GPU) else dtype
    scales = ERR_SCALE[tol_dtype]
    kind = name if name in ("o", "final_state") else ("gate_grad" if name in ("dg", "dgk") else "grad")
    return TOLERANCE[tol_dtype] * scales[kind]


def check_errors(pairs, dtype, bounds=None):
    """pairs: {name: (got, want)}. Every error is measured before any is judged, so a failure
    message lists them all. bounds: {name: bound} in place of bound(name, dtype)."""
    assert set(bounds or {}) <= set(pairs), f"bounds for {set(bounds) - set(pairs)}: no such result"
    errors, failures = {}, []
    for name, (got, want) in pairs.items():
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
        errors[name] = rel_err(got, want)
        limit = (bounds or {}).get(name, bound(name, dtype))
        if errors[name] > limit:
            failures.append(f"{name} {errors[name]:.2e} > {limit:.1e}")
    summary = ", ".join(f"{n}={e:.1e}" for n, e in errors.items())
    assert not failures, f"relative errors over bound: {'; '.join(failures)} (all: {summary})"
    return errors


# ---------------------------------------------------------------------------------------------
# inputs

def make_inputs(B, T, H, HV, K, V, dtype, gate="g", states=False, n_seqs=None, normalize_k=True,
                shifts=(5.0, 5.0)):
    """Realistic inputs: unit-norm keys, per-token decays exp(g) mostly in [0.95, 1) (about
    exp(-0.7) over a chunk: the state carried across chunks matters), beta in (0, 1).
    gate: "g", "gk", "g+gk" or "none"; g = logsigmoid(randn + shifts[0]), gk = logsigmoid(randn + shifts[1]).
    Gates and states are fp32; beta is in q's dtype."""
    gates = gate.split("+")
    q = torch.randn(B, T, H, K, device=DEVICE, dtype=dtype)
    k = torch.randn(B, T, H, K, device=DEVICE, dtype=torch.float32)
    k = (F.normalize(k, dim=-1) if normalize_k else k).to(dtype)
    v = torch.randn(B, T, HV, V, device=DEVICE, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, device=DEVICE) + shifts[0]) if "g" in gates else None
    gk = F.logsigmoid(torch.randn(B, T, HV, K, device=DEVICE) + shifts[1]) if "gk" in gates else None
    beta = torch.sigmoid(torch.randn(B, T, HV, device=DEVICE)).to(dtype)
    n = B if n_seqs is None else n_seqs
    h0 = torch.randn(n, HV, K, V, device=DEVICE) if states else None
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "gk": gk, "initial_state": h0}


def assert_same_gradients(grads: dict, bound: float, what: str) -> None:
    """grads[True] and grads[False] ({leaf: gradient} of check_against_reference under a choice
    on and off, with the same cotangents): equal within `bound` relative error per leaf."""
    for leaf, got in grads[True].items():
        want = grads[False][leaf].double()
        err = float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
        assert err < bound, f"d{leaf}: relative error {err:.2e} between {what}"


def assert_choice_keeps_gradients(inputs, dtype, kwargs: dict, choice: str, bound: float, what: str) -> None:
    """The op's gradients with the declared choice on and off (the same output cotangents for
    both, each checked against fp64) agree within `bound`."""
    grads = {}
    for on in (True, False):
        torch.manual_seed(2)
        with overrides(**{choice: on}):
            _, grads[on] = check_against_reference(inputs, dtype, **kwargs)
    assert_same_gradients(grads, bound, what)


def assert_same_gradients_as(case: tuple, choice: str, what: str, seed: int = 1) -> None:
    """A FUSED_CASES-style case (B, T, H, HV, K, V, gate, states, dtype, lengths): every gradient
    with `choice` on equals the one with it off (whole sequences)."""
    B, T, H, HV, K, V, gate, states, dtype, lengths = case
    torch.manual_seed(seed)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    with overrides(gdn_chunks_per_segment=0):
        assert_choice_keeps_gradients(inputs, dtype, kwargs, choice, 1e-2, what)


def check_case_with_choices(case: tuple, chosen: dict, takes_it) -> None:
    """A FUSED_CASES-style case run with the choices `chosen` forced: the plan takes them
    (takes_it(plan) holds), and every output and gradient matches fp64, with a NaN block of an
    output's size left in the allocator first (poison_allocator)."""
    B, T, H, HV, K, V, gate, states, dtype, lengths = case
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    with overrides(**chosen):
        layout = chunk_layout(B, T, kwargs.get("cu_seqlens"))
        assert takes_it(plan_call(inputs["q"], inputs["v"], gate != "none", False, layout)), chosen
        poison_allocator(B * T * HV * max(K, V), dtype)
        check_against_reference(inputs, dtype, **kwargs)


def assert_choice_refused_where_it_cannot_run(choice: str, attribute: str) -> None:
    """A Hopper-only boolean choice of the plan: off on this machine when it has no SM90 GPU, and
    forced there, an error naming the choice; forced off, off everywhere."""
    q = torch.empty(1, 128, 2, 128, dtype=torch.bfloat16)
    layout = chunk_layout(1, 128, None)
    if not ON_SM90:
        assert getattr(plan_call(q, q, True, False, layout), attribute).value is False
        with overrides(**{choice: True}), pytest.raises(ValueError, match=f"{choice}=True"):
            plan_call(q, q, True, False, layout)
    with overrides(**{choice: False}):
        assert getattr(plan_call(q, q, True, False, layout), attribute).value is False


def assert_refuses_a_cut(choice: str) -> None:
    """Forced on together with a sequence split of bwd_dhu: an error saying why (GPU only: off the
    GPU the choice is refused for the device first)."""
    q = torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16, device="cuda")
    with overrides(**{choice: True}, gdn_chunks_per_segment=8), pytest.raises(ValueError, match="not cut into segments"):
        plan_call(q, q, True, False, chunk_layout(1, 4096, None))


def cu_from_lengths(lengths, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype, device=DEVICE)


def run_op(inputs, leaves_wanted=True, **kwargs):
    leaves = {n: t.clone().requires_grad_(leaves_wanted) for n, t in inputs.items() if t is not None}
    o, final = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"),
                                      leaves["beta"], initial_state=leaves.get("initial_state"),
                                      gk=leaves.get("gk"), **kwargs)
    return leaves, o, final


def run_reference(inputs, use_qk_l2norm_in_kernel=False, **kwargs):
    leaves = {n: t.detach().double().requires_grad_() for n, t in inputs.items() if t is not None}
    o, final = gated_delta_rule_reference(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"),
                                          leaves["beta"], initial_state=leaves.get("initial_state"),
                                          gk=leaves.get("gk"), use_qk_l2norm=use_qk_l2norm_in_kernel,
                                          **kwargs)
    return leaves, o, final


def check_against_reference(inputs, dtype, output_final_state=True, bounds=None, **kwargs):
    """Output, final state and the gradient of (o * do).sum() + (final_state * dht).sum() to every
    input, against the fp64 reference (bounds: as check_errors). Returns (errors, op gradients)."""
    leaves, o, final = run_op(inputs, output_final_state=output_final_state, **kwargs)
    ref_leaves, ref_o, ref_final = run_reference(inputs, output_final_state=output_final_state,
                                                 **kwargs)
    q = inputs["q"]
    assert o.dtype == q.dtype and o.shape == inputs["v"].shape
    pairs = {"o": (o, ref_o)}
    outputs, ref_outputs = [o], [ref_o]
    do = torch.randn_like(o)
    cotangents = [do]
    if output_final_state:
        assert final is not None and final.dtype == torch.float32
        pairs["final_state"] = (final, ref_final)
        outputs.append(final)
        ref_outputs.append(ref_final)
        cotangents.append(torch.randn_like(final))
    else:
        assert final is None
    got = torch.autograd.grad(outputs, list(leaves.values()), cotangents)
    want = torch.autograd.grad(ref_outputs, list(ref_leaves.values()),
                               [c.double() for c in cotangents])
    names = {"initial_state": "dh0"}
    for name, g_got, g_want in zip(leaves, got, want):
        assert g_got.dtype == inputs[name].dtype, f"d{name}: dtype {g_got.dtype} != {inputs[name].dtype}"
        pairs[names.get(name, "d" + name)] = (g_got, g_want)
    return check_errors(pairs, dtype, bounds), dict(zip(leaves, got))


# ---------------------------------------------------------------------------------------------
# shapes

SHAPES = {  # (B, T, H, HV, K, V, gate, states)
    "odd-T": (2, 67, 2, 2, 32, 32, "g", True),
    "shorter-than-chunk": (1, 5, 1, 1, 16, 32, "g", False),
    "gva-K!=V": (1, 130, 1, 2, 32, 16, "g", True),
    "gk-only": (2, 70, 2, 2, 16, 16, "gk", True),
    "g+gk-gva": (1, 100, 1, 2, 32, 32, "g+gk", True),
    # head dims of whole 64-wide tiles: the backward recomputes w, u from the forward's T
    "K64-kept-T": (1, 70, 1, 1, 64, 64, "g", False),
    "K64-kept-T-gva": (1, 70, 1, 2, 64, 128, "g", True),
    "K64-kept-T-no-gate": (2, 67, 1, 1, 64, 64, "none", True),
    # with gk the forward keeps T and the gated pair products; the backward forms w, u from them
    "K64-kept-pairs-g+gk-gva": (1, 70, 1, 2, 64, 64, "g+gk", True),
}


GPU_SHAPES = {  # (B, T, H, HV, K, V, gate, states)
    "h4-128": (2, 4096, 4, 4, 128, 128, "g", True),
    "h16-128": (1, 4096, 16, 16, 128, 128, "g", False),
    "gva-kda-128": (2, 4096, 4, 8, 128, 128, "g+gk", True),
    "gk-K64-V128": (1, 4096, 4, 4, 64, 128, "gk", True),
    "K256-V256": (2, 2048, 2, 2, 256, 256, "g", True),
    # more (sequence, head) pairs than a quarter of the SMs: the state passes' widest tiles
    "K256-V256-64-pairs": (4, 512, 16, 16, 256, 256, "g", True),
    "K48-V32": (1, 1000, 2, 2, 48, 32, "g", True),
    "gva-128": (1, 4096, 4, 8, 128, 128, "g", True),
    "no-gate-gva-K64-V128": (2, 2048, 2, 4, 64, 128, "none", True),
}


MODES = {  # mode: (gates, states)
    "A": ("", False),
    "B": ("", True),
    "C": ("g", False),
    "D": ("gk", False),
    "E": ("g+gk", False),
    "E+states": ("g+gk", True),  # not a benchmark mode: every input at once
}


def dhu_inputs(B, T, H, HV, K, V, dtype, mode, cu=None):
    """Realistic inputs of the state-gradient pass: w, the gated q/k and the chunk-local gates
    come from the fp64 chunk form of a forward pass (so the state gradient stays bounded over many
    chunks); do and dv are random. With gk, q and k are passed gated (HV heads)."""
    gates, states = MODES[mode]
    gates = gates.split("+")
    n = B if cu is None else len(cu) - 1
    x = make_inputs(B, T, H, HV, K, V, torch.float64,
                    "+".join(gt for gt in gates if gt) or "g", False)
    if "g" not in gates:
        x["g"] = None
    with torch.no_grad():
        cf = chunk_form_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                  gk=x["gk"])
    gated = "gk" in gates
    out = {
        "q": (cf["q_gated"] if gated else x["q"]).to(dtype),
        "k": (cf["k_gated"] if gated else x["k"]).to(dtype),
        "w": cf["w"].to(dtype),
        "do": torch.randn(B, T, HV, V, device=DEVICE, dtype=dtype),
        "dv": torch.randn(B, T, HV, V, device=DEVICE, dtype=dtype),
        "g": cf["g_cum"].float() if "g" in gates else None,
        "gk": cf["gk_cum"].float() if gated else None,
        "h0": torch.randn(n, HV, K, V, device=DEVICE) if states else None,
        "dht": torch.randn(n, HV, K, V, device=DEVICE) if states else None,
    }
    return out


def check_dhu(x, dtype, scale, cu=None):
    args = (x["q"], x["k"], x["w"], x["do"], x["dv"])
    kw = dict(g=x["g"], gk=x["gk"], h0=x["h0"], dht=x["dht"], scale=scale, cu_seqlens=cu)
    dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(*args, **kw)
    ref_scale = x["q"].shape[-1] ** -0.5 if scale is None else scale
    ref_dh, ref_dh0, ref_dv2 = bwd_dhu_reference(*args, **{**kw, "scale": ref_scale})
    assert dh.dtype == x["q"].dtype and dv2.dtype == x["dv"].dtype
    pairs = {"dh": (dh, ref_dh), "dv2": (dv2, ref_dv2)}
    if x["h0"] is None:
        assert dh0 is None
    else:
        assert dh0.dtype == torch.float32
        pairs["dh0"] = (dh0, ref_dh0)
    return check_errors(pairs, dtype)


# ---------------------------------------------------------------------------------------------
# the fused SM90 kernels' GPU cases (test_fused_forward.py, test_fused_backward.py)

ON_SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9

FUSED_CASES = {  # name: (B, T, H, HV, K, V, gate, states, dtype, varlen lengths or None)
    "g-h0-K128": (2, 1000, 2, 2, 128, 128, "g", True, torch.bfloat16, None),
    "one-chunk": (1, 64, 1, 1, 128, 128, "g", False, torch.bfloat16, None),
    "65-tokens-fp16": (1, 65, 1, 1, 128, 128, "g", True, torch.float16, None),
    "no-gate-gqa-K64": (3, 333, 1, 2, 64, 128, "none", False, torch.bfloat16, None),
    "K64-V64": (2, 200, 2, 2, 64, 64, "g", True, torch.bfloat16, None),
    "varlen-empty-single": (1, 1000, 1, 2, 128, 128, "g", True, torch.bfloat16, [1, 299, 0, 700]),
}


def poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Leave a freed NaN block of an output's size in the caching allocator, which the op's next
    allocation of that size reuses: rows a kernel fails to write then read as NaN."""
    block = torch.full((numel,), float("nan"), device=DEVICE, dtype=dtype)
    del block


_COMPILE_SM90 = """
import json, sys
sys.path.insert(0, sys.argv[1])
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
job = json.loads(sys.argv[2])
module, name = job["kernel"].rsplit(".", 1)
kernel = getattr(importlib.import_module(module), name)
names = getattr(kernel, "arg_names", None)
constants = {n: v for n, v in job["constants"].items() if names is None or n in names}  # shared lists
signature = {**job["pointers"], **job["scalars"], **{c: "constexpr" for c in constants}}
order = [n for n in (names or signature) if n in signature]  # the kernel's order
signature = {n: signature[n] for n in order}
# as launches specialise them
aligned = {(order.index(n),): [["tt.divisibility", 16]] for n in job["pointers"] if n in order}
source = GluonASTSource if job["gluon"] else ASTSource
compiled = triton.compile(source(kernel, signature, constants, aligned),
                          target=GPUTarget("cuda", 90, 32), options=job["options"])
import os, re, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from triton.tools.disasm import get_sass
sass = get_sass(compiled.asm["cubin"])
with tempfile.TemporaryDirectory() as tmp:  # ptxas -v for the register and spill counts
    ptx = os.path.join(tmp, "k.ptx")
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                            capture_output=True, text=True)
report = report.stdout + report.stderr
print(json.dumps({"cubin": bool(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
                  "mmas": sass.count("HGMMA."), "mma_waits": sass.count("WARPGROUP.DEPBAR"),
                  "registers": int(re.search(r"Used (\\d+) registers", report).group(1)),
                  "spill_bytes": sum(int(n) for n in re.findall(r"(\\d+) bytes spill", report))}))
"""


def compile_for_sm90(kernel: str, pointers: dict, scalars: dict, constants: dict, options: dict,
                     gluon: bool = True) -> dict:
    """Compile a Gluon (or with gluon False, Triton) kernel (its dotted import path) for sm_90a with Triton's compiler and bundled
    ptxas, no GPU needed: -> {"cubin": bool, "shared": bytes, "mmas": warpgroup MMA instructions,
    "mma_waits": waits for them in the SASS, "registers" and "spill_bytes" (stores and loads) as
    ptxas -v counts them, under options' maxnreg where given}. In a fresh process without
    TRITON_INTERPRET: the interpreter the CPU tests run in replaces parts of triton.language while
    it runs kernels, which a compile in the same process could meet."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[3])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps({"kernel": kernel, "pointers": pointers, "scalars": scalars, "constants": constants,
                      "options": options, "gluon": gluon})
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90, root, job], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{kernel} did not compile for sm_90a:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_mma_not_serialised(compiled: dict) -> None:
    """ptxas, short of registers or facing an MMA it cannot keep in flight, serialises every
    warpgroup MMA (a wait after each HGMMA instruction; its C7510-C7515 notes are not shown by
    Triton). The kernels' own waits come one per product of several HGMMA steps."""
    assert compiled["mmas"] > 0, "no warpgroup MMA in the SASS"
    assert compiled["mma_waits"] * 2 <= compiled["mmas"], (
        f"warpgroup MMAs serialised: {compiled['mma_waits']} waits for {compiled['mmas']} HGMMA")
