"""Fused linear cross-entropy: the language-model head and its loss, without the full logits.

    loss = cross_entropy(x @ W.T, targets)      x: [N, H] hidden states, W: [V, H] lm_head weight

What you build here: the last layer of the model and its loss in one custom op that walks the
tokens in chunks. For each chunk it multiplies (cuBLAS, tensor cores), runs the fused
cross-entropy kernel of step 3 on the chunk's logits, which turns them into their gradient in place,
and spends that gradient right away on both input gradients. The [N, V] logits never exist; one
[chunk, V] buffer is reused for every chunk.
What you learn: when a fused op should be a *composition* of a Triton kernel and cuBLAS rather than
one big Triton kernel, how to pick a chunk size from a memory budget, why the weight gradient needs
an fp32 accumulator across chunks, and how to keep a chunked loop free of host syncs.

Count the bytes (and the flops) before timing anything
------------------------------------------------------
LLaMA 3.1 8B: H = 4096, V = 128256. At N = 16384 tokens:
- Unfused (Hugging Face), the logits are N x V = 2.1 G elements: 4.2 GB in bf16, and HF upcasts
  them to fp32 for the loss (8.4 GB), then autograd keeps fp32 copies for backward: ~24 GB peak.
- The work itself is three matmuls of 2 N H V flops each:
      forward  logits = x @ W.T                  2 N H V
      backward dx     = dlogits @ W              2 N H V
               dW     = dlogits.T @ x            2 N H V
  6 N H V = 5.2e13 flops = 65 ms at the ~790 TFLOP/s an H200 sustains in bf16 matmuls. That is the
  floor; the cross-entropy between the matmuls streams 4 bytes per logit (~1 ms per 4k tokens).
  This op is compute bound: the goal is to stay at the matmul floor while using almost no memory.
  `flops()` gives these counts; `ideal_bytes()` the least traffic an ideal fused kernel has (read
  x, W and the targets, write the fp32 per-token losses; backward writes dx and dW once):
      forward:              (16384 + 128256) * 4096 * 2 + 16384 * (8 + 4) = 1,185,087,488 B
      forward + backward: 2 * (16384 + 128256) * 4096 * 2 + 16384 * (8 + 4) = 2,369,978,368 B
  2.37 GB is 0.56 ms at 4.27 TB/s, against 65 ms of matmuls: the bytes are not what limits it.

The design, and the trade-off it makes
--------------------------------------
Chunk over tokens. For a chunk of C tokens:
    logits_c = x_c @ W.T                 -> a reused [C, V] buffer (bf16; C x V x 2 bytes)
    cross-entropy kernel on logits_c     -> per-row losses; the gradient overwrites logits_c
    dx_c     = logits_c @ W              -> written straight into its rows of dx
    dW      += logits_c.T @ x_c          -> an accumulator over the chunks
Each logit is computed once, so the flops stay at 6 N H V, and the gradient is produced in the same
pass as the loss (the backward pass is only a rescale, below).

The weight gradient sums over *all* N tokens, across chunks. Adding each chunk's bf16 result into a
bf16 running sum rounds the sum once per chunk; an fp32 accumulator (cuBLAS adds the chunk's fp32
product into it: `addmm` with `out_dtype=float32`) keeps the sum as exact as one big matmul.
The price is V x H x 4 bytes = 2.1 GB for LLaMA 3.1 8B. `accumulate_fp32=False` accumulates in
the weight's dtype instead (cuBLAS still sums each chunk in fp32; only the running sum is
rounded, once per chunk) and needs no accumulator at all. With one chunk the two are identical.
(Keeping fp32 accuracy *and* no accumulator is possible by walking the vocabulary instead, but it
must recompute the logits once more: 8 N H V flops, 33% more.)

The memory budget, counted: what one forward + backward allocates beyond what was live, at
N = 16384, H = 4096, V = 128256 in bf16 (MB = 10^6 bytes):
    dx, returned                      N x H x 2          =   134 MB   (any implementation)
    dW, returned                      V x H x 2          = 1,051 MB   (any implementation)
    fp32 dW accumulator (several chunks, accumulate_fp32)   V x H x 4 = 2,101 MB
    the chunk's logits buffer         C x V x 2          =   263 MB per 1024 tokens of C
    per-token losses, counts          N x 4 + ...        =  < 1 MB
  accumulate_fp32, C = 2048:   134 + 1,051 + 2,101 + 525 = 3,811 MB  (3,812 measured, H200)
  accumulate_fp32, C = 1024:   134 + 1,051 + 2,101 + 263 = 3,549 MB
  weight's dtype,  C = 2048:   134 + 1,051         + 525 = 1,710 MB  (1,710 measured)
  weight's dtype,  C = 1024:   134 + 1,051         + 263 = 1,448 MB
The two gradients alone take 1,185 MB, so 1.5 GB above what was live leaves ~315 MB for
everything else: a chunk of at most ~1,200 tokens and *no* fp32 accumulator. At fp32 accuracy no
chunking reaches it; the accumulator is the cost (and the vocabulary walk above, which needs none,
costs a third more matmul work instead). Smaller chunks save only C x V x 2 bytes and make every
dW product shorter (K = C) while its fp32 output is read and written once per chunk, so they are
slower (results/runs/flce_chunks_H200.log times both at N = 8192).
So the default stays at 2048-token chunks with the fp32 accumulator, and `accumulate_fp32=False,
chunk=1024` is the setting that fits 1.5 GB, at one bf16 rounding of the dW sum per chunk.

No host syncs: the mean's token count is counted on the GPU once and handed to every chunk's
kernel through a pointer, and the upstream gradient (usually exactly 1.0) is applied in backward
by the cross-entropy's row-scaling kernel, which skips rows whose factor is 1 on the GPU.
`reduction="none"` has one upstream value per token, known only in backward; then forward computes
just the losses and backward recomputes each chunk's logits with the factors applied (8 N H V).

Conventions are the cross-entropy kernel's: `ignore_index` rows give loss 0 and no gradient; mean
over non-ignored rows, 0.0 (attached to the graph) when all are ignored; a target outside [0, V)
gives NaN; the loss is fp32. Tied embeddings (W shared with the input embedding) need nothing
special: autograd adds this op's dW to the embedding's gradient. A frozen weight (LoRA adapters
train beside a frozen lm_head) costs no dW work and no memory: neither the fp32 accumulator nor dW
is allocated, and the chunk loop skips the dW matmuls. Second-order gradients raise an error.

Bias and options. A biased lm_head's `bias` [V] is added by the chunk's matmul itself (`addmm`),
and its gradient is the column sum of each chunk's logit gradient, accumulated in fp32 ([V]
floats). The cross-entropy's options (class weights as `ce_weight`, since `weight` is the
lm_head's; label_smoothing, lse_square_scale, softcap and the return_* extras) go to every chunk's
kernel, with the whole batch's divisors counted once on the GPU. The Hugging Face drop-in passes
the lm_head's bias and Gemma 2's `final_logit_softcapping` as `softcap`.

The chunked pass is a custom op, `torch.ops.playbook.linear_cross_entropy_fwd`, with its fake
implementation and its autograd registered (torch.library.register_autograd: the backward scales
the gradients the op returned, or, for reduction="none", calls `linear_cross_entropy_bwd`). So
`torch.compile`, `torch.library.opcheck` and FSDP see one opaque op and never trace the loop, its
Triton launches or its mixed-dtype cuBLAS calls. The in-place gradient happens inside the op, in
its own chunk buffer, so the op mutates none of its inputs.

Layout of this file, one ladder: the Triton kernel is the cross-entropy's (cross_entropy_kernel.py)
-> chunked pass (the launcher) -> custom ops (fake and autograd registered) ->
`linear_cross_entropy` -> `TritonLinearCrossEntropyLoss`, the drop-in module -> `patch_model` for
Hugging Face models -> `linear_cross_entropy_ref`.

    $ python linear_cross_entropy_test.py   # every check against PyTorch in float64, as a report
"""

