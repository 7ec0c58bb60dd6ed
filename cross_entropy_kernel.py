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
4 bytes per element, 10x less, and with `inplace_grad=True` no new N x V buffer at all. Add the
int64 targets (8 bytes a row) and the fp32 per-row losses (4 bytes a row); `ideal_bytes()` counts it:
    forward only (the loss):   16384 * 128256 * 2 + 16384 * (8 + 4) = 4,202,889,216 B
    forward + backward:    2 * 16384 * 128256 * 2 + 16384 * (8 + 4) = 8,405,581,824 B
Floor at N = 16384 on an H200 (measured copy bandwidth ~4.27 TB/s, bytes read + written):
    8.41 GB / 4.27 TB/s -> 1969 us for the loss and its gradient.

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
  using overwritten values. A loss computed in place can be back-propagated once. Logits whose
  rows share memory (an `expand`ed tensor, a stride of 0) cannot hold one gradient row each: they
  get a new gradient buffer instead (and stay intact). A leaf tensor that requires grad is refused:
  overwriting it would destroy a parameter.
- `targets` may have any stride (a slice of a [B, T] batch, an expanded constant): the kernel
  reads target i at `Targets + i * stride`, so nothing is copied.
- Second-order gradients are not available: the gradient is a buffer computed in the forward
  pass, not a function PyTorch can differentiate again. A backward with `create_graph=True`
  raises a RuntimeError saying so, instead of handing back a gradient whose own derivative would
  silently be zero.

PyTorch sees the kernels as custom ops (`torch.ops.playbook.cross_entropy_*`), each one opaque
node for `torch.compile`, `torch.library.opcheck` and FSDP; Dynamo never traces a Triton launch.
A compiled graph may not rescale the saved gradient in place (see `scale_grad`), so under
`torch.compile` the backward writes the rescaled gradient to a new buffer: one more pass over
N x V than eager mode, the default, which pays nothing for `loss.backward()`.

