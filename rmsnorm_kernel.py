"""Fused RMSNorm in Triton: forward and backward, with Hugging Face LlamaRMSNorm's numerics.

    y = x / sqrt(mean(x^2, last dim) + eps) * weight

What you build here: a forward kernel that reads x once and writes y once, and a backward kernel
that reads dy and x once and writes dx once, while summing the weight gradient on the fly.
What you learn: programs and blocks, masks, fp32 accumulation, persistent (grid-stride) kernels,
how a reduction over rows (the weight gradient) is done without a [rows, hidden] buffer, and how
a kernel becomes a PyTorch operator that torch.compile treats as one opaque node.

Count the bytes before timing anything
--------------------------------------
Hugging Face writes RMSNorm as seven PyTorch ops. For a bf16 input of N rows x H columns, each op
is one kernel that reads its inputs from GPU memory and writes its output back (bytes per element
in brackets; fp32 is 4 bytes, bf16 2):

    a = x.to(torch.float32)          # read 2, write 4
    b = a.pow(2)                     # read 4, write 4
    v = b.mean(-1, keepdim=True)     # read 4           (writes N values: negligible)
    r = torch.rsqrt(v + eps)         #                  (N values)
    c = a * r                        # read 4, write 4
    d = c.to(torch.bfloat16)         # read 4, write 2
    y = weight * d                   # read 2, write 2
                                     # forward: 36 bytes per element

Autograd then runs the backward of each op (dy*w, the bf16->fp32 cast, the two products and the
reduction of the normalisation, pow, the sum of the two paths to x, the cast back to bf16, and
dy*d summed over rows for the weight): about 76 more bytes per element.

The fused kernels move only what they must: forward reads x (2) and writes y (2); backward reads
dy (2) and x (2) and writes dx (2). That is 4 bytes per element forward and 10 forward+backward,
against about 36 and 112: a 9x and an 11x cut in traffic. RMSNorm does ~4 flops per element, so
it is memory-bound, and the traffic *is* the time. Add the weight (read once forward; read once
and its gradient written once backward) and you have `ideal_bytes(n_rows, hidden, dtype,
backward)`, the floor that `benchmark_kernels.py` measures against. Left out: the fp32 inverse RMS
(4 bytes per row written forward and read backward: 0.02% at H = 4096) and the fp32 partial sums
of the weight gradient (a few MB), which are this implementation's choices, not the problem's.

The floor for LLaMA 3.1 8B shapes (16384 tokens x 4096 hidden, bf16) on an H200, whose measured
device-to-device copy bandwidth is ~4.27 TB/s (bytes read + written):
    forward            ideal_bytes(16384, 4096, bf16)                = 268,443,648 B ->  63 us
    forward + backward ideal_bytes(16384, 4096, bf16, backward=True) = 671,113,216 B -> 157 us
`benchmark_kernels.py --kernel rmsnorm` measures how close the kernels come.

Three options, for the families that need them
----------------------------------------------
- `offset`: the weight is applied as (offset + weight). Gemma stores its norm weights around 0 and
  uses offset=1.0; LLaMA uses 0.0. The sum is formed in fp32 inside the kernel.
- `casting_mode`: where the result is rounded to a low-precision dtype.
      "llama"  normalise in fp32, round to the input dtype, then multiply by the weight (LlamaRMSNorm;
               the output has the dtype `weight * x` would have)
      "gemma"  everything in fp32, the weight multiply included, rounded once (GemmaRMSNorm; the
               output has the input's dtype)
      "none"   the input dtype throughout: the inverse RMS, the normalised value, the weight and the
               product are each rounded to it, as a norm written without `.float()` computes them.
               Only the sum of squares stays fp32 (PyTorch's own reduction does the same).
  The backward pass computes in fp32 in every mode, and its weight gradient multiplies dy by the
  normalised value as the forward pass rounded it.
- `in_place`: the backward kernel writes dx over dy's memory, saving one [rows, H] buffer. That is
  safe only when nothing else reads this dy afterwards, which depends on the graph around the norm,
  not on the norm: see `rmsnorm` for when it is not allowed.
All three are `tl.constexpr` in the kernels, so the default (offset 0, "llama", out of place)
compiles to exactly the code it did before they existed, and each other choice to its own binary.

The host's share
----------------
Without a CUDA graph the GPU can only run what the host has queued: a call whose Python, dispatch
and launches take longer than its ~180 us of kernels leaves the GPU waiting, and the host time is the
time. So launch settings are computed once per hidden size, a frozen weight allocates no partial
sums, and an eager call reaches the launchers through a plain autograd.Function instead of the
custom operators, whose dispatch costs host time on every call (see "The eager path" below).
`benchmark_kernels.py` reports host microseconds per call beside the GPU times.

Layout of this file: kernels -> launchers -> custom ops (PyTorch operators, with their autograd)
-> the eager path (an autograd.Function over the launchers) -> functional API -> module and
`patch_model` -> reference.
"""

