"""FP8 linear layers for training: the decoder's seven projections on FP8 tensor cores (Hopper, Blackwell).

    y  = x W^T          x [M tokens, K], W [N, K]          (forward)
    dx = dy W           dy [M, N]                          (backward, reduction over N)
    dW = dy^T x                                            (backward, reduction over the M tokens)

What you build here: Triton kernels that quantize a bf16 tensor to float8_e4m3fn with one fp32 scale
per row (or per column, written transposed), an `autograd.Function` that runs all three matmuls of a
linear layer as `torch._scaled_mm` on FP8 operands, and a module that replaces the q/k/v/o and
gate/up/down projections of a Hugging Face model.
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
scales); left out are the fp32 partial column maxima (one row of K per program: ~4 MB at K = 4096
on an H200), an implementation detail.

The floor at 8192 tokens of LLaMA 3.1 8B (hidden 4096) on an H200 (copy bandwidth ~4.27 TB/s):
    per row            ideal_bytes(8192, 4096, bf16, "rows") = 100,696,064 B ->  24 us
    rows and columns   ideal_bytes(8192, 4096, bf16, "both") = 201,375,744 B ->  47 us
against ~140 us for the q_proj forward matmul (275 GFLOP) at the FP8 peak and ~280 us at the bf16
peak. Per decoder layer and step (8192 tokens, the policy of `patch_model` below) the quantizations
move ~4.0 GB of activations and ~1.3 GB for the weights (again for every micro-batch): ~1.3 ms at
copy bandwidth, against ~5.4 ms of matmul time saved at peak rates (10.7 TFLOP per layer: 10.8 ms
in bf16, 5.4 ms in FP8). These are estimates from peak rates; a GPU benchmark must confirm them.

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

For stock nn.Linear layers that is 45,056 B per token and layer (plus o's shared input), and
30,720 B with FP8. The fused SwiGLU (swiglu_kernel.py) keeps *no* h for a plain nn.Linear down_proj
(it recomputes h in backward), but it only fuses when `type(mlp.down_proj) is nn.Linear`; a
Float8Linear down_proj is called as a module instead, so with both, FP8 keeps 14,336 B per token
and layer more than bf16 with the fused SwiGLU: 3.8 GB at 8192 tokens x 32 layers. (And the MLP then
runs the plain SwiGLU forward op, which is as fast; what is lost is only the recomputation trick.)

q, k and v read one tensor, and so do gate and up: the layers that keep their bf16 input quantize it
once for all of them, per row in the forward and per column in backward (through the model's
`Fp8Handoff`, which `patch_model` gives each of its FP8 layers), which saves 6 of the 10 activation
quantizations of those inputs per decoder layer and step. With the joined projections
(projections_kernel.py, in the default kernel set) q/k/v and gate/up each run as one FP8 layer on one
joined weight: that layer is its input's only reader, so it keeps only the FP8 copy (1 byte per
element), and the table above then reads 4,096 B for q/k/v and for gate/up.

One read for both copies, when the kernel that wrote the tensor took its maxima
-------------------------------------------------------------------------------
The row pass exists to find the maxima. The SwiGLU backward of a joined gate/up projection writes
that projection's output gradient, d gate_up [tokens, 2 x 14336]; its variant in this file
(`_swiglu_joined_bwd_maxima`, reached from swiglu_kernel.py's MLP through `swiglu_joined_fp8`) also
takes both maxima of what it writes and hands them to the gate/up layer (`Fp8Handoff.offer_grad`),
whose backward then makes both FP8 copies in one read (`quantize_both`: the column kernel, also
writing the row copy), bit for bit the copies of the two separate passes. That is one read of d
gate_up fewer, 2 bytes per element: 469,762,048 B at 8192 tokens of LLaMA 3.1 8B (110 us at copy
bandwidth). The pair moves 10 bytes per element of the SwiGLU width (the SwiGLU backward) and 4 per
element of d gate_up (read, two FP8 copies): 2,113,929,216 B at 8192 tokens, a floor of 495 us on an
H200; measured 625.2 us against 802.5 us for the SwiGLU kernel and the two separate passes
(results/runs/swiglu_fp8_H200.log).

In the forward the producer can do more: write the row copy itself
-------------------------------------------------------------------
A row scale needs only the row's maximum, and a kernel that holds whole rows in registers knows it
before anything leaves them. RMSNorm is such a kernel (it needs the row's sum of squares first), and it
writes the input of q/k/v and of gate/up. `_rmsnorm_quantize_rows` is the norm and the row pass in one:
it writes y (which the column pass still reads) and y's row copy with its scales and column maxima, and
never reads y back. Bytes per element at LLaMA 3.1 8B's hidden size, bf16:

    norm, then row pass      read x 2, write y 2;  read y 2, write q 1     7 bytes
    the producer             read x 2, write y 2, write q 1                5 bytes

(`rmsnorm_rows_ideal_bytes`.) At 8192 x 4096 that is 67 MB less per norm, two norms per decoder layer.
`link_norms` gives each decoder layer's norms the model's hand-off, and the FP8 layer that reads that
very output takes the copy (`Fp8Handoff.input_rows`). The copy is bit for bit the row pass's of the
same y; y itself may differ from `rmsnorm_forward`'s in the last bit on a GPU (the row's squares are
added in another order: see fp8_linear_test.py). Measured on an H100 (`benchmark_kernels.py
--fp8-producers`, CUDA graph replays): 82.3 us against 97.5 us for the pair at 8192 tokens, 143.6
against 176.3 at 16384. In the 8B step that is 56 norms x 15 us, about 0.8 ms of a ~508 ms FP8 step:
below what two runs of 12 steps can tell apart (results/runs/fp8_producers_H100/).

The SwiGLU forward, which writes down_proj's input h [tokens, 14336], is the other candidate
(`_swiglu_quantize_rows`, 2 bytes per element of the MLP width fewer). It must hold whole rows of
14,336 to know their maxima, where swiglu_kernel.py streams 2,048-column tiles, and at 1 to 4 programs
per SM it measured 400-431 us against 377 us for the pair (H100, 8192 tokens): fewer loads in flight
cost more than the bytes saved, so it is off (`SWIGLU_WRITES_ROWS`), and its tests keep it correct.

Why eager mode goes around the custom operators
-----------------------------------------------
Each launcher is also a custom operator, which torch.compile needs (an opaque node in its graph).
Calling an operator costs the host ~15 us of Python and dispatcher work, and one FP8 step of LLaMA
3.1 8B makes ~1,100 such calls; where the host falls behind the GPU that is step time. So the layer
is a plain `torch.autograd.Function` whose forward and backward call the launchers directly in eager
mode, and the operators only while torch.compile traces: the same kernels and the same bits.

Recipes: other scales, and matmuls kept in bf16
-------------------------------------------------
Everything above is the default recipe, `rowwise`. `RECIPES` names the others (`--fp8-recipe`;
docs/fp8.md compares them): `rowwise-bf16-dgrad` (dx = dy W as a bf16 matmul), `rowwise-bf16-ends`
(the first and last 2 decoder layers left as nn.Linear), `tensorwise` (one scale per tensor),
`blockwise` (DeepSeek-V3's 1x128 blocks of activations and gradients, 128x128 tiles of weights) and
`mxfp8` (OCP MX: 1x32 blocks with power-of-two scales, Blackwell's format: quantized in plain PyTorch,
`quantize_mx_ref`, as no kernel exists yet; multiplied by torch._scaled_mm's MXFP8 matmul on Blackwell
and from the dequantized operands on the CPU; Hopper refuses it). A block scale needs no pass of its
own: every block lies inside one 128 x 128 tile, so one kernel (`_quantize_tiles`) reads each tile
once, finds its maxima per row, per column or over the tile, and writes both FP8 layouts with their
scales: a block-scaled tensor costs one read where a row-and-column-scaled one costs two. One scale
per tensor needs the tensor's maximum first (the row kernel's column maxima: one read), then the same
tile kernel.

LoRA: a frozen weight kept in FP8
---------------------------------
Under LoRA the base weight never changes: `store_frozen_weights` (after peft has wrapped the layers)
quantizes each frozen weight once, per row, and keeps only that copy, 1 byte per parameter plus one
fp32 scale per row, instead of 2 bytes in bf16 re-quantized every step (6 bytes of traffic). The
forward uses it as above; dx = dy W folds W's row scales into dy's row quantization, so the same copy
serves it (the section "A frozen weight kept in FP8" below counts the bytes). There is no dW.

Layout of this file: kernels -> launchers -> custom ops -> the hand-off and the autograd.Functions ->
functional API -> module and `patch_model` -> references.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from playbook.core import gpu_arch
from playbook.core import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from playbook.core.kernel_utils import (as_rows, check_device, check_float, direct_launch, next_power_of_2, num_sms,
                                   refuse_double_backward)
from playbook.core.model_families import family_classes, model_type
import rmsnorm_kernel
from rmsnorm_kernel import _normalize_rows  # RMSNorm's arithmetic, in the producer kernel below too
import swiglu_kernel
from swiglu_kernel import _act_grads, _act_out, halves  # the activation and its chain rule, in the kernels below too

import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# A row whose largest |value| is below AMAX_FLOOR is scaled as if it were AMAX_FLOOR: all-zero rows
# (the gradient of ignored tokens) then stay exactly zero instead of dividing by zero, and a power of
# two keeps the scale exact. Values below ~2^-55 (2^-6, e4m3's smallest normal, times the floor's
# scale) lose precision; bf16 training has nothing that small that matters.
AMAX_FLOOR = 2.0**-40
ALIGN = 16  # torch._scaled_mm: reduced dimensions and b's columns must be multiples of 16
MAX_COLS = 65536  # one row must fit in one program's registers (the row kernel holds a whole row)

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
# The interpreter's float -> fp8 conversion does not round to nearest even for every value (it
# rounds half up on the first dropped bit, and flushes some subnormals); a GPU does (`cvt.rn.satfinite`).
# On the CPU the kernels therefore round to the e4m3 grid themselves first, so that the conversion
# is exact there and the results equal the GPU's bit for bit.
ROUND_IN_SOFTWARE = kernel_utils.INTERPRET


@dataclass(frozen=True)
class Fp8Recipe:
    """Which scales the FP8 layers use, and which matmuls stay in bf16 (`--fp8-recipe NAME`).

    scaling          "row": one fp32 scale per row (or column) of each operand, along the reduction;
                     "tensor": one fp32 scale per tensor; "block": 1x128 blocks of activations and
                     gradients, 128x128 tiles of weights (DeepSeek-V3); "mx": 1x32 blocks with
                     power-of-two (e8m0) scales, OCP's MXFP8, Blackwell's native format.
    bf16_dgrad       the input-gradient matmul dx = dy W runs in bf16 (forward and dW in FP8)
    bf16_end_layers  the first and the last N decoder layers keep nn.Linear projections
    align            in_features and out_features must be multiples of it: torch._scaled_mm's 16;
                     whole blocks; for 128x128 tiles groups of 4 blocks, because cuBLAS reads tile
                     scales with a leading dimension rounded up to 4 (PyTorch's block-wise path
                     passes the unrounded one, so other widths would compute silently wrong results)
    """

    name: str
    scaling: str
    bf16_dgrad: bool = False
    bf16_end_layers: int = 0
    block: int = 0  # the block length along the reduction ("block": 128, "mx": 32)
    align: int = 16


RECIPES = {r.name: r for r in (
    Fp8Recipe("rowwise", "row"),
    Fp8Recipe("rowwise-bf16-dgrad", "row", bf16_dgrad=True),
    Fp8Recipe("rowwise-bf16-ends", "row", bf16_end_layers=2),
    Fp8Recipe("tensorwise", "tensor"),
    Fp8Recipe("blockwise", "block", block=128, align=4 * 128),
    Fp8Recipe("mxfp8", "mx", block=32, align=32),
)}
MX_BLOCK = 32  # OCP MX: 32 consecutive values along the reduction share one power-of-two scale
E8M0_MIN, E8M0_MAX = -127, 127  # the exponents float8_e8m0fnu holds (255 is its NaN)
DEFAULT_RECIPE = "rowwise"


def get_recipe(name: str) -> Fp8Recipe:
    """The recipe called `name`; ValueError naming the recipes for any other name."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_block(
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
    return v.to(tl.float8e4nv), scale