Layout of this file: kernels -> checked launchers -> custom ops -> autograd.Function and functional
API -> Hugging Face drop-in (`patch_model`) -> reference.
"""

import torch
from torch import nn

import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from kernel_utils import as_rows, check_device, check_float, next_power_of_2
from model_families import model_type

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
    Targets,  # pointer to the targets, [N], any integer dtype, any stride (0 for an expanded one)
    Loss,  # pointer to the per-row losses, [N], fp32
    NValid,  # pointer to the number of non-ignored rows (a 0-d int64 tensor on the device)
    stride_l,  # elements between two rows of Logits
    stride_g,  # elements between two rows of Grad
    stride_t,  # elements between two targets (a slice like labels[:, 1:].T[0] is not contiguous)
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

    target = tl.load(Targets + row * stride_t).to(tl.int64)
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
    Grad,  # pointer to the gradient, [N, V]
    Out,  # pointer to the scaled gradient, [N, V] (Grad itself when scaling in place)
    GradOut,  # pointer to the upstream gradient: one value, or one per row
    stride_g,  # elements between two rows of Grad
    stride_o,  # elements between two rows of Out
    stride_go,  # 0 when one upstream value serves every row (mean / sum), else its stride
    V,  # vocabulary size
    IN_PLACE: tl.constexpr,  # Out is Grad: rows whose factor is exactly 1 need no work at all
    BLOCK_V: tl.constexpr,  # columns per block
):
    row = tl.program_id(0).to(tl.int64)
    go = tl.load(GradOut + row * stride_go).to(tl.float32)
    # `loss.backward()` passes exactly 1.0: in place, there is then nothing to do, and the row is
    # not even read. The test runs on the GPU, per program, so no host sync is needed to skip it.
    if (go != 1.0) | (not IN_PLACE):
        grad_row = Grad + row * stride_g
        out_row = Out + row * stride_o
        for b in range(0, tl.cdiv(V, BLOCK_V)):
            cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
            mask = cols < V
            g = tl.load(grad_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (g * go).to(Out.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
_REDUCTIONS = ("mean", "sum", "none")


def _launch_settings(V: int, block_v: int | None, num_warps: int | None):
    block_v = block_v or min(BLOCK_V, next_power_of_2(V))
    num_warps = num_warps or max(1, min(NUM_WARPS, block_v // 512))
    return block_v, num_warps


def rows_overlap(rows: torch.Tensor) -> bool:
    """True when two rows of a [N, V] matrix (unit column stride) share memory (stride 0, expand)."""
    return rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]


def cross_entropy_forward(logits2, targets, ignore_index, reduction, compute_grad, inplace_grad,
                          block_v=None, num_warps=None, n_valid=None, loss_rows=None):
    """logits2: [N, V], unit stride along V; targets: [N], any stride. Returns (loss, gradient or None).

    A caller that splits one batch into several calls (the fused linear cross-entropy walks the
    tokens in chunks) passes the whole batch's non-ignored count `n_valid` (a 0-d tensor on the
    device) so that each chunk's "mean" gradient is scaled by the global count, and its own slice
    of the per-row losses as `loss_rows`; it then reduces those itself.
    """
    N, V = logits2.shape
    if V > 1 and logits2.stride(1) != 1:
        raise ValueError(f"logits2 needs unit stride along the vocabulary, got strides {logits2.stride()}")
    if compute_grad and inplace_grad and rows_overlap(logits2):
        raise ValueError(f"cannot write the gradient in place: rows of the logits share memory "
                         f"(strides {logits2.stride()}, an expanded tensor?)")
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
            logits2.stride(0), grad.stride(0) if compute_grad else 0, targets.stride(0), V, ignore_index,
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


def scale_gradient_(grad: torch.Tensor, grad_output: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = grad * grad_output (a scalar, or one value per row) without a host sync; in place
    (the default, out=grad) rows whose factor is exactly 1 cost nothing."""
    N, V = grad.shape
    out = grad if out is None else out
    if N == 0:
        return out
    grad_output = grad_output.reshape(-1) if grad_output.dim() else grad_output.reshape(1)
    stride_go = 0 if grad_output.numel() == 1 else grad_output.stride(0)
    block_v, num_warps = _launch_settings(V, None, None)
    _scale_rows[(N,)](grad, out, grad_output, grad.stride(0), out.stride(0), stride_go, V,
                      IN_PLACE=out is grad, BLOCK_V=block_v, num_warps=num_warps)
    return out


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
    if logits.dim() not in (2, 3) or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"expected logits [N, V] with targets [N], or [B, T, V] with [B, T]; got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits have a vocabulary of size 0")


# ------------------------------------------------------------------------------------------------
# Custom ops: what torch.compile, opcheck and FSDP see (one opaque op each; Dynamo never enters
# the Triton launches). Their inputs are already checked: logits2 [N, V] with unit column stride.
# ------------------------------------------------------------------------------------------------
def _loss_like(logits2: torch.Tensor, reduction: str) -> torch.Tensor:
    shape = (logits2.shape[0],) if reduction == "none" else ()
    return logits2.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("playbook::cross_entropy_loss", mutates_args=())
