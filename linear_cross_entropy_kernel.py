"""Fused linear cross-entropy: the language-model head and its loss, without the full logits.

    loss = cross_entropy(x @ W.T, targets)      x: [N, H] hidden states, W: [V, H] lm_head weight

What you build here: the last layer of the model and its loss in one autograd.Function that walks
the tokens in chunks. For each chunk it multiplies (cuBLAS, tensor cores), runs the fused
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

The chunked pass is two custom ops (`torch.ops.playbook.linear_cross_entropy_fwd` / `_bwd`), so
`torch.compile` and FSDP see one opaque op and never trace the loop, its Triton launches or its
mixed-dtype cuBLAS calls.

Layout of this file: chunked pass (launcher) -> custom ops -> autograd.Function and functional
API -> Hugging Face drop-in (`patch_model`) -> reference.
"""

import types
from typing import Optional

import torch
from torch import nn

import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from cross_entropy_kernel import (causal_targets, check_first_order, check_targets_and_reduction,
                                  cross_entropy_forward, hf_reduction, reduce_loss, scale_grad,
                                  scale_gradient_)
from kernel_utils import check_device, check_float
from model_families import model_type

# Memory budget of the reused logits buffer. 512 MiB holds 2048 tokens of a 128256-entry
# vocabulary in bf16 (2048 x 128256 x 2 B = 525 MB): matmuls of 2048 x 4096 x 128256 are large
# enough to run at full tensor-core rate, and N = 8192 tokens (4 x 2048) take 4 chunks.
CHUNK_BYTES = 512 * 2**20
CHUNK_MULTIPLE = 128  # chunk sizes stay multiples of a tensor-core tile


