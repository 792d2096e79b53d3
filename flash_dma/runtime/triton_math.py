"""Math helpers for the kernels, written with plain `tl` ops (they run in the interpreter too).

exp2 on the FMA pipe: the softmax spends one MUFU (special-function unit) instruction per score,
and on Hopper that unit has an eighth of the FMA pipe's throughput. 2^x = 2^floor(x) * 2^frac(x):
a cubic gives 2^frac to 7.5e-5 relative (below the bf16/fp16 rounding of P), and 2^floor is added
straight into the exponent bits. `exp2_split` sends half of a tile through each unit.
"""
import triton
import triton.language as tl

# 2^f on [0, 1): least-maximum-relative-error cubic (max relative error 7.5e-5)
_C0 = tl.constexpr(0.9999249724736429)
_C1 = tl.constexpr(0.6958353091414952)
_C2 = tl.constexpr(0.2260647401833744)
_C3 = tl.constexpr(0.07802502331809236)


@triton.jit
def exp2_poly(x):
    """2^x for x <= 0 without the special-function unit; exactly 0 below -126 (and for -inf)."""
    xc = tl.maximum(x, -126.0)
    n = tl.floor(xc)
    f = xc - n
    p = _C0 + f * (_C1 + f * (_C2 + f * _C3))
    bits = p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)
    return tl.where(x < -126.0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def exp2_split(x, POLY: tl.constexpr):
    """2^x of a 2-D tile (x <= 0). POLY: every second column by exp2_poly, the rest by the
    special-function unit, so that both pipes share the work."""
    if POLY:
        rows: tl.constexpr = x.shape[0]
        cols: tl.constexpr = x.shape[1]
        hw, poly = x.reshape(rows, cols // 2, 2).split()
        return tl.join(tl.math.exp2(hw), exp2_poly(poly)).reshape(rows, cols)
    else:
        return tl.math.exp2(x)