import types
from typing import Optional

import torch
from torch import nn

from cross_entropy_kernel import cross_entropy_forward, cross_entropy_ref, scale_grad, scale_gradient_
from core.losses import (PLAIN, LossOptions, causal_targets, check_first_order, check_options,
                                  check_targets_and_reduction, hf_reduction, loss_output, reduce_loss,
                                  target_weight_sum)
from core.kernel_utils import check_device, check_float
from core.model_families import model_type

# Memory budget of the reused logits buffer. 512 MiB holds 2048 tokens of a 128256-entry
# vocabulary in bf16 (2048 x 128256 x 2 B = 525 MB): matmuls of 2048 x 4096 x 128256 are large
# enough to run at full tensor-core rate.
CHUNK_BYTES = 512 * 2**20
CHUNK_MULTIPLE = 128  # chunk sizes stay multiples of a tensor-core tile


def chunk_tokens(n: int, vocab: int, dtype: torch.dtype, budget_bytes: int | None = None,
                 accumulator_bytes: int = 0) -> int:
    """Tokens per chunk so that one [chunk, V] logits buffer fits in `budget_bytes`.

    Several chunks need an fp32 weight-gradient accumulator of `accumulator_bytes`; one chunk needs
    none. So when the whole batch's logits fit in the buffer budget plus that accumulator, the batch
    is one chunk: no more memory than chunking would take, one large matmul per product instead of
    several, and no fp32 sum to read and write back per chunk. LLaMA 3.1 8B at 4 x 2048 tokens:
    8192 x 128256 x 2 B = 2.1 GB of logits <= 0.54 GB + 2.1 GB, so one chunk, which is both faster
    and smaller at its peak than chunks of 2048 (docs/kernels.md gives the figures).
    """
    budget_bytes = CHUNK_BYTES if budget_bytes is None else budget_bytes
    per_token = vocab * torch.empty((), dtype=dtype).element_size()
    if n * per_token <= budget_bytes + accumulator_bytes:
        return max(1, n)
    return tokens_per_chunk(n, per_token, budget_bytes)


