"""Blackwell's block-scaled formats in one pass: MXFP8 and NVFP4 quantizers (`--fp8-recipe mxfp8 / nvfp4`).

    MXFP8   e4m3 values in 1x32 blocks along the reduction, one power-of-two scale per block (e8m0)
    NVFP4   e2m1 values (two per byte) in 1x16 blocks, one e4m3 scale per block, one fp32 per tensor;
            weights in 16x16 tiles (one quantization serves y = x W^T and dx = dy W)

What you build here: Triton kernels that read a bf16 (or fp32) tensor [M, K] once and write its
block-scaled copy along K, its transposed copy along M (the tokens, which the weight gradient dW = dy^T x
reduces over) and the block scales, in their natural layout or in the swizzled one cuBLAS reads; for
NVFP4 also stochastic rounding (gradients) and a random Hadamard transform of the dW operands. Beside
each kernel, a plain-PyTorch reference that the tests compare with bit for bit. What you learn: what a
block scale costs in bytes (almost nothing: 1 byte per 32 or 16 values), why a power-of-two scale makes
the division exact, and why NVFP4's tensor scale costs a read of its own.

Blackwell's tensor cores (sm_100, sm_103) read these formats natively: on a GB300, 5 PF dense in FP8
and 15 PF in FP4 against 2.5 PF in bf16. Hopper and the CPU have no such tensor cores: there the
recipes run in an explicit emulation mode (`--fp8-emulate`) that quantizes exactly as here and
multiplies the dequantized operands in bf16/fp32: the same numerics, no speed (docs/fp8.md).

Count the bytes before timing anything
--------------------------------------
Quantizing x [M, K] bf16 to MXFP8 in plain PyTorch (`quantize_mxfp8_ref`), bytes per element:

    xf = x.float().view(M, K/32, 32)            # read 2, write 4
    amax = |xf| (NaN and inf masked) .amax(-1)   # read 4 (x3: isnan, isinf, abs), write 4; read 4
    scale = 2^e from amax's exponent            # per block: negligible
    q = (xf / scale).clamp(..).to(e4m3)         # read 4, write 4; read 4, write 4; read 4, write 1
                                                 # ~50 bytes per element, and as much again transposed

The kernel `_mxfp8_quantize` reads each [32, 128] tile once and writes both copies from registers:

    read x 2, write q 1, write qT 1, write the scales 2 x 1/32      4.06 bytes per element (bf16 in)

Only one copy: 3.03 bytes. At the 8B step's shapes (8192 x 4096 and 8192 x 14336, `ideal_bytes`)
both copies move 136 MB and 476 MB: a floor of ~17 us and ~60 us at ~8 TB/s (GB300, on paper).

NVFP4 needs one more thing before it can scale a block: the tensor's largest |x|, because each 1x16
block's scale is stored in e4m3 *relative to* the tensor scale (amax / (6 * 448)). A kernel that
streams the tensor cannot know that maximum before it has seen every value, so NVFP4 costs a read of
its own (`tensor_amax`, 2 bytes per element) unless the kernel that produced the tensor hands its
maximum over (as the FP8 producers hand over row maxima: fp8_producers_kernel.py). Then
`_nvfp4_quantize` reads x again and writes half a byte per value plus one scale byte per 16:

    amax pass: read 2       quantize: read 2, write 0.5 + 1/16 per copy     4.56 (one copy) / 5.13 (both)

Scales, exactly
---------------
MXFP8 (OCP MX v1.0 with the "round up" rule NVIDIA and torchao use): the block's scale is the smallest
power of two 2^e with amax <= 448 * 2^e, so no value saturates (OCP's floor(log2 amax) - 8 may put the
block's largest value above 448). From amax's fp32 bits: e = biased exponent - 135, plus one when the
mantissa is above 0.75 (amax above 1.75 x 2^k = 448 x 2^(k-8)); clamped to e8m0's [-127, 127]. Dividing
by a power of two is exact, so only the cast to e4m3 rounds. There is no floor on the maximum (the
row-wise recipes' AMAX_FLOOR, which would flush a block of values below 2^-57 to zero): a power-of-two scale
never divides by zero, so an all-zero block takes e8m0's smallest scale 2^-127 and stays zero, and a
block of fp32 subnormals keeps its values (2^-127 x 2^-9, e4m3's smallest step, reaches them). A block
holding a NaN or an infinity has no finite scale: its scale is e8m0's NaN (0xFF) and its values e4m3's
NaN (0x7F), so that the whole block dequantizes to NaN, as OCP's spec says of a NaN scale; the
neighbouring blocks are untouched.

NVFP4 (NVIDIA's recipe): g = amax / (6 * 448) per tensor (fp32; amax over the finite values, floored at
AMAX_FLOOR); per block s = e4m3(block amax / (6 g)); values v = x / (s g), rounded to e2m1
{0, 0.5, 1, 1.5, 2, 3, 4, 6} to nearest even (or stochastically) and saturated at 6. A block whose
scale rounds to e4m3 zero (block amax below ~2^-10 x 6 g: 2^-9 of the tensor's maximum) is stored as
zeros. A block with a NaN or an infinity gets e4m3's NaN as its scale (values 0): it dequantizes to NaN.
e2m1 codes are 4 bits, sign on top; the element with the even column index is the low nibble of its byte
(the order of PyTorch's float4_e2m1fn_x2 and cuBLAS).

Rows and columns that are not a multiple of the block: the missing values count as zeros (they do not
change a block's maximum); the copies are as wide as the whole blocks (K rounded up to the block for
NVFP4's packed bytes, M rounded up for the transposed copies) with zeros there, as the matmul's
reduction needs whole blocks.

Stochastic rounding and the random Hadamard transform (NVFP4's training recipe)
--------------------------------------------------------------------------------
Gradients are rounded stochastically: between the two e2m1 values lo <= v < hi around v, up with
probability (v - lo) / (hi - lo), so that the rounding is unbiased on average (E[q] = v) where round-to-
nearest would drop every small update the same way. The random bits are Triton's Philox (`tl.randint`,
seed, element index), which `philox_ref` reproduces in PyTorch so that the reference can be exact too.
The operands of dW = dy^T x are both multiplied along the tokens by the same random orthogonal matrix
(16 x 16 Hadamard blocks with random signs, H D / 4): dy^T (H D / 4)(H D / 4)^T x = dy^T x, but a single
outlier is spread over its 16 neighbours, which fits 4-bit blocks far better. The transform is a
butterfly of 4 add/subtract stages: each output is a fixed sequence of fp32 additions, the same in the
kernel and in the reference, hence bit for bit equal.

Layout of this file: kernels -> launchers -> dequantization and the emulated matmul -> references.
"""

