"""Fused cross-entropy in Triton: loss and gradient in one pass over the logits (online softmax).

    loss_i = logsumexp(logits_i) - logits_i[target_i]
    dloss_i/dlogits_i = softmax(logits_i) - onehot(target_i)

What you build here: a kernel that reads each row of logits, computes its loss, and writes the
gradient of that loss right away, so that forward + backward together read the logits once and
write the gradient once (optionally into the logits' own memory).
What you learn: the online softmax (Milakov & Gimelshein, 2018), looping over a row that does not
fit in one block, int64 row offsets, masking a vocabulary tail, reading a GPU scalar through a
pointer instead of `.item()`, and why the second sweep over a row should run backwards.

Count the bytes before timing anything
--------------------------------------
LLaMA 3.1 8B has a vocabulary of V = 128256. For N tokens the logits are N x V: at N = 16384 and
bf16 that is 4.2 GB, by far the largest activation of the model. Hugging Face computes the loss as

    logits = logits.float()                    # read 2, write 4 bytes per element
    loss = F.cross_entropy(logits, targets)    # log_softmax: read 4, write 4; nll: gathers N
    loss.backward()                            # nll backward: write 4 (a dense one-hot-like
                                               # tensor); log_softmax backward: read 4 + 4,
                                               # write 4; .float() backward: read 4, write 2
                                               # -> about 40 bytes per element, 2x 4-byte copies
                                               #    alive at once (N x V x 8 = 16.8 GB at N=16384)

The fused kernel reads each bf16 logit once (2 bytes) and writes its bf16 gradient once (2 bytes):
4 bytes per element, 10x less, and with `inplace_grad=True` no new N x V buffer at all.
Floor at N = 16384 on an H200 (measured copy bandwidth ~4.27 TB/s, bytes read + written):
    2 * 16384 * 128256 * 2 B = 8.4 GB -> 1967 us.

How one pass can do both: the online softmax
--------------------------------------------
A row of 128256 values does not fit in one program's registers, so the kernel walks it in
blocks. Softmax needs the row maximum m (for stability) and the sum s = sum(exp(x - m)) before it
can normalise anything. The online softmax gets both in a single sweep: keep a running max m and a
running sum s; when a new value raises the max to m', rescale s by exp(m - m') and add the new
terms. The kernel keeps one (m, s) pair per lane of the block and merges the lanes once at the
end, so the sweep is a pure stream of loads with one exp per element. After sweep 1 we know m
and s, hence the loss. Sweep 2 revisits the row to write
exp(x - m) / s - onehot. Sweep 2 runs from the end of the row back to the start: the blocks read
last in sweep 1 are still in the L2 cache, so most of sweep 2's reads never reach GPU memory.

The gradient is computed in the forward pass, where it costs no extra read. The upstream gradient
(1.0 for a plain `loss.backward()`, 3.0 for `(3 * loss).backward()`, or one value per row for
`reduction="none"`) is only known in backward; a small kernel then reads it *through a pointer*
(no `.item()`, no host-device sync) and rescales the rows, skipping rows whose factor is exactly 1,
which costs one launch and no traffic in the common case.

Conventions
-----------
- `ignore_index` rows (default -100, as in Hugging Face labels) give loss 0 and an all-zero
  gradient row. `reduction="mean"` divides by the number of non-ignored rows, like PyTorch; when
  *every* row is ignored it returns 0.0 (PyTorch returns NaN) with an all-zero gradient, and the
  loss stays attached to the graph, so a step on a fully padded batch is a no-op rather than a NaN.
- A target outside [0, V) that is not `ignore_index` cannot be reported without a host sync, so it
  is a defined NaN: that row's loss and gradient are NaN (the kernel never reads out of bounds),
  and so is the reduced loss. Training stops visibly instead of learning from garbage.
- The loss is returned in fp32 whatever the logits' dtype (all arithmetic is fp32).
- `inplace_grad=True` writes the gradient into the logits buffer during the forward pass. Use it
  only when nothing else needs the logits afterwards: the logits you passed in hold gradients once
  the loss is computed. The autograd version counter of the logits is bumped, so an op that saved
  them for its own backward (a softmax before the loss, say) fails loudly instead of silently
  using overwritten values. A loss computed in place can be back-propagated once.

Layout of this file: kernels -> checked launchers -> autograd.Function -> functional API and
nn.Module -> reference.
"""

import torch
from torch import nn

import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from kernel_utils import as_rows, check_device, check_float, next_power_of_2