def tokens_per_chunk(n: int, bytes_per_token: int, budget_bytes: int) -> int:
    """The most tokens, in multiples of CHUNK_MULTIPLE (at least one multiple) and at most n, whose
    buffers of `bytes_per_token` each fit in `budget_bytes`."""
    c = max(CHUNK_MULTIPLE, budget_bytes // bytes_per_token // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return max(1, min(n, c))


# ------------------------------------------------------------------------------------------------
# Matmul helpers: the weight-gradient accumulation
# ------------------------------------------------------------------------------------------------
def accumulate_grad_weight(acc: torch.Tensor, g: torch.Tensor, x: torch.Tensor, first: bool) -> None:
    """acc (+)= g.T @ x, with the products summed in fp32 and added to `acc` in its own dtype."""
    gt = g.t()
    if acc.dtype == g.dtype:  # same dtype: a plain (add)mm, cuBLAS accumulates in fp32 inside
        if first:
            torch.mm(gt, x, out=acc)
        else:
            acc.addmm_(gt, x)
    elif acc.is_cuda:  # bf16/fp16 inputs, fp32 accumulator: cuBLAS writes fp32 directly
        if first:
            torch.ops.aten.mm.dtype_out(gt, x, torch.float32, out=acc)
        else:
            torch.ops.aten.addmm.dtype_out(acc, gt, x, torch.float32, out=acc)
    else:  # CPUs have no mixed-dtype matmul; upcast (only ever small shapes there)
        if first:
            torch.mm(gt.float(), x.float(), out=acc)
        else:
            acc.addmm_(gt.float(), x.float())


def linear_cross_entropy_pass(x, weight, targets, ignore_index, reduction, want_dx, want_dw,
                              accumulate_fp32=True, chunk=None, row_scale=None, bias=None, want_db=False,
                              options=PLAIN, want_z=False, want_pred=False):
    """One chunked sweep over the tokens. Returns (loss, dx, dW, dbias, z-loss, argmax rows), each
    None when not wanted.

    x [N, H], weight [V, H], bias [V] or None, targets [N]; `options` (a checked LossOptions) are
    the cross-entropy kernel's. With `row_scale` ([N], backward of reduction="none") each row's
    gradient is multiplied by its upstream value before the gradient matmuls (and the bias sum).
    """
    N, H = x.shape
    V = weight.shape[0]
    device = x.device
    fp32_acc_bytes = V * H * 4 if (want_dw and accumulate_fp32 and weight.dtype != torch.float32) else 0
    chunk = chunk or chunk_tokens(N, V, x.dtype, accumulator_bytes=fp32_acc_bytes)
    n_chunks = -(-N // chunk) if N else 0
    want_grad = want_dx or want_dw or want_db
    kernel_reduction = "sum" if row_scale is not None else reduction
    # "mean" divides every chunk's gradient by the whole batch's count (or, with class weights, the
    # sum of its targets' weights), computed once, on the GPU
    n_valid = (targets != ignore_index).sum() if kernel_reduction == "mean" else None
    weight_sum = target_weight_sum(targets, ignore_index, options.weight) \
        if options.weight is not None and kernel_reduction == "mean" else None
    loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    z_rows = torch.empty(N, dtype=torch.float32, device=device) if options.lse_square_scale != 0 else None
    pred_rows = torch.empty(N, dtype=torch.int64, device=device) if want_pred else None
    dx = torch.empty_like(x) if want_dx else None
    dw = acc = None
    if want_dw:
        dw = torch.empty_like(weight) if N else torch.zeros_like(weight)
        acc = dw if (n_chunks <= 1 or not accumulate_fp32 or weight.dtype == torch.float32) else \
            torch.empty(weight.shape, dtype=torch.float32, device=device)
    # the bias gradient is a column sum of the logits' gradient: [V] fp32, whatever accumulate_fp32
    db_acc = torch.zeros(V, dtype=torch.float32, device=device) if want_db else None
    buf = torch.empty((min(chunk, N), V), dtype=x.dtype, device=device) if N else None
    for i in range(n_chunks):
        s, e = i * chunk, min(N, (i + 1) * chunk)
        xc, logits = x[s:e], buf[: e - s]
        if bias is None:
            torch.mm(xc, weight.t(), out=logits)
        else:
            torch.addmm(bias, xc, weight.t(), out=logits)
        # The gradient (already divided by the global count for "mean") replaces the logits.
        cross_entropy_forward(logits, targets[s:e], ignore_index, kernel_reduction, want_grad, True,
                              n_valid=n_valid, loss_rows=loss_rows[s:e], options=options, weight_sum=weight_sum,
                              z_rows=None if z_rows is None else z_rows[s:e],
                              pred_rows=None if pred_rows is None else pred_rows[s:e])
        if not want_grad:
            continue
        if row_scale is not None:
            scale_gradient_(logits, row_scale[s:e])
        if want_dx:
            torch.mm(logits, weight, out=dx[s:e])
        if want_dw:
            accumulate_grad_weight(acc, logits, xc, first=i == 0)
        if want_db:
            db_acc += logits.sum(0, dtype=torch.float32)
    if acc is not None and acc is not dw:
        dw.copy_(acc)
    db = db_acc.to(bias.dtype) if want_db else None
    loss = reduce_loss(loss_rows, reduction, n_valid, z_rows, weight_sum) if row_scale is None else None
    z = None
    if want_z:  # no z-loss asked for (lse_square_scale = 0): it is 0
        z = reduce_loss(z_rows, reduction, n_valid) if z_rows is not None else \
            loss_rows.new_zeros(loss_rows.shape if reduction == "none" else ())
    return loss, dx, dw, db, z, pred_rows


def _check_inputs(x, weight, targets, reduction, bias=None):
    check_float("x", x)
    check_float("weight", weight)
    check_targets_and_reduction(targets, reduction)
    check_device(x, weight, targets)
    if x.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(f"expected x [N, H], weight [V, H] and targets [N], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(targets.shape)}")
    if x.shape[1] != weight.shape[1] or targets.shape[0] != x.shape[0]:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)} (must be "
                         f"[V, {x.shape[1]}]), targets {tuple(targets.shape)} (must be [{x.shape[0]}])")
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight must have the same dtype, got {x.dtype} and {weight.dtype}")
    if weight.shape[0] == 0:
        raise ValueError("weight has a vocabulary of size 0")
    if bias is not None:
        check_float("bias", bias)
        check_device(x, bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (one per row of weight), "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias must have the dtype of x and weight ({x.dtype}), got {bias.dtype}")