@triton.jit
def _load_rows(X, rows, cols, col_ok, stride_x, M):
    """A block of whole rows of X (rows past M and columns past K read as 0)."""
    return tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _rows_block(X, Q, Scale, x, rows, cols, col_ok, col_max, M, K, WRITE_ROWS: tl.constexpr, COL_MAX: tl.constexpr,
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
        q, scale = _quantize_block(xf, tl.max(a, axis=1), 1, ROUND_IN_SOFTWARE)
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
        x = _load_rows(X, rows, cols, col_ok, stride_x, M)
        for i in range(0, n_blocks):
            this_rows, this_x = rows, x
            rows = (pid + (i + 1) * n_programs) * ROWS + tl.arange(0, ROWS)
            x = _load_rows(X, rows, cols, col_ok, stride_x, M)
            col_max = _rows_block(X, Q, Scale, this_x, this_rows, cols, col_ok, col_max, M, K, WRITE_ROWS, COL_MAX,
                                  ROUND_IN_SOFTWARE, col_scale, COL_SCALE)
    else:
        for i in range(0, n_blocks):
            rows = (pid + i * n_programs) * ROWS + tl.arange(0, ROWS)
            x = _load_rows(X, rows, cols, col_ok, stride_x, M)
            col_max = _rows_block(X, Q, Scale, x, rows, cols, col_ok, col_max, M, K, WRITE_ROWS, COL_MAX,
                                  ROUND_IN_SOFTWARE, col_scale, COL_SCALE)
    if COL_MAX:
        tl.store(ColMax + pid * K + cols, col_max, mask=col_ok)


@triton.jit
def _rmsnorm_quantize_rows(
    X,  # pointer to the norm's input, [M, H], unit stride along H
    W,  # pointer to the norm's weight, [H]
    Y,  # pointer to the norm's output, [M, H], contiguous
    Rstd,  # pointer to the inverse RMS per row, [M] fp32 (what the norm's backward needs)
    Q,  # pointer to the output's row-quantized copy, [M, H] float8_e4m3fn, contiguous
    Scale,  # pointer to its row scales, [M] fp32
    ColMax,  # pointer to this kernel's partial column maxima of |y|, [n_programs, H] fp32
    stride_x,  # elements between two rows of X
    M,  # rows (tokens)
    H,  # hidden size
    eps,  # the norm's epsilon
    ROWS: tl.constexpr,  # rows per loop iteration
    BLOCK_H: tl.constexpr,  # power of two >= H: a program holds whole rows
    OFFSET: tl.constexpr,  # the norm's weight offset (rmsnorm_kernel.py)
    CASTING: tl.constexpr,  # the norm's casting mode (rmsnorm_kernel.py)
    COL_MAX: tl.constexpr,  # also write the column maxima (the consumer's weight needs a gradient)
    ROUND_IN_SOFTWARE: tl.constexpr,  # see `ROUND_IN_SOFTWARE` above
):
    """RMSNorm's forward that also writes its output's FP8 row copy: `_rmsnorm_fwd` and `_quantize_rows`
    in one kernel. The norm holds whole rows in registers to find their RMS, which is all the row
    quantization needs (a row's maximum): the row copy is made from the registers, and the output is
    never read back. Persistent like `_quantize_rows`, for its column maxima."""
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    col_max = tl.zeros([BLOCK_H], dtype=tl.float32)
    n_blocks = tl.cdiv(tl.cdiv(M, ROWS) - pid, n_programs)
    for i in range(0, n_blocks):
        rows = (pid + i * n_programs) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        x = _load_rows(X, rows, cols, col_ok, stride_x, M)
        y, rstd = _normalize_rows(x, W, cols, col_ok, H, eps, OFFSET, CASTING)
        y = y.to(Y.dtype.element_ty)  # rounded as stored: the FP8 copy is made of these very values
        tl.store(Rstd + rows, rstd, mask=row_ok)
        tl.store(Y + rows[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])
        col_max = _rows_block(Y, Q, Scale, y, rows, cols, col_ok, col_max, M, H, True, COL_MAX, ROUND_IN_SOFTWARE)
    if COL_MAX:
        tl.store(ColMax + pid * H + cols, col_max, mask=col_ok)


@triton.jit
def _swiglu_quantize_rows(
    G,  # pointer to the gate, [M, I], unit stride along I (the first half of a joined gate_up)
    U,  # pointer to up, [M, I], unit stride along I
    Hout,  # pointer to the output act(gate) * up, [M, I], contiguous
    Q,  # pointer to the output's row-quantized copy, [M, I] float8_e4m3fn, contiguous
    Scale,  # pointer to its row scales, [M] fp32
    ColMax,  # pointer to this kernel's partial column maxima of |h|, [n_programs, I] fp32
    stride_g,  # elements between two rows of G
    stride_u,  # elements between two rows of U
    M,  # rows (tokens)
    I,  # the MLP width
    ROWS: tl.constexpr,  # rows per loop iteration
    BLOCK_I: tl.constexpr,  # power of two >= I: a program holds whole rows
    ACT: tl.constexpr,  # "silu" or "gelu_tanh" (swiglu_kernel.py)
    COL_MAX: tl.constexpr,  # also write the column maxima (the consumer's weight needs a gradient)
    ROUND_IN_SOFTWARE: tl.constexpr,  # see `ROUND_IN_SOFTWARE` above
):
    """The SwiGLU forward that also writes its output's FP8 row copy: swiglu_kernel's `_swiglu_fwd`
    (which tiles a row in blocks of 2048) with whole rows per program, so that a row's maximum is known
    before it leaves the registers. Persistent, like `_quantize_rows`, for its column maxima."""
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_I)
    col_ok = cols < I
    col_max = tl.zeros([BLOCK_I], dtype=tl.float32)
    n_blocks = tl.cdiv(tl.cdiv(M, ROWS) - pid, n_programs)
    for i in range(0, n_blocks):
        rows = (pid + i * n_programs) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        g = _load_rows(G, rows, cols, col_ok, stride_g, M).to(tl.float32)
        u = _load_rows(U, rows, cols, col_ok, stride_u, M).to(tl.float32)
        h = _act_out(g, u, ACT).to(Hout.dtype.element_ty)  # rounded as stored
        tl.store(Hout + rows[:, None] * I + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :])
        col_max = _rows_block(Hout, Q, Scale, h, rows, cols, col_ok, col_max, M, I, True, COL_MAX, ROUND_IN_SOFTWARE)
    if COL_MAX:
        tl.store(ColMax + pid * I + cols, col_max, mask=col_ok)


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
        q_rows, row_scale = _quantize_block(x, tl.load(RowMax + rows, mask=row_ok, other=0.0), 1, ROUND_IN_SOFTWARE)
        tl.store(Q + rows[:, None] * K + cols[None, :], q_rows, mask=row_ok[:, None] & col_ok[None, :])
        if tl.program_id(1) == 0:
            tl.store(RowScale + rows, row_scale, mask=row_ok)
    q, scale = _quantize_block(x, tl.load(ColMax + cols, mask=col_ok, other=0.0), 0, ROUND_IN_SOFTWARE)
    # The transpose: a [BLOCK_M, BLOCK_K] tile becomes [BLOCK_K, BLOCK_M], stored with M contiguous.
    # Triton moves it through shared memory so that both the loads and the stores stay coalesced.
    out_mask = col_ok[:, None] & (rows < M_pad)[None, :]
    tl.store(QT + cols[:, None] * M_pad + rows[None, :], tl.trans(q), mask=out_mask)
    if pid_m == 0:
        tl.store(Scale + cols, scale, mask=col_ok)


