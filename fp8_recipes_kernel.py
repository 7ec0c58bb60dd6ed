"""FP8 recipes: other scales than one per row, and matmuls kept in bf16 (`--fp8-recipe NAME`).

What you build here: a Triton kernel that quantizes 128 x 128 tiles with one scale per tensor, per 1x128
block or per 128 x 128 tile (`_quantize_tiles`), the matmuls that take those scales, the layer that runs
them (`Float8ScaledLinear`), and MXFP8's reference quantizer; on top of fp8_linear_kernel.py's row-wise
layer. What you learn: how the place of a scale (per tensor, per block, per row) trades precision for
passes over memory, and which GPU runs which scaled matmul.

fp8_linear_kernel.py is the default recipe, `rowwise`, and its two row-wise variants. `RECIPES`
(core/fp8_support.py) names them all (`--fp8-recipe`;
docs/fp8.md compares them): `rowwise-bf16-dgrad` (dx = dy W as a bf16 matmul), `rowwise-bf16-ends`
(the first and last 2 decoder layers left as nn.Linear), `tensorwise` (one scale per tensor),
`blockwise` (DeepSeek-V3's 1x128 blocks of activations and gradients, 128x128 tiles of weights),
`mxfp8` (OCP MX: 1x32 blocks with power-of-two scales, Blackwell's format) and `nvfp4` (NVIDIA's 4-bit
format: 1x16 blocks with e4m3 scales and a tensor scale, 16x16 weight tiles, stochastic rounding of
gradients, the random Hadamard transform on dW's operands). Those two are quantized by mx_quant_kernel.py's
Triton kernels and multiplied by torch._scaled_mm's MXFP8 / NVFP4 matmuls on Blackwell; Hopper refuses
them unless asked for their emulation (`--fp8-emulate`: the recipes `mxfp8-emulated`, `nvfp4-emulated`),
which multiplies the dequantized operands in bf16, as the CPU always does. A block scale needs no pass of its
own: every block lies inside one 128 x 128 tile, so one kernel (`_quantize_tiles`) reads each tile
once, finds its maxima per row, per column or over the tile, and writes both FP8 layouts with their
scales: a block-scaled tensor costs one read where a row-and-column-scaled one costs two. One scale
per tensor needs the tensor's maximum first (the row kernel's column maxima: one read), then the same
tile kernel.

`fp8_linear`, `check_fp8_device` and `patch_model` below take every recipe: the row-wise ones go to
fp8_linear_kernel.py, the others run here.

Layout of this file: kernel -> launchers -> custom ops -> the autograd.Function and its probe ->
functional API, layer and `patch_model` -> references.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from core import fp8_support
from core.fp8_support import (ALIGN, DEFAULT_RECIPE, RECIPES, compiled_graph_trusted,  # noqa: F401
                                       fast_accum_allowed, get_recipe)
from core.kernel_utils import as_rows
from core.model_families import family_classes
import fp8_linear_kernel
import mx_quant_kernel as mxq
from fp8_linear_kernel import (AMAX_FLOOR, FP8_DTYPE, FP8_MAX, ROUND_IN_SOFTWARE, Float8Linear, abs_max, fp8_rows_op,
                               refuse_create_graph,
                               linear_frame, quantize_block, quantize_rows, quantize_with)

import triton
import triton.language as tl

MX_BLOCK = 32  # OCP MX: 32 consecutive values along the reduction share one power-of-two scale
# NVFP4's random Hadamard transform: one sign vector for every dW operand (x^T and dy^T must share it
# for the transforms to cancel in dy^T x)
NVFP4_HADAMARD_SIGNS = mxq.hadamard_signs(0)
E8M0_MIN, E8M0_MAX = -127, 127  # the exponents float8_e8m0fnu holds (255 is its NaN)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------
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
        q, scale = quantize_block(x, amax_rows, 1, ROUND_IN_SOFTWARE)
        tl.store(Q + rows[:, None] * K + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
        if MODE == 1:
            tl.store(ScaleQ + pid_k * M + rows, scale, mask=row_ok)
    if WRITE_QT:
        qt, scale_t = quantize_block(x, amax_cols, 0, ROUND_IN_SOFTWARE)
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




# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
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


def scaled_mm_tiles_launch(a, a_scale, bt, bt_scale, b_tiles: bool, fast_accum: bool) -> torch.Tensor:
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
    [r % 32, (r // 32) * 4 + column]. Flat, contiguous, in the scales' dtype (NVFP4's e4m3 scales take
    the same layout; mx_quant_kernel's quantizers can write it directly, `swizzle=True`)."""
    R, B = scales.shape
    u = torch.nn.functional.pad(scales.view(torch.uint8), (0, -B % 4, 0, -R % 128))  # pad takes no e8m0
    tiles = u.view(u.shape[0] // 128, 128, u.shape[1] // 4, 4).permute(0, 2, 1, 3)  # [row tile, block tile, 128, 4]
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return swizzled.flatten().view(scales.dtype)


def dequantized_product(a_deq: torch.Tensor, bt_deq: torch.Tensor, scale=None) -> torch.Tensor:
    """a_deq @ bt_deq.T (times `scale`, [1] fp32) rounded to bf16: the emulated block-scaled matmul.

    The dequantized MXFP8 and NVFP4 operands (without NVFP4's tensor scale) are exact in bf16 (an e4m3
    or e2m1 value times a power of two or an e4m3 scale needs at most 8 significant bits), so on a
    GPU the product runs on bf16 tensor cores with fp32 accumulation, as a block-scaled matmul
    accumulates; the tensor scales multiply the bf16 result (one more bf16 rounding). On the CPU, an
    fp32 product rounded once."""
    if a_deq.device.type == "cuda":
        y = a_deq.to(torch.bfloat16) @ bt_deq.to(torch.bfloat16).t()
    else:
        y = a_deq.float() @ bt_deq.float().t()
    return (y if scale is None else y.float() * scale.float().reshape(())).to(torch.bfloat16)


def _dequantized_dtype(t: torch.Tensor) -> torch.dtype:
    """What the emulated matmul dequantizes to: bf16 on a GPU, where `dequantized_product` multiplies in bf16 (the
    same values as fp32 then cast, in half the bytes: mx_quant_kernel's dequantizers), fp32 on the CPU."""
    return torch.bfloat16 if t.device.type == "cuda" else torch.float32


def scaled_mm_nvfp4_launch(a, a_scale, bt, bt_scale, emulate: bool) -> torch.Tensor:
    """a [R, S/2] packed e2m1 @ b, bt [C, S/2] being b transposed, each with (block scales [rows, S/16] e4m3,
    tensor scale [1] fp32) (mx_quant_kernel.quantize_nvfp4): bf16 [R, C]. On Blackwell, torch._scaled_mm's
    NVFP4 matmul (swizzled block scales) times the two tensor scales; on the CPU or `emulate`, the
    dequantized product (`dequantized_product`)."""
    (sa, ga), (sb, gb) = a_scale, bt_scale
    if emulate or a.device.type == "cpu":
        dt = _dequantized_dtype(a)
        return dequantized_product(mxq.dequantize_nvfp4(a, sa, None, dtype=dt),
                                   mxq.dequantize_nvfp4(bt, sb, None, dtype=dt), ga * gb)
    fp4 = torch.float4_e2m1fn_x2
    y = torch._scaled_mm(a.view(fp4), bt.view(fp4).t(), mx_swizzled_scales(sa), mx_swizzled_scales(sb),
                         out_dtype=torch.bfloat16)
    return (y.float() * (ga * gb)).to(torch.bfloat16)


def scaled_mm_mx_launch(a, a_scale, bt, bt_scale, emulate: bool = False) -> torch.Tensor:
    """a [R, S] e4m3 @ b, bt [C, S] being b transposed and row-major, each with its MX scales [rows, S/32]
    (e8m0, `quantize_mx_ref`): bf16 [R, C]. On a GPU, torch._scaled_mm's MXFP8 matmul (block-scaled
    tensor cores: Blackwell), with both scales swizzled; on the CPU, the product of the dequantized
    operands in fp32, rounded once to bf16 (the reference). `check_fp8_device` compares the two once
    per GPU before training uses it (`_probe_scaled_mm`). `emulate` (Hopper, `--fp8-emulate`): the
    dequantized product on bf16 tensor cores (`dequantized_product`)."""
    if a.device.type == "cpu" or emulate:
        dt = _dequantized_dtype(a)
        return dequantized_product(mxq.dequantize_mxfp8(a, a_scale, dt), mxq.dequantize_mxfp8(bt, bt_scale, dt))
    return torch._scaled_mm(a.contiguous(), bt.contiguous().t(), mx_swizzled_scales(a_scale),
                            mx_swizzled_scales(bt_scale), out_dtype=torch.bfloat16)



# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile and opcheck see (fp8_linear_kernel.py says why)
# ------------------------------------------------------------------------------------------------
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
    """a [R, S] fp8 @ b, bt [C, S] being b transposed, with tensor or block scales (`scaled_mm_tiles_launch`)."""
    return scaled_mm_tiles_launch(a, a_scale, bt, bt_scale, b_tiles, fast_accum)


@fp8_scaled_mm_tiles_op.register_fake
def _(a, a_scale, bt, bt_scale, b_tiles, fast_accum):
    return a.new_empty((a.shape[0], bt.shape[0]), dtype=torch.bfloat16)



# ------------------------------------------------------------------------------------------------
# The autograd.Function, and its probe
# ------------------------------------------------------------------------------------------------
def _quant_tiles(x2, mode: str, rows: bool, cols: bool, ops: bool, amax=None):
    """`fp8_tiles_op` with its scales viewed (`natural_scales`), or the launcher."""
    if ops:
        if mode == "tensor" and amax is None:
            amax = fp8_rows_op(x2, False, True)[2].amax().reshape(1)
        return natural_scales(x2.shape, mode, rows, cols, *fp8_tiles_op(x2, mode, rows, cols, amax))
    return quantize_tiles(as_rows(x2), mode, rows, cols, amax)


_sr_seeds = itertools.count(1)  # a fresh Philox seed for each stochastically rounded gradient


def quant_operand(t2, scaling: str, weight: bool, rows: bool, cols: bool, ops: bool, amax=None, grad: bool = False,
                  four_over_six: bool = False):
    """t [M, K] quantized for the matmuls that reduce over K (rows: a copy like t) and for the one
    that reduces over M (cols: the transposed copy [K, M_pad]), each with its natural scales. Weights
    take 128x128 tiles in the block-wise recipe (one quantization serves both of their matmuls),
    activations and gradients 1x128 blocks; the MX recipe scales every operand in 1x32 blocks along
    the reduction, both copies from one read (mx_quant_kernel.quantize_mxfp8). NVFP4
    (mx_quant_kernel.quantize_nvfp4): weights in 16x16 tiles, activations and gradients in 1x16 blocks,
    the transposed copies (dW's operands) through the random Hadamard transform, gradients (`grad`)
    rounded stochastically; its scales are (block scales, tensor scale) pairs; `four_over_six` (the
    nvfp4-46 recipe): weights in 1x16 blocks too, weights and activations with Four Over Six block scales."""
    if scaling == "mx":  # while torch.compile traces: the references (plain PyTorch, the same bits)
        if ops:
            return (mxq.quantize_mxfp8_ref(t2) if rows else (None, None)) + (
                mxq.quantize_mxfp8_t_ref(t2) if cols else (None, None))
        return mxq.quantize_mxfp8(as_rows(t2), rows, cols)
    if scaling == "nvfp4":
        seed, signs = next(_sr_seeds) % 2**31 if grad else 0, None if weight else NVFP4_HADAMARD_SIGNS
        tiles, adaptive = weight and not four_over_six, four_over_six and not grad
        if ops:
            q, s, qt, st, g, gt = mxq.nvfp4_ref(t2, grad, seed, tiles, signs, adaptive)
        else:
            q, s, qt, st, g, gt = mxq.quantize_nvfp4(as_rows(t2), rows, cols, tiles=tiles, stochastic=grad, seed=seed,
                                                     hadamard=signs, adaptive=adaptive)
        return ((q, (s, g)) if rows else (None, None)) + ((qt, (st, gt)) if cols else (None, None))
    mode = "tensor" if scaling == "tensor" else "tile" if weight else "act"
    return _quant_tiles(t2, mode, rows, cols, ops, amax)


def mm_scaled(a, a_scale, bt, bt_scale, scaling: str, b_tiles: bool, fast_accum: bool, ops: bool,
              emulate: bool = False):
    """a @ bt.T for the tensor-wise, block-wise, MX and NVFP4 recipes: bf16 [rows of a, rows of bt]. The
    operands as `quant_operand` returns them (b_tiles: bt's scales are 128x128 tiles; ops: while
    torch.compile traces; emulate: the dequantized product). Public: LoRA's frozen base
    (fp8_lora_kernel.BlockScaledFrozenLinear) multiplies its stored copies with it."""
    if scaling == "mx":  # the same call in eager mode and under torch.compile (plain PyTorch, no launcher)
        return scaled_mm_mx_launch(a, a_scale, bt, bt_scale, emulate)
    if scaling == "nvfp4":
        return scaled_mm_nvfp4_launch(a, a_scale, bt, bt_scale, emulate)
    if ops:
        return fp8_scaled_mm_tiles_op(a, a_scale, bt, bt_scale, b_tiles, fast_accum)
    return scaled_mm_tiles_launch(a, a_scale, bt, bt_scale, b_tiles, fast_accum)


class Float8ScaledLinearFunction(torch.autograd.Function):
    """y = x W^T in FP8 with tensor-wise, block-wise or MX scales (`scaling`), forward and both
    gradient matmuls: the recipes tensorwise, blockwise and mxfp8.

    Each operand is quantized along the dimension its matmul reduces over: x and dy per row (1x128
    blocks, or one scale) for y and dx, and per column, transposed (128x1 blocks along the tokens) for
    dW; W in 128x128 tiles, which are blocks along K for y and along N for dx alike. Saved for
    backward: the weight Parameter (no copy; tensor-wise also its maximum, [1]), and x's transposed
    copy with its scales (`keep_fp8_input`; NVFP4's through the Hadamard transform, made in the forward's
    one read of x) or x itself.

    `handoff` (MXFP8 only, eager mode): the model's `Fp8Handoff` (fp8_producers_kernel.py). x's MXFP8
    copy along K (and its transposed copy, from the SwiGLU) then comes from the kernel that wrote x, if it
    left one (`Fp8Handoff.input_rows`); it is read, not taken, as q, k and v (gate and up) all multiply that
    one copy, and the backward empties the slot. The other recipes hand nothing between layers.
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, keep_fp8_input: bool, need_input_grad: bool,
                need_weight_grad: bool, scaling: str, ops: bool, emulate: bool = False, handoff=None,
                four_over_six: bool = False):
        keep_fp8 = keep_fp8_input and need_weight_grad
        w_amax = None
        if scaling == "tensor":  # the weight's maximum serves its backward copy too: one read fewer there
            w_amax = fp8_rows_op(weight, False, True)[2].amax().reshape(1) if ops else tensor_max(weight)
        if handoff is not None:
            handoff.start_forward()
        made = handoff.input_rows.share(x2) if handoff is not None and scaling == "mx" and not ops else None
        if made is not None:  # from the kernel that wrote x (a norm: the copy along K; the SwiGLU: both)
            xq, sx, *transposed = made
            if not keep_fp8:
                xqt = sxt = None
            elif transposed:
                xqt, sxt = transposed
            else:
                xqt, sxt = quant_operand(x2, scaling, False, False, True, ops, four_over_six=four_over_six)[2:]
        else:
            xq, sx, xqt, sxt = quant_operand(x2, scaling, False, True, keep_fp8, ops, four_over_six=four_over_six)
        wq, sw, _, _ = quant_operand(weight, scaling, True, True, False, ops, w_amax, four_over_six=four_over_six)
        # Fast accumulation in the forward only, as in the row-wise recipe; not with 1x128 blocks,
        # whose point is the precision of each block's partial sum.
        fast = scaling == "tensor" and fast_accum_allowed(x2.device)
        y = mm_scaled(xq, sx, wq, sw, scaling, True, fast, ops, emulate)
        # NVFP4's scales are (block scales, tensor scale) pairs: saved as two tensors, paired again in backward
        saved = ((xqt, *sxt) if scaling == "nvfp4" else (xqt, sxt)) if keep_fp8 else (x2,) if need_weight_grad else ()
        ctx.keep_fp8, ctx.scaling, ctx.ops, ctx.n_saved, ctx.emulate = keep_fp8, scaling, ops, len(saved), emulate
        ctx.handoff, ctx.four_over_six = handoff, four_over_six
        ctx.save_for_backward(weight, *((w_amax,) if w_amax is not None else ()), *saved)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        refuse_create_graph()
        weight, *rest = ctx.saved_tensors
        saved = rest[len(rest) - ctx.n_saved:]
        w_amax = rest[0] if len(rest) > ctx.n_saved else None
        need_dx, need_dw = ctx.needs_input_grad[:2]
        scaling, ops, four = ctx.scaling, ctx.ops, ctx.four_over_six
        if ctx.handoff is not None:
            ctx.handoff.start_backward()  # the forward's shared copies are not needed any more
        dy2 = as_rows(dy)
        dyq, sdy, dyqt, sdyt = quant_operand(dy2, scaling, False, need_dx, need_dw, ops, grad=True, four_over_six=four)
        dx = dw = None
        if need_dx:  # dx = dy W: b = W, column-major, i.e. W^T row-major, in blocks along N
            _, _, wqt, swt = quant_operand(weight, scaling, True, False, True, ops, w_amax, four_over_six=four)
            dx = mm_scaled(dyq, sdy, wqt, swt, scaling, True, False, ops, ctx.emulate).to(dy.dtype)
        if need_dw:  # dW = dy^T x: both transposed copies, reduced over the (zero-padded) tokens
            if ctx.keep_fp8:
                xqt, sxt = (saved[0], tuple(saved[1:])) if scaling == "nvfp4" else saved
            else:
                xqt, sxt = quant_operand(saved[0], scaling, False, False, True, ops, four_over_six=four)[2:]
            dw = mm_scaled(dyqt, sdyt, xqt, sxt, scaling, False, False, ops, ctx.emulate).to(weight.dtype)
        return dx, dw, None, None, None, None, None, None, None, None


def probe_scaled_mm(device: torch.device, scaling: str) -> None:
    """Check the scaling's transposing quantizers (`TRANSPOSING`), then run the scaled matmuls it needs on
    tiny operands (RuntimeError if PyTorch refuses one); the tensor, block, MX and NVFP4 scalings
    (an emulated one, "mx-emulated" or "nvfp4-emulated", runs its dequantized products).

    Block-wise and MXFP8: the three matmuls of a layer (block-wise: 1x128 x 128x128 for y and dx,
    1x128 x 1x128 for dW; MXFP8: 1x32 x 1x32 for all three) on random operands (254 tokens, 512 ->
    1024 features), each against the product of its dequantized operands; a result off by more than
    bf16's rounding means that this PyTorch reads the scales in another layout."""
    emulate = scaling.endswith("-emulated")
    scaling = scaling.removesuffix("-emulated")
    fp8_support.check_copies(device, TRANSPOSING[scaling])
    if scaling == "tensor":
        a, one = torch.ones((ALIGN, ALIGN), device=device).to(FP8_DTYPE), torch.ones(1, device=device)
        for flag in {fast_accum_allowed(device), False}:
            scaled_mm_tiles_launch(a, one, a, one, False, flag)
        return
    g = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(shape, device=device, generator=g).to(torch.bfloat16) for shape in ((254, 512), (254, 1024)))
    w = torch.randn((1024, 512), device=device, generator=g).to(torch.bfloat16)
    if scaling in ("mx", "nvfp4"):
        (xq, sx, xqt, sxt), (dyq, sdy, dyqt, sdyt), (wq, sw, wqt, swt) = (
            quant_operand(t, scaling, t is w, True, True, False) for t in (x, dy, w))
        launch = scaled_mm_mx_launch if scaling == "mx" else scaled_mm_nvfp4_launch
    else:
        xq, sx, xqt, sxt = quantize_tiles(x, "act", True, True)
        wq, sw, wqt, swt = quantize_tiles(w, "tile", True, True)
        dyq, sdy, dyqt, sdyt = quantize_tiles(dy, "act", True, True)
        launch = scaled_mm_tiles_launch
    for what, a, sa, bt, sbt, tiles in (("y", xq, sx, wq, sw, True), ("dx", dyq, sdy, wqt, swt, True),
                                        ("dW", dyqt, sdyt, xqt, sxt, False)):
        if scaling == "nvfp4":
            got = launch(a, sa, bt, sbt, emulate).float()
            want = mxq.dequantize_nvfp4(a, *sa) @ mxq.dequantize_nvfp4(bt, *sbt).t()
        else:
            got = (launch(a, sa, bt, sbt, emulate) if scaling == "mx" else launch(a, sa, bt, sbt, tiles, False)).float()
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