# ------------------------------------------------------------------------------------------------
# Custom ops: one opaque node each for torch.compile, opcheck and FSDP. Gradients and extras that
# are not wanted come back as empty placeholders (an op returns the same number of tensors every
# time). The arguments after `chunk` default to the plain loss: no bias, no options, no extras.
# ------------------------------------------------------------------------------------------------
def _or_empty(t: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t if t is not None else like.new_empty(0, dtype=dtype)


@torch.library.custom_op("playbook::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
            want_dx: bool, want_dw: bool, accumulate_fp32: bool, chunk: Optional[int],
            bias: Optional[torch.Tensor] = None, want_db: bool = False, ce_weight: Optional[torch.Tensor] = None,
            label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: Optional[float] = None,
            want_z: bool = False, want_pred: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dx, dW, dbias, z-loss, argmax rows), the gradients for an upstream gradient of 1.

    want_dx / want_dw / want_db say which gradients the backward will need. They are computed here,
    in the same pass as the loss, except for reduction="none": one upstream value per token is known
    only in backward, so then this pass computes the losses alone and the backward op the gradients
    (see the module docstring). What is not computed comes back as an empty placeholder."""
    options = LossOptions(ce_weight, label_smoothing, lse_square_scale, softcap)
    now = reduction != "none"
    loss, dx, dw, db, z, pred = linear_cross_entropy_pass(x, weight, targets, ignore_index, reduction,
                                                          want_dx and now, want_dw and now, accumulate_fp32,
                                                          chunk, bias=bias, want_db=want_db and now,
                                                          options=options, want_z=want_z, want_pred=want_pred)
    return (loss, _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight),
            _or_empty(z, loss, torch.float32), _or_empty(pred, loss, torch.int64))


@torch.library.custom_op("playbook::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor,
            ignore_index: int, want_dx: bool, want_dw: bool, accumulate_fp32: bool, chunk: Optional[int],
            bias: Optional[torch.Tensor] = None, want_db: bool = False, ce_weight: Optional[torch.Tensor] = None,
            label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
            softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of reduction="none": (dx, dW, dbias) with row i's gradient scaled by grad_rows[i]."""
    options = LossOptions(ce_weight, label_smoothing, lse_square_scale, softcap)
    _, dx, dw, db, _, _ = linear_cross_entropy_pass(x, weight, targets, ignore_index, "none", want_dx, want_dw,
                                                    accumulate_fp32, chunk, row_scale=grad_rows, bias=bias,
                                                    want_db=want_db, options=options)
    return _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@_fwd_op.register_fake
def _(x, weight, targets, ignore_index, reduction, want_dx, want_dw, accumulate_fp32, chunk, bias=None,
      want_db=False, ce_weight=None, label_smoothing=0.0, lse_square_scale=0.0, softcap=None, want_z=False,
      want_pred=False):
    now = reduction != "none"
    loss_shape = (x.shape[0],) if reduction == "none" else ()
    loss = x.new_empty(loss_shape, dtype=torch.float32)
    dx = x.new_empty(x.shape if want_dx and now else (0,))
    dw = weight.new_empty(weight.shape if want_dw and now else (0,))
    db = weight.new_empty((weight.shape[0],) if want_db and now else (0,))
    z = x.new_empty(loss_shape if want_z else (0,), dtype=torch.float32)
    pred = x.new_empty((x.shape[0],) if want_pred else (0,), dtype=torch.int64)
    return loss, dx, dw, db, z, pred


@_bwd_op.register_fake
def _(x, weight, targets, grad_rows, ignore_index, want_dx, want_dw, accumulate_fp32, chunk, bias=None,
      want_db=False, ce_weight=None, label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
    return (x.new_empty(x.shape if want_dx else (0,)), weight.new_empty(weight.shape if want_dw else (0,)),
            weight.new_empty((weight.shape[0],) if want_db else (0,)))


# Autograd of the forward op (torch.library.register_autograd): the gradients it returned are saved
# and, in backward, scaled by the upstream gradient; for reduction="none" the inputs are saved and
# the backward op computes the gradients. The op's other outputs are not differentiable.
def _setup_context(ctx, inputs, output):
    (x, weight, targets, ignore_index, reduction, want_dx, want_dw, accumulate_fp32, chunk, bias, want_db,
     ce_weight, label_smoothing, lse_square_scale, softcap, _, _) = inputs
    _, dx, dw, db, z, pred = output
    ctx.mark_non_differentiable(dx, dw, db, z, pred)
    ctx.args = (ignore_index, accumulate_fp32, chunk, label_smoothing, lse_square_scale, softcap)
    ctx.want = (want_dx, want_dw, want_db)
    ctx.consumed = False
    ctx.deferred = reduction == "none"
    if ctx.deferred:
        ctx.save_for_backward(x, weight, targets, bias, ce_weight)
    else:
        ctx.save_for_backward(dx, dw, db)


def _backward(ctx, grad_loss, *unused_grads):
    check_first_order("fused linear cross-entropy")
    if ctx.consumed:
        raise RuntimeError("the fused linear cross-entropy's gradients were already used by a previous "
                           "backward; run backward once per forward (retain_graph is not supported)")
    ctx.consumed = True
    ignore_index, accumulate_fp32, chunk, label_smoothing, lse_square_scale, softcap = ctx.args
    want_dx, want_dw, want_db = ctx.want
    if ctx.deferred:
        x, weight, targets, bias, ce_weight = ctx.saved_tensors
        dx, dw, db = torch.ops.playbook.linear_cross_entropy_bwd(
            x, weight, targets, grad_loss.float().contiguous(), ignore_index, want_dx, want_dw, accumulate_fp32,
            chunk, bias, want_db, ce_weight, label_smoothing, lse_square_scale, softcap)
    else:
        dx, dw, db = ctx.saved_tensors
        # Usually grad_loss is exactly 1.0 and (in eager mode) these launches skip every row.
        dx = scale_grad(dx, grad_loss) if want_dx else dx
        dw = scale_grad(dw, grad_loss) if want_dw else dw
        db = scale_grad(db.view(1, -1), grad_loss).view(-1) if want_db else db
    # one gradient per input of the op: x, weight, then bias (index 9); a placeholder becomes None
    return (dx if want_dx else None, dw if want_dw else None) + (None,) * 7 + \
        (db if want_db else None,) + (None,) * 7


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# Functional API
# ------------------------------------------------------------------------------------------------
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", accumulate_fp32: bool = True, chunk: int | None = None, *,
                         bias: torch.Tensor | None = None, ce_weight: torch.Tensor | None = None,
                         label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                         return_z_loss: bool = False, return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False):
    """cross_entropy(x @ weight.T + bias, targets) without materialising the logits; differentiable.

    x [..., H] (flattened to [N, H]), weight [V, H], targets [...] matching x's leading shape, any
    stride. reduction="none" returns one loss per token, flattened to [N].
    accumulate_fp32: sum the weight gradient across chunks in an fp32 buffer (V x H x 4 bytes);
    False rounds the running sum to the weight's dtype once per chunk and needs no buffer.
    chunk: tokens per chunk (default: a [chunk, V] buffer of at most CHUNK_BYTES, or the whole batch
        when its logits take no more than that buffer and the fp32 accumulator; see chunk_tokens).

    Keyword-only options: bias [V] (the lm_head's bias; differentiable), and the cross-entropy's
    options with its names and meaning, `ce_weight` being its class weights (`weight` is the
    lm_head's): label_smoothing, lse_square_scale (z-loss), softcap, return_z_loss,
    return_token_accuracy, return_predicted_tokens (then a CrossEntropyOutput is returned, the
    predicted tokens flattened to [N]).
    """
    if isinstance(x, torch.Tensor) and isinstance(targets, torch.Tensor) and x.dim() >= 2 \
            and tuple(targets.shape) == tuple(x.shape[:-1]):
        x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    options = dict(bias=bias, ce_weight=ce_weight, label_smoothing=label_smoothing,
                   lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                   return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
    device_type = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    # (the devices with autocast, named: the meta device has none, and torch.compile of torch 2.11 cannot
    # trace torch.amp.is_autocast_available)
    if isinstance(x, torch.Tensor) and device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        # Under autocast (fp32 weights, bf16 compute) the head's matmul would run in the autocast
        # dtype, as nn.Linear does; cast the inputs once (autograd casts the gradients back) and
        # run the chunked loop with autocast off, so its out= matmuls see one dtype.
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        if isinstance(bias, torch.Tensor):
            options["bias"] = bias.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(x, weight, targets, ignore_index, reduction, accumulate_fp32, chunk,
                                        **options)
    _check_inputs(x, weight, targets, reduction, bias)
    loss_options = check_options(weight.shape[0], x.device, ce_weight, label_smoothing, lse_square_scale, softcap,
                                 weight_name="ce_weight")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    # Which gradients a backward can ask for: an input that requires grad, in grad mode (under
    # torch.no_grad() the op computes the loss alone, whatever the inputs require).
    grad_mode = torch.is_grad_enabled()
    want_dx, want_dw = grad_mode and x.requires_grad, grad_mode and weight.requires_grad
    want_db = grad_mode and bias is not None and bias.requires_grad
    want_pred = bool(return_token_accuracy or return_predicted_tokens)
    loss, _, _, _, z, pred = torch.ops.playbook.linear_cross_entropy_fwd(
        x.contiguous(), weight.contiguous(), targets, int(ignore_index), reduction, want_dx, want_dw,
        bool(accumulate_fp32), chunk, None if bias is None else bias.contiguous(), want_db, *loss_options,
        bool(return_z_loss), want_pred)
    if not (return_z_loss or want_pred):
        return loss
    return loss_output(loss, z, pred, targets, int(ignore_index), return_z_loss, return_token_accuracy,
                       return_predicted_tokens, targets.shape)


# ------------------------------------------------------------------------------------------------
# Drop-in module
# ------------------------------------------------------------------------------------------------
class TritonLinearCrossEntropyLoss(nn.Module):
    """The language-model head and its cross-entropy as one module: the logits are never built.

        loss_fn = TritonLinearCrossEntropyLoss(ignore_index=-100)
        loss = loss_fn(hidden, model.lm_head.weight, labels)  # hidden [B, T, H], labels [B, T]

    forward(hidden [..., H], lm_weight [V, H], target [...], bias=None) returns what
    `nn.CrossEntropyLoss(...)(nn.functional.linear(hidden, lm_weight, bias), target)` returns
    (flattened to [N, V] and [N]; reduction="none" gives the target's shape), with the
    conventions of `linear_cross_entropy`: fp32 loss, 0.0 when every row is ignored, NaN for a
    target outside [0, V). hidden, lm_weight and bias share one dtype (fp32, bf16 or fp16).

    Arguments: ignore_index, reduction ("mean", "sum", "none"), ce_weight (class weights [V], a
    buffer; named apart from the lm_head's weight), label_smoothing (as PyTorch's), z_loss (adds
    z_loss * logsumexp^2 per non-ignored token), softcap (Gemma 2's tanh cap of the logits),
    accumulate_fp32 and chunk (see `linear_cross_entropy`).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", ce_weight: torch.Tensor | None = None,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 accumulate_fp32: bool = True, chunk: int | None = None):
        super().__init__()
        check_targets_and_reduction(torch.empty(0, dtype=torch.int64), reduction)
        if ce_weight is not None and not (isinstance(ce_weight, torch.Tensor) and ce_weight.dim() == 1):
            got = tuple(ce_weight.shape) if isinstance(ce_weight, torch.Tensor) else type(ce_weight).__name__
            raise ValueError(f"ce_weight (class weights) must be a 1-D tensor [V], got {got}")
        # the vocabulary is known only in forward, which checks the class weights' length against it
        check_options(0 if ce_weight is None else ce_weight.shape[0], None if ce_weight is None else ce_weight.device,
                      ce_weight, label_smoothing, z_loss, softcap, weight_name="ce_weight")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction = int(ignore_index), reduction
        self.label_smoothing, self.z_loss = float(label_smoothing), float(z_loss)
        self.softcap = None if softcap is None else float(softcap)
        self.accumulate_fp32, self.chunk = bool(accumulate_fp32), chunk

    def forward(self, hidden: torch.Tensor, lm_weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        loss = linear_cross_entropy(hidden, lm_weight, target, self.ignore_index, self.reduction, self.accumulate_fp32,
                                    self.chunk, bias=bias, ce_weight=self.ce_weight,
                                    label_smoothing=self.label_smoothing, lse_square_scale=self.z_loss,
                                    softcap=self.softcap)
        return loss.view(target.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        options = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        options += [f"{name}={getattr(self, name)}" for name in ("label_smoothing", "z_loss", "softcap", "chunk")
                    if getattr(self, name) not in (0.0, None)]
        return ", ".join(options + ([] if self.accumulate_fp32 else ["accumulate_fp32=False"]))


def flops(n_tokens: int, hidden: int, vocab: int, backward: bool = True) -> int:
    """Matmul flops of the op: 2 N H V for the logits, plus 2 N H V each for dx and dW in backward.
    (reduction="none" recomputes the logits in backward: 8 N H V in all; this counts the ideal.)"""
    return (6 if backward else 2) * n_tokens * hidden * vocab


def ideal_bytes(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, backward: bool = False,
                target_dtype: torch.dtype = torch.int64) -> int:
    """Least traffic of an ideal fused kernel: read x, W and the targets, write fp32 per-token losses;
    with `backward`, write dx and dW once each (the logits and any accumulator stay on chip)."""
    elt, t_elt = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=target_dtype).element_size()
    inputs = (n_tokens + vocab) * hidden * elt  # x and W (dx and dW have the same sizes)
    return inputs * (2 if backward else 1) + n_tokens * (t_elt + 4)


# ------------------------------------------------------------------------------------------------
# Hugging Face drop-in: the causal LM's forward, lm_head fused with the loss
# ------------------------------------------------------------------------------------------------
def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """`XxxForCausalLM.forward` with the lm_head fused into the loss whenever labels are given.

    With labels the [batch, seq, vocab] logits are never computed: `outputs.loss` comes from the
    fused linear cross-entropy (same shift, ignore_index and mean or sum / num_items_in_batch as
    Hugging Face; the lm_head's bias, if any; Gemma 2's `final_logit_softcapping` as `softcap`)
    and `outputs.logits` is None. Without labels (generation, evaluation of logits) it computes
    the logits exactly as the original forward does, capped the same way.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    cache = _cache_name()
    if past_key_values is not None:  # the KV cache under its older name (a `cache=` argument is in kwargs)
        kwargs[cache] = past_key_values
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    softcap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2: 30.0; most families: none
    loss = logits = None
    if labels is not None or shift_labels is not None:
        targets = causal_targets(labels, ignore_index, shift_labels).to(hidden.device)
        weight, bias = lm_head_params(self)
        loss = hf_reduction(lambda reduction: linear_cross_entropy(hidden, weight, targets, ignore_index, reduction,
                                                                   bias=bias, softcap=softcap),
                            num_items_in_batch)
    else:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
    return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions, **{cache: getattr(outputs, cache)})


_CACHE_NAME = {}  # filled by patch_model, outside any compiled forward


def _cache_name() -> str:
    """What this transformers calls the KV cache, as an argument and an output field: `cache` from 5.24
    on, `past_key_values` before (5.24 warns at every call that passes the old name, and 5.40 drops it)."""
    if "name" not in _CACHE_NAME:
        import dataclasses

        from transformers.modeling_outputs import CausalLMOutputWithPast

        fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
        _CACHE_NAME["name"] = "cache" if "cache" in fields else "past_key_values"
    return _CACHE_NAME["name"]


def lm_head_params(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias or None) of the model's lm_head, refusing a head wrapped by an adapter (the
    fused op would skip the adapter's update)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or hasattr(head, "base_layer"):
        raise NotImplementedError(f"the fused linear cross-entropy needs a plain `lm_head` with a weight; "
                                  f"this model's is {type(head).__name__}")
    return weight, getattr(head, "bias", None)


def patch_model(model) -> int:
    """Make a Hugging Face causal LM fuse its lm_head with the loss whenever labels are given; returns 1.

    The model's `forward` is replaced by `causal_lm_forward` (on this instance only).
    """
    model_type(model)  # a clear error for a family the kernels do not know
    lm_head_params(model)
    _cache_name()
    model.forward = types.MethodType(causal_lm_forward, model)
    return 1


def expected_patches(config) -> int:
    """One replacement whatever the architecture: the causal LM's forward."""
    return 1


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def linear_cross_entropy_ref(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "mean", *, bias: torch.Tensor | None = None,
                             ce_weight: torch.Tensor | None = None, label_smoothing: float = 0.0,
                             lse_square_scale: float = 0.0, softcap: float | None = None) -> torch.Tensor:
    """What Hugging Face does: full logits, upcast to fp32 (float64 stays float64), PyTorch's
    cross-entropy (`cross_entropy_ref`, with the same options). reduction="none" gives [N]."""
    logits = nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return cross_entropy_ref(logits, targets.reshape(-1), ignore_index, reduction, weight=ce_weight,
                             label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
                             dtype=torch.promote_types(logits.dtype, torch.float32))