# The tensor-wise and block-wise recipes (`RECIPES`): one [TILE, TILE] tile of x per program, read
# once, written as the row-major copy Q [M, K] and/or the transposed copy QT [K, M_pad]. Where the
# scale comes from (MODE):
#   0 "tensor"  one scale for the whole tensor, from its maximum (TensorMax, found by the row kernel's
#               column maxima: one read before this one)
#   1 "act"     1x128 blocks: Q has one scale per row of the tile (a 1x128 block along K), QT one per
#               column of the tile (a 128x1 block along the tokens M, which dW reduces over)
#   2 "tile"    one scale per 128x128 tile (weights: the same tiles serve y = x W^T and dx = dy W)
# Block scales need no pass of their own: each block lies inside one tile, so a tile finds its
# maxima and applies them from registers.
@triton.jit
def _quantize_tiles(
    X,  # pointer to the input, [M, K], unit stride along K
    Q,  # pointer to the row-major copy, [M, K] float8_e4m3fn (WRITE_Q)
    QT,  # pointer to the transposed copy, [K, M_pad] float8_e4m3fn (WRITE_QT); zeros past M
    ScaleQ,  # MODE 1: [K / TILE, M] fp32, row m's block k at k * M + m; MODE 0: [1]; MODE 2: [M/TILE, K/TILE]
    ScaleQT,  # MODE 1: [M_pad / TILE, K] fp32, the scale of column k's block m at m * K + k
    TensorMax,  # MODE 0: pointer to the largest |x| of the whole tensor, [1] fp32
    stride_x,  # elements between two rows of X
    M,  # rows of X
    M_pad,  # rows of the transposed copy (M rounded up to a multiple of 16, or of TILE for MODE 1)
    K,  # columns of X
    TILE: tl.constexpr,  # tile rows and columns (128 for the block modes)
    MODE: tl.constexpr,  # 0 tensor, 1 act, 2 tile
    WRITE_Q: tl.constexpr,
    WRITE_QT: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = pid_k.to(tl.int64) * TILE + tl.arange(0, TILE)
    row_ok, col_ok = rows < M, cols < K
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)  # rows past M load 0: the zero padding of QT
    a = tl.abs(x)
    if MODE == 0:
        amax_rows = tl.zeros([TILE], dtype=tl.float32) + tl.load(TensorMax)
        amax_cols = tl.zeros([TILE], dtype=tl.float32) + tl.load(TensorMax)
    elif MODE == 1:
        amax_rows = tl.max(a, axis=1)
        amax_cols = tl.max(a, axis=0)
    else:
        amax_rows = tl.zeros([TILE], dtype=tl.float32) + tl.max(tl.max(a, axis=1), axis=0)
        amax_cols = amax_rows
    if WRITE_Q:
        q, scale = _quantize_block(x, amax_rows, 1, ROUND_IN_SOFTWARE)
        tl.store(Q + rows[:, None] * K + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
        if MODE == 1:
            tl.store(ScaleQ + pid_k * M + rows, scale, mask=row_ok)
    if WRITE_QT:
        qt, scale_t = _quantize_block(x, amax_cols, 0, ROUND_IN_SOFTWARE)
        out_mask = col_ok[:, None] & (rows < M_pad)[None, :]
        tl.store(QT + cols[:, None] * M_pad + rows[None, :], tl.trans(qt), mask=out_mask)
        if MODE == 1:
            tl.store(ScaleQT + pid_m * K + cols, scale_t, mask=col_ok)
    if MODE == 0 or MODE == 2:  # one scale per tile: its first value, whichever copy was written
        a0 = tl.maximum(tl.max(amax_rows, axis=0), _AMAX_FLOOR)
        if MODE == 0:
            if (pid_m == 0) & (pid_k == 0):
                tl.store(ScaleQ, tl.math.div_rn(a0, _FP8_MAX))
        else:
            tl.store(ScaleQ + pid_m * tl.num_programs(1) + pid_k, tl.math.div_rn(a0, _FP8_MAX))



# A frozen weight kept in FP8 is multiplied column-major in backward (dx = dy W: the section "A frozen
# weight kept in FP8" below): its bytes, transposed. One [BLOCK_N, BLOCK_K] tile per program, read with
# the input's rows contiguous and written with the output's rows contiguous: 1 byte read and 1 written
# per element. (PyTorch's general strided copy, `q.t().contiguous()`, walks one side a column at a
# time, one byte per 32-byte memory sector unless the cache keeps the rest; the two are not compared on
# a GPU yet.)
@triton.jit
def _transpose_bytes(
    Q,  # pointer to the input, [N, K] bytes (an FP8 tensor viewed as uint8), contiguous
    QT,  # pointer to the output, [K, N] bytes, contiguous
    N,  # rows of Q
    K,  # columns of Q
    BLOCK_N: tl.constexpr,  # tile rows (the contiguous dimension of the output)
    BLOCK_K: tl.constexpr,  # tile columns
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    tile = tl.load(Q + rows[:, None] * K + cols[None, :], mask=(rows < N)[:, None] & (cols < K)[None, :])
    # Triton moves the tile through shared memory, so that both the loads and the stores stay coalesced
    tl.store(QT + cols[:, None] * N + rows[None, :], tl.trans(tile), mask=(cols < K)[:, None] & (rows < N)[None, :])


# The SwiGLU backward of a joined gate/up projection (`swiglu_kernel._swiglu_bwd`, packed), which also
# takes both maxima of the gradient it writes, d gate_up [N, 2I], for that projection's FP8 backward.
# A scale is the largest |value| of its row or column, so quantizing a tensor someone else wrote takes
# two reads (maxima and rows, then columns); with the maxima from the kernel that wrote it, one read
# makes both copies (`quantize_both`). The maxima are those of the values after rounding to bf16, so
# they are exactly the written tensor's. Each program covers a stripe of STRIPE_ROWS rows x BLOCK
# columns, in blocks of SUB_ROWS rows, and writes its partial maxima (per row of its columns; per
# column of its rows), which two small reductions finish.
@triton.jit
def _stripe_maxima(v, rows, cols, row_ok, col_ok, col_max, RowMax, n_col_blocks, COL_BLOCK):
    """Fold a block's column maxima into `col_max`; store its row maxima as column block COL_BLOCK's."""
    a = tl.abs(v.to(tl.float32))
    tl.store(RowMax + rows * n_col_blocks + COL_BLOCK, tl.max(a, axis=1), mask=row_ok)
    return tl.maximum(col_max, tl.max(a, axis=0))


@triton.jit
def _block_of(P, rows, cols, stride, ok):
    """The [SUB_ROWS, BLOCK] block of P at these rows and columns, in fp32 (0 where not `ok`)."""
    return tl.load(P + rows[:, None] * stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _bwd_maxima_block(dh, g, u, DGU, RowMax, rows, cols, row_ok, col_ok, g_max, u_max, I, block, n_blocks,
                      ACT: tl.constexpr):
    """d gate and d up of one block of rows: store them, their row maxima; fold in their column maxima."""
    dg, du = _act_grads(dh, g, u, ACT)
    dg = dg.to(DGU.dtype.element_ty)
    du = du.to(DGU.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    out = rows[:, None] * (2 * I) + cols[None, :]
    tl.store(DGU + out, dg, mask=mask)
    tl.store(DGU + out + I, du, mask=mask)
    g_max = _stripe_maxima(dg, rows, cols, row_ok, col_ok, g_max, RowMax, 2 * n_blocks, block)
    u_max = _stripe_maxima(du, rows, cols, row_ok, col_ok, u_max, RowMax, 2 * n_blocks, n_blocks + block)
    return g_max, u_max


@triton.jit
def _swiglu_joined_bwd_maxima(
    DH,  # pointer to the upstream gradient, [n_rows, I], unit stride along I
    G, U,  # pointers to the saved gate and up (the halves of gate_up)
    DGU,  # pointer to d gate_up, [n_rows, 2I], contiguous: d gate, then d up
    RowMax,  # partial row maxima of |d gate_up|, [n_rows, 2 n_col_blocks] fp32
    ColMax,  # partial column maxima of |d gate_up|, [n_stripes, 2I] fp32
    stride_dh, stride_g, stride_u, n_rows, I,
    STRIPE_ROWS: tl.constexpr, SUB_ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ACT: tl.constexpr,  # "silu" or "gelu_tanh", as in the forward pass
):
    stripe = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    n_blocks = tl.num_programs(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < I
    g_max = tl.zeros([BLOCK], dtype=tl.float32)
    u_max = tl.zeros([BLOCK], dtype=tl.float32)
    # Register double buffering: the next block's loads are in flight while this one is computed,
    # stored and reduced. The load past the stripe's last block is masked off.
    rows = stripe * STRIPE_ROWS + tl.arange(0, SUB_ROWS)
    ok = (rows < n_rows)[:, None] & col_ok[None, :]
    dh, g, u = _block_of(DH, rows, cols, stride_dh, ok), _block_of(G, rows, cols, stride_g, ok), \
        _block_of(U, rows, cols, stride_u, ok)
    for r in range(0, STRIPE_ROWS, SUB_ROWS):
        this_rows, this_dh, this_g, this_u = rows, dh, g, u
        rows = this_rows + SUB_ROWS
        ok = ((rows < n_rows) & (r + SUB_ROWS < STRIPE_ROWS))[:, None] & col_ok[None, :]
        dh, g, u = _block_of(DH, rows, cols, stride_dh, ok), _block_of(G, rows, cols, stride_g, ok), \
            _block_of(U, rows, cols, stride_u, ok)
        g_max, u_max = _bwd_maxima_block(this_dh, this_g, this_u, DGU, RowMax, this_rows, cols,
                                         this_rows < n_rows, col_ok, g_max, u_max, I, block, n_blocks, ACT)
    tl.store(ColMax + stripe * (2 * I) + cols, g_max, mask=col_ok)
    tl.store(ColMax + stripe * (2 * I) + I + cols, u_max, mask=col_ok)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
# Launch settings, from a sweep on an H200 at every shape one LLaMA 3.1 8B step quantizes (8192 tokens;
# results/runs/fp8_tune_H200.log, each variant checked bit for bit before it was timed):
# - The row kernel is latency-bound unless each program has enough bytes in flight: 16384 values per
#   loop iteration (4 rows of 4096, 16 of 1024) on 4 warps, two programs per SM. Against 4096 values
#   per iteration, 2 programs per SM: [8192, 4096] 75.7 -> 46.0 us, [8192, 14336]
#   161.4 -> 134.1 us (then two rows on 16 warps), [8192, 1024] 90.8 -> 31.6 us, [14336, 4096] 90.0 ->
#   66.4 us. Rows wider than 16384: one row per iteration on block/4096 warps (the output gradient of
#   the joined gate/up projections, [8192, 28672]: 658.0 us with two rows on 32 warps, 344.6 us with one
#   row on 8 warps; results/runs/fp8_wide_H200.log). Rows of 4096 to 16384 values: next paragraph.
# - The transposing kernel: 128 x 128 tiles on 4 warps, best or within 3% of the best at every shape
#   ([8192, 4096] 37.2 -> 32.6 us, [8192, 14336] 99.2 -> 90.7 us).
# Triton's interpreter pays per program and per loop iteration, not per element, so there the
# blocks are as large as the data allows and the row kernel runs two programs (which keeps its
# grid-stride loop and the reduction of partial column maxima exercised).
ROW_ELEMENTS, ROW_WARPS, ROW_PROGRAMS_PER_SM = 16384, 4, 2  # rows of up to 2048 values
# Rows padded to 4096, 8192 and 16384 values (LLaMA's 4096, the joined q/k/v's 6144, the MLP's 14336):
# the double-buffered loop (PREFETCH), block -> (rows per iteration, warps, programs per SM). Against
# the single-buffered loop at the settings above (results/runs/fp8_prefetch_H200.log, bit-equal first):
# [8192, 4096] 46.3 -> 43.8 us, [8192, 6144] 74.5 -> 61.1, [8192, 14336] 134.0 -> 111.2,
# [4096, 14336] 78.1 -> 64.5, [6144, 4096] 39.2 -> 37.1. Rows of 28672 (joined gate/up) were slower
# double-buffered (724.4 against 340.9 us with 16 warps): they keep the single loop.
PREFETCH_LAUNCH = {4096: (2, 8, 2), 8192: (1, 8, 2), 16384: (1, 16, 1)}
COL_BLOCK_M, COL_BLOCK_K, COL_NUM_WARPS = 128, 128, 4
# None of these settings depends on the GPU generation, and none is sized to Hopper's 228 KB of shared
# memory per SM. Triton 3.9 compiles the quantizers to the same shared memory per program for sm_90,
# sm_100, sm_103 and sm_120: 32 KB for the transposing kernel (16 KB when it also writes the row copy),
# 16 KB for the tile kernel, 4 to 8 KB for the row kernel. Consumer Blackwell's 99 KB per block holds
# each; its 100 KB per SM holds three transposing programs at a time (Hopper: seven), each with a 32 KB
# tile of loads in flight. The persistent row kernel asks at most 16 warps per SM, within the 48
# resident warps of consumer Blackwell (64 elsewhere). tests/blackwell_test.py checks both limits;
# the speed of these settings on Blackwell is not measured.


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


NORM_PROGRAMS_PER_SM = 4  # persistent programs of the RMSNorm producer per SM (benchmark_kernels.py --fp8-producers)


def rmsnorm_quantize_rows(x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                          casting_mode: str = "llama", col_max: bool = True, out_shape: torch.Size | None = None,
                          programs_per_sm: int | None = None):
    """RMSNorm of x2 [M, H] (rmsnorm_kernel.rmsnorm_forward's numerics) and its output's row copy, in one
    kernel: (y, rstd, q, scale, column maxima or None), each bit for bit what `rmsnorm_forward` and then
    `quantize_rows(y, col_max=col_max)` give. `out_shape`: allocate y in this shape (M x H elements).
    `programs_per_sm`: the persistent grid's size per SM (default NORM_PROGRAMS_PER_SM)."""
    M, H = x2.shape
    if not 1 <= H <= MAX_COLS:
        raise ValueError(f"rows of 1 to {MAX_COLS} elements can be quantized, got {H}")
    y = torch.empty(out_shape if out_shape is not None else (M, H),
                    dtype=rmsnorm_kernel._output_dtype(x2.dtype, weight.dtype, casting_mode), device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
    q = torch.empty((M, H), dtype=FP8_DTYPE, device=x2.device)
    scale = torch.empty(M, dtype=torch.float32, device=x2.device)
    # The norm's own block shape and warps (rmsnorm_kernel._fwd_settings): the sum of squares of a row is
    # then reduced in the same order as in `rmsnorm_forward`, so the inverse RMS and y are the same bits
    # (another layout of the block sums in another order: a last-bit difference, measured on an H100).
    block_h, rows, num_warps = rmsnorm_kernel._fwd_settings(H)
    if kernel_utils.INTERPRET:
        n_programs = 2
    else:
        n_programs = num_sms(x2.device) * (programs_per_sm or NORM_PROGRAMS_PER_SM)
    n_programs = max(1, min(triton.cdiv(max(M, 1), rows), n_programs))
    partial = torch.empty((n_programs, H) if col_max else (1, 1), dtype=torch.float32, device=x2.device)
    if M == 0:
        return y, rstd, q, scale, (torch.zeros(H, dtype=torch.float32, device=x2.device) if col_max else None)
    _rmsnorm_quantize_rows[(n_programs,)](
        x2, weight, y, rstd, q, scale, partial, x2.stride(0), M, H, eps,
        ROWS=rows, BLOCK_H=block_h, OFFSET=float(offset), CASTING=casting_mode, COL_MAX=col_max,
        ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE, num_warps=num_warps,
    )
    return y, rstd, q, scale, (partial.amax(dim=0) if col_max else None)


SWIGLU_PROGRAMS_PER_SM = 2  # persistent programs of the SwiGLU producer per SM (benchmark_kernels.py --fp8-producers)
# Off: measured slower than the pair it replaces (H100, 8192 x 14336: 400-431 us over 1-4 programs per SM
# against 377 us for swiglu_kernel's forward and the row pass; `benchmark_kernels.py --fp8-producers`). A
# program holding whole rows of 14336 keeps too few loads in flight; the 2,048-column tiles of the plain
# SwiGLU kernel stream at 2.8 TB/s where this kernel reaches 2.0.
SWIGLU_WRITES_ROWS = False


def swiglu_quantize_rows(g2: torch.Tensor, u2: torch.Tensor, activation: str = "silu", col_max: bool = True,
                         programs_per_sm: int | None = None):
    """act(gate) * up of g2, u2 [M, I] (swiglu_kernel.swiglu_forward's numerics) and its row copy, in one
    kernel: (h, q, scale, column maxima or None), each bit for bit what `swiglu_forward` and then
    `quantize_rows(h, col_max=col_max)` give (element-wise work and maxima: no order of operations to
    match). `programs_per_sm`: the persistent grid's size per SM (default SWIGLU_PROGRAMS_PER_SM)."""
    M, I = g2.shape
    if not 1 <= I <= MAX_COLS:
        raise ValueError(f"rows of 1 to {MAX_COLS} elements can be quantized, got {I}")
    h = torch.empty((M, I), dtype=g2.dtype, device=g2.device)
    q = torch.empty((M, I), dtype=FP8_DTYPE, device=g2.device)
    scale = torch.empty(M, dtype=torch.float32, device=g2.device)
    block_i = next_power_of_2(I)
    if kernel_utils.INTERPRET:
        rows, num_warps, n_programs = max(1, min(64, 4096 // block_i)), 4, 2
    else:  # one whole row per iteration, 32 values of each operand per thread at LLaMA's 14336 (16 warps)
        rows, num_warps = 1, max(4, min(16, block_i // 1024))
        n_programs = num_sms(g2.device) * (programs_per_sm or SWIGLU_PROGRAMS_PER_SM)
    n_programs = max(1, min(triton.cdiv(max(M, 1), rows), n_programs))
    if M == 0:
        return h, q, scale, (torch.zeros(I, dtype=torch.float32, device=g2.device) if col_max else None)
    partial = torch.empty((n_programs, I) if col_max else (1, 1), dtype=torch.float32, device=g2.device)
    _swiglu_quantize_rows[(n_programs,)](
        g2, u2, h, q, scale, partial, g2.stride(0), u2.stride(0), M, I,
        ROWS=rows, BLOCK_I=block_i, ACT=activation, COL_MAX=col_max, ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE,
        num_warps=num_warps,
    )
    return h, q, scale, (partial.amax(dim=0) if col_max else None)


def swiglu_rows_ideal_bytes(n_rows: int, width: int, dtype: torch.dtype) -> int:
    """Bytes `swiglu_quantize_rows` moves: read gate and up, write h, its row copy and scales. The pair
    (swiglu_kernel's forward, then `quantize_rows`) also reads h back: `dtype.itemsize` bytes per element."""
    n, e = n_rows * width, dtype.itemsize
    return 3 * n * e + n + 4 * n_rows


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


TRANSPOSE_BLOCK, TRANSPOSE_WARPS = 128, 4  # the transposing quantizer's tile and warps; not swept on its own


def transpose_bytes(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] of a one-byte dtype (float8_e4m3fn) -> its transpose [K, N], contiguous: the same bytes as
    `q.t().contiguous()`, one read and one write of each."""
    if q.dim() != 2 or q.element_size() != 1:
        raise ValueError(f"transpose_bytes takes a 2-D tensor of a one-byte dtype, got {q.dtype} {tuple(q.shape)}")
    q = q.contiguous()
    N, K = q.shape
    qt = torch.empty((K, N), dtype=q.dtype, device=q.device)
    if q.numel():
        block_n = block_k = TRANSPOSE_BLOCK
        if kernel_utils.INTERPRET:  # few, large programs: the interpreter pays per program
            block_n, block_k = min(256, next_power_of_2(N)), min(256, next_power_of_2(K))
        grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
        _transpose_bytes[grid](q.view(torch.uint8), qt.view(torch.uint8), N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                               num_warps=TRANSPOSE_WARPS)
    return qt


def quantize(x2: torch.Tensor, rows: bool = True, cols: bool = False):
    """Both quantizations of x [M, K] as asked: (q, row scales, qT, column scales), a layout not asked
    for as empty tensors. Rows alone read x once; columns read it twice (maxima, then the cast), and
    both layouts share the first read."""
    q, s_rows, col_max = quantize_rows(x2, write_rows=rows, col_max=cols)
    if not cols:
        return q, s_rows, x2.new_empty(0, dtype=FP8_DTYPE), x2.new_empty(0, dtype=torch.float32)
    return (q, s_rows, *quantize_cols(x2, col_max))


def _scaled_mm_launch(a, a_scale, bt, bt_scale, fast_accum: bool) -> torch.Tensor:
    """a [R, S] fp8 (row scales [R]) @ b, where bt [C, S] is b transposed, row-major (scales [C]): bf16 [R, C].

    `bt.t()` is the column-major [S, C] operand torch._scaled_mm wants, without a copy; the row-wise
    scaled matmul writes bf16 only."""
    return torch._scaled_mm(a, bt.t(), a_scale[:, None], bt_scale[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


_fast_accum: dict = {}


def fast_accum_allowed(device: torch.device) -> bool:
    """Whether the forward matmul may use fast accumulation on this device.

    It is a Hopper (and Ada) setting: their FP8 tensor cores keep about 14 bits of the running sum
    unless the matmul promotes it to fp32 now and then, which fast accumulation skips. Data-centre
    Blackwell (sm_100, sm_103) accumulates in fp32 whatever the flag says, and PyTorch runs its
    row-wise matmul through a different (CUTLASS) kernel: there the flag is left off. Consumer
    Blackwell (sm_120) and unrecognised GPUs leave it off too: off is the precise setting (the sum is
    promoted to fp32), and no measurement there says the flag is both safe and faster. Decided by
    family (`gpu_arch`), so 10.3 takes 10.0's setting. The CPU ignores it."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _fast_accum:
        _fast_accum[index] = gpu_arch.device_family(index) in (gpu_arch.HOPPER, gpu_arch.OLDER)
    return _fast_accum[index]


# Tensor-wise and block-wise quantization (`_quantize_tiles`): 128 x 128 tiles on 4 warps, the
# transposing kernel's tuned setting; this kernel was not swept on its own.
TILE, TILE_NUM_WARPS = 128, 4
TILE_MODES = {"tensor": 0, "act": 1, "tile": 2}


def tile_rows(m: int, mode: str) -> int:
    """The token dimension of a transposed copy: m rounded up to a multiple of 16, or of 128 for
    1x128 blocks along the tokens (each block of the reduction must be whole)."""
    step = TILE if mode == "act" else ALIGN
    return (m + step - 1) // step * step


def tensor_max(x2: torch.Tensor) -> torch.Tensor:
    """The largest |x| of a 2-D tensor, [1] fp32 (NaN skipped), from the row kernel's column maxima."""
    return quantize_rows(x2, write_rows=False, col_max=True)[2].amax().reshape(1)


def quantize_tiles(x2: torch.Tensor, mode: str, rows: bool = True, cols: bool = False,
                   amax: torch.Tensor | None = None):
    """One read of x [M, K] (unit stride along K): (q [M, K], scales, qT [K, M_pad], scales), a copy
    not asked for as None, with x ~= dequantize_blocks(q, scales) and x.T ~= dequantize_blocks(qT, ...)[:, :M].

    Scales in their natural shapes, element [i, j] the scale of block j of row i of its copy:
      "tensor"  one [1] tensor for both copies, from `amax` ([1] fp32) or from `tensor_max` (one more read)
      "act"     q: [M, K/128], qT: [K, M_pad/128] (views in the column-major layout torch._scaled_mm takes)
      "tile"    q: [M/128, K/128] and qT: its transpose (M and K multiples of 128)
    """
    if mode == "tensor" and amax is None:
        amax = tensor_max(x2)
    return natural_scales(x2.shape, mode, rows, cols, *_launch_tiles(x2, mode, rows, cols, amax))


def _launch_tiles(x2: torch.Tensor, mode: str, rows: bool, cols: bool, amax: torch.Tensor | None):
    """The tile kernel: (q, scales, qT, scales) as it writes them (empty where not asked for)."""
    M, K = x2.shape
    m_pad = tile_rows(M, mode)
    dev, f32 = x2.device, torch.float32
    if mode == "act":
        s_q = torch.empty((triton.cdiv(K, TILE), M) if rows else (0,), dtype=f32, device=dev)
        s_qt = torch.empty((m_pad // TILE, K) if cols else (0,), dtype=f32, device=dev)
    else:  # "tensor": [1]; "tile": [M/128, K/128]; the transposed copy shares them
        s_q = torch.empty((1,) if mode == "tensor" else (triton.cdiv(M, TILE), triton.cdiv(K, TILE)), dtype=f32,
                          device=dev)
        s_qt = s_q.new_empty(0)
    q = torch.empty((M, K) if rows else (0,), dtype=FP8_DTYPE, device=dev)
    qt = torch.empty((K, m_pad) if cols else (0,), dtype=FP8_DTYPE, device=dev)
    if K and m_pad:
        grid = (triton.cdiv(m_pad, TILE), triton.cdiv(K, TILE))
        _quantize_tiles[grid](
            x2, q, qt, s_q, s_qt, amax, x2.stride(0), M, m_pad, K,
            TILE=TILE, MODE=TILE_MODES[mode], WRITE_Q=rows, WRITE_QT=cols, ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE,
            num_warps=TILE_NUM_WARPS,
        )
    else:  # nothing to read: the scale of an all-zero tensor
        s_q.copy_(torch.full_like(s_q, AMAX_FLOOR) / torch.full_like(s_q, FP8_MAX))
    return q, s_q, qt, s_qt


def natural_scales(shape, mode: str, rows: bool, cols: bool, q, s_q, qt, s_qt):
    """The tile kernel's outputs with their scales viewed in natural shapes (`quantize_tiles`), None
    for a copy not asked for."""
    M, K = shape
    if mode == "act":
        s_q, s_qt = s_q.view(-1, M).t(), s_qt.view(-1, K).t()
    elif mode == "tile":
        s_qt = s_q.t()
    else:
        s_qt = s_q
    return ((q, s_q) if rows else (None, None)) + ((qt, s_qt) if cols else (None, None))


def _scaled_mm_tiles_launch(a, a_scale, bt, bt_scale, b_tiles: bool, fast_accum: bool) -> torch.Tensor:
    """a [R, S] fp8 @ b, bt [C, S] being b transposed and row-major, with tensor or block scales in the
    natural shapes of `quantize_tiles` (b_tiles: bt's scales are 128x128 tiles, else 1x128 blocks):
    bf16 [R, C].

    torch._scaled_mm tells the recipes apart by the scales' shapes: [1] and [1] tensor-wise; a's
    [R, S/128] (column-major) with b's [S/128, C/128] (1x128 x 128x128) or [S/128, C] (1x128 x 1x128)
    block-wise, through cuBLAS on Hopper only. PyTorch's CPU scaled matmul has no block scales: there
    the same product is computed from the dequantized operands in fp32, rounded once to bf16."""
    if a_scale.numel() == 1:
        return torch._scaled_mm(a, bt.t(), a_scale, bt_scale, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    if a.device.type == "cpu":
        return (dequantize_blocks(a, a_scale) @ dequantize_blocks(bt, bt_scale).t()).to(torch.bfloat16)
    R = a.shape[0]
    if R % 4:  # cuBLASLt wants the leading dimension of a's scales (R) a multiple of 4: zero rows, cut off below
        a = torch.nn.functional.pad(a.view(torch.uint8), (0, 0, 0, -R % 4)).view(FP8_DTYPE)
        a_scale = torch.nn.functional.pad(a_scale, (0, 0, 0, -R % 4), value=1.0)
    sa = a_scale.t().contiguous().t()  # [R, S/128] with strides (1, R): a no-op for `quantize_tiles`' scales
    sb = bt_scale.contiguous().t() if b_tiles else bt_scale.t().contiguous()
    return torch._scaled_mm(a, bt.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)[:R]


def mx_swizzled_scales(scales: torch.Tensor) -> torch.Tensor:
    """MX block scales [R, S/32] (float8_e8m0fnu, one per 32 values of a row) in the layout cuBLAS reads
    them in (cuBLAS docs, "1D block scaling factors layout"; PyTorch's SwizzleType.SWIZZLE_32_4_4): the
    rows padded to a multiple of 128 and the blocks to a multiple of 4 (zero bytes: padding is never
    multiplied with data), then each 128 x 4 tile stored as 32 x 16 bytes, row r of the tile at
    [r % 32, (r // 32) * 4 + column]. Flat, contiguous."""
    R, B = scales.shape
    u = torch.nn.functional.pad(scales.view(torch.uint8), (0, -B % 4, 0, -R % 128))  # pad takes no e8m0
    tiles = u.view(u.shape[0] // 128, 128, u.shape[1] // 4, 4).permute(0, 2, 1, 3)  # [row tile, block tile, 128, 4]
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return swizzled.flatten().view(torch.float8_e8m0fnu)


def _scaled_mm_mx_launch(a, a_scale, bt, bt_scale) -> torch.Tensor:
    """a [R, S] e4m3 @ b, bt [C, S] being b transposed and row-major, each with its MX scales [rows, S/32]
    (e8m0, `quantize_mx_ref`): bf16 [R, C]. On a GPU, torch._scaled_mm's MXFP8 matmul (block-scaled
    tensor cores: Blackwell), with both scales swizzled; on the CPU, the product of the dequantized
    operands in fp32, rounded once to bf16 (the reference). `check_fp8_device` compares the two once
    per GPU before training uses it (`_probe_scaled_mm`)."""
    if a.device.type == "cpu":
        return (dequantize_blocks(a, a_scale) @ dequantize_blocks(bt, bt_scale).t()).to(torch.bfloat16)
    return torch._scaled_mm(a.contiguous(), bt.contiguous().t(), mx_swizzled_scales(a_scale),
                            mx_swizzled_scales(bt_scale), out_dtype=torch.bfloat16)


# The SwiGLU backward with maxima: stripes of STRIPE_ROWS rows (the partial column maxima are
# n_rows / STRIPE_ROWS rows of fp32: 7.3 MB for d gate_up at 8192 tokens), one row of BLOCK values per
# loop step, the double-buffered loop. From the sweep at [8192, 14336] on an H200
# (results/runs/swiglu_fp8_H200.log, each setting bit-equal first): this kernel + quantize_both
# 625.2 us against 802.5 us for the SwiGLU kernel + the two separate passes (639.8 us with a
# single-buffered loop); taller stripes leave too few programs (256 rows of 4 x 512: 2480 us,
# results/runs/swiglu_fp8_tallstripes_H200.log).
MAXIMA_LAUNCH = (128, 1, 1024, 4)  # stripe rows, sub rows, block, warps


def _maxima_launch(n_rows: int, width: int):
    """(grid, stripe rows, sub rows, block, warps) of `_swiglu_joined_bwd_maxima`."""
    stripe, sub, block, warps = MAXIMA_LAUNCH
    if kernel_utils.INTERPRET:  # few, large programs: the interpreter pays per program and loop step
        block = min(1024, next_power_of_2(width))
        sub = max(1, min(64, 4096 // block))
        stripe, warps = 2 * sub, 4
    return (triton.cdiv(n_rows, stripe), triton.cdiv(width, block)), stripe, sub, block, warps


def swiglu_joined_backward_maxima(dh2: torch.Tensor, g2: torch.Tensor, u2: torch.Tensor, activation: str = "silu"):
    """(d gate_up [n_rows, 2I] as `swiglu_kernel.swiglu_backward(..., packed=True)` writes it, its row
    maxima [n_rows], its column maxima [2I]): what `quantize_both` needs to quantize it in one read."""
    n_rows, width = g2.shape
    dgu = torch.empty((n_rows, 2 * width), dtype=g2.dtype, device=g2.device)
    grid, stripe, sub, block, warps = _maxima_launch(n_rows, width)
    # The partial maxima, fp32: per row of each column block, and per column of each stripe. The kernel
    # writes every one; with nothing to launch they are zeros.
    alloc = torch.empty if dgu.numel() else torch.zeros
    row_part = alloc((n_rows, 2 * grid[1]), dtype=torch.float32, device=g2.device)
    col_part = alloc((max(1, grid[0]), 2 * width), dtype=torch.float32, device=g2.device)
    if dgu.numel():
        _swiglu_joined_bwd_maxima[grid](dh2, g2, u2, dgu, row_part, col_part, dh2.stride(0), g2.stride(0),
                                        u2.stride(0), n_rows, width, STRIPE_ROWS=stripe, SUB_ROWS=sub, BLOCK=block,
                                        ACT=activation, num_warps=warps)
    return dgu, row_part.amax(dim=1), col_part.amax(dim=0)


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile and opcheck see
# ------------------------------------------------------------------------------------------------
# Each launcher is one opaque node for torch.compile (Dynamo never traces the Triton launch code);
# `register_fake` gives its outputs' shapes and dtypes. Quantization has no gradient: the
# autograd.Functions below call these ops only inside their forward and backward, where autograd is
# off, and only while torch.compile traces (eager mode calls the launchers: see the Functions).
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
    """a [R, S] fp8 (row scales [R]) @ b, where bt [C, S] is b transposed (`_scaled_mm_launch`).

    An operator of its own, so that torch.compile calls this exact cuBLAS matmul instead of lowering
    aten._scaled_mm to Inductor's own scaled-matmul templates. (That does not cure the compiled dx
    that differs from eager on GPUs: see `compiled_graph_trusted`.)
    """
    return _scaled_mm_launch(a, a_scale, bt, bt_scale, fast_accum)


@fp8_scaled_mm_op.register_fake
def _(a, a_scale, bt, bt_scale, fast_accum):
    return a.new_empty((a.shape[0], bt.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("playbook::swiglu_joined_fp8_bwd", mutates_args=())
def swiglu_joined_fp8_bwd_op(dh: torch.Tensor, gate_up: torch.Tensor,
                             activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate_up [rows, 2I], its row maxima [rows], its column maxima [2I]) of |d gate_up|."""
    return swiglu_joined_backward_maxima(as_rows(dh), *halves(gate_up), activation)


@swiglu_joined_fp8_bwd_op.register_fake
def _(dh, gate_up, activation):
    f32 = torch.float32
    return (gate_up.new_empty(gate_up.shape), gate_up.new_empty(gate_up.shape[0], dtype=f32),
            gate_up.new_empty(gate_up.shape[1], dtype=f32))


refuse_double_backward(swiglu_joined_fp8_bwd_op, "swiglu_joined_fp8")


@torch.library.custom_op("playbook::fp8_quantize_tiles", mutates_args=())
def fp8_tiles_op(x: torch.Tensor, mode: str, rows: bool, cols: bool,
                 amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q, scales, qT, scales) as `_launch_tiles` writes them (`natural_scales` views them)."""
    x2 = as_rows(x)
    if mode == "tensor" and amax is None:
        amax = tensor_max(x2)
    return _launch_tiles(x2, mode, rows, cols, amax)


@fp8_tiles_op.register_fake
def _(x, mode, rows, cols, amax):
    M, K = x.shape
    m_pad, f32 = tile_rows(M, mode), torch.float32
    if mode == "act":
        s_q = x.new_empty((-(-K // TILE), M) if rows else (0,), dtype=f32)
        s_qt = x.new_empty((m_pad // TILE, K) if cols else (0,), dtype=f32)
    else:
        s_q = x.new_empty((1,) if mode == "tensor" else (-(-M // TILE), -(-K // TILE)), dtype=f32)
        s_qt = x.new_empty(0, dtype=f32)
    return (x.new_empty((M, K) if rows else (0,), dtype=FP8_DTYPE), s_q,
            x.new_empty((K, m_pad) if cols else (0,), dtype=FP8_DTYPE), s_qt)


@torch.library.custom_op("playbook::fp8_scaled_mm_tiles", mutates_args=())
def fp8_scaled_mm_tiles_op(a: torch.Tensor, a_scale: torch.Tensor, bt: torch.Tensor, bt_scale: torch.Tensor,
                           b_tiles: bool, fast_accum: bool) -> torch.Tensor:
    """a [R, S] fp8 @ b, bt [C, S] being b transposed, with tensor or block scales (`_scaled_mm_tiles_launch`)."""
    return _scaled_mm_tiles_launch(a, a_scale, bt, bt_scale, b_tiles, fast_accum)


@fp8_scaled_mm_tiles_op.register_fake
def _(a, a_scale, bt, bt_scale, b_tiles, fast_accum):
    return a.new_empty((a.shape[0], bt.shape[0]), dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# The hand-off: what the FP8 layers of one model pass to each other within a pass
# ------------------------------------------------------------------------------------------------
class HandoffSlot:
    """One value made from one tensor (its FP8 copies, or its maxima), for the next reader of that very
    tensor, unchanged.

    The slot holds the tensor itself, so its memory cannot be freed and reused by another tensor while
    the slot is filled: equal address, shape, strides, dtype, device and version counter then mean the
    same tensor, unchanged (an in-place write bumps the version).
    """

    def __init__(self):
        self.key = self.tensor = self.value = None
        self.taken = 0  # values handed over by `take` (the tests check that a fused path ran)

    @staticmethod
    def _key(x: torch.Tensor):
        return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version)

    def get(self, x: torch.Tensor):
        """The value put for x, if x is that very tensor, unchanged; else None."""
        return self.value if self.tensor is not None and self.key == self._key(x) else None

    def put(self, x: torch.Tensor, value) -> None:
        self.key, self.tensor, self.value = self._key(x), x, value

    def clear(self) -> None:
        self.key = self.tensor = self.value = None

    def take(self, x: torch.Tensor):
        """`get`, and empty the slot when it matched (the value is then the caller's alone): once only."""
        value = self.get(x)
        if value is not None:
            self.clear()
            self.taken += 1
        return value


class Fp8Handoff:
    """What the FP8 layers of one model hand to each other; `patch_model` gives every Float8Linear of a
    model the same one (its `fp8_handoff`). A layer without one (None) hands nothing over.

    shared_rows   q, k and v read one tensor, and so do gate and up: the first of them to quantize it
                  per row leaves (rows, scales, column maxima) here for the others' forward. Without
                  it each layer quantizes the tensor again, forward and backward: per decoder layer
                  three extra reads and writes of the [tokens, 4096] input each way, and six more
                  launches. Only layers that keep their bf16 input (`keep_fp8_input=False`) use it.
    shared_cols   the same in backward: the column-quantized, transposed copy of that input.
    grad_maxima   the row and column maxima of an output gradient, from the kernel that wrote it (the
                  SwiGLU backward of `swiglu_joined_fp8`): the layer whose backward receives that very
                  gradient makes both of its FP8 copies in one read (`quantize_both`).
    input_rows    the row-quantized copy of an input (rows, scales, column maxima), from the kernel that
                  wrote that input: an RMSNorm linked by `link_norms` (`RMSNormFp8Function`). The FP8
                  layer that reads that very tensor next skips its row pass.

    A forward empties backward's slots and a backward the forward's, so no value (nor the tensor it
    came from) outlives the pass that made it. A copy or pickle of a model gets an empty hand-off.
    """

    def __init__(self):
        self.shared_rows, self.shared_cols, self.grad_maxima = HandoffSlot(), HandoffSlot(), HandoffSlot()
        self.input_rows = HandoffSlot()

    def offer_grad(self, dy: torch.Tensor, maxima: tuple) -> None:
        """Hand (row maxima [M], column maxima [N]) of |dy| for dy [M, N] to the next FP8 layer whose
        backward receives dy, unchanged."""
        self.grad_maxima.put(as_rows(dy), maxima)

    def start_forward(self) -> None:
        self.shared_cols.clear()
        self.grad_maxima.clear()

    def start_backward(self) -> None:
        self.shared_rows.clear()
        self.input_rows.clear()

    def is_empty(self) -> bool:
        return all(s.tensor is None for s in (self.shared_rows, self.shared_cols, self.grad_maxima, self.input_rows))

    def rmsnorm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A linked norm's forward (rmsnorm_kernel.TritonRMSNorm with `fp8_handoff` set: `link_norms`):
        RMSNorm that also leaves its output's FP8 row copy in `input_rows`. Where the launchers cannot run
        (torch.compile tracing, a meta tensor, a dispatch mode) it is the norm's own forward."""
        if not direct_launch(x, norm.weight):  # (rmsnorm checks its inputs itself)
            return rmsnorm_kernel.rmsnorm(x, norm.weight, norm.variance_epsilon, offset=norm.offset,
                                          casting_mode=norm.casting_mode, in_place=norm.in_place)
        rmsnorm_kernel._check_inputs(x, norm.weight, norm.offset, norm.casting_mode)  # (refuses rows over MAX_HIDDEN = MAX_COLS)
        return RMSNormFp8Function.apply(x, norm.weight, float(norm.variance_epsilon), float(norm.offset),
                                        norm.casting_mode, bool(norm.in_place), self, torch.is_grad_enabled())

    def swiglu_joined(self, gate_up: torch.Tensor, activation: str = "silu", down: nn.Module | None = None):
        """The fused SwiGLU MLP's FP8 hook (swiglu_kernel.swiglu_mlp_forward): `swiglu_joined_fp8` with
        this hand-off, so the SwiGLU file need not import this one; `down`: the MLP's down projection."""
        return swiglu_joined_fp8(gate_up, activation, self, down)

    def __reduce__(self):  # copy.deepcopy and pickle: a fresh, empty hand-off
        return (Fp8Handoff, ())


# ------------------------------------------------------------------------------------------------
# The autograd.Functions: eager mode calls the launchers, torch.compile the operators
# ------------------------------------------------------------------------------------------------
# Eager mode calls the launchers directly (`ops=False`), torch.compile the operators (`ops=True`): the
# module docstring says why (~15 us of host time per operator call, ~1,100 calls per step), and
# results/runs/profile_H200_fp8_launch_operators.log and finetune_H200_fp8_launch_*.log measure it.
def _quant_rows(x2, write_rows: bool, col_max: bool, ops: bool, col_scale=None):
    """`fp8_rows_op`, or its launcher (the column maxima are then None when not asked for)."""
    if ops:
        return fp8_rows_op(x2, write_rows, col_max, col_scale)
    return quantize_rows(as_rows(x2), write_rows, col_max, col_scale)


def _quant_cols(x2, col_max, ops: bool):
    return fp8_cols_op(x2, col_max) if ops else quantize_cols(as_rows(x2), col_max)


def _quant_both(x2, row_max, col_max, ops: bool):
    return fp8_both_op(x2, row_max, col_max) if ops else quantize_both(as_rows(x2), row_max, col_max)


def _scaled_mm(a, a_scale, bt, bt_scale, fast_accum: bool, ops: bool):
    if ops:
        return fp8_scaled_mm_op(a, a_scale, bt, bt_scale, fast_accum)
    return _scaled_mm_launch(a, a_scale, bt, bt_scale, fast_accum)


class Float8LinearFunction(torch.autograd.Function):
    """y = x W^T with FP8 operands in the forward and in both gradient matmuls.

    Saved for backward (exactly): the weight Parameter itself (no copy) with its column maxima [K]
    when dx is needed, and, when the weight needs a gradient, either the input x as given and its
    column maxima [K] (`keep_fp8_input` False), or only xT, x's FP8 copy quantized per column and
    transposed ([K, padded(M)], 1 byte per element), and its K fp32 scales. Nothing of x is saved
    when the weight is frozen (LoRA): dx does not need x. The column maxima come free with the
    forward's row quantization (the tensor is in registers anyway), so backward reads W and x once
    each to quantize them per column. `handoff`: the model's `Fp8Handoff`, or None; `ops`: launch
    through the custom operators (torch.compile) instead of the launchers (eager).

    `bf16_dgrad` (the recipe rowwise-bf16-dgrad): dx = dy W runs as a bf16 matmul of the bf16 gradient
    and the bf16 weight; W's column maxima and dy's row copy are then not made at all.
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, keep_fp8_input: bool, need_input_grad: bool,
                need_weight_grad: bool, handoff: Fp8Handoff | None, ops: bool, bf16_dgrad: bool):
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
            xq, sx, xmax = _quant_rows(x2, True, need_weight_grad, ops)
            if share:
                handoff.shared_rows.put(x2, (xq, sx, xmax if need_weight_grad else None))
        fp8_dx = need_input_grad and not bf16_dgrad
        wq, sw, wmax = _quant_rows(weight, True, fp8_dx, ops)
        # wq [N, K] is W: b = W^T, column-major. Fast accumulation: Hopper's FP8 tensor cores accumulate
        # with fewer than 32 bits unless the matmul promotes partial sums to fp32 now and then, which
        # "fast accumulation" skips. Like torchao's float8 recipes, the forward uses it and the two
        # gradient matmuls (longer, more cancelling sums) do not. (The CPU ignores it.)
        y = _scaled_mm(xq, sx, wq, sw, fast_accum_allowed(x2.device), ops)
        if keep_fp8:
            saved_x = _quant_cols(x2, xmax, ops)  # xT and its scales; x itself is not kept
        elif need_weight_grad:
            saved_x = (x2, xmax)
        else:
            saved_x = ()
        ctx.keep_fp8, ctx.handoff, ctx.ops, ctx.fp8_dx = keep_fp8, handoff, ops, fp8_dx
        ctx.save_for_backward(weight, *((wmax,) if fp8_dx else ()), *saved_x)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if torch.is_grad_enabled():  # backward(create_graph=True): the FP8 backward has no derivative
            raise RuntimeError("fp8_linear: second-order gradients (create_graph=True) are not supported by the FP8 "
                               "matmuls; use nn.Linear for double backward")
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
            dyq, sdy, dyqt, sdyt = _quant_both(dy2, *made, ops)  # both layouts in one read
        elif made is not None and need_dw:  # the columns only (bf16 dx): the maxima spare the row pass
            dyqt, sdyt = _quant_cols(dy2, made[1], ops)
        else:
            dyq, sdy, dymax = _quant_rows(dy2, fp8_dx, need_dw, ops)  # rows, and the maxima for the columns
        dx = dw = None
        if need_dx and not fp8_dx:  # rowwise-bf16-dgrad: the bf16 gradient times the bf16 weight
            dx = (dy2 @ weight.to(dy2.dtype)).to(dy.dtype)
        elif need_dx:
            # dx = dy W: b = W [N, K] column-major is W^T [K, N] row-major, scaled along N per column of W.
            wqt, swt = _quant_cols(weight, wmax, ops)
            dx = _scaled_mm(dyq, sdy, wqt, swt, False, ops).to(dy.dtype)
        if need_dw:
            if ctx.keep_fp8:
                xqt, sxt = saved
            else:  # a bf16 input that q/k/v (or gate/up) share: quantize it per column once
                hit = handoff.shared_cols.get(saved[0]) if handoff is not None else None
                xqt, sxt = hit if hit is not None else _quant_cols(*saved, ops)
                if hit is None and handoff is not None:
                    handoff.shared_cols.put(saved[0], (xqt, sxt))
            if dyqt is None:
                dyqt, sdyt = _quant_cols(dy2, dymax, ops)
            # dW = dy^T x: a = dyT [N, padded(M)], b = x [padded(M), K] column-major (from xT); the
            # zero padding of both along the tokens adds nothing.
            dw = _scaled_mm(dyqt, sdyt, xqt, sxt, False, ops).to(weight.dtype)
        return dx, dw, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# A frozen weight kept in FP8 (LoRA on an FP8 base)
# ------------------------------------------------------------------------------------------------
# Under LoRA the base weight W [N, K] never changes, so it is quantized once, per row (`frozen_weight`:
# bit for bit the copy every forward above makes of it), and its bf16 copy is freed: 1 byte per
# parameter and 4 per output row instead of 2 per parameter. That one copy serves both matmuls that
# read W:
#     forward   y  = x W^T:  y[m, n]  = s[n] sum_k x[m, k] q[n, k]     s runs along N, constant along
#                                                                      the reduction (K): _scaled_mm's
#                                                                      column scales of b, as above
#     backward  dx = dy W:   dx[m, k] = sum_n (dy[m, n] s[n]) q[n, k]  s runs along the reduction (N),
#                                                                      so it is folded into dy: the row
#                                                                      quantization of dy takes dy * s
#                                                                      (`quantize_rows(..., col_scale=s)`,
#                                                                      in registers, no extra pass), and
#                                                                      q is multiplied with unit scales
# The second line is exact algebra: dx carries two e4m3 roundings, of dy s (per row, at most 2^-4 of
# each value) and of W (per row, the same bound), as the per-column recipe's dx does. The choices not
# taken: one scale per tensor (also 1 byte per parameter, but every row of W is then scaled to the
# largest value of the whole matrix, and rows of small values lose mantissa bits to e4m3's subnormals),
# and a second, column-scaled copy for dx (2 bytes per parameter: bf16's footprint, nothing saved).
#
# The price is a transpose. torch._scaled_mm multiplies a row-major `a` by a column-major `b` (cuBLAS's
# "TN" layout, the only one Hopper's FP8 matmuls take), so dx = (dy s) q needs q [N, K] with N
# contiguous: backward copies it transposed (`transpose_bytes`: read 1 byte, write 1 byte per parameter)
# and frees the copy after the matmul. For LLaMA 3.1 8B's 6.98 B projection parameters that is 14.0 GB per step
# (~3.3 ms at an H200's ~4.27 TB/s, if the copy runs at copy bandwidth: not measured), against the 6
# bytes per parameter (41.9 GB) that re-quantizing a bf16 frozen weight costs every step (read 2,
# write 1 per row in the forward, and again per column in backward; 3 more for each forward that
# gradient checkpointing recomputes).
def frozen_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen weight W [N, K] as it is stored: (q [N, K] float8_e4m3fn, scale [N] fp32) with
    W ~= q * scale[:, None], the row quantization (`quantize_rows`) every forward above makes of W."""
    with torch.no_grad():
        q, scale, _ = quantize_rows(as_rows(weight.detach()))
    return q, scale


def frozen_forward(x2: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, handoff: Fp8Handoff | None = None,
                   ops: bool = False) -> torch.Tensor:
    """y = x W^T, bf16 [M, N], from x [M, K] and a stored FP8 weight (wq [N, K], its row scales ws [N]).
    `handoff`: x's row copy is shared with the next layer that reads the same x (q/k/v, gate/up), as
    `Float8LinearFunction` shares it; None: quantized here alone."""
    hit = handoff.shared_rows.get(x2) if handoff is not None else None
    if hit is not None:
        xq, sx = hit[0], hit[1]
    else:
        xq, sx, _ = _quant_rows(x2, True, False, ops)
        if handoff is not None:
            handoff.shared_rows.put(x2, (xq, sx, None))  # no column maxima: a trained layer makes its own
    return _scaled_mm(xq, sx, wq, ws, fast_accum_allowed(x2.device), ops)


def frozen_input_grad(dy2: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bf16_dgrad: bool = False,
                      ops: bool = False) -> torch.Tensor:
    """dx = dy W, bf16 [M, K], from dy [M, N] and a stored FP8 weight (section comment above): dy times
    the weight's row scales, quantized per row, times q, transposed for the matmul (a copy freed after
    it; unit scales along K). `bf16_dgrad` (the recipe rowwise-bf16-dgrad): a bf16 matmul with the
    weight dequantized instead, one weight's bf16 copy at a time."""
    if bf16_dgrad:
        return dy2 @ (wq.float() * ws[:, None]).to(dy2.dtype)
    dyq, sdy, _ = _quant_rows(dy2, True, False, ops, col_scale=ws)
    # [K, N] row-major, i.e. q column-major; while torch.compile traces, PyTorch's copy (the same bytes)
    wqt = wq.view(torch.uint8).t().contiguous().view(FP8_DTYPE) if ops else transpose_bytes(wq)
    ones = torch.ones(wq.shape[1], dtype=torch.float32, device=wq.device)  # the scales are all in dy's
    return _scaled_mm(dyq, sdy, wqt, ones, False, ops)


class Float8FrozenLinearFunction(torch.autograd.Function):
    """y = x W^T for a frozen weight kept in FP8 (`Float8Linear.store_fp8_weight`): the forward and the
    input gradient as FP8 matmuls from the one stored copy (`frozen_forward`, `frozen_input_grad`).

    Saved for backward: the stored weight and its scales (no copy), nothing of x (dx does not need x,
    and there is no dW). `handoff`: the model's `Fp8Handoff` for a layer that shares its input (x's row
    copy), or None; `ops`: through the custom operators (torch.compile)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, handoff: Fp8Handoff | None, ops: bool,
                bf16_dgrad: bool):
        if handoff is not None:
            handoff.start_forward()
        y = frozen_forward(x2, wq, ws, handoff, ops)
        ctx.handoff, ctx.ops, ctx.bf16_dgrad = handoff, ops, bf16_dgrad
        ctx.save_for_backward(wq, ws)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("fp8_linear: second-order gradients (create_graph=True) are not supported by the FP8 "
                               "matmuls; use nn.Linear for double backward")
        if ctx.handoff is not None:
            ctx.handoff.start_backward()  # the forward's shared row copies are not needed any more
        dx = None
        if ctx.needs_input_grad[0]:
            wq, ws = ctx.saved_tensors
            dx = frozen_input_grad(as_rows(dy), wq, ws, ctx.bf16_dgrad, ctx.ops).to(dy.dtype)
        return dx, None, None, None, None, None


def _quant_tiles(x2, mode: str, rows: bool, cols: bool, ops: bool, amax=None):
    """`fp8_tiles_op` with its scales viewed (`natural_scales`), or the launcher."""
    if ops:
        if mode == "tensor" and amax is None:
            amax = fp8_rows_op(x2, False, True)[2].amax().reshape(1)
        return natural_scales(x2.shape, mode, rows, cols, *fp8_tiles_op(x2, mode, rows, cols, amax))
    return quantize_tiles(as_rows(x2), mode, rows, cols, amax)


def _quant_operand(t2, scaling: str, weight: bool, rows: bool, cols: bool, ops: bool, amax=None):
    """t [M, K] quantized for the matmuls that reduce over K (rows: a copy like t) and for the one
    that reduces over M (cols: the transposed copy [K, M_pad]), each with its natural scales. Weights
    take 128x128 tiles in the block-wise recipe (one quantization serves both of their matmuls),
    activations and gradients 1x128 blocks; the MX recipe scales every operand in 1x32 blocks along
    the reduction (with the plain-PyTorch quantizer `quantize_mx_ref`, on any device: no kernel yet)."""
    if scaling == "mx":
        q, s = quantize_mx_ref(t2) if rows else (None, None)
        if cols:
            m_pad = -(-t2.shape[0] // MX_BLOCK) * MX_BLOCK
            qt, st = quantize_mx_ref(torch.nn.functional.pad(t2, (0, 0, 0, m_pad - t2.shape[0])).t())
        else:
            qt = st = None
        return q, s, qt, st
    mode = "tensor" if scaling == "tensor" else "tile" if weight else "act"
    return _quant_tiles(t2, mode, rows, cols, ops, amax)


def _mm_scaled(a, a_scale, bt, bt_scale, scaling: str, b_tiles: bool, fast_accum: bool, ops: bool):
    """a @ bt.T for the tensor-wise, block-wise and MX recipes: bf16 [rows of a, rows of bt]."""
    if scaling == "mx":  # the same call in eager mode and under torch.compile (plain PyTorch, no launcher)
        return _scaled_mm_mx_launch(a, a_scale, bt, bt_scale)
    if ops:
        return fp8_scaled_mm_tiles_op(a, a_scale, bt, bt_scale, b_tiles, fast_accum)
    return _scaled_mm_tiles_launch(a, a_scale, bt, bt_scale, b_tiles, fast_accum)


class Float8ScaledLinearFunction(torch.autograd.Function):
    """y = x W^T in FP8 with tensor-wise, block-wise or MX scales (`scaling`), forward and both
    gradient matmuls: the recipes tensorwise, blockwise and mxfp8.

    Each operand is quantized along the dimension its matmul reduces over: x and dy per row (1x128
    blocks, or one scale) for y and dx, and per column, transposed (128x1 blocks along the tokens) for
    dW; W in 128x128 tiles, which are blocks along K for y and along N for dx alike. Saved for
    backward: the weight Parameter (no copy; tensor-wise also its maximum, [1]), and x's transposed
    FP8 copy with its scales (`keep_fp8_input`) or x itself. These recipes hand nothing between layers.
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, keep_fp8_input: bool, need_input_grad: bool,
                need_weight_grad: bool, scaling: str, ops: bool):
        keep_fp8 = keep_fp8_input and need_weight_grad
        w_amax = None
        if scaling == "tensor":  # the weight's maximum serves its backward copy too: one read fewer there
            w_amax = fp8_rows_op(weight, False, True)[2].amax().reshape(1) if ops else tensor_max(weight)
        xq, sx, xqt, sxt = _quant_operand(x2, scaling, False, True, keep_fp8, ops)
        wq, sw, _, _ = _quant_operand(weight, scaling, True, True, False, ops, w_amax)
        # Fast accumulation in the forward only, as in the row-wise recipe; not with 1x128 blocks,
        # whose point is the precision of each block's partial sum.
        fast = scaling == "tensor" and fast_accum_allowed(x2.device)
        y = _mm_scaled(xq, sx, wq, sw, scaling, True, fast, ops)
        saved = (xqt, sxt) if keep_fp8 else (x2,) if need_weight_grad else ()
        ctx.keep_fp8, ctx.scaling, ctx.ops, ctx.n_saved = keep_fp8, scaling, ops, len(saved)
        ctx.save_for_backward(weight, *((w_amax,) if w_amax is not None else ()), *saved)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("fp8_linear: second-order gradients (create_graph=True) are not supported by the FP8 "
                               "matmuls; use nn.Linear for double backward")
        weight, *rest = ctx.saved_tensors
        saved = rest[len(rest) - ctx.n_saved:]
        w_amax = rest[0] if len(rest) > ctx.n_saved else None
        need_dx, need_dw = ctx.needs_input_grad[:2]
        scaling, ops = ctx.scaling, ctx.ops
        dy2 = as_rows(dy)
        dyq, sdy, dyqt, sdyt = _quant_operand(dy2, scaling, False, need_dx, need_dw, ops)
        dx = dw = None
        if need_dx:  # dx = dy W: b = W, column-major, i.e. W^T row-major, in blocks along N
            _, _, wqt, swt = _quant_operand(weight, scaling, True, False, True, ops, w_amax)
            dx = _mm_scaled(dyq, sdy, wqt, swt, scaling, True, False, ops).to(dy.dtype)
        if need_dw:  # dW = dy^T x: both transposed copies, reduced over the (zero-padded) tokens
            xqt, sxt = saved if ctx.keep_fp8 else _quant_operand(saved[0], scaling, False, False, True, ops)[2:]
            dw = _mm_scaled(dyqt, sdyt, xqt, sxt, scaling, False, False, ops).to(weight.dtype)
        return dx, dw, None, None, None, None, None


class SwigluJoinedFp8Function(torch.autograd.Function):
    """act(gate) * up of a joined gate_up [rows, 2I] (`swiglu_kernel.swiglu_joined`, same kernels),
    whose backward writes d gate_up with `_swiglu_joined_bwd_maxima` and hands its maxima to the FP8
    gate/up projection that receives it (`handoff.offer_grad`). Eager mode only: a compiled graph
    cannot carry the hand-off (`swiglu_joined_fp8` runs the plain operator there)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, activation: str, handoff: Fp8Handoff, rows: bool, col_max: bool):
        ctx.save_for_backward(gate_up)  # the matmul that made gate_up keeps it alive anyway
        ctx.activation, ctx.handoff = activation, handoff
        if not rows:
            return swiglu_kernel.swiglu_forward(*halves(gate_up), activation)
        h, q, scale, maxima = swiglu_quantize_rows(*halves(gate_up), activation, col_max)
        handoff.input_rows.put(h, (q, scale, maxima))  # for the down projection, which reads h next
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("swiglu_joined_fp8: second-order gradients (create_graph=True) are not supported by "
                               "the fused kernel; use the plain PyTorch reference for double backward")
        (gate_up,) = ctx.saved_tensors
        dgu, row_max, col_max = swiglu_joined_backward_maxima(as_rows(dh), *halves(gate_up), ctx.activation)
        ctx.handoff.offer_grad(dgu, (row_max, col_max))
        return dgu, None, None, None, None


class RMSNormFp8Function(rmsnorm_kernel._RMSNormFunction):
    """rmsnorm_kernel.rmsnorm (eager) whose forward also leaves its output's FP8 row copy in the
    hand-off (`Fp8Handoff.input_rows`) for the FP8 layer that reads that output next; the backward is
    the norm's own. The row copy needs no pass of its own (`_rmsnorm_quantize_rows`)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place, handoff, col_max):
        x2, weight = as_rows(x), weight.contiguous()
        y, rstd, q, scale, maxima = rmsnorm_quantize_rows(x2, weight, eps, offset, casting_mode, col_max, x.shape)
        handoff.input_rows.put(as_rows(y), (q, scale, maxima))
        rmsnorm_kernel._RMSNormFunction.keep(ctx, x2, weight, rstd, offset, casting_mode, in_place, x.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*rmsnorm_kernel._RMSNormFunction.backward(ctx, dy), None, None)


# ------------------------------------------------------------------------------------------------
# Checks, and the functional API
# ------------------------------------------------------------------------------------------------
_probed: dict = {}


class Fp8KernelMismatch(RuntimeError):
    """A quantizing kernel wrote other bytes on this GPU than the plain-PyTorch reference computes."""


def check_fp8_device(device: torch.device, recipe: str = DEFAULT_RECIPE) -> None:
    """Refuse, with a clear message, a device that cannot run the recipe's scaled FP8 matmuls.

    CPU: allowed (PyTorch's CPU `_scaled_mm` is a slow reference, the kernels run in Triton's
    interpreter, and the block and MX matmuls are computed from dequantized operands), so every test
    runs without a GPU. CUDA: compute capability 8.9 or newer (Ada, Hopper, Blackwell), and once per
    device and scaling (`_probe_scaled_mm`) the recipe's quantizers that write a transposed copy are
    checked bit for bit against the reference and a small matmul of its scaling is run with the flags
    training uses, so that a Triton or PyTorch build that cannot do either on this GPU fails here, at
    set-up, in one line, instead of in (or silently through) training. Per GPU family (`gpu_arch`):
      row-wise, tensor-wise   cuBLAS on sm_89 and sm_90; PyTorch's CUTLASS row-wise kernel on
                              Blackwell, where fast accumulation is left off (`fast_accum_allowed`)
      block-wise              PyTorch runs 1x128 / 128x128 scales through cuBLAS on Hopper only; the
                              probe also checks the values against the dequantized product
      mxfp8                   Blackwell (10.x, 12.x) and newer: torch._scaled_mm's MXFP8 matmul, probed
                              like block-wise; Ada and Hopper have no MX tensor cores: refused in one
                              line (`_mx_missing`) rather than emulated, which would be slower than bf16
    """
    r = get_recipe(recipe)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise RuntimeError(f"FP8 linear layers need a CUDA GPU of compute capability 8.9 or newer (or the CPU, for "
                           f"tests); the tensors are on {device}")
    if torch.version.hip is not None:
        raise RuntimeError("FP8 linear layers use float8_e4m3fn, NVIDIA's FP8; ROCm GPUs (MI300: e4m3fnuz) are not "
                           "supported: train without --fp8")
    major, minor = gpu_arch.device_capability(device)
    family = gpu_arch.arch_family((major, minor))
    if (major, minor) < (8, 9):
        raise RuntimeError(f"FP8 matmuls need compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                           f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: train without --fp8")
    has_mx = family not in (gpu_arch.OLDER, gpu_arch.HOPPER)
    if r.scaling == "mx" and not has_mx:
        raise RuntimeError(_mx_missing(major, minor))
    if r.scaling == "block" and family != gpu_arch.HOPPER:
        raise RuntimeError(f"--fp8-recipe blockwise: PyTorch's 1x128 / 128x128 block-scaled FP8 matmul (cuBLAS) runs "
                           f"on Hopper (sm_90) only, and this GPU is sm_{major}{minor}: use --fp8-recipe rowwise"
                           + (" (mxfp8 is this GPU's block format)" if has_mx else ""))
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.__version__, triton.__version__, r.scaling)
    if key not in _probed:
        try:
            _probe_scaled_mm(torch.device("cuda", index), r.scaling)
            _probed[key] = None
        except Fp8KernelMismatch as err:
            _probed[key] = str(err)
        except RuntimeError as err:
            kind = {"row": "row-wise", "tensor": "tensor-wise", "block": "block-wise", "mx": "MXFP8"}[r.scaling]
            _probed[key] = (f"this PyTorch ({torch.__version__}) has no usable {kind} scaled FP8 matmul for "
                            f"sm_{major}{minor} ({str(err).splitlines()[0][:200]}): use another --fp8-recipe, train "
                            "without --fp8, or try a newer PyTorch")
    if _probed[key]:
        raise RuntimeError(_probed[key])


def _mx_missing(major: int, minor: int) -> str:
    """Why --fp8-recipe mxfp8 cannot run on a GPU of compute capability major.minor, before Blackwell: one line."""
    return (f"--fp8-recipe mxfp8 needs MX block-scaled FP8 tensor cores (1x32 blocks, e8m0 scales), which "
            f"Blackwell (compute capability 10.0 and newer) has and this sm_{major}{minor} GPU has not: use "
            "--fp8-recipe rowwise")


def _probe_scaled_mm(device: torch.device, scaling: str) -> None:
    """Check the recipe's transposing quantizers (`check_transposed_copies`), then run the scaled matmuls
    it needs on tiny operands (RuntimeError if PyTorch refuses one).

    Block-wise and MXFP8: the three matmuls of a layer (block-wise: 1x128 x 128x128 for y and dx,
    1x128 x 1x128 for dW; MXFP8: 1x32 x 1x32 for all three) on random operands (254 tokens, 512 ->
    1024 features), each against the product of its dequantized operands; a result off by more than
    bf16's rounding means that this PyTorch reads the scales in another layout."""
    check_transposed_copies(device, scaling)
    fast = fast_accum_allowed(device)
    if scaling in ("row", "tensor"):
        a = torch.ones((ALIGN, ALIGN), device=device).to(FP8_DTYPE)
        for flag in {fast, False}:
            if scaling == "row":
                _scaled_mm_launch(a, torch.ones(ALIGN, device=device), a, torch.ones(ALIGN, device=device), flag)
            else:
                one = torch.ones(1, device=device)
                _scaled_mm_tiles_launch(a, one, a, one, False, flag)
        return
    g = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(shape, device=device, generator=g).to(torch.bfloat16) for shape in ((254, 512), (254, 1024)))
    w = torch.randn((1024, 512), device=device, generator=g).to(torch.bfloat16)
    if scaling == "mx":
        (xq, sx, xqt, sxt), (dyq, sdy, dyqt, sdyt), (wq, sw, wqt, swt) = (
            _quant_operand(t, "mx", t is w, True, True, False) for t in (x, dy, w))
        launch = _scaled_mm_mx_launch
    else:
        xq, sx, xqt, sxt = quantize_tiles(x, "act", True, True)
        wq, sw, wqt, swt = quantize_tiles(w, "tile", True, True)
        dyq, sdy, dyqt, sdyt = quantize_tiles(dy, "act", True, True)
        launch = _scaled_mm_tiles_launch
    for what, a, sa, bt, sbt, tiles in (("y", xq, sx, wq, sw, True), ("dx", dyq, sdy, wqt, swt, True),
                                        ("dW", dyqt, sdyt, xqt, sxt, False)):
        got = (launch(a, sa, bt, sbt) if scaling == "mx" else launch(a, sa, bt, sbt, tiles, False)).float()
        want = dequantize_blocks(a, sa) @ dequantize_blocks(bt, sbt).t()
        err = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()  # a sync, once
        if not err <= 2.0**-7:  # bf16 output: an RMS relative rounding of ~2^-9
            raise RuntimeError(f"the block-scaled matmul for {what} is off by {err:.3g} (relative L2) against the "
                               "dequantized product: this PyTorch reads the block scales in another layout")


# The quantizers that store a tensor transposed, per scaling, as (what, function of x). Triton has
# miscompiled FP8 stores through a transposing layout conversion when the same kernel also stores
# the tensor untransposed: foreign bytes in the transposed copy, reported with ptxas 12.9 (what Triton
# 3.8 assembles Hopper code with) and gone with ptxas 13.3 (triton-lang/triton#11111); Triton 3.9
# assembles Hopper and Blackwell code with ptxas 13.4. Which kernels it hits depends on the ptxas
# release, the target and the launch configuration, so instead of a list of Triton versions the
# kernels that write both copies (and the transposed copy alone) are run once per GPU at set-up, at
# two token counts (a multiple of 16 and not, which Triton compiles apart), and compared bit for bit
# with the plain-PyTorch references, as the tests do. Row-wise: the column kernel alone and with the
# row copy (`quantize_both`); tensor- and block-wise: the tile kernel in the modes the recipe uses.
TRANSPOSING = {
    "row": (("quantize_cols", lambda x: (None, None) + quantize_cols(x, _abs_max(x.float(), 0))),
            ("quantize_both", lambda x: quantize_both(x, _abs_max(x.float(), 1), _abs_max(x.float(), 0)))),
    "tensor": (("tile kernel, tensor scale", lambda x: quantize_tiles(x, "tensor", True, True)),
               ("tile kernel, tensor scale, transposed only", lambda x: quantize_tiles(x, "tensor", False, True))),
    "block": (("tile kernel, 1x128 blocks", lambda x: quantize_tiles(x, "act", True, True)),
              ("tile kernel, 1x128 blocks, transposed only", lambda x: quantize_tiles(x, "act", False, True)),
              ("tile kernel, 128x128 tiles, transposed only", lambda x: quantize_tiles(x, "tile", False, True))),
    "mx": (),  # quantize_mx_ref: plain PyTorch, no Triton kernel
}


def _reference_copies(x: torch.Tensor, what: str):
    """(q, scales, qT, scales) of x [M, K] as the plain-PyTorch references make them for a `TRANSPOSING` entry."""
    M = x.shape[0]
    if what.startswith("quantize_"):
        return (*quantize_rows_ref(x), *quantize_cols_ref(x))
    mode = "tensor" if "tensor" in what else "act" if "1x128" in what else "tile"
    xt = torch.nn.functional.pad(x.float(), (0, 0, 0, tile_rows(M, mode) - M)).t()
    if mode == "tensor":
        return (*quantize_tensor_ref(x), *quantize_tensor_ref(xt))
    block = (TILE, TILE) if mode == "tile" else (1, TILE)
    return (*quantize_blocks_ref(x, *block), *quantize_blocks_ref(xt, *block))


def check_transposed_copies(device: torch.device, scaling: str) -> None:
    """Fp8KernelMismatch (one line naming Triton, its ptxas and the fix) unless every `TRANSPOSING`
    quantizer of this scaling writes, on `device`, the bytes the plain-PyTorch reference computes."""
    g = torch.Generator(device="cpu").manual_seed(1)
    for M in (256, 250):
        x = (torch.randn(M, 256, generator=g) * torch.logspace(-3, 3, M)[:, None]).to(device, torch.bfloat16)
        for what, quantize in TRANSPOSING[scaling]:
            if "128x128" in what and M % TILE:  # weights: whole tiles (Fp8Recipe.align)
                continue
            q, s, qt, st = quantize(x)
            rq, rs, rqt, rst = _reference_copies(x, what)
            bits = torch.equal  # of the FP8 bytes and the fp32 scales; a sync, once per device and scaling
            same = (bits(qt.view(torch.uint8), rqt.view(torch.uint8)) and bits(st.reshape(rst.shape), rst)
                    and (q is None or (bits(q.view(torch.uint8), rq.view(torch.uint8))
                                       and bits(s.reshape(rs.shape), rs))))
            if not same:
                where = gpu_arch.describe(gpu_arch.device_capability(device)) if device.type == "cuda" else "the CPU"
                raise Fp8KernelMismatch(
                    f"FP8 quantizer ({what}, {M} x 256) on {where} wrote other bytes than the PyTorch reference "
                    f"with Triton {triton.__version__} (ptxas {_ptxas_release(device)}): an FP8 transposed store "
                    "miscompiled (triton-lang/triton#11111: ptxas 12.9, gone with 13.3); use a Triton that assembles "
                    "with ptxas 13.3 or newer (3.9 does), or point TRITON_PTXAS_PATH at a CUDA 13.3+ ptxas, or train "
                    "without --fp8")


def _ptxas_release(device: torch.device) -> str:
    """'13.4': the ptxas release Triton assembles this GPU's kernels with, or 'unknown'."""
    if device.type != "cuda":
        return "unknown"
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
        major, minor = gpu_arch.device_capability(device)
        found = re.search(r"release (\d+\.\d+)", get_ptxas_version(10 * major + minor))
        return found.group(1) if found else "unknown"
    except Exception:  # another Triton layout, or no ptxas: the message still names Triton's version
        return "unknown"


# Where FP8 pays: the size rule. An FP8 projection adds passes that read and write its operands (the
# quantizing casts: bytes in proportion to tokens x (in + out)) to save matmul time (in proportion to
# tokens x in x out). Their ratio is tokens x in x out / (tokens x (in + out)) = in x out / (in + out),
# the projection's harmonic width, whatever the token count: a narrow projection does too little
# arithmetic per byte for the faster matmul to pay for its casts. `benchmark_kernels.py --fp8-crossover`
# times one projection's forward and backward both ways, captured as CUDA graphs, over widths from
# SmolLM2-135M's to LLaMA 3.1 8B's; FP8_MIN_WIDTH is read off those rows (docs/fp8.md, "Where FP8 pays"):
# on an H100 at 4,096 and 8,192 tokens, FP8 ran at 0.30-0.57x of bf16 for widths 144-512, 0.72-0.92x at
# 819-1,024, and 1.20-1.47x from 2,048 up (results/runs/fp8_crossover_H100.log); the rule keeps bf16 below
# 1,536, between the last width that lost and the first that gained. Projections that read the same
# input (q/k/v, gate/up) share its quantization, so they are judged together, as one projection whose
# out_features is their sum: LLaMA 3.1 8B's k and v (4,096 -> 1,024 each) go with q (4,096 -> 6,144 together).
FP8_MIN_WIDTH = 1536
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def harmonic_width(in_features: int, out_features: int) -> float:
    return in_features * out_features / (in_features + out_features)


def size_reason(in_features: int, out_features: int) -> str | None:
    """Why a projection this size stays bf16 under the size rule (`--fp8-layers auto`), or None."""
    width = harmonic_width(in_features, out_features)
    if width < FP8_MIN_WIDTH:
        return (f"too small for FP8 to gain (harmonic width in x out / (in + out) = {width:.0f}, below the "
                f"measured crossover {FP8_MIN_WIDTH})")
    return None


def unsupported_reason(in_features: int, out_features: int, recipe: str = DEFAULT_RECIPE) -> str | None:
    """Why a [out_features, in_features] weight cannot go through the recipe's scaled matmul, or None."""
    r = get_recipe(recipe)
    step = r.align
    bad = [f"{name} = {n}" for name, n in (("in_features", in_features), ("out_features", out_features)) if n % step]
    if bad:
        why = ("as torch._scaled_mm requires" if step == ALIGN else f"as --fp8-recipe {recipe} requires (its blocks: "
               "Fp8Recipe.align)")
        return f"{' and '.join(bad)} not a multiple of {step}, {why}"
    if in_features > MAX_COLS or out_features > MAX_COLS:
        return f"a dimension above {MAX_COLS} (the quantizing kernel holds a whole row)"
    return None


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


def compiled_graph_trusted(device: torch.device) -> bool:
    """Whether torch.compile may trace the FP8 layer into its graph on this device.

    Not on CUDA: on an H100 and an H200 (torch 2.11, Triton 3.6) the compiled graph's input gradient
    differed from eager's by the size of the gradient itself (fp8_linear_test.py's compile test), with
    the quantizers and the scaled matmul all opaque custom operators; the cause is not found yet. On a
    GPU a compiled model therefore runs each FP8 layer eagerly (a graph break around it): correct, and
    the rest of the model is still compiled. The CPU's compiled graph equals eager's bit for bit.
    """
    return device.type != "cuda"


@torch.compiler.disable
def _fp8_linear_eager(x, weight, bias, keep_fp8_input, handoff, recipe):
    return fp8_linear(x, weight, bias, keep_fp8_input, handoff, recipe)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               keep_fp8_input: bool = True, handoff: Fp8Handoff | None = None,
               recipe: str = DEFAULT_RECIPE) -> torch.Tensor:
    """F.linear(x, weight, bias) with FP8 matmuls forward and backward; any leading shape of x.

    The output has x's dtype (the autocast dtype under torch.autocast) and passes through bf16 (the
    row-wise scaled matmul writes bf16). `keep_fp8_input`: what backward keeps of x (module docstring).
    `handoff`: an `Fp8Handoff` shared with the model's other FP8 layers (`patch_model` gives each layer
    the model's), or None to hand nothing over. Under torch.compile on a GPU the layer runs outside the
    graph (`compiled_graph_trusted`); a traced layer hands nothing over and launches through the operators.
    `recipe`: a name of `RECIPES` (its scales, and which matmul stays bf16); only the row-wise recipes
    use the hand-off.
    """
    r = get_recipe(recipe)
    compiling = torch.compiler.is_compiling()
    if compiling and not compiled_graph_trusted(x.device):
        return _fp8_linear_eager(x, weight, bias, keep_fp8_input, handoff, recipe)
    _check_inputs(x, weight, bias, recipe)
    if not compiling:
        check_fp8_device(x.device, recipe)  # cached after the first call; nothing a compiled graph needs to see
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x2 = as_rows(x.to(out_dtype))
    if x2.shape[0] == 0:  # no tokens: an empty output, zero gradients, and no zero-sized matmul
        y = x2 @ weight.t().to(out_dtype)
    else:
        grad = torch.is_grad_enabled()
        need_dx, need_dw = grad and x2.requires_grad, grad and weight.requires_grad
        if r.scaling == "row":
            y = Float8LinearFunction.apply(x2, weight, keep_fp8_input, need_dx, need_dw,
                                           None if compiling else handoff, compiling, r.bf16_dgrad)
        else:
            y = Float8ScaledLinearFunction.apply(x2, weight, keep_fp8_input, need_dx, need_dw, r.scaling, compiling)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(out_dtype)


@torch.compiler.disable
def _fp8_frozen_linear_eager(x, weight, weight_scale, bias, handoff, recipe):
    return fp8_frozen_linear(x, weight, weight_scale, bias, handoff, recipe)


def fp8_frozen_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, handoff: Fp8Handoff | None = None,
                      recipe: str = DEFAULT_RECIPE) -> torch.Tensor:
    """F.linear(x, W, bias) for a frozen W kept in FP8: weight [N, K] float8_e4m3fn and its row scales
    weight_scale [N] fp32 (`frozen_weight`), any leading shape of x. The forward and dx run as FP8
    matmuls from that one copy (`Float8FrozenLinearFunction`); W gets no gradient. The output has x's
    dtype (the autocast dtype under torch.autocast). `recipe`: a row-wise recipe (rowwise-bf16-dgrad:
    dx in bf16 from the dequantized weight). torch.compile as in `fp8_linear`."""
    r = get_recipe(recipe)
    compiling = torch.compiler.is_compiling()
    if compiling and not compiled_graph_trusted(x.device):
        return _fp8_frozen_linear_eager(x, weight, weight_scale, bias, handoff, recipe)
    check_float("x", x)
    check_device(x, weight, weight_scale)
    if r.scaling != "row":
        raise ValueError(f"a weight kept in FP8 has row scales; recipe {recipe} scales {r.scaling}-wise")
    N, K = weight.shape
    if weight.dtype != FP8_DTYPE or weight_scale.shape != (N,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"a weight kept in FP8 is [out, in] {FP8_DTYPE} with [out] fp32 row scales, got "
                         f"{weight.dtype} {tuple(weight.shape)} and {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if x.dim() == 0 or x.shape[-1] != K:
        raise ValueError(f"x's last dimension must equal in_features = {K}, got x of shape {tuple(x.shape)}")
    if not compiling:
        check_fp8_device(x.device, recipe)
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x2 = as_rows(x.to(out_dtype))
    if x2.shape[0] == 0:  # no tokens: an empty output (and an empty dx), no zero-sized matmul
        y = x2 @ x2.new_zeros((K, N))
    else:
        y = Float8FrozenLinearFunction.apply(x2, weight, weight_scale, None if compiling else handoff, compiling,
                                             r.bf16_dgrad)
    y = y.view(*x.shape[:-1], N)
    return y if bias is None else y + bias.to(out_dtype)


def swiglu_joined_fp8(gate_up: torch.Tensor, activation: str = "silu", handoff: Fp8Handoff | None = None,
                      down: nn.Module | None = None):
    """`swiglu_kernel.swiglu_joined` (act(gate) * up from gate_up [..., 2I]) for an MLP whose gate/up
    projection is an FP8 layer holding `handoff`: backward also takes d gate_up's row and column
    maxima and hands them to that layer, which then quantizes d gate_up in one read instead of two.
    When `down`, the layer that reads the output next, takes FP8 row copies (`takes_rows`), the forward
    also writes the output's row copy for it (`swiglu_quantize_rows`: one read of h fewer).
    Without a hand-off, and while torch.compile traces, it is `swiglu_joined` itself."""
    if handoff is None or torch.compiler.is_compiling():
        return swiglu_kernel.swiglu_joined(gate_up, activation)
    swiglu_kernel._check_joined(gate_up, activation)
    rows = SWIGLU_WRITES_ROWS and down is not None and takes_rows(down, handoff)
    h = SwigluJoinedFp8Function.apply(as_rows(gate_up), activation, handoff, rows, torch.is_grad_enabled())
    return h.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


# ------------------------------------------------------------------------------------------------
# Module, and patching a Hugging Face model
# ------------------------------------------------------------------------------------------------
class Float8Linear(nn.Linear):
    """nn.Linear whose three matmuls run in FP8; same Parameters (`weight`, `bias`), same state dict.

    A subclass, so that code asking `isinstance(m, nn.Linear)` (peft's LoRA, optimizers' weight-decay
    rules) still sees a linear layer, while code asking `type(m) is nn.Linear` (the fused SwiGLU's
    down-projection shortcut) calls this module instead of reading its weight. `fp8_handoff`: the
    `Fp8Handoff` this layer shares with the model's other FP8 layers (`patch_model` sets it), or None.
    `recipe`: the name of its `Fp8Recipe`. A frozen weight can be kept in FP8 instead of bf16
    (`store_fp8_weight`: LoRA's base); the layer then also holds the buffer `weight_scale`.
    """

    keep_fp8_input: bool = True
    fp8_handoff: Fp8Handoff | None = None
    recipe: str = DEFAULT_RECIPE

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_fp8_input: bool = True, handoff: Fp8Handoff | None = None,
                    recipe: str = DEFAULT_RECIPE) -> "Float8Linear":
        """Wrap an existing nn.Linear, *sharing* its weight and bias Parameters (no copy)."""
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
        if self.stores_fp8():
            return fp8_frozen_linear(x, self.weight, self.weight_scale, self.bias, self._frozen_handoff(), self.recipe)
        return fp8_linear(x, self.weight, self.bias, self.keep_fp8_input, self.fp8_handoff, self.recipe)

    # A frozen weight kept in FP8 (LoRA's base; the section "A frozen weight kept in FP8" above)
    def stores_fp8(self) -> bool:
        """Whether the weight is kept in FP8 (`store_fp8_weight`): `weight` float8_e4m3fn, `weight_scale` fp32."""
        return self.weight.dtype == FP8_DTYPE

    def store_fp8_weight(self) -> None:
        """Quantize the frozen weight once (`frozen_weight`) and keep only that: `weight` becomes a
        float8_e4m3fn [out, in] Parameter (requires_grad False) and the buffer `weight_scale` [out] fp32
        its row scales; the bf16 Parameter is dropped, and freed once nothing else holds it. The state
        dict then holds those two tensors under `weight` and `weight_scale`. `base_fingerprints` keeps
        the float64 sum and L2 norm of the bf16 weight (a sync, once), which checkpoints record for the
        frozen base instead of the FP8 values' (playbook/checkpoint.py): an adapter trained on this
        base resumes on its bf16 original and the other way round. ValueError for a weight that needs
        a gradient (it could never change again) or a recipe without row scales; twice: nothing."""
        if self.stores_fp8():
            return
        if self.weight.requires_grad:
            raise ValueError("only a frozen weight (requires_grad=False, as LoRA's base) can be kept in FP8: "
                             "this one is trained")
        if get_recipe(self.recipe).scaling != "row":
            raise ValueError(f"a weight kept in FP8 has one scale per row; recipe {self.recipe} scales "
                             f"{get_recipe(self.recipe).scaling}-wise (use a row-wise recipe)")
        from playbook.core.tensors import fingerprint

        self.base_fingerprints = {"weight": fingerprint(self.weight)}
        q, scale = frozen_weight(self.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)

    def _frozen_handoff(self) -> Fp8Handoff | None:
        """The hand-off for a layer whose input other layers read too (q/k/v, gate/up: `keep_fp8_input`
        False), which then share its row copy; None for the others."""
        return None if self.keep_fp8_input else self.fp8_handoff

    def frozen_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] -> x W^T [M, out] bf16 (no bias), for an autograd.Function that owns the layer's
        backward (lora_kernel.LoRALinearFunction); eager mode."""
        if self.fp8_handoff is not None:
            self.fp8_handoff.start_forward()
        return frozen_forward(x2, self.weight, self.weight_scale, self._frozen_handoff())

    def frozen_input_grad(self, dy2: torch.Tensor) -> torch.Tensor:
        """dy2 [M, out] -> dy W [M, in] bf16, the backward of `frozen_forward`."""
        if self.fp8_handoff is not None:
            self.fp8_handoff.start_backward()
        return frozen_input_grad(dy2, self.weight, self.weight_scale, get_recipe(self.recipe).bf16_dgrad)

    @staticmethod
    def joined_linear(x: torch.Tensor, weight: torch.Tensor, bias, members) -> torch.Tensor:
        """A group of FP8 layers joined by projections_kernel.py (q/k/v, gate/up) as one FP8 layer that
        keeps only the FP8 copy of x for backward (the group is x's one consumer), sharing the layers'
        hand-off."""
        return fp8_linear(x, weight, bias, keep_fp8_input=True, handoff=members[0].fp8_handoff,
                          recipe=members[0].recipe)

    def extra_repr(self) -> str:
        stored = ", weight kept in fp8" if self.stores_fp8() else ""
        return super().extra_repr() + f", fp8 {self.recipe}, keep_fp8_input={self.keep_fp8_input}{stored}"


# The decoder's projections by attribute name; Phi-3 fuses q/k/v into `qkv_proj` and gate/up into
# `gate_up_proj`, which are converted the same way.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
# Which projections keep only their FP8 input for backward (module docstring: the others' bf16 input
# is shared with another projection or kept by attention anyway).
KEEP_FP8_INPUT = {"down_proj"}


def _projections(model: nn.Module):
    """(owner module, attribute name) of every decoder projection, found by class (LlamaAttention, ...)."""
    blocks = family_classes("Attention") + family_classes("MLP")
    for module in model.modules():
        if isinstance(module, blocks):
            for name in PROJECTIONS:
                if isinstance(getattr(module, name, None), nn.Linear):
                    yield module, name


def bf16_layers(model: nn.Module, recipe: str) -> set:
    """ids of the projection owners (attention and MLP blocks) that the recipe keeps in bf16: those of
    the first and the last `bf16_end_layers` decoder layers, in the order the model holds them."""
    ends = get_recipe(recipe).bf16_end_layers
    if not ends:
        return set()
    layers = [m for m in model.modules() if isinstance(m, family_classes("DecoderLayer"))]
    kept = layers[:ends] + layers[max(ends, len(layers) - ends):]
    return {id(m) for layer in kept for m in layer.modules()}


def patch_model(model: nn.Module, recipe: str = DEFAULT_RECIPE, sizes: str = "all") -> int:
    """Replace the q/k/v/o and gate/up/down projections of every decoder layer with Float8Linear.

    The lm_head and the embeddings stay in bf16 (the head's logits are the most precision-sensitive
    matmul of the model, and an embedding is a lookup, not a matmul). A projection whose dimensions
    torch._scaled_mm cannot take, or that is not a plain nn.Linear (an adapter, a 4-bit layer), stays
    as it is and is named in one log line. Refuses (RuntimeError) a GPU without FP8 matmuls. Returns
    how many projections now run in FP8; patching twice changes nothing.

    The model holds one `Fp8Handoff` (`model.fp8_handoff`), and every layer converted here shares it:
    q/k/v and gate/up quantize their common input once, and the fused SwiGLU hands d gate_up's maxima
    to the gate/up projection (`swiglu_joined_fp8`). (Row-wise recipes only: the others hand nothing.)

    `recipe`: a name of `RECIPES` (ValueError for another); the projections of the decoder layers it
    keeps in bf16 (`bf16_layers`) stay nn.Linear, and are not counted.
    `sizes`: "all" converts every projection the recipe takes; "auto" keeps in bf16 those too small for
    FP8 to gain (`size_reason`, the measured crossover), named in one log line.
    """
    from playbook.core.process import log

    r = get_recipe(recipe)
    model_type(model)
    for device in {p.device for p in model.parameters()}:
        check_fp8_device(device, recipe)
    handoff = None
    if r.scaling == "row":
        handoff = getattr(model, "fp8_handoff", None)
        if not isinstance(handoff, Fp8Handoff):
            handoff = model.fp8_handoff = Fp8Handoff()
    in_bf16 = bf16_layers(model, recipe)
    skipped = []
    group_out = {}  # (owner, name) -> out_features of the projections that share its input, itself included
    for owner, name in _projections(model):
        group = next((g for g in SHARED_INPUT if name in g), (name,))
        group_out[id(owner), name] = sum(getattr(getattr(owner, n, None), "out_features", 0) for n in group)
    for owner, name in list(_projections(model)):
        linear = getattr(owner, name)
        if isinstance(linear, Float8Linear) or id(owner) in in_bf16:
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
        setattr(owner, name, Float8Linear.from_linear(linear, keep_fp8_input=name in KEEP_FP8_INPUT, handoff=handoff,
                                                      recipe=recipe))
    if skipped:
        log(f"FP8: {len(skipped)} projection(s) stay as they are: {'; '.join(sorted(set(skipped)))}")
    return sum(isinstance(getattr(owner, name), Float8Linear) for owner, name in _projections(model))


# A norm and the FP8 layer that reads its output: (the norm's attribute on the decoder layer, the block
# holding the readers, the readers that take the row copy: joined or first of their group)
NORM_READERS = (("input_layernorm", "self_attn", ("q_proj", "qkv_proj")),
                ("post_attention_layernorm", "mlp", ("gate_proj", "gate_up_proj")))


def takes_rows(reader: nn.Module, handoff: Fp8Handoff) -> bool:
    """Whether `reader` takes an FP8 row copy of its input from `handoff.input_rows`: a Float8Linear of a
    row-wise recipe sharing that hand-off, with a trained bf16 weight (a frozen FP8 weight, LoRA's base,
    has its own forward)."""
    return (isinstance(reader, Float8Linear) and reader.fp8_handoff is handoff and handoff is not None
            and not reader.stores_fp8() and reader.weight.requires_grad and get_recipe(reader.recipe).scaling == "row")


def link_norms(model: nn.Module) -> int:
    """Let each decoder layer's RMSNorm write the FP8 row copy of its output for the FP8 projection that
    reads it (`Fp8Handoff.input_rows`): input_layernorm for q/k/v, post_attention_layernorm for gate/up.
    Linked only where that is exactly the model's data flow and the copy will be taken: the norm is a
    TritonRMSNorm (rmsnorm_kernel.py), the reader a Float8Linear of a row-wise recipe with a hand-off and
    a trained bf16 weight, and the decoder layer has no other norm in between (Gemma 2's
    pre_feedforward_layernorm: there post_attention_layernorm's output goes to the residual stream).
    Call it after every step that replaces modules (kernels, FP8, LoRA). A copy nobody takes would be
    work for nothing, never a wrong result: the reader takes it only for that very tensor, unchanged.
    Returns how many norms are linked; again: the same count."""
    linked = 0
    for layer in model.modules():
        if not isinstance(layer, family_classes("DecoderLayer")) or hasattr(layer, "pre_feedforward_layernorm"):
            continue
        for norm_name, block_name, readers in NORM_READERS:
            norm, block = getattr(layer, norm_name, None), getattr(layer, block_name, None)
            reader = next((getattr(block, r) for r in readers if hasattr(block, r)), None) if block else None
            if not (isinstance(norm, rmsnorm_kernel.TritonRMSNorm) and isinstance(reader, Float8Linear)
                    and takes_rows(reader, reader.fp8_handoff)):
                continue
            norm.fp8_handoff = reader.fp8_handoff
            linked += 1
    return linked


def store_frozen_weights(model: nn.Module) -> int:
    """Keep the frozen weight of every Float8Linear of `model` in FP8 (`Float8Linear.store_fp8_weight`),
    once: call it after peft has wrapped the layers and frozen their weights (`playbook.models.prepare_model`
    does, for --lora-r with --fp8). peft sizes and casts a new adapter to its base layer's weight dtype,
    so an FP8 weight before peft would give FP8 adapters. Layers whose weight is trained, or whose recipe
    has no row scales, keep their bf16 weight (re-quantized every step), named in one log line. Returns
    how many layers keep their weight in FP8; calling it twice changes nothing."""
    from playbook.core.process import log

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    kept = []
    for m in layers:
        if m.weight.requires_grad:
            kept.append("trained weights")
        elif get_recipe(m.recipe).scaling != "row":
            kept.append(f"recipe {m.recipe} (its scales are not row-wise)")
        else:
            m.store_fp8_weight()
    if kept:
        log(f"FP8: {len(kept)} frozen-base layer(s) keep their bf16 weight, quantized every step: "
            f"{'; '.join(sorted(set(kept)))}")
    return sum(m.stores_fp8() for m in layers)


def expected_patches(config, recipe: str = DEFAULT_RECIPE) -> int:
    """Decoder projections the recipe runs in FP8: those whose dimensions its scaled matmul takes (7 per
    layer, 4 in Phi-3, fused), in the decoder layers it does not keep in bf16."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    if config.model_type == "phi3":  # (in, out) of qkv_proj, o_proj, gate_up_proj, down_proj
        shapes = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]
    else:  # q, k, v, o, gate, up, down
        shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter),
                  (inter, hidden)]
    ends = get_recipe(recipe).bf16_end_layers
    layers = max(0, config.num_hidden_layers - 2 * ends)
    return layers * sum(unsupported_reason(i, o, recipe) is None for i, o in shapes)


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


def rmsnorm_rows_ideal_bytes(n_rows: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes `rmsnorm_quantize_rows` moves for an [n_rows, hidden] input of `dtype`: the norm's
    (rmsnorm_kernel.ideal_bytes: read x and the weight, write y) plus the row copy and its scales, and
    no read of y: `dtype.itemsize` bytes per element fewer than the norm and the row pass apart."""
    return rmsnorm_kernel.ideal_bytes(n_rows, hidden, dtype) + n_rows * hidden + 4 * n_rows


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


def _abs_max(xf: torch.Tensor, dims) -> torch.Tensor:
    """max |x| over `dims`, NaN skipped (as the kernels' maxima), floored at AMAX_FLOOR."""
    return torch.where(xf.isnan(), 0.0, xf.abs()).amax(dim=dims).clamp(min=AMAX_FLOOR)


def _quantize_with(xf: torch.Tensor, amax: torch.Tensor):
    """(x * (448 / amax) as e4m3, amax / 448), amax broadcast against x; the kernels' exact arithmetic."""
    inv = torch.full_like(amax, FP8_MAX) / amax  # tensor / tensor: one IEEE division, as div_rn
    return (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), amax / torch.full_like(amax, FP8_MAX)


def quantize_tensor_ref(x: torch.Tensor):
    """Plain PyTorch: (q [M, K] float8_e4m3fn, scale [1] fp32), one scale for the whole tensor."""
    xf = x.float()
    q, scale = _quantize_with(xf, _abs_max(xf, (0, 1)).reshape(1, 1) if xf.numel() else xf.new_full((1, 1), AMAX_FLOOR))
    return q, scale.reshape(1)


def quantize_blocks_ref(x: torch.Tensor, block_rows: int, block_cols: int):
    """Plain PyTorch: (q [M, K] float8_e4m3fn, scales [M / block_rows, K / block_cols] fp32), one scale
    per block (1 x 128: activations; 128 x 128: weights). x's shape must be a multiple of the block."""
    M, K = x.shape
    xf = x.float().view(M // block_rows, block_rows, K // block_cols, block_cols)
    amax = _abs_max(xf, (1, 3))
    q, scale = _quantize_with(xf, amax[:, None, :, None])
    return q.view(M, K), scale[:, 0, :, 0]


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [R, S] (e4m3) times its block scales [R / br, S / bc] (fp32, one tensor scale, or e8m0): fp32."""
    s = scales.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    R, S = q.shape
    return q.float() * s.repeat_interleave(R // s.shape[0], dim=0).repeat_interleave(S // s.shape[1], dim=1)


def quantize_mx_ref(x: torch.Tensor, block: int = MX_BLOCK):
    """MXFP8, the reference (the recipe mxfp8): (q [M, K] float8_e4m3fn, scales [M, K / block]
    float8_e8m0fnu), one power-of-two scale per `block` consecutive values of a row.

    The scale is the smallest power of two 2^e with amax <= 448 * 2^e, so no value saturates (OCP's
    rule, 2^(floor(log2 amax) - 8), may put a block's largest value above 448; NVIDIA's and torchao's
    "round up" rule is this one). With amax = m 2^p, m in [0.5, 1) (frexp, exact) and 448 = 0.875 2^9:
    e = p - 9, or p - 8 when m > 0.875. Dividing by a power of two is exact; only the cast to e4m3
    rounds. e is clamped to e8m0's range [-127, 127] (all-zero blocks take the floor's scale)."""
    M, K = x.shape
    if K % block:
        raise ValueError(f"MX blocks of {block}: the row length {K} must be a multiple of {block}")
    xf = x.float().view(M, K // block, block)
    amax = _abs_max(xf, 2)
    m, p = torch.frexp(amax)
    e = (p - 9 + (m > 0.875).to(p.dtype)).clamp(E8M0_MIN, E8M0_MAX)
    scale = torch.ldexp(torch.ones_like(amax), e)
    q = (xf / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, K), scale.to(torch.float8_e8m0fnu)


def mx_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The forward y = x W^T of the recipe mxfp8 in plain PyTorch: x [M, K] and W [N, K] quantized in
    1x32 blocks along K (`quantize_mx_ref`; K a multiple of 32, ValueError otherwise), dequantized, and
    multiplied in fp32 (the layer rounds this product once to bf16)."""
    xq, sx = quantize_mx_ref(x)
    wq, sw = quantize_mx_ref(weight)
    return dequantize_blocks(xq, sx) @ dequantize_blocks(wq, sw).t()
