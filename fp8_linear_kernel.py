"""FP8 linear layers for training: the decoder's seven projections on FP8 tensor cores (Hopper, Blackwell).

    y  = x W^T          x [M tokens, K], W [N, K]          (forward)
    dx = dy W           dy [M, N]                          (backward, reduction over N)
    dW = dy^T x                                            (backward, reduction over the M tokens)

What you build here: Triton kernels that quantize a bf16 tensor to float8_e4m3fn with one fp32 scale
per row (or per column, written transposed), an `autograd.Function` that runs all three matmuls of a
linear layer as `torch._scaled_mm` on FP8 operands, and a module that replaces the q/k/v/o and
gate/up/down projections of a Hugging Face model. The other FP8 lessons build on this one:
fp8_recipes_kernel.py, fp8_producers_kernel.py, fp8_lora_kernel.py (docs/fp8.md, "The lessons").
What you learn: what a scaled FP8 matmul needs (which dimension each scale runs along, which operand
must be column-major, the 16-element alignment), why the weight-gradient matmul needs a *different*
quantization than the forward (its reduction runs over tokens), and how much memory the backward
pass really keeps.

Why FP8, and what it costs
--------------------------
An H100 or H200 multiplies FP8 operands at twice the bf16 rate (~1979 against ~989 dense TFLOPS at
peak). The seven projections are ~87% of an 8B model's training FLOPs at 2048 tokens per sequence
(the lm_head and attention are the rest), so once the element-wise work is fused (the other kernel
files) they set the step's floor; FP8 lowers that floor. The price is precision:
e4m3 keeps 3 mantissa bits, so each quantized value is off by up to 2^-4 of itself (half a step of
2^-3), against bf16's 2^-8. The matmuls accumulate in fp32 and return bf16, and errors of many
independent products average out along the reduction (see fp8_linear_test.py for the bounds).

Scales. e4m3's largest finite value is 448. A row r of x is stored as q = x / s_r with
s_r = amax_r / 448 (amax_r = max |x| over the row), and the matmul multiplies the scales back in:
    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k]
which is exact algebra only if every scale is constant along the *reduction* dimension. Hence:
    forward   y  = x W^T     x scaled per token row,    W per output row (both along K)
    backward  dx = dy W      dy per token row,          W per column, i.e. along N (the out dim)
              dW = dy^T x    dy and x both along the tokens (per column of each, over M)
So W is quantized twice (per row for the forward, per column for dx), and x and dy once per row and
once per column. `torch._scaled_mm(a, b, scale_a [rows of a, 1], scale_b [1, cols of b])` wants `a`
row-major and `b` column-major: the column-quantizing kernel therefore writes its output transposed
(xT [K, M] row-major, whose transpose is the column-major [M, K] operand), which also puts the token
dimension last, where the dW matmul reduces over it. The matmul needs every dimension it reduces
over, and `b`'s columns, to be multiples of 16: in_features and out_features must be, and the token
dimension is zero-padded to a multiple of 16 inside the transposed copies (zeros add nothing to dW).

Count the bytes before timing anything
--------------------------------------
The matmuls are compute-bound; the quantizations are pure memory traffic added around them, and
they are what the kernels below must keep small. Quantizing an [M, K] bf16 tensor per row, written
in PyTorch (bytes per element):

    xf = x.float()                               # read 2, write 4
    amax = xf.abs().amax(dim=1)                  # read 4, write 4; read 4
    q = (xf * (448 / amax)[:, None])             # read 4, write 4
    q = q.clamp(-448, 448).to(float8_e4m3fn)     # read 4, write 4; read 4, write 1
                                                 # 39 bytes per element

The row kernel reads x once and writes q once: 3 bytes per element (13x less). A per-*column* scale
depends on every row, so no kernel can both find it and apply it while streaming a tensor larger
than on-chip memory once. So the row kernel also takes the column maxima of what it reads (the
tensor is in registers anyway: a few MB of fp32 partial maxima written, no extra read), and the
column kernel reads x a second time to cast and transpose it: 3 more bytes per element. Every
column quantization in this file follows a row quantization of the same tensor (of x and W in the
forward, of dy in backward), so a layer never reads a tensor more than twice, and backward reads W
and x only once each. `ideal_bytes(n_rows, n_cols, dtype, layouts)` is that count (plus the fp32
scales, without the partial column maxima, an implementation detail).

At 8192 tokens of LLaMA 3.1 8B (hidden 4096) that is 100,696,064 B per row (`ideal_bytes(8192, 4096,
bf16, "rows")`) and 201,375,744 B for both layouts ("both"); docs/fp8.md ("The bytes of the
quantizations") sets them against the matmul time they save.

What backward keeps, per token and decoder layer (LLaMA 3.1 8B: H = 4096, I = 14336)
--------------------------------------------------------------------------------------
nn.Linear keeps its bf16 input (2 bytes per element). `Float8Linear` keeps either the same bf16
input (`keep_fp8_input=False`; quantized per column in backward) or only its FP8 transposed copy
and K fp32 scales (`keep_fp8_input=True`: 1 byte per element; the bf16 input is freed). The weight
is kept as the Parameter itself (no copy), quantized per column in backward: keeping that FP8 copy
from the forward would hold 1 byte per parameter (7 GB for 8B) from forward to backward. Which is
better for the input depends on who else holds it, so `patch_model` chooses per projection:

    input of             shared by / also kept by       bf16 nn.Linear    Float8Linear (patch_model)
    q, k, v              one tensor, three layers       2H =  8,192 B     bf16 kept: 8,192 B (3 FP8 copies: 12,288)
    o                    SDPA keeps its output          2H (shared)       bf16 kept: shared
    gate, up             one tensor, two layers         2H =  8,192 B     bf16 kept: 8,192 B
    down (h)             nothing                        2I = 28,672 B     FP8 kept: I = 14,336 B

With stock nn.Linear layers that is 45,056 B per token and layer (plus o's shared input), 30,720 B
with FP8; docs/fp8.md ("The bytes of the quantizations") sets it against the fused SwiGLU's bf16 MLP.

q, k and v read one tensor, and so do gate and up: the layers that keep their bf16 input quantize it
once for all of them, per row in the forward and per column in backward (through the model's
`Fp8Handoff`, fp8_producers_kernel.py), which saves 6 of the 10 activation quantizations of those
inputs per decoder layer and step. With the joined projections
(projections_kernel.py, in the default kernel set) q/k/v and gate/up each run as one FP8 layer on one
joined weight: that layer is its input's only reader, so it keeps only the FP8 copy (1 byte per
element), and the table above then reads 4,096 B for q/k/v and for gate/up.

Why eager mode goes around the custom operators
-----------------------------------------------
Each launcher is also a custom operator, which torch.compile needs (an opaque node in its graph).
Calling an operator costs the host ~15 us of Python and dispatcher work, and one FP8 step of LLaMA
3.1 8B makes ~1,100 such calls; where the host falls behind the GPU that is step time. So the layer
is a plain `torch.autograd.Function` whose forward and backward call the launchers directly in eager
mode, and the operators only while torch.compile traces: the same kernels and the same bits.


Layout of this file: kernels -> launchers -> custom ops -> the hand-off and the autograd.Function ->
checks and the functional API -> module and `patch_model` -> references.
"""