from __future__ import annotations

import functools

import torch

from core import kernel_utils  # (check_device: where the kernels can run)
from fp8_linear_kernel import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, ROUND_IN_SOFTWARE, cast_e4m3

import triton
import triton.language as tl

MX_BLOCK = 32  # MXFP8: 32 consecutive values along the reduction share one e8m0 scale
NV_BLOCK = 16  # NVFP4: 16 values share one e4m3 scale
E2M1_MAX = 6.0  # largest e2m1 value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the codes 0..7; code | 8 is the negative
E8M0_NAN = 0xFF  # e8m0's NaN: the scale of a block holding a NaN or an infinity
_E8M0_NAN = tl.constexpr(E8M0_NAN)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_NV_RANGE = tl.constexpr(E2M1_MAX * FP8_MAX)  # 2688: the tensor scale g = amax / 2688


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def as_f32(x):
    """x as fp32; bf16 through its bits (a shift: exact, what a GPU does), because the interpreter
    converts bf16 subnormals wrongly and the tests compare subnormal blocks bit for bit."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _finite_amax(a, AXIS: tl.constexpr):
    """(largest finite |x| along AXIS, whether any value along AXIS is NaN or infinite) of a = |x|."""
    bad = (a != a) | (a == float("inf"))
    return tl.max(tl.where(bad, 0.0, a), axis=AXIS), tl.max(bad.to(tl.int32), axis=AXIS) > 0


@triton.jit
def _e8m0(amax):
    """(the e8m0 byte, the exact fp32 multiplier 2^-e) of the smallest 2^e with amax <= 448 * 2^e."""
    bits = amax.to(tl.int32, bitcast=True)  # zero and subnormal maxima: biased exponent 0, e clamps to -127
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    # 2^-e as fp32 bits: -e <= 127 always; e = 127 (2^-127, subnormal) is beyond any finite amax
    inv = ((127 - tl.minimum(e, 126)) << 23).to(tl.float32, bitcast=True)
    return (e + 127).to(tl.uint8), inv


@triton.jit
def _swizzled(r, b, n_block_tiles):
    """Where cuBLAS reads the scale of row r's block b: 128 x 4 tiles of 512 bytes, row-major over
    (r // 128, b // 4), each stored as [r % 32, (r // 32) % 4, b % 4] (mx_swizzled_scales)."""
    return (((r // 128) * n_block_tiles + b // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + b % 4)


@triton.jit
def mxfp8_rows(
    x,  # a [ROWS, BLOCK_K] fp32 tile in registers (0 past M and K)
    rows,  # its row indices [ROWS], int64
    cols,  # its column indices [BLOCK_K], int64, starting at a multiple of 32
    first_block,  # the index of its first 1x32 block along K: cols[0] // 32
    Q,  # the copy along K [M, K] float8_e4m3fn
    S,  # its scales: [M, cdiv(K, 32)] e8m0 bytes, or swizzled (SWIZZLE)
    M, K, S_TILES,  # as in `_mxfp8_quantize`
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    SWIZZLE: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
):
    """The MXFP8 copy along K of a tile in registers, written with its e8m0 scales: the tile seen as
    [ROWS, BLOCK_K / 32 blocks, 32 values], each block scaled by its own power of two (module docstring).
    Public for the kernels that produce a tensor and write its copy themselves (fp8_producers_kernel.py)."""
    NB: tl.constexpr = BLOCK_K // 32
    row_ok, col_ok = rows < M, cols < K
    x3 = tl.reshape(x, (ROWS, NB, 32))
    amax, bad = _finite_amax(tl.abs(x3), 2)
    byte, inv = _e8m0(amax)
    v = tl.reshape(x3 * inv[:, :, None], (ROWS, BLOCK_K))
    bad_v = tl.reshape(tl.broadcast_to(bad[:, :, None], (ROWS, NB, 32)), (ROWS, BLOCK_K))
    q = cast_e4m3(tl.where(bad_v, float("nan"), v), ROUND_IN_SOFTWARE)
    tl.store(Q + rows[:, None] * K + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
    byte = tl.where(bad, _E8M0_NAN, byte).to(tl.uint8)
    r2 = rows[:, None] + tl.zeros((ROWS, NB), tl.int64)
    b2 = first_block + tl.arange(0, NB)[None, :] + tl.zeros((ROWS, NB), tl.int64)
    n_blocks = (K + 31) // 32
    s_ok = (r2 < M) & (b2 < n_blocks)
    if SWIZZLE:
        tl.store(S + _swizzled(r2, b2, S_TILES), byte, mask=s_ok)
    else:
        tl.store(S + r2 * n_blocks + b2, byte, mask=s_ok)


@triton.jit
def _mxfp8_quantize(
    X,  # pointer to the input [M, K], unit stride along K
    Q,  # the copy along K [M, K] float8_e4m3fn (WRITE_Q)
    S,  # its scales: [M, cdiv(K, 32)] e8m0 bytes, or swizzled (SWIZZLE; zeroed by the launcher)
    QT,  # the transposed copy [K, M_pad] float8_e4m3fn, zeros past M (WRITE_QT)
    ST,  # its scales: [K, M_pad / 32] e8m0 bytes, or swizzled
    stride_x,  # elements between two rows of X
    M,  # rows of X
    K,  # columns of X
    M_pad,  # M rounded up to 32
    S_TILES,  # 4-block tiles per row of S (swizzled layout): cdiv(cdiv(K, 32), 4)
    ST_TILES,  # the same for ST: cdiv(M_pad / 32, 4)
    BLOCK_M: tl.constexpr,  # rows per program, a multiple of 32
    BLOCK_K: tl.constexpr,  # columns per program, a multiple of 32
    WRITE_Q: tl.constexpr,
    WRITE_QT: tl.constexpr,
    SWIZZLE: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = as_f32(tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None] & (cols < K)[None, :],
                        other=0.0))  # missing values read as 0: the padding rule
    mxfp8_tile(x, Q, S, QT, ST, M, K, M_pad, S_TILES, ST_TILES, BLOCK_M, BLOCK_K, WRITE_Q, WRITE_QT, SWIZZLE,
               ROUND_IN_SOFTWARE)


@triton.jit
def mxfp8_tile(
    x,  # this program's [BLOCK_M, BLOCK_K] fp32 tile of rows BLOCK_M pid_m.., columns BLOCK_K pid_k.. (0 past M, K)
    Q, S, QT, ST,  # the copies and their scales, as in `_mxfp8_quantize`
    M, K, M_pad, S_TILES, ST_TILES,
    BLOCK_M: tl.constexpr,  # a multiple of 32: BLOCK_M / 32 blocks along M per column, and that many bytes of
    BLOCK_K: tl.constexpr,  # each transposed row stored together (32 per program was a short write)
    WRITE_Q: tl.constexpr,
    WRITE_QT: tl.constexpr,
    SWIZZLE: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
):
    """Both MXFP8 copies of one tile already in registers, written with their scales: `_mxfp8_quantize`'s
    work after its load, public for a kernel that computes the tile itself (fp8_producers_kernel's SwiGLU)."""
    NB: tl.constexpr = BLOCK_K // 32
    NBM: tl.constexpr = BLOCK_M // 32
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < K
    if WRITE_Q:  # 1x32 blocks along K
        mxfp8_rows(x, rows, cols, pid_k.to(tl.int64) * NB, Q, S, M, K, S_TILES, BLOCK_M, BLOCK_K, SWIZZLE,
                   ROUND_IN_SOFTWARE)
    if WRITE_QT:  # 32x1 blocks along M: NBM blocks per column of the tile, written as a row of QT
        x3 = tl.reshape(x, (NBM, 32, BLOCK_K))
        amax_t, bad_t = _finite_amax(tl.abs(x3), 1)  # [NBM, BLOCK_K]
        byte_t, inv_t = _e8m0(amax_t)
        v_t = tl.reshape(tl.where(bad_t[:, None, :], float("nan"), x3 * inv_t[:, None, :]), (BLOCK_M, BLOCK_K))
        qt = cast_e4m3(v_t, ROUND_IN_SOFTWARE)
        tl.store(QT + cols[:, None] * M_pad + rows[None, :], tl.trans(qt),
                 mask=col_ok[:, None] & (rows < M_pad)[None, :])
        byte_t = tl.trans(tl.where(bad_t, _E8M0_NAN, byte_t).to(tl.uint8))  # [BLOCK_K, NBM]
        c2 = cols[:, None] + tl.zeros((BLOCK_K, NBM), tl.int64)
        b2 = pid_m.to(tl.int64) * NBM + tl.arange(0, NBM)[None, :] + tl.zeros((BLOCK_K, NBM), tl.int64)
        t_ok = (c2 < K) & (b2 < M_pad // 32)
        if SWIZZLE:
            tl.store(ST + _swizzled(c2, b2, ST_TILES), byte_t, mask=t_ok)
        else:
            tl.store(ST + c2 * (M_pad // 32) + b2, byte_t, mask=t_ok)


@triton.jit
def _abs_max_partial(
    X,  # pointer to the input [M, K], unit stride along K
    Partial,  # [programs] fp32: each program's largest finite |x|
    stride_x, M, K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = as_f32(tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None] & (cols < K)[None, :],
                        other=0.0))
    a, _ = _finite_amax(tl.abs(x), 1)
    tl.store(Partial + pid_m * tl.num_programs(1) + pid_k, tl.max(a, axis=0))


@triton.jit
def _e2m1_codes(v, U, STOCHASTIC: tl.constexpr):
    """e2m1 codes (int32, sign in bit 3) of fp32 v, saturated at +-6: to nearest even, or up with
    probability (|v| - lo) / (hi - lo) given uniform U in [0, 1) (STOCHASTIC)."""
    a = tl.minimum(tl.abs(v), 6.0)
    if STOCHASTIC:
        step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))  # e2m1's spacing around a
        lo = tl.floor(a * (1.0 / step)) * step  # powers of two: exact (`/` is approximate on a GPU)
        r = tl.where(U * step < a - lo, lo + step, lo)
        code = tl.where(r < 2.0, r * 2.0, tl.where(r < 4.0, r + 2.0, r * 0.5 + 4.0)).to(tl.int32)
    else:  # the midpoints between neighbours; ties (0.25, 1.25, 2.5, 5) go to the even code
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))
    return code | tl.where(v < 0, 8, 0)


@triton.jit
def _uniform(seed, offset):
    """Uniform fp32 in [0, 1) with 24 random bits, from Philox at (seed, offset): `uniform_ref`."""
    r = tl.randint(seed, offset)
    return (r >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _nvfp4_pack(x, scale_of_value, g, U, ROWS: tl.constexpr, COLS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Packed e2m1 bytes [ROWS, COLS / 2] of x / (s g) (0 where s is 0), the low nibble the even column."""
    d = scale_of_value * g
    v = tl.where(d > 0, tl.math.div_rn(x, tl.where(d > 0, d, 1.0)), 0.0)
    code = _e2m1_codes(v, U, STOCHASTIC)
    lo, hi = tl.split(tl.reshape(code, (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _nvfp4_scales(amax, bad, g, ROUND_IN_SOFTWARE: tl.constexpr, TOP: tl.constexpr):
    """(e4m3 block scales, as fp32 values) for block maxima amax: e4m3(min(amax / (TOP g), 448)), NaN if bad;
    TOP: the e2m1 value a block's maximum maps to (6; 4 for Four Over Six's other candidate)."""
    s = tl.math.div_rn(amax, g * TOP)
    s = tl.where(bad, float("nan"), tl.minimum(s, _FP8_MAX))
    s8 = cast_e4m3(s, ROUND_IN_SOFTWARE)
    # NaN from the flag, not from the e4m3 byte: the interpreter reads e4m3's NaN (0x7F) back as 480
    return s8.to(tl.uint8, bitcast=True), tl.where(bad, float("nan"), s8.to(tl.float32))


@triton.jit
def _e2m1_value(code):
    """The fp32 value of e2m1 codes (int32, sign in bit 3): E2M1_VALUES, negated for the sign."""
    c = code & 7
    m = tl.where(c < 4, c.to(tl.float32) * 0.5,
                 tl.where(c == 4, 2.0, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0))))
    return tl.where((code & 8) != 0, -m, m)


@triton.jit
def _nvfp4_codes_error(x, sf, g, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(e2m1 codes to nearest [ROWS, COLS], each 1x16 block's squared error [ROWS, COLS / 16]) of x under block
    scales sf: the error of a value is value(code) * s * g - x, squared, and a block's 16 are added in pairs
    ((0 + 1) + (2 + 3)) + ..., a fixed order the reference repeats (the launch turns off fused multiply-add
    for the same reason: `_nvfp4_adaptive_ref`)."""
    NB: tl.constexpr = COLS // 16
    d = tl.reshape(tl.broadcast_to(sf[:, :, None], (ROWS, NB, 16)), (ROWS, COLS)) * g
    v = tl.where(d > 0, tl.math.div_rn(x, tl.where(d > 0, d, 1.0)), 0.0)
    code = _e2m1_codes(v, 0.0, False)
    e = _e2m1_value(code) * d - x
    a, b = tl.split(tl.reshape(e * e, (ROWS, NB, 8, 2)))
    a, b = tl.split(tl.reshape(a + b, (ROWS, NB, 4, 2)))
    a, b = tl.split(tl.reshape(a + b, (ROWS, NB, 2, 2)))
    a, b = tl.split(a + b)
    return code, a + b


@triton.jit
def _nvfp4_adaptive(x, amax, bad, g, ROWS: tl.constexpr, COLS: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr):
    """Four Over Six: (packed e2m1 bytes [ROWS, COLS / 2], e4m3 block scales [ROWS, COLS / 16]) of x, each 1x16
    block scaled so that its maximum maps to 6 or to 4, whichever leaves the smaller squared error (6 on a tie:
    the plain recipe's; a block with a NaN or an infinity keeps its NaN scale)."""
    NB: tl.constexpr = COLS // 16
    s8_6, sf_6 = _nvfp4_scales(amax, bad, g, ROUND_IN_SOFTWARE, 6.0)
    s8_4, sf_4 = _nvfp4_scales(amax, bad, g, ROUND_IN_SOFTWARE, 4.0)
    code_6, err_6 = _nvfp4_codes_error(x, sf_6, g, ROWS, COLS)
    code_4, err_4 = _nvfp4_codes_error(x, sf_4, g, ROWS, COLS)
    four = err_4 < err_6  # False where either is NaN
    code = tl.where(tl.reshape(tl.broadcast_to(four[:, :, None], (ROWS, NB, 16)), (ROWS, COLS)), code_4, code_6)
    lo, hi = tl.split(tl.reshape(code, (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8), tl.where(four, s8_4, s8_6)


@triton.jit
def _hadamard16(x, SIGNS: tl.constexpr, ROWS: tl.constexpr):
    """Each row of x [ROWS, 16] times the random orthogonal H D / 4: signs (bit i of SIGNS: minus) then
    four butterfly stages (a, b) -> (a + b, a - b) at distances 1, 2, 4, 8, then / 4 (exact)."""
    i = tl.arange(0, 16)
    x = x * tl.where(((SIGNS >> i) & 1) != 0, -1.0, 1.0)[None, :]
    for s in tl.static_range(4):
        # the distance h = 1 << s written out in the shape: the GPU compiler refuses a name annotated
        # tl.constexpr bound again in the next unrolled iteration, and makes a plain name a tensor
        x4 = tl.permute(tl.reshape(x, (ROWS, 8 >> s, 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(x4)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, 16))
    return x * 0.25


@triton.jit
def _nvfp4_quantize(
    X,  # pointer to the input [M, K], unit stride along K
    Q,  # the copy along K: [M, K_pad / 2] packed e2m1 (WRITE_Q)
    S,  # its scales: [M, K_pad / 16] e4m3, or swizzled (SWIZZLE; zeroed by the launcher)
    QT,  # the transposed copy [K, M_pad / 2] packed e2m1, zeros past M (WRITE_QT)
    ST,  # its scales: [K, M_pad / 16] e4m3, or swizzled
    TensorScale,  # [1] fp32: g = amax / (6 * 448)
    stride_x,  # elements between two rows of X
    M, K,  # rows and columns of X
    K_pad, M_pad,  # K and M rounded up to 16 (M to BLOCK_M for the transposed copy: whole tiles)
    S_TILES, ST_TILES,  # 4-block tiles per row of S and of ST (the swizzled layout)
    seed,  # Philox seed of the stochastic rounding
    BLOCK_M: tl.constexpr,  # rows per program, a multiple of 16
    BLOCK_K: tl.constexpr,  # columns per program, a multiple of 16
    TILES: tl.constexpr,  # 16x16 blocks (weights): both copies share each tile's scale
    WRITE_Q: tl.constexpr,
    WRITE_QT: tl.constexpr,
    STOCHASTIC: tl.constexpr,  # stochastic rounding (gradients), else to nearest even
    ADAPTIVE: tl.constexpr,  # Four Over Six block scales (`_nvfp4_adaptive`; 1x16 blocks, to nearest)
    HADAMARD: tl.constexpr,  # the random Hadamard transform of the transposed copy, along M
    SIGNS: tl.constexpr,  # its 16 random signs, one bit each
    SWIZZLE: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 16
    NBM: tl.constexpr = BLOCK_M // 16
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < K
    x = as_f32(tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0))
    g = tl.load(TensorScale)
    if TILES:  # one scale per 16x16 tile, for both copies
        a4 = tl.abs(tl.reshape(x, (NBM, 16, NB, 16)))
        bad4 = (a4 != a4) | (a4 == float("inf"))
        amax_t = tl.max(tl.max(tl.where(bad4, 0.0, a4), axis=3), axis=1)  # [NBM, NB]
        bad_t = tl.max(tl.max(bad4.to(tl.int32), axis=3), axis=1) > 0
        s8_t, sf_t = _nvfp4_scales(amax_t, bad_t, g, ROUND_IN_SOFTWARE, 6.0)
    if WRITE_Q:
        if TILES:
            s8 = tl.reshape(tl.broadcast_to(s8_t[:, None, :], (NBM, 16, NB)), (BLOCK_M, NB))
            sf = tl.reshape(tl.broadcast_to(sf_t[:, None, :], (NBM, 16, NB)), (BLOCK_M, NB))
        else:
            amax, bad = _finite_amax(tl.abs(tl.reshape(x, (BLOCK_M, NB, 16))), 2)
            s8, sf = _nvfp4_scales(amax, bad, g, ROUND_IN_SOFTWARE, 6.0)
        if ADAPTIVE:
            packed, s8 = _nvfp4_adaptive(x, amax, bad, g, BLOCK_M, BLOCK_K, ROUND_IN_SOFTWARE)
        else:
            sfv = tl.reshape(tl.broadcast_to(sf[:, :, None], (BLOCK_M, NB, 16)), (BLOCK_M, BLOCK_K))
            U = 0.0
            if STOCHASTIC:
                U = _uniform(seed, rows[:, None] * K_pad + cols[None, :])
            packed = _nvfp4_pack(x, sfv, g, U, BLOCK_M, BLOCK_K, STOCHASTIC)
        pcols = pid_k.to(tl.int64) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(Q + rows[:, None] * (K_pad // 2) + pcols[None, :], packed,
                 mask=row_ok[:, None] & (pcols < K_pad // 2)[None, :])
        r2 = rows[:, None] + tl.zeros((BLOCK_M, NB), tl.int64)
        b2 = pid_k.to(tl.int64) * NB + tl.arange(0, NB)[None, :] + tl.zeros((BLOCK_M, NB), tl.int64)
        s_ok = (r2 < M) & (b2 < K_pad // 16)
        if SWIZZLE:
            tl.store(S + _swizzled(r2, b2, S_TILES), s8, mask=s_ok)
        else:
            tl.store(S + r2 * (K_pad // 16) + b2, s8, mask=s_ok)
    if WRITE_QT:  # the tile transposed: [BLOCK_K rows of QT, BLOCK_M tokens], blocks of 16 tokens
        xt = tl.trans(x)
        g_t = g
        if HADAMARD:
            g_t = g * 4.0  # the transform grows a value by at most 4x (`quantize_nvfp4`)
            xt = tl.reshape(_hadamard16(tl.reshape(xt, (BLOCK_K * NBM, 16)), SIGNS, BLOCK_K * NBM), (BLOCK_K, BLOCK_M))
        if TILES:
            s8t = tl.reshape(tl.broadcast_to(tl.trans(s8_t)[:, None, :], (NB, 16, NBM)), (BLOCK_K, NBM))
            sft = tl.reshape(tl.broadcast_to(tl.trans(sf_t)[:, None, :], (NB, 16, NBM)), (BLOCK_K, NBM))
        else:
            amax_c, bad_c = _finite_amax(tl.abs(tl.reshape(xt, (BLOCK_K, NBM, 16))), 2)
            s8t, sft = _nvfp4_scales(amax_c, bad_c, g_t, ROUND_IN_SOFTWARE, 6.0)
        if ADAPTIVE:
            packed_t, s8t = _nvfp4_adaptive(xt, amax_c, bad_c, g_t, BLOCK_K, BLOCK_M, ROUND_IN_SOFTWARE)
        else:
            sftv = tl.reshape(tl.broadcast_to(sft[:, :, None], (BLOCK_K, NBM, 16)), (BLOCK_K, BLOCK_M))
            U_t = 0.0
            if STOCHASTIC:  # another stream than the row copy's: offsets past it
                U_t = _uniform(seed, M_pad * K_pad + cols[:, None] * M_pad + rows[None, :])
            packed_t = _nvfp4_pack(xt, sftv, g_t, U_t, BLOCK_K, BLOCK_M, STOCHASTIC)
        prow = pid_m.to(tl.int64) * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
        tl.store(QT + cols[:, None] * (M_pad // 2) + prow[None, :], packed_t, mask=col_ok[:, None])
        c2 = cols[:, None] + tl.zeros((BLOCK_K, NBM), tl.int64)
        m2 = pid_m.to(tl.int64) * NBM + tl.arange(0, NBM)[None, :] + tl.zeros((BLOCK_K, NBM), tl.int64)
        if SWIZZLE:
            tl.store(ST + _swizzled(c2, m2, ST_TILES), s8t, mask=c2 < K)
        else:
            tl.store(ST + c2 * (M_pad // 16) + m2, s8t, mask=c2 < K)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
# Tiles and warps per program, by the copies asked for, (along K, along M): MX_CONFIG (BLOCK_M, BLOCK_K,
# num_warps), NV_CONFIG (BLOCK_K, num_warps; NV_BLOCK_M, which also pads the transposed copy's tokens, is fixed).
# `benchmark_kernels.py --mx-quant --tune` times the choices on the GPU at hand, each checked bit for bit first;
# these are its fastest on an H100 at the 8B step's shapes (results/H100/mx_quant_tune.log): tiles of more than
# 32 rows were slower for the transposed copy, 256 columns 1-4 % faster along K alone, and NVFP4's transposed
# copy with stochastic rounding and the Hadamard transform 1.7x faster on [32, 64] tiles and 8 warps than on
# [32, 128] and 4. MX_BLOCK_K / MX_NUM_WARPS: the [32, BLOCK_K] tiles of the producers (fp8_producers_kernel.py).
MX_BLOCK_K, MX_NUM_WARPS = 128, 4
MX_CONFIG = {(True, False): (32, 256, 4), (False, True): (32, 128, 4), (True, True): (32, 128, 4)}
NV_BLOCK_M = 32
NV_CONFIG = {(True, False): (128, 4), (False, True): (64, 8), (True, True): (64, 8)}


def scale_buffer(rows: int, blocks: int, swizzle: bool, dtype, device) -> torch.Tensor:
    """Scales [rows, blocks] of one byte, or their swizzled layout (zeroed: its padding is read by cuBLAS)."""
    if swizzle:
        return torch.zeros(-(-rows // 128) * 128 * (-(-blocks // 4) * 4), dtype=torch.uint8, device=device).view(dtype)
    return torch.empty((rows, blocks), dtype=torch.uint8, device=device).view(dtype)


def quantize_mxfp8(x2: torch.Tensor, rows: bool = True, cols: bool = False, swizzle: bool = False):
    """One read of x [M, K] (unit stride along K): (q [M, K] e4m3, scales [M, cdiv(K, 32)] e8m0,
    qT [K, M_pad] e4m3, scales [K, M_pad / 32] e8m0), M_pad = M rounded up to 32, None for a copy not
    asked for. swizzle: the scales flat, in the layout cuBLAS reads (`mx_swizzled_scales`)."""
    if x2.dim() != 2 or x2.stride(-1) != 1:
        raise ValueError(f"quantize_mxfp8 takes a 2-D tensor with unit stride along K, got {tuple(x2.shape)}")
    kernel_utils.check_device(x2)  # a CPU tensor on a GPU machine: refused with the fix, not by Triton's launcher
    M, K = x2.shape
    m_pad, n_blocks = -(-M // MX_BLOCK) * MX_BLOCK, -(-K // MX_BLOCK)
    dev, e8 = x2.device, torch.float8_e8m0fnu
    q = torch.empty((M, K) if rows else (0,), dtype=FP8_DTYPE, device=dev)
    s = scale_buffer(M, n_blocks, swizzle, e8, dev) if rows else torch.empty(0, dtype=e8, device=dev)
    qt = torch.empty((K, m_pad) if cols else (0,), dtype=FP8_DTYPE, device=dev)
    st = scale_buffer(K, m_pad // MX_BLOCK, swizzle, e8, dev) if cols else torch.empty(0, dtype=e8, device=dev)
    if M and K:
        block_m, block_k, warps = MX_CONFIG[(bool(rows), bool(cols))]
        grid = (triton.cdiv(m_pad, block_m), triton.cdiv(K, block_k))
        _mxfp8_quantize[grid](
            x2, q, s.view(torch.uint8), qt, st.view(torch.uint8), x2.stride(0), M, K, m_pad,
            -(-n_blocks // 4), -(-(m_pad // MX_BLOCK) // 4),
            BLOCK_M=block_m, BLOCK_K=block_k, WRITE_Q=rows, WRITE_QT=cols, SWIZZLE=swizzle,
            ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE, num_warps=warps,
        )
    elif cols:
        qt.view(torch.uint8).zero_()
    return ((q, s) if rows else (None, None)) + ((qt, st) if cols else (None, None))


def tensor_amax(x2: torch.Tensor) -> torch.Tensor:
    """The largest finite |x| of x [M, K], floored at AMAX_FLOOR: [1] fp32 (one read, then a tiny max)."""
    kernel_utils.check_device(x2)
    M, K = x2.shape
    bm, bk = 32, 256
    grid = (triton.cdiv(M, bm), triton.cdiv(K, bk))
    partial = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=x2.device)
    if M and K:
        _abs_max_partial[grid](x2, partial, x2.stride(0), M, K, BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return partial.amax().clamp(min=AMAX_FLOOR).reshape(1) if partial.numel() else x2.new_full((1,), AMAX_FLOOR,
                                                                                                dtype=torch.float32)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """g = amax / (6 * 448), [1] fp32 (a tensor divisor: IEEE division, as the reference's)."""
    return amax.float() / torch.full_like(amax.float(), E2M1_MAX * FP8_MAX)


def hadamard_signs(seed: int) -> int:
    """The 16 random signs of the Hadamard transform, one bit each (1: minus), from `seed`."""
    g = torch.Generator().manual_seed(int(seed))
    return int((torch.randint(0, 2, (16,), generator=g) << torch.arange(16)).sum())


def quantize_nvfp4(x2: torch.Tensor, rows: bool = True, cols: bool = False, tiles: bool = False,
                   stochastic: bool = False, seed: int = 0, hadamard: int | None = None, swizzle: bool = False,
                   amax: torch.Tensor | None = None, adaptive: bool = False):
    """x [M, K] as NVFP4: (q [M, K_pad / 2] uint8, scales [M, K_pad / 16] e4m3, qT [K, M_pad / 2] uint8,
    scales [K, M_pad / 16] e4m3, g [1] fp32, the transposed copy's g [1]), K_pad = K rounded up to 16,
    M_pad = M rounded up to 32
    (the kernel's tile), None for a copy not asked for.

    tiles: one scale per 16x16 tile (weights; M and K multiples of 16), shared by both copies;
    stochastic: stochastic rounding with Philox `seed`; hadamard: the 16 sign bits of the random
    Hadamard transform applied to the transposed copy along M (`hadamard_signs`), None for none; that
    copy then takes 4 g as its tensor scale (the transform grows a value by at most 16 x 1/4 = 4x, so no
    block saturates; a power of two, so exact);
    amax: the tensor's largest finite |x| ([1] fp32) if known, else `tensor_amax` reads x for it;
    adaptive: Four Over Six (Cook et al., 2025): each 1x16 block's maximum maps to 6 or to 4, whichever leaves
    the smaller squared error (`_nvfp4_adaptive`); to nearest only, not with tiles."""
    if x2.dim() != 2 or x2.stride(-1) != 1:
        raise ValueError(f"quantize_nvfp4 takes a 2-D tensor with unit stride along K, got {tuple(x2.shape)}")
    kernel_utils.check_device(x2, *([] if amax is None else [amax]))
    M, K = x2.shape
    if tiles and hadamard is not None:
        raise ValueError("NVFP4: the Hadamard transform is for the dW operands (activations, gradients), not 16x16 "
                         "weight tiles")
    if adaptive and (tiles or stochastic):
        raise ValueError("NVFP4 Four Over Six (adaptive) compares errors of 1x16 blocks rounded to nearest: not with "
                         "16x16 tiles or stochastic rounding")
    if tiles and (M % NV_BLOCK or K % NV_BLOCK):
        raise ValueError(f"NVFP4 16x16 tiles: the weight's shape {M} x {K} must be multiples of 16")
    k_pad, m_pad = -(-K // NV_BLOCK) * NV_BLOCK, -(-M // NV_BLOCK_M) * NV_BLOCK_M
    dev, e4 = x2.device, FP8_DTYPE
    g = nvfp4_tensor_scale(tensor_amax(x2) if amax is None else amax.reshape(1))
    q = torch.empty((M, k_pad // 2) if rows else (0,), dtype=torch.uint8, device=dev)
    s = scale_buffer(M, k_pad // NV_BLOCK, swizzle, e4, dev) if rows else torch.empty(0, dtype=e4, device=dev)
    qt = torch.empty((K, m_pad // 2) if cols else (0,), dtype=torch.uint8, device=dev)
    st = scale_buffer(K, m_pad // NV_BLOCK, swizzle, e4, dev) if cols else torch.empty(0, dtype=e4, device=dev)
    if M and K:
        block_k, warps = NV_CONFIG[(bool(rows), bool(cols))]
        grid = (m_pad // NV_BLOCK_M, triton.cdiv(K, block_k))
        _nvfp4_quantize[grid](
            x2, q, s.view(torch.uint8), qt, st.view(torch.uint8), g, x2.stride(0), M, K, k_pad, m_pad,
            -(-(k_pad // NV_BLOCK) // 4), -(-(m_pad // NV_BLOCK) // 4), int(seed),
            BLOCK_M=NV_BLOCK_M, BLOCK_K=block_k, TILES=tiles, WRITE_Q=rows, WRITE_QT=cols, STOCHASTIC=stochastic,
            ADAPTIVE=adaptive, HADAMARD=hadamard is not None, SIGNS=hadamard or 0, SWIZZLE=swizzle,
            ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE, num_warps=warps,
            enable_fp_fusion=not adaptive,  # Four Over Six's errors: each product rounded, as in the reference
        )
    elif cols:
        qt.zero_()
    g_t = g * 4.0 if hadamard is not None else g  # the transposed copy's tensor scale
    return ((q, s) if rows else (None, None)) + ((qt, st) if cols else (None, None)) + (g, g_t)


def ideal_bytes(n_rows: int, n_cols: int, dtype: torch.dtype, fmt: str = "mxfp8", copies: int = 2) -> int:
    """Bytes one quantization of an [n_rows, n_cols] tensor of `dtype` must move (module docstring):
    one read, `copies` (1 or 2) quantized copies with one scale byte per block; NVFP4 also reads the
    tensor once for its maximum."""
    n, e = n_rows * n_cols, dtype.itemsize
    if fmt == "mxfp8":
        return n * e + copies * (n + n // MX_BLOCK)
    return 2 * n * e + copies * (n // 2 + n // NV_BLOCK)


# ------------------------------------------------------------------------------------------------
# Dequantization and the emulated matmul (Hopper and the CPU: `--fp8-emulate`)
# ------------------------------------------------------------------------------------------------
# The dequantizers make fp32 (the references) or bf16 (`dtype`: the emulated matmul on a GPU, which multiplies in
# bf16). Both give the same values there: an e4m3 or e2m1 value times an e8m0 or e4m3 scale has at most 8
# significant bits, and a bf16 product is the fp32 product rounded once, as the cast of the fp32 one is. In bf16
# they hold 6 bytes per value at their peak (the values, the scales repeated, the product) against fp32's 12
# (playbook/plan/estimate.py, DEQUANTIZE_BYTES).
def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [R, S] e4m3 times its e8m0 scales [R, cdiv(S, 32)] (natural layout): [R, S] in `dtype`."""
    s = scales.to(dtype).repeat_interleave(MX_BLOCK, dim=1)[:, :q.shape[1]]
    return q.to(dtype) * s


def e2m1_table(device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 e2m1 codes' values, indexed by code (sign in bit 3): E2M1_VALUES, then their negatives."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _e2m1_pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Byte b's two e2m1 values (b & 15, b >> 4): [256, 2], made once per device and dtype. Made at each call, the
    table was a copy from host memory before every emulated matmul: the host waited for the GPU each time, and a
    CUDA graph could not capture the step."""
    table = e2m1_table(device, dtype)
    return torch.stack((table.repeat(16), table.repeat_interleave(16)), dim=-1)


def e2m1_decode(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 bytes [R, C] -> [R, 2 C] in `dtype` (the low nibble first): each byte looks up its pair of
    values in a 256-row table, with int32 indices (2 bytes per value, where int64 codes per nibble took 8)."""
    return _e2m1_pairs(packed.device, dtype)[packed.int()].reshape(packed.shape[0], -1)


def dequantize_nvfp4(q: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None, cols: int | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 q [R, S_pad / 2] times its e4m3 block scales [R, S_pad / 16] and g (None: the block scales
    alone): [R, cols] in `dtype`."""
    v = e2m1_decode(q, dtype) * scales.to(dtype).repeat_interleave(NV_BLOCK, dim=1)
    if g is not None:
        v = v * g.to(dtype).reshape(())
    return v if cols is None else v[:, :cols]


# ------------------------------------------------------------------------------------------------
# References (plain PyTorch; the tests compare the kernels with them bit for bit)
# ------------------------------------------------------------------------------------------------
def _pad_to(xf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(xf, (0, cols - xf.shape[1], 0, rows - xf.shape[0]))


def _finite_amax_ref(xf: torch.Tensor, dim):
    a = xf.abs()
    bad = ~torch.isfinite(xf)
    return torch.where(bad, 0.0, a).amax(dim=dim), bad.any(dim=dim)


def quantize_mxfp8_ref(x: torch.Tensor):
    """MXFP8 along K in plain PyTorch: (q [M, K] e4m3, scales [M, cdiv(K, 32)] e8m0) with the module
    docstring's rules (the smallest power of two that keeps 448, NaN blocks, zero padding)."""
    M, K = x.shape
    nb = -(-K // MX_BLOCK)
    xf = _pad_to(x.float(), M, nb * MX_BLOCK).view(M, nb, MX_BLOCK)
    amax, bad = _finite_amax_ref(xf, 2)
    m, p = torch.frexp(amax)
    e = torch.where(amax == 0, -127, p - 9 + (m > 0.875).to(p.dtype)).clamp(-127, 127)  # frexp(0) = (0, 0)
    v = xf / torch.ldexp(torch.ones_like(amax), e)[:, :, None]
    v = torch.where(bad[:, :, None], float("nan"), v.clamp(-FP8_MAX, FP8_MAX))
    byte = torch.where(bad, E8M0_NAN, e + 127).to(torch.uint8)
    return v.to(FP8_DTYPE).view(M, -1)[:, :K], byte.view(torch.float8_e8m0fnu)


def quantize_mxfp8_t_ref(x: torch.Tensor):
    """The transposed copy: x.T zero-padded to M_pad (a multiple of 32) tokens, quantized along them."""
    M, K = x.shape
    return quantize_mxfp8_ref(_pad_to(x.float(), -(-M // MX_BLOCK) * MX_BLOCK, K).t())


def philox_ref(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Triton's `tl.randint(seed, offsets)` (Philox 4x32, 10 rounds) in PyTorch int64: uint32 values."""
    mask = 0xFFFFFFFF
    off = offsets.long()
    c0, c1 = off & mask, (off >> 32) & mask
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = int(seed) & mask, (int(seed) >> 32) & mask

    def mul(a: int, b: torch.Tensor):  # (high, low) 32 bits of a * b without leaving int64
        lo16, hi16 = b & 0xFFFF, b >> 16
        p_lo, p_hi = a * lo16, a * hi16
        return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & mask

    for _ in range(10):
        hi_b, lo_b = mul(0xCD9E8D57, c2)
        hi_a, lo_a = mul(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0


def uniform_ref(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """The kernels' uniform numbers in [0, 1): the top 24 bits of `philox_ref`, times 2^-24."""
    return (philox_ref(seed, offsets) >> 8).float() * 2.0**-24


def e2m1_codes_ref(v: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """`_e2m1_codes` in PyTorch: e2m1 codes (sign in bit 3) of fp32 v, to nearest even or stochastic (u)."""
    a = v.abs().clamp(max=E2M1_MAX)
    if u is None:
        code = sum((a > t).int() if strict else (a >= t).int()
                   for t, strict in ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
                                     (3.5, False), (5.0, True)))
    else:
        step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
        lo = torch.floor(a * (1.0 / step)) * step
        r = torch.where(u * step < a - lo, lo + step, lo)
        code = torch.where(r < 2.0, r * 2.0, torch.where(r < 4.0, r + 2.0, r * 0.5 + 4.0)).int()
    return code | torch.where(v < 0, 8, 0).int()


def hadamard_ref(x: torch.Tensor, signs: int) -> torch.Tensor:
    """Each group of 16 consecutive values of each row of fp32 x [R, 16 n] times H D / 4 (`_hadamard16`)."""
    R, C = x.shape
    d = torch.where((signs >> torch.arange(16)) & 1 != 0, -1.0, 1.0).to(x.device)
    y = (x.reshape(-1, 16) * d).clone()
    for s in range(4):
        h = 1 << s
        y4 = y.view(-1, 16 // (2 * h), 2, h)
        a, b = y4[:, :, 0], y4[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, 16)
    return (y * 0.25).view(R, C)


def _nvfp4_scales_ref(amax, bad, g, top: float = 6.0):
    s = amax / (g * top)
    s = torch.where(bad, float("nan"), s.clamp(max=FP8_MAX))
    s8 = s.to(FP8_DTYPE)
    return s8, s8.float()


def _nvfp4_values_ref(xf, sf, g, u):
    d = sf * g
    v = torch.where(d > 0, xf / torch.where(d > 0, d, 1.0), 0.0)
    code = e2m1_codes_ref(v, u)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)


def _nvfp4_adaptive_ref(xf, amax, bad, g):
    """`_nvfp4_adaptive` in PyTorch: (packed codes, e4m3 scales) of padded xf [M, K_pad], each 1x16 block scaled
    to 6 or to 4 by the smaller squared error, the block's errors added in the kernel's order."""
    M, k_pad = xf.shape
    table = e2m1_table(xf.device)
    out = []
    for top in (6.0, 4.0):
        s8, sf = _nvfp4_scales_ref(amax, bad, g, top)
        d = sf.repeat_interleave(16, dim=1) * g
        code = e2m1_codes_ref(torch.where(d > 0, xf / torch.where(d > 0, d, 1.0), 0.0))
        e = table[code.long()] * d - xf
        err = (e * e).view(M, k_pad // 16, 16)
        while err.shape[-1] > 1:  # pairs: (0 + 1), (2 + 3), ... then their sums in pairs
            err = err[..., 0::2] + err[..., 1::2]
        out.append((code, s8, err[..., 0]))
    (code_6, s8_6, err_6), (code_4, s8_4, err_4) = out
    four = err_4 < err_6
    code = torch.where(four.repeat_interleave(16, dim=1), code_4, code_6)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8), torch.where(four, s8_4.view(torch.uint8),
                                                                               s8_6.view(torch.uint8)).view(FP8_DTYPE)


def quantize_nvfp4_ref(x: torch.Tensor, g: torch.Tensor, tiles: bool = False, u: torch.Tensor | None = None,
                       adaptive: bool = False):
    """NVFP4 along K in plain PyTorch, given the tensor scale g ([1] fp32): (q [M, K_pad / 2] uint8,
    scales [M, K_pad / 16] e4m3); 1x16 blocks, or 16x16 tiles (tiles; M a multiple of 16), rounded to
    nearest even or stochastically with uniform numbers u [M, K_pad]; adaptive: Four Over Six
    (`_nvfp4_adaptive_ref`)."""
    M, K = x.shape
    k_pad = -(-K // NV_BLOCK) * NV_BLOCK
    xf = _pad_to(x.float(), M, k_pad)
    g = g.float().reshape(())
    if tiles:
        amax, bad = _finite_amax_ref(xf.view(M // 16, 16, k_pad // 16, 16), (1, 3))
        s8, sf = _nvfp4_scales_ref(amax, bad, g)
        s8, sf = s8.repeat_interleave(16, dim=0), sf.repeat_interleave(16, dim=0)
    else:
        amax, bad = _finite_amax_ref(xf.view(M, k_pad // 16, 16), 2)
        if adaptive:
            return _nvfp4_adaptive_ref(xf, amax, bad, g)
        s8, sf = _nvfp4_scales_ref(amax, bad, g)
    return _nvfp4_values_ref(xf, sf.repeat_interleave(16, dim=1), g, u), s8


def quantize_nvfp4_t_ref(x: torch.Tensor, g: torch.Tensor, tiles: bool = False, u: torch.Tensor | None = None,
                         hadamard: int | None = None, adaptive: bool = False):
    """The transposed copy: x.T zero-padded to M_pad tokens (a multiple of 32), Hadamard-transformed along
    them (hadamard: its sign bits), quantized along them."""
    M, K = x.shape
    xt = _pad_to(x.float(), -(-M // NV_BLOCK_M) * NV_BLOCK_M, K).t().contiguous()
    if hadamard is not None:
        xt, g = hadamard_ref(xt, hadamard), g * 4.0
    return quantize_nvfp4_ref(xt, g, tiles, u, adaptive)


def nvfp4_ref(x: torch.Tensor, stochastic: bool = False, seed: int = 0, tiles: bool = False,
              hadamard: int | None = None, adaptive: bool = False):
    """Everything `quantize_nvfp4(x, True, True, ...)` returns, in plain PyTorch: (q, s, qT, sT, g, g of qT)."""
    M, K = x.shape
    xf = x.float()
    amax = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax() if xf.numel() else xf.new_zeros(())
    g = nvfp4_tensor_scale(amax.clamp(min=AMAX_FLOOR).reshape(1))
    k_pad, m_pad = -(-K // NV_BLOCK) * NV_BLOCK, -(-M // NV_BLOCK_M) * NV_BLOCK_M
    u = ut = None
    if stochastic:
        u = uniform_ref(seed, torch.arange(M)[:, None] * k_pad + torch.arange(k_pad)[None, :]).to(x.device)
        ut = uniform_ref(seed, m_pad * k_pad + torch.arange(K)[:, None] * m_pad
                         + torch.arange(m_pad)[None, :]).to(x.device)
    q, s = quantize_nvfp4_ref(x, g, tiles, u, adaptive)
    qt, st = quantize_nvfp4_t_ref(x, g, tiles, ut, hadamard, adaptive)
    return q, s, qt, st, g, g * 4.0 if hadamard is not None else g