import triton
import triton.language as tl

# Launch settings for the vocabulary sweep, the fastest in `benchmark_kernels.py --tune` on an H200
# at both 1024 and 16384 tokens: 16384 columns per block; 32 warps x 32 threads = 1024 threads,
# 16 values (two 16-byte bf16 loads) per thread, one program per SM.
BLOCK_V = 16384
NUM_WARPS = 32
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
MIN_START = tl.constexpr(-1.0e38)  # a finite "minus infinity" (logits below it count as -inf)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _cross_entropy_fwd(
    Logits,  # pointer to the logits, [N, V], unit stride along V
    Grad,  # pointer to the gradient output, [N, V] (may be Logits itself: in place)
    Targets,  # pointer to the targets, [N], any integer dtype
    Loss,  # pointer to the per-row losses, [N], fp32
    NValid,  # pointer to the number of non-ignored rows (a 0-d int64 tensor on the device)
    stride_l,  # elements between two rows of Logits
    stride_g,  # elements between two rows of Grad
    V,  # vocabulary size
    ignore_index,  # target value whose rows are skipped
    MEAN: tl.constexpr,  # scale the gradient by 1 / n_valid (reduction="mean")
    COMPUTE_GRAD: tl.constexpr,  # also write the gradient (False when no backward will run)
    BLOCK_V: tl.constexpr,  # columns per block of the sweep
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride exceeds 2^31 past ~16.7k rows
    logits_row = Logits + row * stride_l
    grad_row = Grad + row * stride_g
    cols0 = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(V, BLOCK_V)

    target = tl.load(Targets + row).to(tl.int64)
    if target == ignore_index:
        # Ignored row: loss 0 and a gradient row of exact zeros. The zeros must be *stored*
        # (the gradient buffer is uninitialised, or holds logits when in place).
        tl.store(Loss + row, 0.0)
        if COMPUTE_GRAD:
            for b in range(0, n_blocks):
                cols = b * BLOCK_V + cols0
                tl.store(grad_row + cols, tl.zeros([BLOCK_V], tl.float32).to(Grad.dtype.element_ty), mask=cols < V)
    else:
        # ---- sweep 1: running max and running sum of exp(x - max), kept *per lane* -------------
        # Every lane (position in the block) keeps its own max m and sum s over the values it has
        # seen. A lane sees x and either adds exp(x - m) (x <= m), or makes x its new max and
        # rescales: s * exp(m - x) + 1 (x > m). Both cases need exp(-|x - m|): one exp per
        # element, and no reduction across the block inside the loop. Reductions synchronise all
        # the warps of a program, which would stall the loads; here they happen once, after it.
        # The lanes start at a finite MIN_START rather than -inf, so that x - m is never
        # -inf - (-inf) = NaN: a -inf logit (or the masked tail) then adds exp(-inf) = 0.
        # Each iteration also *prefetches* the next block: its load is in flight while this block
        # is computed, which doubles the bytes each warp has on the way (a loop that loads, waits
        # and computes reached only a third of the memory bandwidth).
        m_lane = tl.full([BLOCK_V], MIN_START, tl.float32)
        s_lane = tl.zeros([BLOCK_V], tl.float32)
        x_next = tl.load(logits_row + cols0, mask=cols0 < V, other=-float("inf"))
        for b in range(0, n_blocks):
            x = x_next.to(tl.float32)
            cols = (b + 1) * BLOCK_V + cols0  # the next block (all masked off after the last)
            x_next = tl.load(logits_row + cols, mask=cols < V, other=-float("inf"))
            e = tl.exp2(tl.abs(x - m_lane) * -LOG2E)  # exp(-|x - m|); exp2 is the native unit
            s_lane = tl.where(x > m_lane, s_lane * e + 1.0, s_lane + e)
            m_lane = tl.maximum(m_lane, x)
        m = tl.max(m_lane, axis=0)  # the row max; bring every lane's sum to it and add them up
        s = tl.sum(s_lane * tl.exp2((m_lane - m) * LOG2E), axis=0)  # lanes that saw nothing: 0
        # log-sum-exp = m + log(s). Keep m and log(s) apart: m may be ~1000, and their rounded sum
        # would carry an absolute error of ~1e-4 into every exponent below.
        log2_s = tl.log2(s)

        in_range = (target >= 0) & (target < V)
        # An out-of-range target never reads memory: it gets NaN, which poisons loss and gradient.
        x_target = tl.load(logits_row + target, mask=in_range, other=float("nan")).to(tl.float32)
        # loss = lse - x_target (NaN for an all -inf row, as in PyTorch)
        tl.store(Loss + row, (m - x_target) + log2_s / LOG2E)

        # ---- sweep 2 (backwards, for L2 reuse): gradient = (softmax - onehot) * scale ----------
        if COMPUTE_GRAD:
            scale = 1.0
            if MEAN:
                # The count lives on the GPU; reading it here avoids a host sync. max(., 1): an
                # all-ignored batch never reaches this branch, but stay safe against 1/0.
                n_valid = tl.load(NValid).to(tl.float32)
                scale = 1.0 / tl.maximum(n_valid, 1.0)
            scale = tl.where(in_range, scale, float("nan"))
            # softmax * scale = exp(x - m) / s * scale = exp2((x - m) * log2(e) - log2(s)) * scale:
            # a subtraction, a fused multiply-add, one exp2 and a multiply per element. x - m comes
            # first (two nearby numbers: exact enough); folding m into the fused multiply-add would
            # subtract large numbers and lose ~1e-4 of relative precision at logits ~ 1000.
            cols = (n_blocks - 1) * BLOCK_V + cols0
            x_next = tl.load(logits_row + cols, mask=cols < V, other=-float("inf"))
            for i in range(0, n_blocks):
                x = x_next.to(tl.float32)
                mask = cols < V
                cols_next = cols - BLOCK_V  # prefetch the block before; none after the first
                x_next = tl.load(logits_row + cols_next, mask=(cols_next >= 0) & (cols_next < V), other=-float("inf"))
                g = tl.exp2((x - m) * LOG2E - log2_s) * scale
                tl.store(grad_row + cols, g.to(Grad.dtype.element_ty), mask=mask)
                cols = cols_next
            # The one-hot part touches a single element: fix it up after the sweep instead of
            # comparing every column with the target. The barrier makes the sweep's store of that
            # element (by some other thread of this program) land before this one.
            tl.debug_barrier()
            p_target = tl.exp2((x_target - m) * LOG2E - log2_s)
            tl.store(grad_row + target, ((p_target - 1.0) * scale).to(Grad.dtype.element_ty), mask=in_range)