from __future__ import annotations

import torch
from torch import nn

from core import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from core import fp8_support
from core.fp8_support import (ALIGN, DEFAULT_RECIPE, FP8_MIN_WIDTH, MAX_COLS, RECIPES,  # noqa: F401
                                       Fp8KernelMismatch, compiled_graph_trusted, fast_accum_allowed, get_recipe,
                                       expected_patches, harmonic_width, size_reason,
                                       unsupported_reason)
from core.kernel_utils import as_rows, check_device, check_float, next_power_of_2, num_sms
from core.model_families import family_classes, model_type
from core.process import log

import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# A row whose largest |value| is below AMAX_FLOOR is scaled as if it were AMAX_FLOOR: all-zero rows
# (the gradient of ignored tokens) then stay exactly zero instead of dividing by zero, and a power of
# two keeps the scale exact. Values below ~2^-55 (2^-6, e4m3's smallest normal, times the floor's
# scale) lose precision; bf16 training has nothing that small that matters.
AMAX_FLOOR = 2.0**-40

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
# The interpreter's float -> fp8 conversion does not round to nearest even for every value (it
# rounds half up on the first dropped bit, and flushes some subnormals); a GPU does (`cvt.rn.satfinite`).
# On the CPU the kernels therefore round to the e4m3 grid themselves first, so that the conversion
# is exact there and the results equal the GPU's bit for bit.
ROUND_IN_SOFTWARE = kernel_utils.INTERPRET


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def quantize_block(
    x,  # an fp32 block [R, C]
    amax,  # the largest |x| of each row ([R], AXIS = 1) or of each column ([C], AXIS = 0)
    AXIS: tl.constexpr,  # the axis the maxima were taken along
    ROUND_IN_SOFTWARE: tl.constexpr,  # see `ROUND_IN_SOFTWARE` above
):
    """(x / scale as float8_e4m3fn, scale) with scale = max(amax, floor) / 448 per row or column.

    Scales are divided with `div_rn`, IEEE round-to-nearest: Triton's `/` on fp32 is an approximate
    division on NVIDIA GPUs (up to 2 ulp), and the scales must match the reference bit for bit. The
    clamp saturates at +-448 (x * (448 / amax) can land one ulp above 448) and keeps NaN: a NaN
    input must poison its output, not turn into +-448. (The maxima skip NaN, so a NaN poisons only
    its own element, not its row's scale.)
    """
    a = tl.maximum(amax, _AMAX_FLOOR)
    scale = tl.math.div_rn(a, _FP8_MAX)
    inv = tl.math.div_rn(_FP8_MAX, a)
    if AXIS == 1:
        v = x * inv[:, None]
    else:
        v = x * inv[None, :]
    return cast_e4m3(v, ROUND_IN_SOFTWARE), scale


@triton.jit
def cast_e4m3(
    v,  # fp32 values already divided by their scale
    ROUND_IN_SOFTWARE: tl.constexpr,  # see `ROUND_IN_SOFTWARE` above
):
    """v as float8_e4m3fn: saturated at +-448, rounded to nearest even, NaN kept (every FP8 quantizer's cast)."""
    v = tl.where(v == v, tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX), v)  # NaN != NaN: NaN stays
    if ROUND_IN_SOFTWARE:
        # Round to the nearest e4m3 value, ties to even, in fp32. e4m3 has 3 mantissa bits, so near
        # v its values are 2^(e - 3) apart (e = v's binary exponent), and 2^-9 apart below 2^-6
        # (subnormals). Adding then subtracting 2^23 such steps makes the fp32 adder round to a
        # multiple of the step with its own round-to-nearest-even; the cast below is then exact.
        bits = v.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF  # biased by 127
        step_exponent = tl.maximum(exponent, 127 - 6) - 3
        big = ((step_exponent + 23) << 23).to(tl.float32, bitcast=True)  # 2^23 steps
        r = (tl.abs(v) + big) - big
        r = tl.where(bits < 0, -r, r)  # v's sign bit, so that -0.0 stays -0.0
        # The interpreter's conversion keeps a NaN's top 3 mantissa bits and rounds on the 4th; only
        # 111 then 0 (fp32 bits 0x7FF00000) arrives as e4m3's NaN.
        v = tl.where(v == v, r, tl.full(v.shape, 0x7FF00000, tl.int32).to(tl.float32, bitcast=True))
    return v.to(tl.float8e4nv)


