"""FP8 producers: a norm and a SwiGLU that hand the next FP8 layer what it would read their output for.

What you build here: the hand-off through which the FP8 layers of one model pass each other quantized
copies and maxima (`Fp8Handoff`); an RMSNorm that also writes its output's FP8 row copy, or its MXFP8
copy under the MXFP8 recipes (`Fp8RMSNorm`);
a SwiGLU backward that also takes the maxima of the gradient it writes (`swiglu_joined_fp8`); the steps
that link them to the FP8 projections of a model; and `apply`, the one entry point of --fp8, which
converts a model's projections (fp8_recipes_kernel.patch_model), links the producers and reports. What
you learn: a quantization's row pass exists only to find maxima, so the kernel that writes a tensor can
spare that pass, and where that pays.

The norm is rmsnorm_kernel.py's TritonRMSNorm as a subclass and the MLP forward is built from
swiglu_kernel.py's public pieces: those lessons know nothing of FP8.

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
added in another order: see fp8_producers_test.py). Measured on an H100 (`benchmark_kernels.py
--fp8-producers`, CUDA graph replays): 82.3 us against 97.5 us for the pair at 8192 tokens, 143.6
against 176.3 at 16384. In the 8B step that is 56 norms x 15 us, about 0.8 ms of a ~508 ms FP8 step:
below what two runs of 12 steps can tell apart (results/runs/fp8_producers_H100/).

The block-scaled recipe MXFP8 (`--fp8-recipe mxfp8`, mx_quant_kernel.py) needs even less: a 1x32 block's
e8m0 scale is known from that block's 32 values, so the norm writes y's MXFP8 copy along H from its
registers too (`_rmsnorm_quantize_mxfp8`), and q, k and v (gate and up) all read that one copy, where each
would otherwise quantize y itself. Bytes per element at the hidden size, bf16, one reader:

    norm, then quantize_mxfp8(y)     read x 2, write y 2;  read y 2, write q 1 + 1/32      7.03 bytes
    the producer                     read x 2, write y 2, write q 1 + 1/32                  5.03 bytes

(`rmsnorm_mxfp8_ideal_bytes`), and 3.03 bytes more for each further reader of the same y. y is still
written: the norm's backward and dW's transposed copy (made in the readers' backward) read it. A joined
reader (qkv, gate_up: projections_kernel.py) keeps its input's transposed copy instead and makes it in
the forward, from y: there the norm saves no bytes, the quantizer reading y for one copy instead of two.
The copy is bit for bit `quantize_mxfp8(y)`; y is the row-wise producer's (same arithmetic, same caveat).

The SwiGLU needs no whole rows for MXFP8: `_swiglu_quantize_mxfp8` computes h on mx_quant's [32, 128]
tiles and writes h and both of its copies (along the MLP width for down_proj's forward, transposed for
its dW), which down_proj keeps: read gate and up 4, write h 2 and the copies 2.06, 8.06 bytes per element
where swiglu_kernel's forward and `quantize_mxfp8(h, True, True)` move 10.06 (`swiglu_mxfp8_ideal_bytes`).

The SwiGLU forward, which writes down_proj's input h [tokens, 14336], is the other candidate
(`_swiglu_quantize_rows`, 2 bytes per element of the MLP width fewer). It must hold whole rows of
14,336 to know their maxima, where swiglu_kernel.py streams 2,048-column tiles, and at 1 to 4 programs
per SM it measured 400-431 us against 377 us for the pair (H100, 8192 tokens): fewer loads in flight
cost more than the bytes saved, so it is off (`SWIGLU_WRITES_ROWS`), and its tests keep it correct.

Layout of this file: kernels -> launchers -> custom op -> the hand-off -> the autograd.Functions ->
the producer modules -> linking them, and `apply`.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from core import kernel_utils  # (selects the interpreter on machines without a GPU; check_device)
from core.fp8_support import DEFAULT_RECIPE, bf16_layer_counts, compiled_graph_trusted, expected_patches, get_recipe
from core.kernel_utils import as_rows, direct_launch, next_power_of_2, num_sms, refuse_double_backward
from core.model_families import family_classes
from core.process import log
from fp8_linear_kernel import (FP8_DTYPE, MAX_COLS, ROUND_IN_SOFTWARE, Float8Linear, cast_e4m3, load_rows,
                               refuse_create_graph, rows_block)
import fp8_recipes_kernel
import mx_quant_kernel as mxq
import rmsnorm_kernel
from rmsnorm_kernel import normalize_rows  # RMSNorm's arithmetic, in the producer kernel below too
import swiglu_kernel
from swiglu_kernel import act_grads, act_out, halves  # the activation and its chain rule, in the kernels below too

import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
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
    ROUND_IN_SOFTWARE: tl.constexpr,  # fp8_linear_kernel.ROUND_IN_SOFTWARE
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
        x = load_rows(X, rows, cols, col_ok, stride_x, M)
        y, rstd = normalize_rows(x, W, cols, col_ok, H, eps, OFFSET, CASTING)
        y = y.to(Y.dtype.element_ty)  # rounded as stored: the FP8 copy is made of these very values
        tl.store(Rstd + rows, rstd, mask=row_ok)
        tl.store(Y + rows[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])
        col_max = rows_block(Y, Q, Scale, y, rows, cols, col_ok, col_max, M, H, True, COL_MAX, ROUND_IN_SOFTWARE)
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
    ROUND_IN_SOFTWARE: tl.constexpr,  # fp8_linear_kernel.ROUND_IN_SOFTWARE
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
        g = load_rows(G, rows, cols, col_ok, stride_g, M).to(tl.float32)
        u = load_rows(U, rows, cols, col_ok, stride_u, M).to(tl.float32)
        h = act_out(g, u, ACT).to(Hout.dtype.element_ty)  # rounded as stored
        tl.store(Hout + rows[:, None] * I + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :])
        col_max = rows_block(Hout, Q, Scale, h, rows, cols, col_ok, col_max, M, I, True, COL_MAX, ROUND_IN_SOFTWARE)
    if COL_MAX:
        tl.store(ColMax + pid * I + cols, col_max, mask=col_ok)



@triton.jit
def _rmsnorm_quantize_mxfp8(
    X,  # pointer to the norm's input, [M, H], unit stride along H
    W,  # pointer to the norm's weight, [H]
    Y,  # pointer to the norm's output, [M, H], contiguous
    Rstd,  # pointer to the inverse RMS per row, [M] fp32 (what the norm's backward needs)
    Q,  # pointer to the output's MXFP8 copy along H, [M, H] float8_e4m3fn, contiguous
    S,  # pointer to its e8m0 scales: [M, cdiv(H, 32)] bytes, or swizzled (SWIZZLE; zeroed by the launcher)
    stride_x,  # elements between two rows of X
    M,  # rows (tokens)
    H,  # hidden size
    S_TILES,  # 4-block tiles per row of S in the swizzled layout: cdiv(cdiv(H, 32), 4)
    eps,  # the norm's epsilon
    ROWS: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # power of two >= max(H, 32): a program holds whole rows, in whole 1x32 blocks
    OFFSET: tl.constexpr,  # the norm's weight offset (rmsnorm_kernel.py)
    CASTING: tl.constexpr,  # the norm's casting mode (rmsnorm_kernel.py)
    SWIZZLE: tl.constexpr,  # the scales in the layout cuBLAS reads (mx_quant_kernel._swizzled)
    ROUND_IN_SOFTWARE: tl.constexpr,  # fp8_linear_kernel.ROUND_IN_SOFTWARE
):
    """RMSNorm's forward that also writes its output's MXFP8 copy along H: `_rmsnorm_fwd` and the row half
    of mx_quant_kernel's `_mxfp8_quantize` in one kernel. A 1x32 block's scale needs only that block's
    maximum, which the registers hold as soon as the row is normalized; the output is never read back.
    No column maxima (MX scales are per block), so no persistent grid: one block of rows per program."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok, col_ok = rows < M, cols < H
    x = load_rows(X, rows, cols, col_ok, stride_x, M)
    y, rstd = normalize_rows(x, W, cols, col_ok, H, eps, OFFSET, CASTING)
    y = y.to(Y.dtype.element_ty)  # rounded as stored: the MXFP8 copy is made of these very values
    tl.store(Rstd + rows, rstd, mask=row_ok)
    tl.store(Y + rows[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])
    # Columns past H hold 0 (x and W read as 0 there): mx_quant's padding rule, no effect on a block's maximum
    mxq.mxfp8_rows(mxq.as_f32(y), rows, cols.to(tl.int64), 0, Q, S, M, H, S_TILES, ROWS, BLOCK_H, SWIZZLE,
                   ROUND_IN_SOFTWARE)