import functools
import math

import torch
from torch import nn

from core.kernel_utils import (as_rows, check_device, check_float, direct_launch, next_power_of_2, num_sms,
                                   refuse_double_backward)
from core.model_families import family, family_classes

import triton
import triton.language as tl

MAX_HIDDEN = 65536  # one row must fit in one program's registers (64 fp32 values per thread)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
# A Triton kernel is written for one *program*: the GPU runs many programs (a "grid") in
# parallel, each on its own tile of data. `tl.program_id(0)` says which tile is ours. Values
# like `tl.arange(0, BLOCK_H)` are whole blocks of numbers that Triton spreads over the threads
# of the program; every arithmetic line below works on a block at once.
@triton.jit
def normalize_rows(x, W, cols, col_ok, H, eps, OFFSET: tl.constexpr, CASTING: tl.constexpr):
    """(y, rstd) of a loaded block of whole rows x [BLOCK_M, BLOCK_H]: y in fp32, to be stored in the
    output dtype, and the fp32 inverse RMS per row. One function for the forward kernel below and for
    fp8_producers_kernel.py's RMSNorm that also writes its output's FP8 copy, so both compute the same bits."""
    xf = x.to(tl.float32)  # accumulate in fp32 whatever the input dtype
    mean_sq = tl.sum(xf * xf, axis=1) / H  # [BLOCK_M]: a reduction along the row
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    if CASTING == "none":
        rstd = rstd.to(x.dtype).to(tl.float32)  # the input dtype throughout: round every step

    if CASTING == "gemma":
        # GemmaRMSNorm: the weight multiply in fp32 too, one rounding at the end.
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
        y = xf * rstd[:, None] * w[None, :]
    else:
        # Hugging Face's LLaMA order of operations: normalise in fp32, round to the input dtype,
        # *then* multiply by the weight. Rounding first keeps our output bit-compatible with
        # LlamaRMSNorm. ("none" rounds the weight and the product to the input dtype as well.)
        x_hat = (xf * rstd[:, None]).to(x.dtype)
        w = tl.load(W + cols, mask=col_ok, other=0.0)
        if CASTING == "none":
            w = w.to(x.dtype)
        if OFFSET != 0.0:
            w = w.to(tl.float32) + OFFSET
            if CASTING == "none":
                w = w.to(x.dtype)
        y = x_hat.to(tl.float32) * w.to(tl.float32)[None, :]
        if CASTING == "none":
            y = y.to(x.dtype)
    return y, rstd