def _loss_op(logits2: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The loss alone (evaluation, or logits that need no gradient): reads the logits once."""
    return cross_entropy_forward(logits2, targets, ignore_index, reduction, False, False)[0]


@torch.library.custom_op("playbook::cross_entropy_fwd", mutates_args=())
def _fwd_op(logits2: torch.Tensor, targets: torch.Tensor, ignore_index: int,
            reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient for an upstream gradient of 1) with the gradient in a new [N, V] buffer."""
    return cross_entropy_forward(logits2, targets, ignore_index, reduction, True, False)


@torch.library.custom_op("playbook::cross_entropy_fwd_inplace", mutates_args=("logits2",))
def _fwd_inplace_op(logits2: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The loss; the gradient (for an upstream gradient of 1) overwrites `logits2`."""
    return cross_entropy_forward(logits2, targets, ignore_index, reduction, True, True)[0]


@torch.library.custom_op("playbook::cross_entropy_scale_grad_inplace", mutates_args=("grad",))
def _scale_grad_inplace_op(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backward in eager mode: grad *= grad_output (one value, or one per row), in place; rows
    whose factor is exactly 1 are skipped on the GPU, so `loss.backward()` costs no traffic."""
    scale_gradient_(grad, grad_output)


@torch.library.custom_op("playbook::cross_entropy_scale_grad", mutates_args=())
def _scale_grad_op(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """Backward under torch.compile: grad * grad_output into a new buffer (one pass)."""
    return scale_gradient_(grad, grad_output, out=torch.empty_like(grad))


@_loss_op.register_fake
def _(logits2, targets, ignore_index, reduction):
    return _loss_like(logits2, reduction)


@_fwd_op.register_fake
def _(logits2, targets, ignore_index, reduction):
    return _loss_like(logits2, reduction), logits2.new_empty(logits2.shape)


@_fwd_inplace_op.register_fake
def _(logits2, targets, ignore_index, reduction):
    return _loss_like(logits2, reduction)


@_scale_grad_inplace_op.register_fake
def _(grad, grad_output):
    return None


@_scale_grad_op.register_fake
def _(grad, grad_output):
    return torch.empty_like(grad)


def scale_grad(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """A backward's `grad * grad_output`, for a gradient buffer saved by the forward pass.

    Eager mode scales the buffer in place (free when grad_output is 1.0). A compiled graph must
    not mutate it: AOTAutograd traces forward and backward as one graph, where an in-place write
    to a buffer that the forward also returns (the logits, with `inplace_grad`) would reach back
    into the forward's outputs; there the functional op writes a new buffer in one pass.
    """
    if torch.compiler.is_compiling():
        return torch.ops.playbook.cross_entropy_scale_grad(grad, grad_output)
    torch.ops.playbook.cross_entropy_scale_grad_inplace(grad, grad_output)
    return grad


# ------------------------------------------------------------------------------------------------
# autograd.Function and functional API
# ------------------------------------------------------------------------------------------------
def check_first_order(what: str) -> None:
    """Refuse `backward(create_graph=True)`: a fused loss's gradient is a buffer, not a function
    PyTorch can differentiate again, and a silent constant would make second derivatives zero."""
    # Autograd runs backward in grad mode only for create_graph=True. A compiled graph is traced in
    # grad mode whatever the caller does, and AOTAutograd refuses double backward itself.
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"the {what} has no second derivative: backward with create_graph=True "
                           "(double backward, gradient penalties) is not supported")


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, inplace_grad, grad_enabled):
        rows = as_rows(logits)  # logits itself, or a contiguous copy (never a view made here)
        # needs_input_grad says whether the logits require grad, even under torch.no_grad();
        # grad_enabled (the caller's grad mode) says whether a backward can happen at all.
        ctx.consumed = False
        if not (ctx.needs_input_grad[0] and grad_enabled):
            return torch.ops.playbook.cross_entropy_loss(rows, targets, ignore_index, reduction)
        if inplace_grad and not rows_overlap(rows):
            # The op declares that it mutates `rows`, so PyTorch bumps the version counter that
            # `rows` shares with `logits`: an op that saved the logits for its own backward (a
            # softmax before the loss, say) then raises "modified by an inplace operation".
            loss = torch.ops.playbook.cross_entropy_fwd_inplace(rows, targets, ignore_index, reduction)
            grad = rows
        else:
            loss, grad = torch.ops.playbook.cross_entropy_fwd(rows, targets, ignore_index, reduction)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        check_first_order("fused cross-entropy")
        if ctx.consumed:
            raise RuntimeError(
                "the fused cross-entropy's gradient buffer was already used by a previous "
                "backward; run backward once per forward (retain_graph is not supported)"
            )
        ctx.consumed = True
        (grad,) = ctx.saved_tensors
        return scale_grad(grad, grad_output), None, None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", inplace_grad: bool = False) -> torch.Tensor:
    """Cross-entropy of `logits` [N, V] (or [B, T, V]) against int64 `targets` [N] (or [B, T]).

    Same semantics as `torch.nn.functional.cross_entropy` (mean over non-ignored rows), except:
    all rows ignored -> 0.0 for "mean"; out-of-range targets -> NaN; the loss is fp32.
    reduction="none" returns one loss per row, in the targets' shape.
    inplace_grad: write the gradient into the logits' memory (see the module docstring); logits
    whose rows share memory (an expanded tensor) get a new gradient buffer instead.
    """
    _check_inputs(logits, targets, reduction)
    if inplace_grad and logits.is_leaf and logits.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("inplace_grad=True would overwrite a leaf tensor that requires grad; pass the "
                           "logits computed by the model (an intermediate), or use inplace_grad=False")
    # Flatten [B, T, V] here, in the caller's grad mode: autograd forbids writing in place into a
    # view that was made inside the Function's forward (where grad mode is off).
    logits2 = logits.reshape(-1, logits.shape[-1]) if logits.dim() == 3 else logits
    loss = CrossEntropyFunction.apply(logits2, targets.reshape(-1), int(ignore_index), reduction,
                                      bool(inplace_grad), torch.is_grad_enabled())
    return loss.view(targets.shape) if reduction == "none" else loss


def ideal_bytes(n_rows: int, vocab: int, dtype: torch.dtype, backward: bool = False,
                target_dtype: torch.dtype = torch.int64) -> int:
    """Bytes the fused kernel must move at least: read the logits and targets, write fp32 losses,
    and with `backward` write the gradient once (the upstream-gradient rescale is skipped on the
    GPU when that gradient is 1.0, as for `loss.backward()`; any other value rereads and rewrites it)."""
    elt, t_elt = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=target_dtype).element_size()
    logits = n_rows * vocab * elt
    return logits * (2 if backward else 1) + n_rows * (t_elt + 4)


# ------------------------------------------------------------------------------------------------
# Hugging Face drop-in: the causal-LM loss
# ------------------------------------------------------------------------------------------------
def causal_targets(labels: torch.Tensor | None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """HF's causal shift without copying logits or hidden states: targets[t] = labels[t + 1], last ignored."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    return shift_labels


def hf_reduction(loss_with, num_items_in_batch):
    """HF's causal-LM reduction: the mean over non-ignored tokens, or, under gradient accumulation,
    the sum divided by `num_items_in_batch` (the token count of the whole accumulated batch).
    `loss_with(reduction)` computes the loss with "mean" or "sum"."""
    if num_items_in_batch is None:
        return loss_with("mean")
    loss = loss_with("sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fused_causal_lm_loss(inplace_grad: bool = True):
    """A drop-in for Hugging Face's `ForCausalLMLoss` that calls the fused cross-entropy.

    Same semantics: labels shifted left with `ignore_index` padding (the logits are not shifted,
    so no [tokens, vocab] copy is made), mean over non-ignored tokens, or sum / num_items_in_batch
    under gradient accumulation. Unlike HF it does not upcast the logits to fp32: the kernel reads
    bf16 and computes in fp32. With `inplace_grad` the gradient overwrites the logits during the
    forward pass: after `model(..., labels=...)`, `outputs.logits` holds gradients, not logits.
    """

    def loss_fn(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, **kwargs):
        logits2 = logits.view(-1, vocab_size)
        targets = causal_targets(labels, ignore_index, shift_labels).reshape(-1).to(logits.device)
        return hf_reduction(lambda reduction: cross_entropy(logits2, targets, ignore_index, reduction, inplace_grad),
                            num_items_in_batch)

    return loss_fn


def patch_model(model, inplace_grad: bool = True) -> int:
    """Make a Hugging Face causal LM compute its loss with the fused cross-entropy; returns 1.

    `model.loss_function` is what every supported family's forward calls on its logits.
    """
    model_type(model)  # a clear error for a family the kernels do not know
    model.loss_function = fused_causal_lm_loss(inplace_grad)
    return 1


def expected_patches(config) -> int:
    """One replacement whatever the architecture: the model's loss function."""
    return 1


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      reduction: str = "mean") -> torch.Tensor:
    """PyTorch on fp32-upcast logits, as Hugging Face computes its loss (NaN when all ignored)."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       ignore_index=ignore_index, reduction=reduction).view(
        targets.shape if reduction == "none" else ())