def chunk_tokens(n: int, vocab: int, dtype: torch.dtype, budget_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one [chunk, V] logits buffer fits in `budget_bytes`."""
    per_token = vocab * torch.empty((), dtype=dtype).element_size()
    c = max(CHUNK_MULTIPLE, budget_bytes // per_token // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return max(1, min(n, c))


# ------------------------------------------------------------------------------------------------
# Matmul helpers: the weight-gradient accumulation
# ------------------------------------------------------------------------------------------------
def _accumulate_grad_weight(acc: torch.Tensor, g: torch.Tensor, x: torch.Tensor, first: bool) -> None:
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
                              accumulate_fp32=True, chunk=None, row_scale=None):
    """One chunked sweep over the tokens. Returns (loss, dx or None, dW or None).

    x [N, H], weight [V, H], targets [N]. With `row_scale` ([N], backward of reduction="none") each
    row's gradient is multiplied by its upstream value before the two gradient matmuls.
    """
    N, H = x.shape
    V = weight.shape[0]
    device = x.device
    chunk = chunk or chunk_tokens(N, V, x.dtype)
    n_chunks = -(-N // chunk) if N else 0
    want_grad = want_dx or want_dw
    kernel_reduction = "sum" if row_scale is not None else reduction
    # "mean" divides every chunk's gradient by the whole batch's count, counted once, on the GPU
    n_valid = (targets != ignore_index).sum() if kernel_reduction == "mean" else None
    loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    dx = torch.empty_like(x) if want_dx else None
    dw = acc = None
    if want_dw:
        dw = torch.empty_like(weight) if N else torch.zeros_like(weight)
        acc = dw if (n_chunks <= 1 or not accumulate_fp32 or weight.dtype == torch.float32) else \
            torch.empty(weight.shape, dtype=torch.float32, device=device)
    buf = torch.empty((min(chunk, N), V), dtype=x.dtype, device=device) if N else None
    for i in range(n_chunks):
        s, e = i * chunk, min(N, (i + 1) * chunk)
        xc, logits = x[s:e], buf[: e - s]
        torch.mm(xc, weight.t(), out=logits)
        # The gradient (already divided by the global count for "mean") replaces the logits.
        cross_entropy_forward(logits, targets[s:e], ignore_index, kernel_reduction, want_grad, True,
                              n_valid=n_valid, loss_rows=loss_rows[s:e])
        if not want_grad:
            continue
        if row_scale is not None:
            scale_gradient_(logits, row_scale[s:e])
        if want_dx:
            torch.mm(logits, weight, out=dx[s:e])
        if want_dw:
            _accumulate_grad_weight(acc, logits, xc, first=i == 0)
    if acc is not None and acc is not dw:
        dw.copy_(acc)
    loss = reduce_loss(loss_rows, reduction, n_valid) if row_scale is None else None
    return loss, dx, dw


def _check_inputs(x, weight, targets, reduction):
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


# ------------------------------------------------------------------------------------------------
# Custom ops: one opaque node each for torch.compile, opcheck and FSDP. Gradients that are not
# wanted come back as empty placeholders (an op returns the same number of tensors every time).
# ------------------------------------------------------------------------------------------------
def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("playbook::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
            want_dx: bool, want_dw: bool, accumulate_fp32: bool,
            chunk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dx, dW) for an upstream gradient of 1; dx / dW are empty when not wanted."""
    loss, dx, dw = linear_cross_entropy_pass(x, weight, targets, ignore_index, reduction, want_dx, want_dw,
                                             accumulate_fp32, chunk)
    return loss, _or_empty(dx, x), _or_empty(dw, weight)


@torch.library.custom_op("playbook::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor,
            ignore_index: int, want_dx: bool, want_dw: bool, accumulate_fp32: bool,
            chunk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of reduction="none": (dx, dW) with row i's gradient scaled by grad_rows[i]."""
    _, dx, dw = linear_cross_entropy_pass(x, weight, targets, ignore_index, "none", want_dx, want_dw,
                                          accumulate_fp32, chunk, row_scale=grad_rows)
    return _or_empty(dx, x), _or_empty(dw, weight)


@_fwd_op.register_fake
def _(x, weight, targets, ignore_index, reduction, want_dx, want_dw, accumulate_fp32, chunk):
    loss = x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    dx = x.new_empty(x.shape if want_dx else (0,))
    return loss, dx, weight.new_empty(weight.shape if want_dw else (0,))


@_bwd_op.register_fake
def _(x, weight, targets, grad_rows, ignore_index, want_dx, want_dw, accumulate_fp32, chunk):
    return x.new_empty(x.shape if want_dx else (0,)), weight.new_empty(weight.shape if want_dw else (0,))


# ------------------------------------------------------------------------------------------------
# autograd.Function and functional API
# ------------------------------------------------------------------------------------------------
class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index, reduction, accumulate_fp32, chunk, grad_enabled):
        x, weight = x.contiguous(), weight.contiguous()
        # needs_input_grad is True under torch.no_grad() too; grad_enabled is the caller's grad mode
        want_dx, want_dw = ctx.needs_input_grad[0] and grad_enabled, ctx.needs_input_grad[1] and grad_enabled
        ctx.args = (ignore_index, accumulate_fp32, chunk)
        ctx.want = (want_dx, want_dw)
        ctx.consumed = False
        # One upstream value per token (reduction="none") is known only in backward: compute the
        # losses now, and the gradients in backward (see the module docstring).
        ctx.deferred = reduction == "none" and (want_dx or want_dw)
        fwd = torch.ops.playbook.linear_cross_entropy_fwd
        if ctx.deferred:
            loss, _, _ = fwd(x, weight, targets, ignore_index, reduction, False, False, accumulate_fp32, chunk)
            ctx.save_for_backward(x, weight, targets)
        else:
            loss, dx, dw = fwd(x, weight, targets, ignore_index, reduction, want_dx, want_dw, accumulate_fp32, chunk)
            ctx.save_for_backward(dx, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        check_first_order("fused linear cross-entropy")
        if ctx.consumed:
            raise RuntimeError("the fused linear cross-entropy's gradients were already used by a previous "
                               "backward; run backward once per forward (retain_graph is not supported)")
        ctx.consumed = True
        ignore_index, accumulate_fp32, chunk = ctx.args
        want_dx, want_dw = ctx.want
        if ctx.deferred:
            x, weight, targets = ctx.saved_tensors
            dx, dw = torch.ops.playbook.linear_cross_entropy_bwd(
                x, weight, targets, grad_output.float().contiguous(), ignore_index, want_dx, want_dw,
                accumulate_fp32, chunk)
        else:
            dx, dw = ctx.saved_tensors
            # Usually grad_output is exactly 1.0 and (in eager mode) these launches skip every row.
            dx = scale_grad(dx, grad_output) if want_dx else dx
            dw = scale_grad(dw, grad_output) if want_dw else dw
        # a gradient that is not wanted is an empty placeholder: autograd gets None for it
        return dx if want_dx else None, dw if want_dw else None, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", accumulate_fp32: bool = True, chunk: int | None = None):
    """cross_entropy(x @ weight.T, targets) without materialising the logits; differentiable.

    x [..., H] (flattened to [N, H]), weight [V, H], targets [...] matching x's leading shape, any
    stride. reduction="none" returns one loss per token, flattened to [N].
    accumulate_fp32: sum the weight gradient across chunks in an fp32 buffer (V x H x 4 bytes);
    False rounds the running sum to the weight's dtype once per chunk and needs no buffer.
    chunk: tokens per chunk (default: a [chunk, V] buffer of at most CHUNK_BYTES).
    """
    if isinstance(x, torch.Tensor) and isinstance(targets, torch.Tensor) and x.dim() >= 2 \
            and tuple(targets.shape) == tuple(x.shape[:-1]):
        x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    device_type = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(device_type):
        # Under autocast (fp32 weights, bf16 compute) the head's matmul would run in the autocast
        # dtype, as nn.Linear does; cast both inputs once (autograd casts the gradients back) and
        # run the chunked loop with autocast off, so its out= matmuls see one dtype.
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(x, weight, targets, ignore_index, reduction, accumulate_fp32, chunk)
    _check_inputs(x, weight, targets, reduction)
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    return LinearCrossEntropyFunction.apply(x, weight, targets, int(ignore_index), reduction,
                                            bool(accumulate_fp32), chunk, torch.is_grad_enabled())


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

    With labels the [batch, seq, vocab] logits are never computed: `outputs.logits` is None and
    `outputs.loss` comes from the fused linear cross-entropy (same shift, ignore_index and mean or
    sum / num_items_in_batch as Hugging Face). Without labels (generation, evaluation of logits)
    it computes the logits exactly as the original forward does.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
    hidden = outputs.last_hidden_state
    loss = logits = None
    if labels is not None or shift_labels is not None:
        targets = causal_targets(labels, ignore_index, shift_labels).to(hidden.device)
        weight = lm_head_weight(self)
        loss = hf_reduction(lambda reduction: linear_cross_entropy(hidden, weight, targets, ignore_index, reduction),
                            num_items_in_batch)
    else:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def lm_head_weight(model) -> torch.Tensor:
    """The weight the fused op multiplies by, refusing heads it would compute wrongly: a biased
    lm_head (the op has no bias term) or one wrapped by an adapter (its update would be skipped)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or hasattr(head, "base_layer"):
        raise NotImplementedError(f"the fused linear cross-entropy needs a plain `lm_head` with a weight; "
                                  f"this model's is {type(head).__name__}")
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("the fused linear cross-entropy needs a bias-free `lm_head` "
                                  "(it computes x @ W.T); this model's lm_head has a bias")
    return weight


def patch_model(model) -> int:
    """Make a Hugging Face causal LM fuse its lm_head with the loss whenever labels are given; returns 1.

    The model's `forward` is replaced by `causal_lm_forward` (on this instance only).
    """
    model_type(model)  # a clear error for a family the kernels do not know
    lm_head_weight(model)
    model.forward = types.MethodType(causal_lm_forward, model)
    return 1


def expected_patches(config) -> int:
    """One replacement whatever the architecture: the causal LM's forward."""
    return 1


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def linear_cross_entropy_ref(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """What Hugging Face does: full logits, upcast to fp32, PyTorch's cross-entropy."""
    logits = x.reshape(-1, x.shape[-1]) @ weight.t()
    return nn.functional.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index,
                                       reduction=reduction)