@triton.jit
def _swiglu_quantize_mxfp8(
    G,  # pointer to the gate, [M, I], unit stride along I (the first half of a joined gate_up)
    U,  # pointer to up, [M, I], unit stride along I
    Hout,  # pointer to the output act(gate) * up, [M, I], contiguous
    Q,  # the output's MXFP8 copy along I, [M, I] float8_e4m3fn
    S,  # its e8m0 scales, [M, cdiv(I, 32)] bytes
    QT,  # the transposed copy along the tokens, [I, M_pad] float8_e4m3fn (WRITE_QT)
    ST,  # its e8m0 scales, [I, M_pad / 32] bytes
    stride_g,  # elements between two rows of G
    stride_u,  # elements between two rows of U
    M,  # rows (tokens)
    I,  # the MLP width
    M_pad,  # M rounded up to 32
    BLOCK_M: tl.constexpr,  # rows per program, a multiple of 32 (mx_quant_kernel.mxfp8_tile)
    BLOCK_K: tl.constexpr,  # columns per program, a multiple of 32
    ACT: tl.constexpr,  # "silu" or "gelu_tanh" (swiglu_kernel.py)
    WRITE_QT: tl.constexpr,  # also the transposed copy (the reader keeps it for dW)
    ROUND_IN_SOFTWARE: tl.constexpr,  # fp8_linear_kernel.ROUND_IN_SOFTWARE
):
    """The SwiGLU forward that also writes its output's MXFP8 copies: swiglu_kernel's `_swiglu_fwd` on
    mx_quant_kernel's [32, BLOCK_K] tiles, whose 1x32 and 32x1 blocks lie inside the tile, so both copies
    come from registers (`mxq.mxfp8_tile`) and h is never read back. Unlike the row-wise copy, no whole
    row is needed: a block's scale depends on its 32 values only."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = act_out(g, u, ACT).to(Hout.dtype.element_ty)  # rounded as stored: the copies are made of these values
    tl.store(Hout + rows[:, None] * I + cols[None, :], h, mask=mask)
    # act(0) * 0 = 0 past M and I: mx_quant's padding rule
    mxq.mxfp8_tile(mxq.as_f32(h), Q, S, QT, ST, M, I, M_pad, 0, 0, BLOCK_M, BLOCK_K, True, WRITE_QT, False,
                   ROUND_IN_SOFTWARE)


# The SwiGLU backward of a joined gate/up projection (swiglu_kernel.py's backward kernel, packed), which also
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
    dg, du = act_grads(dh, g, u, ACT)
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
                    dtype=rmsnorm_kernel.output_dtype(x2.dtype, weight.dtype, casting_mode), device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
    q = torch.empty((M, H), dtype=FP8_DTYPE, device=x2.device)
    scale = torch.empty(M, dtype=torch.float32, device=x2.device)
    # The norm's own block shape and warps (rmsnorm_kernel.fwd_settings): the sum of squares of a row is
    # then reduced in the same order as in `rmsnorm_forward`, so the inverse RMS and y are the same bits
    # (another layout of the block sums in another order: a last-bit difference, measured on an H100).
    block_h, rows, num_warps = rmsnorm_kernel.fwd_settings(H)
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


def rmsnorm_quantize_mxfp8(x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                           casting_mode: str = "llama", swizzle: bool = False, out_shape: torch.Size | None = None):
    """RMSNorm of x2 [M, H] (rmsnorm_kernel.rmsnorm_forward's numerics) and its output's MXFP8 copy along H,
    in one kernel: (y, rstd, q [M, H] e4m3, scales [M, cdiv(H, 32)] e8m0, or flat in cuBLAS's layout with
    `swizzle`), q and scales bit for bit what `mx_quant_kernel.quantize_mxfp8(y)` gives. H need not be a
    multiple of 32 (the last block is zero-padded, as mx_quant pads it). `out_shape`: allocate y in this
    shape (M x H elements)."""
    M, H = x2.shape
    if not 1 <= H <= MAX_COLS:
        raise ValueError(f"rows of 1 to {MAX_COLS} elements can be quantized, got {H}")
    kernel_utils.check_device(x2, weight)
    dev, n_blocks = x2.device, -(-H // mxq.MX_BLOCK)
    y = torch.empty(out_shape if out_shape is not None else (M, H),
                    dtype=rmsnorm_kernel.output_dtype(x2.dtype, weight.dtype, casting_mode), device=dev)
    rstd = torch.empty(M, dtype=torch.float32, device=dev)
    q = torch.empty((M, H), dtype=FP8_DTYPE, device=dev)
    s = mxq.scale_buffer(M, n_blocks, swizzle, torch.float8_e8m0fnu, dev)
    if M == 0:
        return y, rstd, q, s
    # The norm's own block shape and warps (rmsnorm_kernel.fwd_settings), so that a row's sum of squares is
    # reduced as in `rmsnorm_forward`; rows shorter than 16 take a 32-wide block (one whole MX block).
    block_h, rows, num_warps = rmsnorm_kernel.fwd_settings(H)
    block_h = max(block_h, mxq.MX_BLOCK)
    _rmsnorm_quantize_mxfp8[(triton.cdiv(M, rows),)](
        x2, weight, y, rstd, q, s.view(torch.uint8), x2.stride(0), M, H, -(-n_blocks // 4), eps,
        ROWS=rows, BLOCK_H=block_h, OFFSET=float(offset), CASTING=casting_mode, SWIZZLE=swizzle,
        ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE, num_warps=num_warps,
    )
    return y, rstd, q, s


def rmsnorm_mxfp8_ideal_bytes(n_rows: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes `rmsnorm_quantize_mxfp8` moves for an [n_rows, hidden] input of `dtype`: the norm's
    (rmsnorm_kernel.ideal_bytes) plus the MXFP8 copy and one scale byte per 32 values, and no read of y:
    `dtype.itemsize` bytes per element fewer than the norm and `quantize_mxfp8(y)` apart."""
    return rmsnorm_kernel.ideal_bytes(n_rows, hidden, dtype) + n_rows * hidden + n_rows * (-(-hidden // 32))


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

# On: the MXFP8 copies come from tiles of whole 32-row blocks, as mx_quant's quantizer's, so no whole rows are
# held (the row-wise producer's cost above); it moves 2 bytes per element of the MLP width fewer than
# swiglu_kernel's forward and `quantize_mxfp8` (`swiglu_mxfp8_ideal_bytes`). `benchmark_kernels.py --mx-quant`
# times the two.
SWIGLU_WRITES_MX = True
# Its (BLOCK_M, BLOCK_K, num_warps): tiles as mx_quant_kernel.MX_CONFIG's (`benchmark_kernels.py --mx-quant --tune`)
SWIGLU_MX_CONFIG = (32, 128, 4)


def swiglu_quantize_mxfp8(g2: torch.Tensor, u2: torch.Tensor, activation: str = "silu", cols: bool = True):
    """act(gate) * up of g2, u2 [M, I] (swiglu_kernel.swiglu_forward's numerics) and its MXFP8 copies, in one
    kernel: (h, q [M, I], scales [M, cdiv(I, 32)], qT [I, M_pad], scales [I, M_pad / 32]; the last two None
    without `cols`), the copies bit for bit `mx_quant_kernel.quantize_mxfp8(h, True, cols)`'s (natural
    scales: the recipe's layout)."""
    M, I = g2.shape
    kernel_utils.check_device(g2, u2)
    dev, e8 = g2.device, torch.float8_e8m0fnu
    m_pad, n_blocks = -(-M // mxq.MX_BLOCK) * mxq.MX_BLOCK, -(-I // mxq.MX_BLOCK)
    h = torch.empty((M, I), dtype=g2.dtype, device=dev)
    q = torch.empty((M, I), dtype=FP8_DTYPE, device=dev)
    s = torch.empty((M, n_blocks), dtype=torch.uint8, device=dev).view(e8)
    qt = torch.empty((I, m_pad) if cols else (0,), dtype=FP8_DTYPE, device=dev)
    st = torch.empty((I, m_pad // mxq.MX_BLOCK) if cols else (0,), dtype=torch.uint8, device=dev).view(e8)
    if M and I:
        block_m, block_k, warps = SWIGLU_MX_CONFIG
        grid = (triton.cdiv(m_pad, block_m), triton.cdiv(I, block_k))
        _swiglu_quantize_mxfp8[grid](
            g2, u2, h, q, s.view(torch.uint8), qt, st.view(torch.uint8), g2.stride(0), u2.stride(0), M, I, m_pad,
            BLOCK_M=block_m, BLOCK_K=block_k, ACT=activation, WRITE_QT=cols, ROUND_IN_SOFTWARE=ROUND_IN_SOFTWARE,
            num_warps=warps,
        )
    elif cols:
        qt.view(torch.uint8).zero_()
    return h, q, s, *((qt, st) if cols else (None, None))


def swiglu_mxfp8_ideal_bytes(n_rows: int, width: int, dtype: torch.dtype, copies: int = 2) -> int:
    """Bytes `swiglu_quantize_mxfp8` moves: read gate and up, write h and `copies` MXFP8 copies with a scale
    byte per 32 values. The pair (swiglu_kernel's forward, then `quantize_mxfp8`) also reads h back."""
    n, e = n_rows * width, dtype.itemsize
    return 3 * n * e + copies * (n + n // 32)


def swiglu_rows_ideal_bytes(n_rows: int, width: int, dtype: torch.dtype) -> int:
    """Bytes `swiglu_quantize_rows` moves: read gate and up, write h, its row copy and scales. The pair
    (swiglu_kernel's forward, then `quantize_rows`) also reads h back: `dtype.itemsize` bytes per element."""
    n, e = n_rows * width, dtype.itemsize
    return 3 * n * e + n + 4 * n_rows



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
# Custom op: what torch.compile and opcheck see
# ------------------------------------------------------------------------------------------------
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

    def share(self, x: torch.Tensor):
        """`get`, counted in `taken`, leaving the value for the other readers of x (the MXFP8 layers q, k and
        v read the norm's one copy; the backward empties the slot)."""
        value = self.get(x)
        self.taken += value is not None
        return value

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
                  layer that reads that very tensor next skips its row pass. MXFP8 recipes: the input's
                  MXFP8 copy along K (values, e8m0 scales), which every layer reading that tensor uses.

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

    def __reduce__(self):  # copy.deepcopy and pickle: a fresh, empty hand-off
        return (Fp8Handoff, ())



# ------------------------------------------------------------------------------------------------
# The autograd.Functions of the producers
# ------------------------------------------------------------------------------------------------
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
        refuse_create_graph("swiglu_joined_fp8", "the fused kernel", "the plain PyTorch reference")
        (gate_up,) = ctx.saved_tensors
        dgu, row_max, col_max = swiglu_joined_backward_maxima(as_rows(dh), *halves(gate_up), ctx.activation)
        ctx.handoff.offer_grad(dgu, (row_max, col_max))
        return dgu, None, None, None, None


class SwigluJoinedMxFunction(torch.autograd.Function):
    """act(gate) * up of a joined gate_up [rows, 2I] whose forward also leaves h's MXFP8 copies (along I,
    and, `cols`, transposed along the tokens) in the hand-off for the MXFP8 down projection that reads h
    next (`swiglu_quantize_mxfp8`); the backward is `swiglu_kernel.swiglu_joined`'s own. Eager mode only."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, activation: str, handoff: Fp8Handoff, cols: bool):
        ctx.save_for_backward(gate_up)  # the matmul that made gate_up keeps it alive anyway
        ctx.activation = activation
        h, *copies = swiglu_quantize_mxfp8(*halves(gate_up), activation, cols)
        handoff.input_rows.put(h, tuple(copies) if cols else tuple(copies[:2]))
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        refuse_create_graph("the MXFP8 SwiGLU producer", "the fused kernel", "the plain PyTorch reference")
        (gate_up,) = ctx.saved_tensors
        return swiglu_kernel.swiglu_joined_bwd_op(as_rows(dh), gate_up, ctx.activation), None, None, None


class RMSNormFp8Function(rmsnorm_kernel.RMSNormFunction):
    """rmsnorm_kernel.rmsnorm (eager) whose forward also leaves its output's FP8 row copy (or, `mx`, its
    MXFP8 copy along H) in the hand-off (`Fp8Handoff.input_rows`) for the FP8 layers that read that output
    next; the backward is the norm's own. The copy needs no pass of its own (`_rmsnorm_quantize_rows`,
    `_rmsnorm_quantize_mxfp8`)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place, handoff, col_max, mx=False):
        x2, weight = as_rows(x), weight.contiguous()
        if mx:
            y, rstd, q, scales = rmsnorm_quantize_mxfp8(x2, weight, eps, offset, casting_mode, out_shape=x.shape)
            handoff.input_rows.put(as_rows(y), (q, scales))
        else:
            y, rstd, q, scale, maxima = rmsnorm_quantize_rows(x2, weight, eps, offset, casting_mode, col_max, x.shape)
            handoff.input_rows.put(as_rows(y), (q, scale, maxima))
        rmsnorm_kernel.RMSNormFunction.keep(ctx, x2, weight, rstd, offset, casting_mode, in_place, x.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*rmsnorm_kernel.RMSNormFunction.backward(ctx, dy), None, None, None)



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
    swiglu_kernel.check_joined(gate_up, activation)
    rows = SWIGLU_WRITES_ROWS and down is not None and takes_rows(down, handoff)
    h = SwigluJoinedFp8Function.apply(as_rows(gate_up), activation, handoff, rows, torch.is_grad_enabled())
    return h.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)



# ------------------------------------------------------------------------------------------------
# The producer modules
# ------------------------------------------------------------------------------------------------
class Fp8RMSNorm(rmsnorm_kernel.TritonRMSNorm):
    """A TritonRMSNorm that also leaves its output's FP8 row copy (`fp8_mx`: its MXFP8 copy) in
    `fp8_handoff.input_rows`, for the FP8 layer that reads that output next (`link_norms` makes a decoder
    layer's norm one, in place: the same module, Parameter and hooks). Where the launchers cannot run
    (torch.compile tracing, a meta tensor, a dispatch mode) it is the norm's own forward."""

    fp8_handoff: Fp8Handoff | None = None
    fp8_mx: bool = False  # the readers run an MXFP8 recipe (`takes_mx_rows`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_handoff is None or not direct_launch(x, self.weight):  # (rmsnorm checks its inputs itself)
            return super().forward(x)
        rmsnorm_kernel.check_inputs(x, self.weight, self.offset, self.casting_mode)  # (refuses rows over MAX_COLS)
        return RMSNormFp8Function.apply(x, self.weight, float(self.variance_epsilon), float(self.offset),
                                        self.casting_mode, bool(self.in_place), self.fp8_handoff,
                                        torch.is_grad_enabled(), self.fp8_mx)

    def extra_repr(self) -> str:
        copy = "MXFP8 copy" if self.fp8_mx else "FP8 row copy"
        return super().extra_repr() + (f", writes the next layer's {copy}" if self.fp8_handoff is not None else "")


def fp8_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """swiglu_kernel.swiglu_mlp_forward whose joined gate/up output, when its projection is an FP8 layer
    holding the model's hand-off, goes through `swiglu_joined_fp8`: its backward hands that layer the
    maxima of d gate_up (`link_mlps` sets this forward). Under an MXFP8 recipe, when the down projection
    takes MXFP8 copies from that hand-off (`takes_mx_rows`), the SwiGLU writes them
    (`SwigluJoinedMxFunction`; `SWIGLU_WRITES_MX`)."""
    g, u, gu = swiglu_kernel.gate_and_up(mlp, x)
    down = mlp.down_proj
    if gu is not None and not swiglu_kernel.folds_down(down):
        gate = mlp.gate_up_proj if hasattr(mlp, "gate_up_proj") else mlp.gate_proj
        handoff = getattr(gate, "fp8_handoff", None)
        activation = getattr(mlp, "fused_activation", "silu")
        scaling = get_recipe(gate.recipe).scaling if handoff is not None else None
        if scaling == "row":
            return down(swiglu_joined_fp8(gu, activation, handoff, down))
        if (scaling == "mx" and SWIGLU_WRITES_MX and takes_mx_rows(down, handoff) and direct_launch(gu)
                and as_rows(gu).stride(-1) == 1):
            swiglu_kernel.check_joined(gu, activation)
            cols = down.keep_fp8_input and torch.is_grad_enabled() and down.weight.requires_grad  # its dW operand
            h = SwigluJoinedMxFunction.apply(as_rows(gu), activation, handoff, cols)
            return down(h.view(*gu.shape[:-1], gu.shape[-1] // 2))
    return swiglu_kernel.mlp_down(mlp, x, g, u, gu)


# ------------------------------------------------------------------------------------------------
# Linking the producers to a model's FP8 layers, and --fp8's entry point
# ------------------------------------------------------------------------------------------------
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


def takes_mx_rows(reader: nn.Module, handoff: Fp8Handoff) -> bool:
    """Whether `reader` takes an MXFP8 copy of its input along K from `handoff.input_rows`: a Float8Linear
    of an MXFP8 recipe (emulated or not) sharing that hand-off, with a trained bf16 weight (LoRA's frozen
    base stores its own block-scaled weight and has its own forward)."""
    return (isinstance(reader, Float8Linear) and reader.fp8_handoff is handoff and handoff is not None
            and not reader.stores_fp8() and reader.weight.requires_grad and get_recipe(reader.recipe).scaling == "mx")


def link_norms(model: nn.Module) -> int:
    """Let each decoder layer's RMSNorm write the FP8 row copy of its output for the FP8 projection that
    reads it (`Fp8Handoff.input_rows`): input_layernorm for q/k/v, post_attention_layernorm for gate/up;
    the norm becomes an `Fp8RMSNorm` in place. Linked only where that is exactly the model's data flow and
    the copy will be taken: the norm is a TritonRMSNorm (rmsnorm_kernel.py), the reader a Float8Linear of
    a row-wise recipe with a hand-off and a trained bf16 weight (`takes_rows`; or of an MXFP8 recipe,
    `takes_mx_rows`: the norm then writes the MXFP8 copy), and the decoder layer has
    no other norm in between (Gemma 2's pre_feedforward_layernorm: there post_attention_layernorm's
    output goes to the residual stream). A copy nobody takes would be work for nothing, never a wrong
    result: the reader takes it only for that very tensor, unchanged. Returns how many norms are linked;
    again: the same count."""
    linked = 0
    for layer in model.modules():
        if not isinstance(layer, family_classes("DecoderLayer")) or hasattr(layer, "pre_feedforward_layernorm"):
            continue
        for norm_name, block_name, readers in NORM_READERS:
            norm, block = getattr(layer, norm_name, None), getattr(layer, block_name, None)
            reader = next((getattr(block, r) for r in readers if hasattr(block, r)), None) if block else None
            if not (isinstance(norm, rmsnorm_kernel.TritonRMSNorm) and isinstance(reader, Float8Linear)):
                continue
            mx = takes_mx_rows(reader, reader.fp8_handoff)
            if not (mx or takes_rows(reader, reader.fp8_handoff)):
                continue
            norm.__class__ = Fp8RMSNorm
            norm.fp8_handoff, norm.fp8_mx = reader.fp8_handoff, mx
            linked += 1
    return linked


def link_mlps(model: nn.Module) -> int:
    """Run every MLP on the fused SwiGLU forward (swiglu_kernel.patch_model) through `fp8_mlp_forward`,
    which hands d gate_up's maxima to an FP8 gate/up projection holding the model's hand-off (decided at
    each call, as the projections may change). Returns how many MLPs run it; again: the same count."""
    linked = 0
    for mlp in model.modules():
        forward = getattr(getattr(mlp, "forward", None), "__func__", None)
        if forward is swiglu_kernel.swiglu_mlp_forward:
            mlp.forward = types.MethodType(fp8_mlp_forward, mlp)
        linked += getattr(mlp.forward, "__func__", None) is fp8_mlp_forward
    return linked


def model_handoff(model: nn.Module, recipe: str) -> Fp8Handoff | None:
    """The model's one `Fp8Handoff` (`model.fp8_handoff`, made on the first call) for a row-wise or MXFP8
    recipe (fp8_recipes_kernel.HANDS_OVER); None for the others, which hand nothing over."""
    if get_recipe(recipe).scaling not in fp8_recipes_kernel.HANDS_OVER:
        return None
    if not isinstance(getattr(model, "fp8_handoff", None), Fp8Handoff):
        model.fp8_handoff = Fp8Handoff()
    return model.fp8_handoff


def patch_model(model: nn.Module, recipe: str = DEFAULT_RECIPE, sizes: str = "all") -> int:
    """fp8_recipes_kernel.patch_model with the model's hand-off (`model_handoff`), which every layer converted
    here shares: q/k/v and gate/up quantize their common input once, and the producers linked to them hand
    over their copies and maxima. Returns how many projections run in FP8."""
    return fp8_recipes_kernel.patch_model(model, recipe, sizes, model_handoff(model, recipe))


def apply(model: nn.Module, recipe: str = DEFAULT_RECIPE, layers: str = "all", *, compiled: bool = False,
          chunked_mlp: bool = False, lora: bool = False) -> int:
    """--fp8: the decoder's projections as FP8 matmuls of the recipe (`patch_model`), the producers linked
    to them, and what was done in the log. Returns how many projections run in FP8.

    layers: --fp8-layers; "auto" applies the size rule on a GPU (on a CPU nothing is timed, so every
    projection the recipe takes is converted). The norms are linked (`link_norms`) unless the model is
    compiled (a traced norm writes no copy), its MLP runs in chunks (the readers get other tensors) or
    LoRA will freeze the readers' weights (`takes_rows`); the MLPs (`link_mlps`) unless LoRA follows
    (lora_kernel then fuses the MLP's adapted down projection instead). RuntimeError for a GPU without
    the recipe's FP8 matmuls.
    """
    on_gpu = any(p.device.type == "cuda" for p in model.parameters())
    converted = patch_model(model, recipe, sizes="auto" if layers == "auto" and on_gpu else "all")
    r = get_recipe(recipe)
    first, last = bf16_layer_counts(recipe, model.config.num_hidden_layers)
    kept = (f"the first and last {first} decoder layers, " if first else
            f"the last {last} decoder layers, " if last else "")
    dgrad = "; input gradients (dx = dy W) in bf16" if r.bf16_dgrad else ""
    # the denominator counts every decoder projection the matmul takes, those the recipe keeps in bf16 too
    every = expected_patches(model.config, "rowwise")
    emulated = ("; emulated: block-scaled numerics from dequantized bf16 matmuls, no block-scaled tensor cores, "
                "speed not comparable" if r.emulated else "")
    log(f"FP8: {converted} of {every} decoder projections run as FP8 matmuls (recipe {recipe}{dgrad}); "
        f"{kept}lm_head and embeddings stay bf16{emulated}")
    if converted == 0 and r.bf16_end_layers:
        log(f"warning: --fp8 converted nothing: this model has {model.config.num_hidden_layers} decoder layers, all among "
            f"the first and last {r.bf16_end_layers} that recipe {recipe} keeps in bf16; --fp8-recipe rowwise converts them")
    if not lora:
        link_mlps(model)
    linked = link_norms(model) if not (compiled or chunked_mlp or lora) else 0
    if linked:
        copy = "MXFP8 copy" if r.scaling == "mx" else "FP8 row copy"
        log(f"FP8: {linked} RMSNorms write their output's {copy} for the projections that read it")
    devices = {p.device for p in model.parameters()}
    if compiled and not all(compiled_graph_trusted(d) for d in devices):
        log("torch.compile with --fp8: each FP8 projection runs outside the compiled graph (its compiled "
            "gradient is not trusted on this device; fp8_support.compiled_graph_trusted says why)")
    return converted


def rmsnorm_rows_ideal_bytes(n_rows: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes `rmsnorm_quantize_rows` moves for an [n_rows, hidden] input of `dtype`: the norm's
    (rmsnorm_kernel.ideal_bytes: read x and the weight, write y) plus the row copy and its scales, and
    no read of y: `dtype.itemsize` bytes per element fewer than the norm and the row pass apart."""
    return rmsnorm_kernel.ideal_bytes(n_rows, hidden, dtype) + n_rows * hidden + 4 * n_rows