@triton.jit
def _rmsnorm_fwd(
    X,  # pointer to the input, [n_rows, H], unit stride along H
    W,  # pointer to the weight, [H]
    Y,  # pointer to the output, [n_rows, H], contiguous
    Rstd,  # pointer to the saved inverse RMS, [n_rows], fp32
    stride_x,  # elements between two rows of X
    stride_y,  # elements between two rows of Y
    n_rows,  # number of rows
    H,  # hidden size (row length)
    eps,  # added to the mean square before the square root
    BLOCK_M: tl.constexpr,  # rows per program (several when H is small, to keep programs busy)
    BLOCK_H: tl.constexpr,  # power of two >= H (blocks must have power-of-two sizes)
    OFFSET: tl.constexpr,  # the weight is applied as OFFSET + w (0.0, or 1.0 for Gemma)
    CASTING: tl.constexpr,  # "llama", "gemma" or "none": where the result is rounded
):
    # `tl.constexpr` arguments are known when the kernel is compiled: Triton builds one binary
    # per distinct value, so block shapes can depend on them, and an `if` on them is resolved at
    # compile time (the branches not taken leave no trace in the binary).
    pid = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 on big tensors
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row indices of this program
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H] column indices
    row_ok = rows < n_rows
    col_ok = cols < H
    # A mask switches off the lanes past the end of the data: masked loads return `other`,
    # masked stores write nothing. This is how a power-of-two block covers H = 4097 or 1.
    mask = row_ok[:, None] & col_ok[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y, rstd = normalize_rows(x, W, cols, col_ok, H, eps, OFFSET, CASTING)
    tl.store(Rstd + rows, rstd, mask=row_ok)  # 4 bytes per row, kept for the backward pass
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd(
    DY,  # pointer to the upstream gradient, [n_rows, H], unit stride along H
    X,  # pointer to the saved input, [n_rows, H]
    W,  # pointer to the weight, [H]
    Rstd,  # pointer to the saved inverse RMS, [n_rows], fp32
    DX,  # pointer to the input gradient, [n_rows, H] (may be DY itself: see `in_place`)
    DW_partial,  # pointer to fp32 partial weight gradients, [n_programs, H]
    stride_dy,  # elements between two rows of DY
    stride_x,  # elements between two rows of X
    stride_dx,  # elements between two rows of DX
    n_rows,  # number of rows
    H,  # hidden size
    BLOCK_M: tl.constexpr,  # rows handled per loop iteration
    BLOCK_H: tl.constexpr,  # power of two >= H
    COMPUTE_DW: tl.constexpr,  # False when the weight does not require a gradient
    OFFSET: tl.constexpr,  # the weight is applied as OFFSET + w
    CASTING: tl.constexpr,  # "llama", "gemma" or "none", as in the forward pass
):
    # This kernel is *persistent*: the grid has only a few programs per SM, and each program
    # walks over row blocks pid, pid + n_programs, pid + 2 * n_programs, ... (a grid-stride loop).
    # That lets every program keep a running sum of its rows' weight gradient in registers and
    # write it once at the end: n_programs x H partial sums instead of a [rows, H] buffer.
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    if CASTING == "none":
        w = w.to(X.dtype.element_ty)  # the weight as the forward pass rounded it
    w = w.to(tl.float32)
    if OFFSET != 0.0:
        w += OFFSET
        if CASTING == "none":
            w = w.to(X.dtype.element_ty).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)

    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    # Software pipelining by hand: load the first row block, then in each iteration issue the
    # loads of the *next* block before computing this one, so that memory is always busy.
    # (When DX is DY, each program overwrites only rows it has already read: the prefetch reads
    # the next block, never one that was written.)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x_next = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    for i in range(0, tl.cdiv(n_blocks - pid, n_programs)):
        block = pid + i * n_programs  # int64, since pid is
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = x_next
        dy = dy_next.to(tl.float32)
        rows_n = rows + n_programs * BLOCK_M  # the next block of this program (masked past the end)
        mask_n = (rows_n < n_rows)[:, None] & col_ok[None, :]
        x_next = tl.load(X + rows_n[:, None] * stride_x + cols[None, :], mask=mask_n, other=0.0)
        dy_next = tl.load(DY + rows_n[:, None] * stride_dy + cols[None, :], mask=mask_n, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)

        xf = x.to(tl.float32)
        x_hat = xf * rstd[:, None]
        # y = w * x_hat, x_hat = x * rstd(x). With g = dy * w, the chain rule gives
        #     dx = rstd * (g - x_hat * mean(g * x_hat))
        g = dy * w[None, :]
        c = tl.sum(g * x_hat, axis=1) / H
        dx = rstd[:, None] * (g - x_hat * c[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

        if COMPUTE_DW:
            # dW = sum over rows of dy * x_hat, with x_hat as the forward pass multiplied it by the
            # weight: rounded to the input dtype ("llama", "none") or not ("gemma"). Masked rows
            # loaded dy = 0, so they add nothing.
            if CASTING == "gemma":
                dw_acc += tl.sum(dy * x_hat, axis=0)
            else:
                dw_acc += tl.sum(dy * x_hat.to(x.dtype).to(tl.float32), axis=0)

    if COMPUTE_DW:
        tl.store(DW_partial + pid * H + cols, dw_acc, mask=col_ok)


# ------------------------------------------------------------------------------------------------
# Launchers: validate, pick block sizes and grid, launch
# ------------------------------------------------------------------------------------------------
# Launch settings, from `benchmark_kernels.py --tune` on an H100 and an H200 at 16384 x 4096: ~4096
# values per program (forward) or per loop iteration (backward), 16 values per thread (8 warps for
# H = 4096), two persistent backward programs per SM. At 16 warps the forward lost 8% on the
# H200 and the backward 12%; one program per SM left the backward at half the copy bandwidth.
FWD_TARGET_ELEMENTS = 4096
BWD_TARGET_ELEMENTS = 4096
BWD_PROGRAMS_PER_SM = 2


def _block_rows(block_h: int, target_elements: int) -> int:
    """Rows per program (or per loop iteration) so that it handles about `target_elements`."""
    return max(1, min(16, target_elements // block_h))


def _num_warps(elements: int, values_per_thread: int = 16) -> int:
    """Warps of 32 threads for `elements` values per program, 1 to 32 of them."""
    return max(1, min(32, elements // (32 * values_per_thread)))


def output_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, casting_mode: str) -> torch.dtype:
    """"llama": the dtype `weight * x` would give; "gemma" and "none": the input's."""
    return torch.promote_types(x_dtype, w_dtype) if casting_mode == "llama" else x_dtype


# The launch decisions depend only on the hidden size (and the device, for the persistent grid), so
# they are made once per size and remembered: a training step calls the norm 65 times with one H.
@functools.lru_cache(maxsize=None)
def fwd_settings(H: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_M, num_warps) of the forward kernel for rows of H values."""
    block_h = next_power_of_2(H)
    block_m = _block_rows(block_h, FWD_TARGET_ELEMENTS)
    return block_h, block_m, _num_warps(block_m * block_h)


@functools.lru_cache(maxsize=None)
def _bwd_settings(H: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_M, num_warps, most programs) of the persistent backward kernel."""
    block_h = next_power_of_2(H)
    block_m = _block_rows(block_h, BWD_TARGET_ELEMENTS)
    num_warps = _num_warps(block_m * block_h)
    # Two programs of 32 warps would need two SMs' worth of threads: then keep one per SM, or the
    # persistent grid would run in two waves (seen at H = 16384: half the bandwidth).
    programs_per_sm = 1 if num_warps >= 32 else BWD_PROGRAMS_PER_SM
    return block_h, block_m, num_warps, num_sms(device) * programs_per_sm


def rmsnorm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                    casting_mode: str = "llama", block_m: int | None = None, num_warps: int | None = None,
                    out_shape: torch.Size | None = None):
    """x2: [rows, H] with unit stride along H. Returns y [rows, H] and rstd [rows] (fp32).

    `out_shape`: allocate y in this shape instead (the caller's x.shape, rows x H elements), so that
    the caller can return y itself rather than a view of it."""
    n_rows, H = x2.shape
    y = torch.empty(out_shape if out_shape is not None else (n_rows, H),
                    dtype=output_dtype(x2.dtype, weight.dtype, casting_mode), device=x2.device)
    y2 = y.view(n_rows, H) if out_shape is not None else y
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows == 0:
        return y, rstd
    if block_m is None and num_warps is None:
        block_h, block_m, num_warps = fwd_settings(H)
    else:  # settings chosen by the caller (benchmark_kernels.py --tune)
        block_h = next_power_of_2(H)
        block_m = block_m or _block_rows(block_h, FWD_TARGET_ELEMENTS)
        num_warps = num_warps or _num_warps(block_m * block_h)
    grid = (-(-n_rows // block_m),)  # plain integers: triton.cdiv is a Triton function, slower to call
    _rmsnorm_fwd[grid](
        x2, weight, y2, rstd,
        x2.stride(0), y2.stride(0), n_rows, H, eps,
        BLOCK_M=block_m, BLOCK_H=block_h, OFFSET=float(offset), CASTING=casting_mode, num_warps=num_warps,
    )
    return y, rstd


def rmsnorm_backward(dy2, x2, weight, rstd, need_dw: bool, offset: float = 0.0, casting_mode: str = "llama",
                     dx: torch.Tensor | None = None, programs_per_sm: int | None = None,
                     block_m: int | None = None, num_warps: int | None = None):
    """Gradients for x (same dtype as x) and, if `need_dw`, for the weight (weight's dtype).

    `dx`: where to write the input gradient, [rows, H] with unit stride along H (by default a new
    tensor). Passing `dy2` itself makes the backward in place.
    """
    n_rows, H = x2.shape
    if dx is None:
        dx = torch.empty((n_rows, H), dtype=x2.dtype, device=x2.device)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if need_dw else None
        return dx, dw
    if programs_per_sm is None and block_m is None and num_warps is None:
        block_h, block_m, num_warps, max_programs = _bwd_settings(H, x2.device)
    else:  # settings chosen by the caller (benchmark_kernels.py --tune)
        block_h = next_power_of_2(H)
        block_m = block_m or _block_rows(block_h, BWD_TARGET_ELEMENTS)
        num_warps = num_warps or _num_warps(block_m * block_h)
        max_programs = num_sms(x2.device) * (programs_per_sm or (1 if num_warps >= 32 else BWD_PROGRAMS_PER_SM))
    n_programs = min(-(-n_rows // block_m), max_programs)
    # Partial sums in fp32, one row per program: at most ~264 x H x 4 bytes, a few MB. A frozen
    # weight (LoRA) needs none: the kernel then never touches the pointer, and rstd stands in.
    dw_partial = torch.empty((n_programs, H), dtype=torch.float32, device=x2.device) if need_dw else rstd
    _rmsnorm_bwd[(n_programs,)](
        dy2, x2, weight, rstd, dx, dw_partial,
        dy2.stride(0), x2.stride(0), dx.stride(0), n_rows, H,
        BLOCK_M=block_m, BLOCK_H=block_h, COMPUTE_DW=need_dw, OFFSET=float(offset), CASTING=casting_mode,
        num_warps=num_warps,
    )
    # The final reduction over programs is a tiny, deterministic torch.sum (no atomics).
    dw = dw_partial.sum(dim=0).to(weight.dtype) if need_dw else None
    return dx, dw


CASTING_MODES = ("llama", "gemma", "none")


def check_inputs(x: torch.Tensor, weight: torch.Tensor, offset: float = 0.0, casting_mode: str = "llama") -> None:
    check_float("x", x)
    check_float("weight", weight)
    check_device(x, weight)
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D [hidden], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"x's last dimension must equal the weight's size {weight.shape[0]}, got x of shape {tuple(x.shape)}"
        )
    if not 1 <= weight.shape[0] <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be between 1 and {MAX_HIDDEN}, got {weight.shape[0]}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {', '.join(map(repr, CASTING_MODES))}, got {casting_mode!r}")
    if not math.isfinite(offset):
        raise ValueError(f"offset must be a finite number, got {offset}")


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile, opcheck and FSDP see
# ------------------------------------------------------------------------------------------------
# Each launcher becomes a PyTorch operator (`torch.ops.playbook.rmsnorm_fwd` and `..._bwd`). To
# torch.compile an operator is one opaque node: Dynamo never traces into the Triton launch code.
# `register_fake` gives the compiler the outputs' shapes, dtypes and strides without running
# anything; `register_autograd` ties the forward operator to the backward one. The operators take
# [rows, H] matrices with unit stride along H (the functional API below flattens for them).
@torch.library.custom_op("playbook::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                   casting_mode: str = "llama", in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, H], weight [H] -> y [rows, H], rstd [rows] (fp32).

    `in_place` changes nothing here: it is an input so that the backward can read it."""
    return rmsnorm_forward(as_rows(x), weight.contiguous(), eps, offset, casting_mode)


@rmsnorm_fwd_op.register_fake
def _(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False):
    y = x.new_empty(x.shape, dtype=output_dtype(x.dtype, weight.dtype, casting_mode))
    return y, x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("playbook::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                   need_dw: bool, offset: float = 0.0,
                   casting_mode: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """dx [rows, H] and dW [H] (an empty tensor when not `need_dw`: an operator returns tensors)."""
    dx, dw = rmsnorm_backward(as_rows(dy), as_rows(x), weight.contiguous(), rstd, need_dw, offset, casting_mode)
    return dx, dw if need_dw else weight.new_empty(0)


@rmsnorm_bwd_op.register_fake
def _(dy, x, weight, rstd, need_dw, offset=0.0, casting_mode="llama"):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if need_dw else 0)


# The in-place backward is an operator of its own that *declares* that it writes into dy
# (`mutates_args`): an operator's output may not alias its input, and a write that PyTorch is not
# told about would go unseen by torch.compile and by autograd's checks of saved tensors.
@torch.library.custom_op("playbook::rmsnorm_bwd_in_place", mutates_args=("dy",))
def rmsnorm_bwd_in_place_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                            need_dw: bool, offset: float = 0.0, casting_mode: str = "llama") -> torch.Tensor:
    """Writes dx over dy (contiguous [rows, H], x's dtype); returns dW (empty when not `need_dw`)."""
    _, dw = rmsnorm_backward(dy, as_rows(x), weight.contiguous(), rstd, need_dw, offset, casting_mode, dx=dy)
    return dw if need_dw else weight.new_empty(0)


@rmsnorm_bwd_in_place_op.register_fake
def _(dy, x, weight, rstd, need_dw, offset=0.0, casting_mode="llama"):
    return weight.new_empty(weight.shape if need_dw else 0)


def _setup_context(ctx, inputs, output):
    x, weight, _, offset, casting_mode, in_place = inputs
    ctx.save_for_backward(x, weight, output[1])  # x, not y: the backward needs x and rstd
    ctx.mark_non_differentiable(output[1])
    ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place


def _can_overwrite(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """dx may be written over dy when dy has dx's dtype and its own dense memory (not an expanded,
    stride-0 gradient, whose rows share memory), and when this backward is not itself being
    differentiated (`create_graph=True`: then the out-of-place operator refuses, clearly)."""
    return (dy.dtype == x.dtype and dy.shape == x.shape and dy.is_contiguous()
            and not torch.is_grad_enabled() and not dy.requires_grad)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if ctx.in_place and need_dx and _can_overwrite(dy, x):
        dw = rmsnorm_bwd_in_place_op(dy, x, weight, rstd, need_dw, ctx.offset, ctx.casting_mode)
        dx = dy  # now holds dx
    else:
        dx, dw = rmsnorm_bwd_op(dy, x, weight, rstd, need_dw, ctx.offset, ctx.casting_mode)
    return dx if need_dx else None, dw if need_dw else None, None, None, None, None


rmsnorm_fwd_op.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(rmsnorm_bwd_op, "rmsnorm")  # (the in-place one only runs with gradients off)


# ------------------------------------------------------------------------------------------------
# The eager path: the same launchers, without the operator machinery
# ------------------------------------------------------------------------------------------------
# Calling a custom operator costs host time on every call: the dispatcher hands it to Python, the
# autograd registration wraps it in a generated Function, the arguments are normalised against the
# schema, and the implementation runs behind a guard that keeps Dynamo out. For a kernel that
# takes ~180 us of GPU time, that host time was *the* cost of a call as a user makes it (no CUDA
# graph): the GPU waited for Python. So an eager call goes through this plain autograd.Function,
# which calls the launchers directly, and only a traced call (torch.compile, opcheck, a fake or
# functional tensor, any dispatch mode) uses the operators, which tracing needs. Both run the same
# kernels with the same launch settings, so their results are bitwise equal (rmsnorm_test.py).
class RMSNormFunction(torch.autograd.Function):
    # It takes x in its own shape and flattens it inside: a view taken outside (x.reshape(-1, H),
    # y.view(x.shape)) would add an autograd node on each side, which the backward pass then has to
    # run, two more steps of host work per call for nothing.
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        x2, weight = as_rows(x), weight.contiguous()
        # y is allocated in x's shape, not viewed into it: a view returned by a custom Function may
        # not be modified in place afterwards (autograd refuses), and a caller may well do that
        y, rstd = rmsnorm_forward(x2, weight, eps, offset, casting_mode, out_shape=x.shape)
        RMSNormFunction.keep(ctx, x2, weight, rstd, offset, casting_mode, in_place, x.shape)
        return y

    @staticmethod
    def keep(ctx, x2, weight, rstd, offset, casting_mode, in_place, x_shape):
        """What backward needs (also for fp8_producers_kernel's norm that writes an FP8 copy, same backward)."""
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        ctx.x_shape = x_shape

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled() or not direct_launch(dy):
            # create_graph=True: the backward operator's autograd refuses a second derivative clearly
            dx, dw, *rest = _backward(ctx, as_rows(dy), None)
            return (None if dx is None else dx.view(ctx.x_shape)), dw, *rest
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy2 = as_rows(dy)  # a view of dy, or a copy when dy's rows are not dense (an expanded dy)
        if ctx.in_place and need_dx and _can_overwrite(dy2, x):
            _, dw = rmsnorm_backward(dy2, x, weight, rstd, need_dw, ctx.offset, ctx.casting_mode, dx=dy2)
            torch.autograd.graph.increment_version(dy2)  # as the in-place operator declares its write
            dx = dy2
        else:
            dx, dw = rmsnorm_backward(dy2, x, weight, rstd, need_dw, ctx.offset, ctx.casting_mode)
        return dx.view(ctx.x_shape) if need_dx else None, dw if need_dw else None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# Functional API, module, patching a Hugging Face model
# ------------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0,
            casting_mode: str = "llama", in_place: bool = False) -> torch.Tensor:
    """Fused RMSNorm over the last dimension of `x` (any leading shape); differentiable once.

    offset: the weight is applied as (offset + weight): 1.0 for Gemma, whose weights are stored
        around 0, 0.0 otherwise.
    casting_mode: "llama" (LlamaRMSNorm's rounding), "gemma" (GemmaRMSNorm's) or "none" (the input
        dtype throughout); see the module docstring.
    in_place: the backward pass writes dx over the memory of dy, the gradient it receives, instead
        of a new [rows, H] buffer. It falls back to a new buffer by itself when dy cannot hold dx (a
        dtype other than x's, as with fp32 weights and bf16 x in "llama" mode; an expanded or
        strided gradient). It is *not allowed* when anything else reads that same dy tensor after
        this backward, which the norm cannot see. That happens when
          - the norm's output is added to another tensor (`residual + norm(h)`, Gemma 2's post
            norms): autograd hands the addition's gradient, one tensor, to both of its inputs, so
            the other input would receive dx instead of dy;
          - you pass your own tensor to `y.backward(dy)` and use it afterwards (it is overwritten);
          - the graph is run backward twice (`retain_graph=True`) and the gradient that reaches
            the norm is a tensor kept by the graph.
        A norm whose output feeds only matrix multiplications (the q/k/v or gate/up projections,
        the lm_head) receives a fresh gradient and can run in place; `patch_model(in_place=True)`
        does so for exactly those norms.
    """
    check_inputs(x, weight, offset, casting_mode)
    if direct_launch(x, weight):
        return RMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode, bool(in_place))
    y, _ = rmsnorm_fwd_op(as_rows(x), weight, float(eps), float(offset), casting_mode, bool(in_place))
    return y.view(x.shape)


class TritonRMSNorm(nn.Module):
    """Drop-in replacement for `LlamaRMSNorm` (same parameter name, `weight`, and same numerics);
    with `offset=1.0, casting_mode="gemma"` for `GemmaRMSNorm`. See `rmsnorm` for the options."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, *, offset: float = 0.0,
                 casting_mode: str = "llama", in_place: bool = False):
        super().__init__()
        # (offset + weight) starts at 1: ones for LLaMA, zeros for Gemma's offset of 1.
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset, self.casting_mode, self.in_place = float(offset), casting_mode, bool(in_place)

    @classmethod
    def from_module(cls, module: nn.Module, *, offset: float = 0.0, casting_mode: str = "llama",
                    in_place: bool = False) -> "TritonRMSNorm":
        """Wrap an existing RMSNorm module, *sharing* its weight Parameter (no copy).

        Sharing matters: an optimizer built before the swap, a tied weight, or an FSDP-sharded
        parameter keep pointing at the same tensor. The options say how the module computes:
        `offset=1.0, casting_mode="gemma"` for GemmaRMSNorm and Gemma2RMSNorm. A LayerNorm (it
        subtracts the mean, and adds a bias) or a norm without a weight is refused.
        """
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or isinstance(getattr(module, "bias", None), torch.Tensor):
            raise TypeError(f"{type(module).__name__} is not an RMSNorm: it subtracts the mean and adds a bias, which "
                            "RMSNorm does not; TritonRMSNorm replaces RMSNorm modules only (x / rms(x) * weight)")
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise TypeError(f"{type(module).__name__} has no weight tensor to share (elementwise_affine=False?)")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise TypeError(f"{type(module).__name__} has no `variance_epsilon` or `eps` attribute")
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {', '.join(map(repr, CASTING_MODES))}, got {casting_mode!r}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = module.weight  # the same Parameter object
        new.variance_epsilon = float(eps)
        new.offset, new.casting_mode, new.in_place = float(offset), casting_mode, bool(in_place)
        return new

    @classmethod
    def from_llama_rmsnorm(cls, module: nn.Module) -> "TritonRMSNorm":
        """`from_module` with LlamaRMSNorm's numerics (offset 0, "llama" casting, out of place)."""
        return cls.from_module(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.variance_epsilon, offset=self.offset, casting_mode=self.casting_mode,
                       in_place=self.in_place)

    def extra_repr(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        extra += f", casting_mode={self.casting_mode!r}" if self.casting_mode != "llama" else ""
        extra += ", in_place=True" if self.in_place else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{extra}"


def patch_model(model: nn.Module, in_place: bool = False) -> int:
    """Replace every RMSNorm module of a Hugging Face causal LM with a TritonRMSNorm sharing its weight.

    Modules are found by class (LlamaRMSNorm, GemmaRMSNorm, ...), never by name; the family table
    (core/model_families.py) says how the family's norm computes (Gemma: offset 1, "gemma" casting).
    `in_place=True` runs the backward in place in every norm except those whose output is added
    to the residual stream (Gemma 2's post-attention and post-feed-forward norms), where it is not
    allowed (see `rmsnorm`). Returns how many norms now run the kernel; patching twice replaces
    nothing more and returns the same count.
    """
    fam = family(model)  # a clear error for a family the kernels do not know
    classes = family_classes("RMSNorm", model.config.model_type)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TritonRMSNorm.from_module(
            module, offset=fam.norm_offset, casting_mode=fam.norm_casting,
            in_place=in_place and child not in fam.residual_norms))
    return sum(isinstance(m, TritonRMSNorm) for m in model.modules())


def expected_patches(config) -> int:
    """RMSNorms in the architecture: 2 per layer (4 in Qwen3, with its q/k norms, and in Gemma 2,
    with its pre/post feed-forward norms) plus the final one."""
    return family(config).norms_per_layer * config.num_hidden_layers + 1


def ideal_bytes(n_rows: int, hidden: int, dtype: torch.dtype, backward: bool = False) -> int:
    """The fewest bytes the fused kernels can move for an [n_rows, hidden] input of `dtype`.

    Forward reads x and the weight and writes y; `backward=True` adds the backward pass, which reads
    dy, x and the weight and writes dx and the weight gradient (see the module docstring).
    """
    e = dtype.itemsize
    forward = 2 * n_rows * hidden * e + hidden * e
    return forward + (3 * n_rows * hidden * e + 2 * hidden * e if backward else 0)


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                casting_mode: str = "llama") -> torch.Tensor:
    """Plain PyTorch: Hugging Face's LlamaRMSNorm ("llama"), GemmaRMSNorm ("gemma", offset=1.0), or
    the same formula in the input dtype ("none"). The fp32 steps run in float64 for float64 input,
    so that a float64 call is a float64 reference."""
    input_dtype = x.dtype
    if casting_mode == "none":
        w = weight.to(input_dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)
    compute = torch.promote_types(input_dtype, torch.float32)
    xf = x.to(compute)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        return (xf * (offset + weight.to(compute))).to(input_dtype)
    return (offset + weight) * xf.to(input_dtype) if offset else weight * xf.to(input_dtype)