@triton.jit
def load_rows(X, rows, cols, col_ok, stride_x, M):
    """A block of whole rows of X (rows past M and columns past K read as 0)."""
    return tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def rows_block(X, Q, Scale, x, rows, cols, col_ok, col_max, M, K, WRITE_ROWS: tl.constexpr, COL_MAX: tl.constexpr,
                ROUND_IN_SOFTWARE: tl.constexpr, col_scale=None, COL_SCALE: tl.constexpr = False):
    """One loaded block of whole rows (times `col_scale` per column if COL_SCALE): quantize and store it,
    fold it into the column maxima."""
    row_ok = rows < M
    xf = x.to(tl.float32)
    if COL_SCALE:
        xf = xf * col_scale[None, :]
    a = tl.abs(xf)
    if COL_MAX:
        col_max = tl.maximum(col_max, tl.max(a, axis=0))
    if WRITE_ROWS:
        q, scale = quantize_block(xf, tl.max(a, axis=1), 1, ROUND_IN_SOFTWARE)
        tl.store(Q + rows[:, None] * K + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
        tl.store(Scale + rows, scale, mask=row_ok)
    return col_max


@triton.jit
def _quantize_rows(
    X,  # pointer to the input, [M, K], unit stride along K
    Q,  # pointer to the row-quantized output, [M, K] float8_e4m3fn, contiguous
    Scale,  # pointer to the row scales, [M] fp32
    ColMax,  # pointer to this kernel's partial column maxima, [n_programs, K] fp32
    stride_x,  # elements between two rows of X
    M,  # rows (tokens, or a weight's output features)
    K,  # row length
    ROWS: tl.constexpr,  # rows per loop iteration
    BLOCK_K: tl.constexpr,  # power of two >= K: a program holds whole rows
    WRITE_ROWS: tl.constexpr,  # quantize per row and write Q and Scale
    COL_MAX: tl.constexpr,  # also write the maxima of |x| per column over this program's rows
    PREFETCH: tl.constexpr,  # load the next block of rows before working on this one
    ROUND_IN_SOFTWARE: tl.constexpr,  # see `ROUND_IN_SOFTWARE` above
    ColScale=None,  # pointer to [K] fp32 factors: x * ColScale[None, :] is quantized instead of x (COL_SCALE)
    COL_SCALE: tl.constexpr = False,  # (a frozen FP8 weight's row scales folded into dy: `frozen_input_grad`)
):
    # Persistent: program p takes row blocks p, p + n_programs, ... and keeps a running maximum of
    # each column in registers, written once at the end: n_programs x K partial maxima, reduced by a
    # tiny torch.amax, instead of one atomic per element.
    pid = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 past 149,796 rows of 14336
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
    col_scale = col_max
    if COL_SCALE:
        col_scale = tl.load(ColScale + cols, mask=col_ok, other=0.0)  # read once per program
    n_blocks = tl.cdiv(tl.cdiv(M, ROWS) - pid, n_programs)
    if PREFETCH:
        # Register double buffering: the next block's loads are in flight while this block's row
        # maxima, scales and stores are computed (two blocks live per thread). The load after the
        # last block is masked off entirely.
        rows = pid * ROWS + tl.arange(0, ROWS)
        x = load_rows(X, rows, cols, col_ok, stride_x, M)
        for i in range(0, n_blocks):
            this_rows, this_x = rows, x
            rows = (pid + (i + 1) * n_programs) * ROWS + tl.arange(0, ROWS)
            x = load_rows(X, rows, cols, col_ok, stride_x, M)
            col_max = rows_block(X, Q, Scale, this_x, this_rows, cols, col_ok, col_max, M, K, WRITE_ROWS, COL_MAX,
                                  ROUND_IN_SOFTWARE, col_scale, COL_SCALE)
    else:
        for i in range(0, n_blocks):
            rows = (pid + i * n_programs) * ROWS + tl.arange(0, ROWS)
            x = load_rows(X, rows, cols, col_ok, stride_x, M)
            col_max = rows_block(X, Q, Scale, x, rows, cols, col_ok, col_max, M, K, WRITE_ROWS, COL_MAX,
                                  ROUND_IN_SOFTWARE, col_scale, COL_SCALE)
    if COL_MAX:
        tl.store(ColMax + pid * K + cols, col_max, mask=col_ok)


@triton.jit
def _quantize_cols_transposed(
    X,  # pointer to the input, [M, K], unit stride along K
    QT,  # pointer to the column-quantized output, transposed: [K, M_pad] float8_e4m3fn, contiguous
    Scale,  # pointer to the column scales, [K] fp32 (written by the programs of the first row block)
    ColMax,  # pointer to the column maxima of |x|, [K] fp32
    stride_x,  # elements between two rows of X
    M,  # rows of X
    M_pad,  # M rounded up to a multiple of 16; rows M..M_pad-1 of the output are written as zeros
    K,  # columns of X
    BLOCK_M: tl.constexpr,  # tile rows (becomes the contiguous dimension of the output)
    BLOCK_K: tl.constexpr,  # tile columns
    ROUND_IN_SOFTWARE: tl.constexpr,
    ROWS_TOO: tl.constexpr = False,  # also quantize per row, from the row maxima given in RowMax
    RowMax=None,  # [M] fp32: the largest |x| of each row (ROWS_TOO)
    Q=None,  # [M, K] float8_e4m3fn: x quantized per row (ROWS_TOO)
    RowScale=None,  # [M] fp32: its scales (written by the programs of the first column block)
):
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    row_ok = rows < M
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)  # rows past M load 0: they become the zero padding
    if ROWS_TOO:
        # The row quantization of the same tile, when the kernel that wrote x also took its row
        # maxima: both FP8 layouts from one read of x.
        q_rows, row_scale = quantize_block(x, tl.load(RowMax + rows, mask=row_ok, other=0.0), 1, ROUND_IN_SOFTWARE)
        tl.store(Q + rows[:, None] * K + cols[None, :], q_rows, mask=row_ok[:, None] & col_ok[None, :])
        if tl.program_id(1) == 0:
            tl.store(RowScale + rows, row_scale, mask=row_ok)
    q, scale = quantize_block(x, tl.load(ColMax + cols, mask=col_ok, other=0.0), 0, ROUND_IN_SOFTWARE)
    # The transpose: a [BLOCK_M, BLOCK_K] tile becomes [BLOCK_K, BLOCK_M], stored with M contiguous.
    # Triton moves it through shared memory so that both the loads and the stores stay coalesced.
    out_mask = col_ok[:, None] & (rows < M_pad)[None, :]
    tl.store(QT + cols[:, None] * M_pad + rows[None, :], tl.trans(q), mask=out_mask)
    if pid_m == 0:
        tl.store(Scale + cols, scale, mask=col_ok)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
# Launch settings, chosen by a sweep on an H200 at every shape one LLaMA 3.1 8B step quantizes, each variant
# checked bit for bit before it was timed (docs/fp8.md, "Launch settings", has the timings):
# - the row kernel needs enough bytes in flight per program: 16384 values per loop iteration on 4 warps,
#   two programs per SM; rows wider than 16384 values: one row per iteration on block/4096 warps; rows
#   padded to 4096, 8192 and 16384 values: the double-buffered loop (PREFETCH_LAUNCH: block -> rows per
#   iteration, warps, programs per SM), which the rows of 28672 (joined gate/up) do not take;
# - the transposing kernel: 128 x 128 tiles on 4 warps.
# Triton's interpreter pays per program and per loop iteration, not per element, so there the
# blocks are as large as the data allows and the row kernel runs two programs (which keeps its
# grid-stride loop and the reduction of partial column maxima exercised).
ROW_ELEMENTS, ROW_WARPS, ROW_PROGRAMS_PER_SM = 16384, 4, 2  # rows of up to 2048 values
PREFETCH_LAUNCH = {4096: (2, 8, 2), 8192: (1, 8, 2), 16384: (1, 16, 1)}
COL_BLOCK_M, COL_BLOCK_K, COL_NUM_WARPS = 128, 128, 4
# None of these settings depends on the GPU generation or is sized to one GPU's shared memory; docs/fp8.md
# ("Launch settings") lists what each kernel takes per program, and tests/blackwell_test.py checks that
# consumer Blackwell's limits hold them.