# The tile kernel's modes that store a tensor transposed, per scaling, as (what, function of x, reference):
# checked once per GPU (fp8_support.check_copies says why).
def _tile_reference(mode: str):
    """The plain-PyTorch references of the tile kernel's copies of x [M, K] in `mode`: (q, scales, qT, scales)."""
    def reference(x):
        xt = torch.nn.functional.pad(x.float(), (0, 0, 0, tile_rows(x.shape[0], mode) - x.shape[0])).t()
        if mode == "tensor":
            return (*quantize_tensor_ref(x), *quantize_tensor_ref(xt))
        block = (TILE, TILE) if mode == "tile" else (1, TILE)
        return (*quantize_blocks_ref(x, *block), *quantize_blocks_ref(xt, *block))
    return reference


def _bytes(copies):
    """(q, scales, qT, scales) with every tensor viewed as bytes (check_copies compares them with torch.equal)."""
    return tuple(None if t is None else t.contiguous().view(torch.uint8) for t in copies)


TRANSPOSING = {
    "tensor": (("tile kernel, tensor scale", lambda x: quantize_tiles(x, "tensor", True, True),
                _tile_reference("tensor")),
               ("tile kernel, tensor scale, transposed only", lambda x: quantize_tiles(x, "tensor", False, True),
                _tile_reference("tensor"))),
    "block": (("tile kernel, 1x128 blocks", lambda x: quantize_tiles(x, "act", True, True), _tile_reference("act")),
              ("tile kernel, 1x128 blocks, transposed only", lambda x: quantize_tiles(x, "act", False, True),
               _tile_reference("act")),
              ("tile kernel, 128x128 tiles, transposed only", lambda x: quantize_tiles(x, "tile", False, True),
               _tile_reference("tile"))),
    "mx": (("MXFP8 kernel, both copies", lambda x: _bytes(mxq.quantize_mxfp8(x, True, True)),
            lambda x: _bytes(mxq.quantize_mxfp8_ref(x) + mxq.quantize_mxfp8_t_ref(x))),
           ("MXFP8 kernel, transposed only", lambda x: _bytes(mxq.quantize_mxfp8(x, False, True)),
            lambda x: _bytes((None, None) + mxq.quantize_mxfp8_t_ref(x)))),
    "nvfp4": (("NVFP4 kernel, both copies, Hadamard", lambda x: _bytes(mxq.quantize_nvfp4(
                  x, True, True, hadamard=NVFP4_HADAMARD_SIGNS)[:4]),
               lambda x: _bytes(mxq.nvfp4_ref(x, hadamard=NVFP4_HADAMARD_SIGNS)[:4])),
              ("NVFP4 kernel, 16x16 tiles, both copies",  # (weights: whole tiles, so the rows cut to 16s)
               lambda x: _bytes(mxq.quantize_nvfp4(x[:x.shape[0] // 16 * 16], True, True, tiles=True)[:4]),
               lambda x: _bytes(mxq.nvfp4_ref(x[:x.shape[0] // 16 * 16], tiles=True)[:4]))),
}


# ------------------------------------------------------------------------------------------------
# Every recipe: checks, the functional API, the layer and patching a model
# ------------------------------------------------------------------------------------------------
def check_fp8_device(device: torch.device, recipe: str = DEFAULT_RECIPE) -> None:
    """Refuse, in one line, a device that cannot run the recipe (core.fp8_support.check_device: the
    per-GPU gates, then once per GPU and scaling the recipe's probe): fp8_linear_kernel.check_fp8_device for
    the row-wise recipes, `probe_scaled_mm` for the others."""
    if get_recipe(recipe).scaling == "row":
        return fp8_linear_kernel.check_fp8_device(device, recipe)
    fp8_support.check_device(device, recipe, probe_scaled_mm)


@torch.compiler.disable
def _fp8_linear_eager(x, weight, bias, keep_fp8_input, handoff, recipe):
    return fp8_linear(x, weight, bias, keep_fp8_input, handoff, recipe)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               keep_fp8_input: bool = True, handoff=None, recipe: str = DEFAULT_RECIPE) -> torch.Tensor:
    """fp8_linear_kernel.fp8_linear for every recipe of `RECIPES`: the row-wise ones there, the others
    (`Float8ScaledLinearFunction`) here, where `handoff` serves MXFP8 only (the others hand nothing over)."""
    r = get_recipe(recipe)
    if r.scaling == "row":
        return fp8_linear_kernel.fp8_linear(x, weight, bias, keep_fp8_input, handoff, recipe)
    if torch.compiler.is_compiling() and not compiled_graph_trusted(x.device):
        return _fp8_linear_eager(x, weight, bias, keep_fp8_input, handoff, recipe)
    return linear_frame(x, weight, bias, recipe, check_fp8_device, lambda x2, need_dx, need_dw, ops: (
        Float8ScaledLinearFunction.apply(x2, weight, keep_fp8_input, need_dx, need_dw, r.scaling, ops, r.emulated,
                                         None if ops else handoff, r.four_over_six)))


class Float8ScaledLinear(Float8Linear):
    """Float8Linear for the tensor-wise, block-wise and MX recipes (`fp8_linear` above)."""

    scalings = ("tensor", "block", "mx", "nvfp4")

    @staticmethod
    def check_device(device: torch.device, recipe: str) -> None:
        check_fp8_device(device, recipe)

    def linear(self, x, weight, bias, keep_fp8_input: bool, handoff) -> torch.Tensor:
        return fp8_linear(x, weight, bias, keep_fp8_input, handoff, self.recipe)


def layer_class(recipe: str) -> type:
    """The layer that runs the recipe: Float8Linear (row-wise) or Float8ScaledLinear."""
    return Float8Linear if get_recipe(recipe).scaling in Float8Linear.scalings else Float8ScaledLinear


def bf16_layers(model: nn.Module, recipe: str) -> set:
    """ids of the projection owners (attention and MLP blocks) that the recipe keeps in bf16: those of
    the first and the last layers `fp8_support.bf16_layer_counts` names, in the order the model holds them."""
    layers = [m for m in model.modules() if isinstance(m, family_classes("DecoderLayer"))]
    first, last = fp8_support.bf16_layer_counts(recipe, len(layers))
    if not first and not last:
        return set()
    kept = layers[:first] + layers[max(first, len(layers) - last):]
    return {id(m) for layer in kept for m in layer.modules()}



# The scalings whose layers take an `Fp8Handoff`: row-wise (shared copies, maxima, the norms' row copies)
# and MXFP8 (the norms' MXFP8 copies, fp8_producers_kernel.rmsnorm_quantize_mxfp8)
HANDS_OVER = ("row", "mx")


def patch_model(model: nn.Module, recipe: str = DEFAULT_RECIPE, sizes: str = "all", handoff=None) -> int:
    """fp8_linear_kernel.patch_model for every recipe: each projection becomes the recipe's layer
    (`layer_class`), the decoder layers the recipe keeps in bf16 (`bf16_layers`) keep nn.Linear, and
    `handoff` (row-wise and MXFP8 recipes only: `HANDS_OVER`) is shared by the converted layers. Returns how
    many run in FP8."""
    shared = handoff if get_recipe(recipe).scaling in HANDS_OVER else None
    return fp8_linear_kernel.patch_model(model, recipe, sizes, shared,
                                         layer_class(recipe), bf16_layers(model, recipe))


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------
def quantize_tensor_ref(x: torch.Tensor):
    """Plain PyTorch: (q [M, K] float8_e4m3fn, scale [1] fp32), one scale for the whole tensor."""
    xf = x.float()
    q, scale = quantize_with(xf, abs_max(xf, (0, 1)).reshape(1, 1) if xf.numel() else xf.new_full((1, 1), AMAX_FLOOR))
    return q, scale.reshape(1)


def quantize_blocks_ref(x: torch.Tensor, block_rows: int, block_cols: int):
    """Plain PyTorch: (q [M, K] float8_e4m3fn, scales [M / block_rows, K / block_cols] fp32), one scale
    per block (1 x 128: activations; 128 x 128: weights). x's shape must be a multiple of the block."""
    M, K = x.shape
    xf = x.float().view(M // block_rows, block_rows, K // block_cols, block_cols)
    amax = abs_max(xf, (1, 3))
    q, scale = quantize_with(xf, amax[:, None, :, None])
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
    float8_e8m0fnu), one power-of-two scale per `block` consecutive values of a row; K a multiple of
    the block (ValueError otherwise). mx_quant_kernel.quantize_mxfp8_ref, whose docstring gives the rules
    (the smallest power of two 2^e with amax <= 448 * 2^e, NaN and infinite blocks) and whose kernel
    the recipe runs."""
    M, K = x.shape
    if K % block or block != MX_BLOCK:
        raise ValueError(f"MX blocks of {MX_BLOCK}: the row length {K} must be a multiple of {MX_BLOCK}")
    return mxq.quantize_mxfp8_ref(x)


def mx_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The forward y = x W^T of the recipe mxfp8 in plain PyTorch: x [M, K] and W [N, K] quantized in
    1x32 blocks along K (`quantize_mx_ref`; K a multiple of 32, ValueError otherwise), dequantized, and
    multiplied in fp32 (the layer rounds this product once to bf16)."""
    xq, sx = quantize_mx_ref(x)
    wq, sw = quantize_mx_ref(weight)
    return dequantize_blocks(xq, sx) @ dequantize_blocks(wq, sw).t()