@triton.jit
def _scale_rows(
    Grad,  # pointer to the gradient, [N, V], scaled in place
    GradOut,  # pointer to the upstream gradient: one value, or one per row
    stride_g,  # elements between two rows of Grad
    stride_go,  # 0 when one upstream value serves every row (mean / sum), else 1
    V,  # vocabulary size
    BLOCK_V: tl.constexpr,  # columns per block
):
    row = tl.program_id(0).to(tl.int64)
    go = tl.load(GradOut + row * stride_go).to(tl.float32)
    # `loss.backward()` passes exactly 1.0: then there is nothing to do, and the row is not even
    # read. The test runs on the GPU, per program, so no host sync is needed to skip the work.
    if go != 1.0:
        grad_row = Grad + row * stride_g
        for b in range(0, tl.cdiv(V, BLOCK_V)):
            cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
            mask = cols < V
            g = tl.load(grad_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_row + cols, (g * go).to(Grad.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
_REDUCTIONS = ("mean", "sum", "none")


def _launch_settings(V: int, block_v: int | None, num_warps: int | None):
    block_v = block_v or min(BLOCK_V, next_power_of_2(V))
    num_warps = num_warps or max(1, min(NUM_WARPS, block_v // 512))
    return block_v, num_warps


def cross_entropy_forward(logits2, targets, ignore_index, reduction, compute_grad, inplace_grad,
                          block_v=None, num_warps=None, n_valid=None, loss_rows=None):
    """logits2: [N, V], unit stride along V. Returns (loss, gradient buffer or None).

    A caller that splits one batch into several calls (the fused linear cross-entropy walks the
    tokens in chunks) passes the whole batch's non-ignored count `n_valid` (a 0-d tensor on the
    device) so that each chunk's "mean" gradient is scaled by the global count, and its own slice
    of the per-row losses as `loss_rows`; it then reduces those itself.
    """
    N, V = logits2.shape
    device = logits2.device
    if loss_rows is None:
        loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    # The mean's token count stays on the GPU (no sync); only "mean" reads it.
    if n_valid is None and reduction == "mean":
        n_valid = (targets != ignore_index).sum()
    grad = None
    if compute_grad:
        grad = logits2 if inplace_grad else torch.empty((N, V), dtype=logits2.dtype, device=device)
    if N > 0:
        block_v, num_warps = _launch_settings(V, block_v, num_warps)
        _cross_entropy_fwd[(N,)](
            logits2, grad if compute_grad else logits2, targets, loss_rows,
            n_valid if n_valid is not None else loss_rows,  # never read unless MEAN
            logits2.stride(0), grad.stride(0) if compute_grad else 0, V, ignore_index,
            MEAN=reduction == "mean", COMPUTE_GRAD=compute_grad, BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return reduce_loss(loss_rows, reduction, n_valid), grad


def reduce_loss(loss_rows: torch.Tensor, reduction: str, n_valid: torch.Tensor | None) -> torch.Tensor:
    """Per-row losses -> the requested reduction (mean over non-ignored rows; 0.0 when none are)."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / n_valid.clamp(min=1)


def scale_gradient_(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """grad *= grad_output (a scalar, or one value per row), in place, without a host sync."""
    N, V = grad.shape
    if N == 0:
        return grad
    grad_output = grad_output.reshape(-1) if grad_output.dim() else grad_output.reshape(1)
    stride_go = 0 if grad_output.numel() == 1 else grad_output.stride(0)
    block_v, num_warps = _launch_settings(V, None, None)
    _scale_rows[(N,)](grad, grad_output, grad.stride(0), stride_go, V, BLOCK_V=block_v, num_warps=num_warps)
    return grad


def check_targets_and_reduction(targets, reduction: str) -> None:
    """The checks every loss of this playbook makes on its targets and reduction."""
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an int64 (or int32) tensor of class indices, got {got}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _check_inputs(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> None:
    check_float("logits", logits)
    check_targets_and_reduction(targets, reduction)
    check_device(logits, targets)
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"expected logits [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if logits.shape[1] == 0:
        raise ValueError("logits have a vocabulary of size 0")


# ------------------------------------------------------------------------------------------------
# autograd.Function, functional API, module
# ------------------------------------------------------------------------------------------------
class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, inplace_grad, grad_enabled):
        logits2 = as_rows(logits)
        # needs_input_grad says whether the logits require grad, even under torch.no_grad();
        # grad_enabled (the caller's grad mode) says whether a backward can happen at all.
        compute_grad = ctx.needs_input_grad[0] and grad_enabled
        loss, grad = cross_entropy_forward(logits2, targets, ignore_index, reduction, compute_grad, inplace_grad)
        if compute_grad and inplace_grad and logits2.data_ptr() == logits.data_ptr():
            # We overwrote `logits` behind autograd's back. Bumping its version counter makes any
            # op that saved it for backward raise "modified by an inplace operation".
            torch.autograd.graph.increment_version(logits)
        ctx.shape = logits.shape
        ctx.consumed = False
        if compute_grad:
            ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.consumed:
            raise RuntimeError(
                "the fused cross-entropy's gradient buffer was already used by a previous "
                "backward; run backward once per forward (retain_graph is not supported)"
            )
        ctx.consumed = True
        (grad,) = ctx.saved_tensors
        scale_gradient_(grad, grad_output)
        return grad.view(ctx.shape), None, None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", inplace_grad: bool = False) -> torch.Tensor:
    """Cross-entropy of `logits` [N, V] against int64 `targets` [N]; differentiable.

    Same semantics as `torch.nn.functional.cross_entropy` (mean over non-ignored rows), except:
    all rows ignored -> 0.0 for "mean"; out-of-range targets -> NaN; the loss is fp32.
    """
    _check_inputs(logits, targets, reduction)
    return CrossEntropyFunction.apply(logits, targets, int(ignore_index), reduction, bool(inplace_grad),
                                      torch.is_grad_enabled())


class TritonCrossEntropyLoss(nn.Module):
    """Like `nn.CrossEntropyLoss` for logits [..., V] and targets [...] (class indices)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", inplace_grad: bool = False):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.inplace_grad = inplace_grad

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"expected logits [..., V] and targets [...] with the same leading shape, got "
                f"{tuple(logits.shape)} and {tuple(targets.shape)}"
            )
        loss = cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
            self.ignore_index, self.reduction, self.inplace_grad,
        )
        return loss.view(targets.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, inplace_grad={self.inplace_grad}"


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      reduction: str = "mean") -> torch.Tensor:
    """PyTorch on fp32-upcast logits, as Hugging Face computes its loss (NaN when all ignored)."""
    return nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)