def row_launch(block_k: int, sms: int) -> tuple[int, int, int]:
    """(rows per loop iteration, warps, persistent programs) of the row kernel on a GPU with `sms` SMs,
    for rows padded to `block_k` (a power of two, at most MAX_COLS). Each thread holds at most 128
    values of a loop iteration (fp32 registers), or with `row_prefetch` two iterations of 32 each."""
    if block_k in PREFETCH_LAUNCH:
        rows, warps, per_sm = PREFETCH_LAUNCH[block_k]
        return rows, warps, sms * per_sm
    if block_k <= 8192:
        return ROW_ELEMENTS // block_k, ROW_WARPS, sms * ROW_PROGRAMS_PER_SM
    return 1, block_k // 4096, sms  # 128 values per thread


def row_prefetch(block_k: int) -> bool:
    """Whether the row kernel double-buffers its loads for rows padded to `block_k`."""
    return block_k in PREFETCH_LAUNCH


def padded(m: int) -> int:
    """The token dimension of a transposed FP8 copy: m rounded up to a multiple of 16."""
    return (m + ALIGN - 1) // ALIGN * ALIGN


def quantize_rows(x2: torch.Tensor, write_rows: bool = True, col_max: bool = False,
                  col_scale: torch.Tensor | None = None):
    """One read of a 2-D [M, K] tensor (unit stride along K).

    Returns (q [M, K] float8_e4m3fn, scale [M] fp32), with x ~= q * scale[:, None], if `write_rows`
    (else two empty tensors), and the column maxima of |x| [K] (what `quantize_cols` needs) if
    `col_max` (else None). `col_scale` ([K] fp32, contiguous): quantize x * col_scale[None, :] (an
    fp32 product, taken in registers) instead of x; the maxima are then those of the product.
    """
    M, K = x2.shape
    if not 1 <= K <= MAX_COLS:
        raise ValueError(f"rows of 1 to {MAX_COLS} elements can be quantized, got {K}")
    if col_scale is not None and (col_scale.shape != (K,) or col_scale.dtype != torch.float32
                                  or not col_scale.is_contiguous()):
        raise ValueError(f"col_scale must be a contiguous [{K}] fp32 tensor, got {tuple(col_scale.shape)} "
                         f"{col_scale.dtype}")
    q = torch.empty((M, K) if write_rows else (0,), dtype=FP8_DTYPE, device=x2.device)
    scale = torch.empty(M if write_rows else 0, dtype=torch.float32, device=x2.device)
    block_k = next_power_of_2(K)
    if kernel_utils.INTERPRET:
        rows = max(1, min(256, 16384 // block_k))
        num_warps, n_programs = 4, 2
    else:
        rows, num_warps, n_programs = row_launch(block_k, num_sms(x2.device))
    prefetch = row_prefetch(block_k)  # the interpreter runs the same loop as the GPU for this width
    n_programs = max(1, min(triton.cdiv(M, rows), n_programs))
    partial = torch.empty((n_programs, K) if col_max else (1, 1), dtype=torch.float32, device=x2.device)
    _quantize_rows[(n_programs,)](
        x2, q, scale, partial, x2.stride(0), M, K,
        ROWS=rows, BLOCK_K=block_k, WRITE_ROWS=write_rows, COL_MAX=col_max, PREFETCH=prefetch,
        ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE, ColScale=scale if col_scale is None else col_scale,
        COL_SCALE=col_scale is not None, num_warps=num_warps,
    )
    return q, scale, (partial.amax(dim=0) if col_max else None)  # a deterministic max over programs


def quantize_cols(x2: torch.Tensor, col_max: torch.Tensor):
    """One read of x [M, K] and its column maxima [K] (from `quantize_rows`): the column-quantized copy,
    transposed, qT [K, padded(M)] float8_e4m3fn (zeros past M), and its scales [K] fp32, with
    x ~= (qT * scale[:, None])[:, :M].T."""
    return _launch_cols(x2, col_max)[2:]


def quantize_both(x2: torch.Tensor, row_max: torch.Tensor, col_max: torch.Tensor):
    """One read of x [M, K], given its row maxima [M] and column maxima [K] (from the kernel that wrote
    x): (q [M, K], row scales [M], qT [K, padded(M)], column scales [K]), each equal bit for bit to
    what `quantize_rows` and `quantize_cols` make of x, which read it twice."""
    return _launch_cols(x2, col_max, row_max)


def _launch_cols(x2: torch.Tensor, col_max: torch.Tensor, row_max: torch.Tensor | None = None):
    """The column kernel: (q, row scales, qT, column scales), the first two None without `row_max`."""
    M, K = x2.shape
    m_pad = padded(M)
    rows_too = row_max is not None
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x2.device) if rows_too else None
    row_scale = torch.empty(M, dtype=torch.float32, device=x2.device) if rows_too else None
    qt = torch.empty((K, m_pad), dtype=FP8_DTYPE, device=x2.device)
    scale = torch.empty(K, dtype=torch.float32, device=x2.device)
    block_m, block_k = COL_BLOCK_M, COL_BLOCK_K
    if kernel_utils.INTERPRET:
        block_m, block_k = min(256, next_power_of_2(m_pad)), min(256, next_power_of_2(K))
    grid = (max(1, triton.cdiv(m_pad, block_m)), triton.cdiv(K, block_k))
    _quantize_cols_transposed[grid](
        x2, qt, scale, col_max, x2.stride(0), M, m_pad, K,
        BLOCK_M=block_m, BLOCK_K=block_k, ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE, ROWS_TOO=rows_too, RowMax=row_max, Q=q,
        RowScale=row_scale, num_warps=COL_NUM_WARPS,
    )
    return q, row_scale, qt, scale


def quantize(x2: torch.Tensor, rows: bool = True, cols: bool = False):
    """Both quantizations of x [M, K] as asked: (q, row scales, qT, column scales), a layout not asked
    for as empty tensors. Rows alone read x once; columns read it twice (maxima, then the cast), and
    both layouts share the first read."""
    q, s_rows, col_max = quantize_rows(x2, write_rows=rows, col_max=cols)
    if not cols:
        return q, s_rows, x2.new_empty(0, dtype=FP8_DTYPE), x2.new_empty(0, dtype=torch.float32)
    return (q, s_rows, *quantize_cols(x2, col_max))


def scaled_mm_launch(a, a_scale, bt, bt_scale, fast_accum: bool) -> torch.Tensor:
    """a [R, S] fp8 (row scales [R]) @ b, where bt [C, S] is b transposed, row-major (scales [C]): bf16 [R, C].

    `bt.t()` is the column-major [S, C] operand torch._scaled_mm wants, without a copy; the row-wise
    scaled matmul writes bf16 only."""
    return torch._scaled_mm(a, bt.t(), a_scale[:, None], bt_scale[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile and opcheck see
# ------------------------------------------------------------------------------------------------
# Each launcher is one opaque node for torch.compile (Dynamo never traces the Triton launch code); `register_fake`
# gives its outputs' shapes and dtypes. Quantization has no gradient: the autograd.Functions call these ops only
# inside their forward and backward, where autograd is off, and only while torch.compile traces.
@torch.library.custom_op("playbook::fp8_quantize_rows", mutates_args=())
def fp8_rows_op(x: torch.Tensor, write_rows: bool, col_max: bool,
                col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (times col_scale [K] per column, if given) -> (q [M, K] fp8, scale [M], column maxima [K]);
    what is not asked for is empty."""
    q, scale, cmax = quantize_rows(as_rows(x), write_rows, col_max, col_scale)
    return q, scale, cmax if col_max else x.new_empty(0, dtype=torch.float32)


@fp8_rows_op.register_fake
def _(x, write_rows, col_max, col_scale=None):
    M, K = x.shape
    f32 = torch.float32
    q = x.new_empty((M, K) if write_rows else (0,), dtype=FP8_DTYPE)
    return q, x.new_empty(M if write_rows else 0, dtype=f32), x.new_empty(K if col_max else 0, dtype=f32)


@torch.library.custom_op("playbook::fp8_quantize_cols", mutates_args=())
def fp8_cols_op(x: torch.Tensor, col_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], its column maxima [K] -> (qT [K, padded(M)] fp8, scale [K])."""
    return quantize_cols(as_rows(x), col_max)


@fp8_cols_op.register_fake
def _(x, col_max):
    M, K = x.shape
    return x.new_empty((K, (M + ALIGN - 1) // ALIGN * ALIGN), dtype=FP8_DTYPE), x.new_empty(K, dtype=torch.float32)


@torch.library.custom_op("playbook::fp8_quantize_both", mutates_args=())
def fp8_both_op(x: torch.Tensor, row_max: torch.Tensor,
                col_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], its row maxima [M] and column maxima [K] -> (q [M, K], scale [M], qT [K, padded(M)], scale [K])."""
    return quantize_both(as_rows(x), row_max, col_max)


@fp8_both_op.register_fake
def _(x, row_max, col_max):
    M, K = x.shape
    f32 = torch.float32
    return (x.new_empty((M, K), dtype=FP8_DTYPE), x.new_empty(M, dtype=f32),
            x.new_empty((K, (M + ALIGN - 1) // ALIGN * ALIGN), dtype=FP8_DTYPE), x.new_empty(K, dtype=f32))


@torch.library.custom_op("playbook::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm_op(a: torch.Tensor, a_scale: torch.Tensor, bt: torch.Tensor, bt_scale: torch.Tensor,
                     fast_accum: bool) -> torch.Tensor:
    """a [R, S] fp8 (row scales [R]) @ b, where bt [C, S] is b transposed (`scaled_mm_launch`).

    An operator of its own, so that torch.compile calls this exact cuBLAS matmul instead of lowering
    aten._scaled_mm to Inductor's own scaled-matmul templates. (That does not cure the compiled dx
    that differs from eager on GPUs: see `compiled_graph_trusted`.)
    """
    return scaled_mm_launch(a, a_scale, bt, bt_scale, fast_accum)


@fp8_scaled_mm_op.register_fake
def _(a, a_scale, bt, bt_scale, fast_accum):
    return a.new_empty((a.shape[0], bt.shape[0]), dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# The autograd.Function: eager mode calls the launchers, torch.compile the operators
# ------------------------------------------------------------------------------------------------
# Eager mode calls the launchers directly (`ops=False`), torch.compile the operators (`ops=True`): the
# module docstring says why.
def quant_rows(x2, write_rows: bool, col_max: bool, ops: bool, col_scale=None):
    """`fp8_rows_op`, or its launcher (the column maxima are then None when not asked for)."""
    if ops:
        return fp8_rows_op(x2, write_rows, col_max, col_scale)
    return quantize_rows(as_rows(x2), write_rows, col_max, col_scale)


def quant_cols(x2, col_max, ops: bool):
    return fp8_cols_op(x2, col_max) if ops else quantize_cols(as_rows(x2), col_max)


def quant_both(x2, row_max, col_max, ops: bool):
    return fp8_both_op(x2, row_max, col_max) if ops else quantize_both(as_rows(x2), row_max, col_max)


def scaled_mm(a, a_scale, bt, bt_scale, fast_accum: bool, ops: bool):
    if ops:
        return fp8_scaled_mm_op(a, a_scale, bt, bt_scale, fast_accum)
    return scaled_mm_launch(a, a_scale, bt, bt_scale, fast_accum)


def refuse_create_graph(what: str = "fp8_linear", by: str = "the FP8 matmuls", instead: str = "nn.Linear") -> None:
    """Every FP8 layer's backward (this file's, fp8_recipes_kernel.py's, fp8_lora_kernel.py's) and the FP8
    producers' (fp8_producers_kernel.py) starts here: under backward(create_graph=True) grad mode is on, and these
    backwards have no derivative of their own. `what` names the refusing function, `by` what has no derivative,
    `instead` what to use for double backward."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what}: second-order gradients (create_graph=True) are not supported by {by}; use "
                           f"{instead} for double backward")


class Float8LinearFunction(torch.autograd.Function):
    """y = x W^T with FP8 operands in the forward and in both gradient matmuls.

    Saved for backward (exactly): the weight Parameter itself (no copy) with its column maxima [K]
    when dx is needed, and, when the weight needs a gradient, either the input x as given and its
    column maxima [K] (`keep_fp8_input` False), or only xT, x's FP8 copy quantized per column and
    transposed ([K, padded(M)], 1 byte per element), and its K fp32 scales. Nothing of x is saved
    when the weight is frozen (LoRA): dx does not need x. The column maxima come free with the
    forward's row quantization (the tensor is in registers anyway), so backward reads W and x once
    each to quantize them per column. `handoff`: the model's `Fp8Handoff` (fp8_producers_kernel.py), or
    None; `ops`: launch through the custom operators (torch.compile) instead of the launchers (eager).

    `bf16_dgrad` (the recipe rowwise-bf16-dgrad): dx = dy W runs as a bf16 matmul of the bf16 gradient
    and the bf16 weight; W's column maxima and dy's row copy are then not made at all.
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, keep_fp8_input: bool, need_input_grad: bool,
                need_weight_grad: bool, handoff, ops: bool, bf16_dgrad: bool):
        keep_fp8 = keep_fp8_input and need_weight_grad
        share = handoff is not None and not keep_fp8_input
        if handoff is not None:
            handoff.start_forward()
        made = handoff.input_rows.take(x2) if handoff is not None else None  # from the norm that wrote x
        hit = handoff.shared_rows.get(x2) if share else None
        if made is not None and (made[2] is not None or not need_weight_grad):
            xq, sx, xmax = made
            if share:
                handoff.shared_rows.put(x2, made)
        elif hit is not None and (hit[2] is not None or not need_weight_grad):
            xq, sx, xmax = hit
        else:
            xq, sx, xmax = quant_rows(x2, True, need_weight_grad, ops)
            if share:
                handoff.shared_rows.put(x2, (xq, sx, xmax if need_weight_grad else None))
        fp8_dx = need_input_grad and not bf16_dgrad
        wq, sw, wmax = quant_rows(weight, True, fp8_dx, ops)
        # wq [N, K] is W: b = W^T, column-major. Fast accumulation (`fast_accum_allowed`): like torchao's
        # float8 recipes, the forward uses it and the two gradient matmuls (longer sums) do not.
        y = scaled_mm(xq, sx, wq, sw, fast_accum_allowed(x2.device), ops)
        if keep_fp8:
            saved_x = quant_cols(x2, xmax, ops)  # xT and its scales; x itself is not kept
        elif need_weight_grad:
            saved_x = (x2, xmax)
        else:
            saved_x = ()
        ctx.keep_fp8, ctx.handoff, ctx.ops, ctx.fp8_dx = keep_fp8, handoff, ops, fp8_dx
        ctx.save_for_backward(weight, *((wmax,) if fp8_dx else ()), *saved_x)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        refuse_create_graph()
        need_dx, need_dw = ctx.needs_input_grad[:2]
        weight, *saved = ctx.saved_tensors
        wmax = saved.pop(0) if ctx.fp8_dx else None
        fp8_dx = need_dx and ctx.fp8_dx
        handoff, ops = ctx.handoff, ctx.ops
        dy2 = as_rows(dy)
        if handoff is not None:
            handoff.start_backward()
        made = handoff.grad_maxima.take(dy2) if handoff is not None else None  # dy's maxima, from its writer
        dyqt = None
        if made is not None and fp8_dx and need_dw:
            dyq, sdy, dyqt, sdyt = quant_both(dy2, *made, ops)  # both layouts in one read
        elif made is not None and need_dw:  # the columns only (bf16 dx): the maxima spare the row pass
            dyqt, sdyt = quant_cols(dy2, made[1], ops)
        else:
            dyq, sdy, dymax = quant_rows(dy2, fp8_dx, need_dw, ops)  # rows, and the maxima for the columns
        dx = dw = None
        if need_dx and not fp8_dx:  # rowwise-bf16-dgrad: the bf16 gradient times the bf16 weight
            dx = (dy2 @ weight.to(dy2.dtype)).to(dy.dtype)
        elif need_dx:
            # dx = dy W: b = W [N, K] column-major is W^T [K, N] row-major, scaled along N per column of W.
            wqt, swt = quant_cols(weight, wmax, ops)
            dx = scaled_mm(dyq, sdy, wqt, swt, False, ops).to(dy.dtype)
        if need_dw:
            if ctx.keep_fp8:
                xqt, sxt = saved
            else:  # a bf16 input that q/k/v (or gate/up) share: quantize it per column once
                hit = handoff.shared_cols.get(saved[0]) if handoff is not None else None
                xqt, sxt = hit if hit is not None else quant_cols(*saved, ops)
                if hit is None and handoff is not None:
                    handoff.shared_cols.put(saved[0], (xqt, sxt))
            if dyqt is None:
                dyqt, sdyt = quant_cols(dy2, dymax, ops)
            # dW = dy^T x: a = dyT [N, padded(M)], b = x [padded(M), K] column-major (from xT); the
            # zero padding of both along the tokens adds nothing.
            dw = scaled_mm(dyqt, sdyt, xqt, sxt, False, ops).to(weight.dtype)
        return dx, dw, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# Checks, and the functional API
# ------------------------------------------------------------------------------------------------
def check_fp8_device(device: torch.device, recipe: str = DEFAULT_RECIPE) -> None:
    """Refuse, in one line, a device that cannot run this row-wise recipe (fp8_support.check_device, with
    `probe_scaled_mm`); ValueError for another scaling (fp8_recipes_kernel.check_fp8_device takes all)."""
    if get_recipe(recipe).scaling != "row":
        raise ValueError(f"recipe {recipe} is not row-wise: fp8_recipes_kernel.check_fp8_device checks it")
    fp8_support.check_device(device, recipe, probe_scaled_mm)


def probe_scaled_mm(device: torch.device, scaling: str = "row") -> None:
    """Check the transposing quantizers (`TRANSPOSING`), then run the row-wise scaled matmul on tiny
    operands with the flags training uses (RuntimeError if PyTorch refuses it)."""
    fp8_support.check_copies(device, TRANSPOSING)
    a = torch.ones((ALIGN, ALIGN), device=device).to(FP8_DTYPE)
    for flag in {fast_accum_allowed(device), False}:
        scaled_mm_launch(a, torch.ones(ALIGN, device=device), a, torch.ones(ALIGN, device=device), flag)


# The quantizers that store a tensor transposed, as (what, function of x, its plain-PyTorch reference), checked
# once per GPU at set-up (fp8_support.check_copies says why); fp8_recipes_kernel.py checks its tile kernel.
TRANSPOSING = (
    ("quantize_cols", lambda x: (None, None) + quantize_cols(x, abs_max(x.float(), 0)),
     lambda x: (*quantize_rows_ref(x), *quantize_cols_ref(x))),
    ("quantize_both", lambda x: quantize_both(x, abs_max(x.float(), 1), abs_max(x.float(), 0)),
     lambda x: (*quantize_rows_ref(x), *quantize_cols_ref(x))),
)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> None:
    check_float("x", x)
    check_float("weight", weight)
    check_device(x, weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension must equal in_features = {weight.shape[1]}, "
                         f"got x of shape {tuple(x.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    reason = unsupported_reason(weight.shape[1], weight.shape[0], recipe)
    if reason:
        raise ValueError(f"FP8 linear: {reason}; keep this layer in bf16 (patch_model skips such layers)")


@torch.compiler.disable
def _fp8_linear_eager(x, weight, bias, keep_fp8_input, handoff, recipe):
    return fp8_linear(x, weight, bias, keep_fp8_input, handoff, recipe)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               keep_fp8_input: bool = True, handoff=None, recipe: str = DEFAULT_RECIPE) -> torch.Tensor:
    """F.linear(x, weight, bias) with FP8 matmuls forward and backward; any leading shape of x.

    The output has x's dtype (the autocast dtype under torch.autocast) and passes through bf16 (the
    row-wise scaled matmul writes bf16). `keep_fp8_input`: what backward keeps of x (module docstring).
    `handoff`: an `Fp8Handoff` shared with the model's other FP8 layers (fp8_producers_kernel.py), or
    None to hand nothing over. Under torch.compile on a GPU the layer runs outside the graph
    (`compiled_graph_trusted`); a traced layer hands nothing over and launches through the operators.
    `recipe`: a row-wise recipe of `RECIPES` (which matmul stays bf16); fp8_recipes_kernel.fp8_linear
    runs the others.
    """
    r = get_recipe(recipe)
    if r.scaling != "row":
        raise ValueError(f"recipe {recipe} scales {r.scaling}-wise: fp8_recipes_kernel.fp8_linear runs it")
    if torch.compiler.is_compiling() and not compiled_graph_trusted(x.device):
        return _fp8_linear_eager(x, weight, bias, keep_fp8_input, handoff, recipe)
    return linear_frame(x, weight, bias, recipe, check_fp8_device, lambda x2, need_dx, need_dw, ops: (
        Float8LinearFunction.apply(x2, weight, keep_fp8_input, need_dx, need_dw, None if ops else handoff, ops,
                                   r.bf16_dgrad)))


def linear_frame(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, check_device_fn,
                 product) -> torch.Tensor:
    """What every FP8 linear does around its matmuls: check the inputs (and, in eager mode, the device with
    `check_device_fn(device, recipe)`), cast x to the autocast dtype, flatten it to rows, multiply
    (`product(x2, need_dx, need_dw, ops)`, ops: while torch.compile traces), restore x's leading shape and
    add the bias. No tokens: an empty output and zero gradients, without a zero-sized matmul."""
    _check_inputs(x, weight, bias, recipe)
    compiling = torch.compiler.is_compiling()
    if not compiling:
        check_device_fn(x.device, recipe)  # cached after the first call; nothing a compiled graph needs to see
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x2 = as_rows(x.to(out_dtype))
    if x2.shape[0] == 0:
        y = x2 @ weight.t().to(out_dtype)
    else:
        grad = torch.is_grad_enabled()
        y = product(x2, grad and x2.requires_grad, grad and weight.requires_grad, compiling)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# Module, and patching a Hugging Face model
# ------------------------------------------------------------------------------------------------
class Float8Linear(nn.Linear):
    """nn.Linear whose three matmuls run in FP8; same Parameters (`weight`, `bias`), same state dict.

    A subclass, so that code asking `isinstance(m, nn.Linear)` (peft's LoRA, optimizers' weight-decay
    rules) still sees a linear layer, while code asking `type(m) is nn.Linear` (the fused SwiGLU's
    down-projection shortcut) calls this module instead of reading its weight. `fp8_handoff`: the
    `Fp8Handoff` this layer shares with the model's other FP8 layers (`patch_model` sets it), or None.
    `recipe`: the name of its `Fp8Recipe`, of a scaling in `scalings`, which `linear` runs
    (fp8_recipes_kernel.Float8ScaledLinear runs the others).
    """

    keep_fp8_input: bool = True
    fp8_handoff = None
    recipe: str = DEFAULT_RECIPE
    scalings = ("row",)

    @staticmethod
    def check_device(device: torch.device, recipe: str) -> None:  # (a lookup at call time, so tests can patch it)
        check_fp8_device(device, recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_fp8_input: bool = True, handoff=None,
                    recipe: str = DEFAULT_RECIPE) -> "Float8Linear":
        """Wrap an existing nn.Linear, *sharing* its weight and bias Parameters (no copy)."""
        if get_recipe(recipe).scaling not in cls.scalings:
            raise ValueError(f"{cls.__name__} runs {', '.join(cls.scalings)} scales, not recipe {recipe}")
        reason = unsupported_reason(linear.in_features, linear.out_features, recipe)
        if reason:
            raise ValueError(f"cannot run this layer in FP8: {reason}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight  # the same Parameter objects: optimizers and FSDP keep working
        new.bias = linear.bias
        new.keep_fp8_input = keep_fp8_input
        new.fp8_handoff = handoff
        new.recipe = get_recipe(recipe).name
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias, self.keep_fp8_input, self.fp8_handoff)

    def linear(self, x, weight, bias, keep_fp8_input: bool, handoff) -> torch.Tensor:
        """The layer's recipe on these operands (`fp8_linear`); a joined group passes its joined weight."""
        return fp8_linear(x, weight, bias, keep_fp8_input, handoff, self.recipe)

    def stores_fp8(self) -> bool:
        """Whether the weight is kept in FP8 (fp8_lora_kernel.store_fp8_weight: LoRA's frozen base)."""
        return self.weight.dtype == FP8_DTYPE

    @staticmethod
    def joined_linear(x: torch.Tensor, weight: torch.Tensor, bias, members) -> torch.Tensor:
        """A group of FP8 layers joined by projections_kernel.py (q/k/v, gate/up) as one FP8 layer that
        keeps only the FP8 copy of x for backward (the group is x's one consumer), sharing the layers'
        hand-off."""
        return members[0].linear(x, weight, bias, True, members[0].fp8_handoff)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8 {self.recipe}, keep_fp8_input={self.keep_fp8_input}"


# The decoder's projections by attribute name; Phi-3 fuses q/k/v into `qkv_proj` and gate/up into
# `gate_up_proj`, which are converted the same way.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
# Which projections keep only their FP8 input for backward (module docstring: the others' bf16 input
# is shared with another projection or kept by attention anyway).
KEEP_FP8_INPUT = {"down_proj"}
# Projections that read the same input: they share its quantization, and the size rule judges them together.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def projections(model: nn.Module):
    """(owner module, attribute name) of every decoder projection, found by class (LlamaAttention, ...)."""
    blocks = family_classes("Attention") + family_classes("MLP")
    for module in model.modules():
        if isinstance(module, blocks):
            for name in PROJECTIONS:
                if isinstance(getattr(module, name, None), nn.Linear):
                    yield module, name


def patch_model(model: nn.Module, recipe: str = DEFAULT_RECIPE, sizes: str = "all", handoff=None,
                layer: type = Float8Linear, keep: set | None = None) -> int:
    """Replace the q/k/v/o and gate/up/down projections of every decoder layer with `layer` (Float8Linear).

    The lm_head and the embeddings stay in bf16 (the head's logits are the most precision-sensitive
    matmul of the model, and an embedding is a lookup, not a matmul). A projection whose dimensions
    torch._scaled_mm cannot take, or that is not a plain nn.Linear (an adapter, a 4-bit layer), stays
    as it is and is named in one log line. Refuses (RuntimeError) a GPU without FP8 matmuls. Returns
    how many projections now run in FP8; patching twice changes nothing.

    `handoff`: an `Fp8Handoff` (fp8_producers_kernel.py) every converted layer shares (q/k/v and gate/up then
    quantize their common input once), or None. `recipe`: a name of `RECIPES` whose scaling `layer` runs.
    `keep`: ids of the blocks whose projections stay nn.Linear (fp8_recipes_kernel.bf16_layers).
    `sizes`: "all" converts every projection the recipe takes; "auto" keeps in bf16 those too small for
    FP8 to gain (`size_reason`, the measured crossover), named in one log line.
    """
    r = get_recipe(recipe)
    if r.scaling not in layer.scalings:
        raise ValueError(f"{layer.__name__} runs {', '.join(layer.scalings)} scales, not recipe {recipe}: "
                         "fp8_recipes_kernel.patch_model converts every recipe")
    if keep is None and r.bf16_end_layers:
        raise ValueError(f"recipe {recipe} keeps end layers bf16: fp8_recipes_kernel.patch_model converts it")
    model_type(model)
    for device in {p.device for p in model.parameters()}:
        layer.check_device(device, recipe)
    skipped = []
    group_out = {}  # (owner, name) -> out_features of the projections that share its input, itself included
    for owner, name in projections(model):
        group = next((g for g in SHARED_INPUT if name in g), (name,))
        group_out[id(owner), name] = sum(getattr(getattr(owner, n, None), "out_features", 0) for n in group)
    for owner, name in list(projections(model)):
        linear = getattr(owner, name)
        if isinstance(linear, Float8Linear) or id(owner) in (keep or ()):
            continue
        reason = (f"a {type(linear).__name__}, not a plain nn.Linear" if type(linear) is not nn.Linear
                  else unsupported_reason(linear.in_features, linear.out_features, recipe)
                  or (size_reason(linear.in_features, group_out[id(owner), name]) if sizes == "auto" else None))
        if reason:
            joined = group_out.get((id(owner), name), linear.out_features) != linear.out_features
            skipped.append(f"{name} [{linear.out_features}, {linear.in_features}]"
                           + (" (with the projections sharing its input)" if joined and "too small" in reason else "")
                           + f": {reason}")
            continue
        setattr(owner, name, layer.from_linear(linear, keep_fp8_input=name in KEEP_FP8_INPUT, handoff=handoff,
                                               recipe=recipe))
    if skipped:
        log(f"FP8: {len(skipped)} projection(s) stay as they are: {'; '.join(sorted(set(skipped)))}")
    return sum(isinstance(getattr(owner, name), Float8Linear) for owner, name in projections(model))


def ideal_bytes(n_rows: int, n_cols: int, dtype: torch.dtype, layouts: str = "rows") -> int:
    """Bytes the quantizing kernels move for an [n_rows, n_cols] input of `dtype` (module docstring).

    layouts: "rows" (read once, write the FP8 copy and a scale per row), "cols" (read once more, given
    the column maxima from the row pass, write the transposed FP8 copy and a scale per column) or
    "both" (the two passes).
    """
    n, e = n_rows * n_cols, dtype.itemsize
    rows = n * (e + 1) + 4 * n_rows
    cols = n * (e + 1) + 4 * n_cols
    return {"rows": rows, "cols": cols, "both": rows + cols}[layouts]

# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------
def quantize_rows_ref(x: torch.Tensor):
    """Plain PyTorch: (q [M, K] float8_e4m3fn, scale [M] fp32) with the kernels' exact arithmetic."""
    xf = x.float()
    a = torch.where(xf.isnan(), 0.0, xf.abs())  # the maxima skip NaN, as the kernels' do
    amax = (a.amax(dim=1) if xf.shape[1] else xf.new_zeros(xf.shape[0])).clamp(min=AMAX_FLOOR)
    # Not `FP8_MAX / amax`: PyTorch computes number / tensor as reciprocal(tensor) * number, rounding twice.
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    # A tensor divisor: on a GPU, PyTorch divides by a Python number as a multiplication by its
    # reciprocal (one more rounding), while the kernels divide with IEEE rounding (div_rn).
    return q, amax / torch.full_like(amax, FP8_MAX)


def quantize_cols_ref(x: torch.Tensor):
    """Plain PyTorch: (qT [K, padded(M)] float8_e4m3fn, scale [K]): x quantized per column, transposed."""
    qt, scale = quantize_rows_ref(x.t())
    return torch.nn.functional.pad(qt.view(torch.uint8), (0, padded(x.shape[0]) - x.shape[0])).view(FP8_DTYPE), scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The forward in plain PyTorch from the reference quantizers: dequantize, multiply in fp32."""
    xq, sx = quantize_rows_ref(x)
    wq, sw = quantize_rows_ref(weight)
    return (xq.float() * sx[:, None]) @ (wq.float() * sw[:, None]).t()


def abs_max(xf: torch.Tensor, dims) -> torch.Tensor:
    """max |x| over `dims`, NaN skipped (as the kernels' maxima), floored at AMAX_FLOOR."""
    return torch.where(xf.isnan(), 0.0, xf.abs()).amax(dim=dims).clamp(min=AMAX_FLOOR)


def quantize_with(xf: torch.Tensor, amax: torch.Tensor):
    """(x * (448 / amax) as e4m3, amax / 448), amax broadcast against x; the kernels' exact arithmetic."""
    inv = torch.full_like(amax, FP8_MAX) / amax  # tensor / tensor: one IEEE division, as div_rn
    return (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), amax / torch.full_like(amax, FP8_MAX)
