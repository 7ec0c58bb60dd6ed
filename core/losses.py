"""What every loss of the playbook shares: its options, checks, reductions and outputs, and Hugging Face's
causal-LM conventions.

    LossOptions, check_options           class weights, label smoothing, the z-loss and the logit cap, checked
    check_targets_and_reduction          int64 (or int32) class indices; "mean", "sum" or "none"
    target_weight_sum, reduce_loss       per-row losses to the requested reduction, as PyTorch divides
    CrossEntropyOutput, loss_output      the loss with its extras (z-loss, token accuracy, predicted tokens)
    check_first_order                    a fused loss's gradient is a buffer: no second derivative
    causal_targets, hf_reduction         Hugging Face's shifted labels and its gradient-accumulation reduction

The fused losses (cross_entropy_kernel.py, linear_cross_entropy_kernel.py, distillation_kernel.py) compute
their rows in Triton; what they hand back to PyTorch follows these rules, so that they agree with each other
and with PyTorch's own losses.
"""

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

REDUCTIONS = ("mean", "sum", "none")


class LossOptions(NamedTuple):
    """What a loss computes beyond plain cross-entropy; the defaults select the plain kernel."""

    weight: Optional[torch.Tensor] = None  # class weights [V], fp32, contiguous (see check_options)
    label_smoothing: float = 0.0  # eps in [0, 1]
    lse_square_scale: float = 0.0  # z-loss coefficient
    softcap: Optional[float] = None  # cap the logits at +-softcap with tanh


PLAIN = LossOptions()


def target_weight_sum(targets: torch.Tensor, ignore_index: int, weight: torch.Tensor) -> torch.Tensor:
    """The weighted mean's divisor: the sum of weight[target] over the non-ignored rows, as PyTorch
    divides by. A 0-d fp32 tensor computed on the device (no sync); out-of-range targets add 0."""
    V = weight.shape[0]
    counted = (targets != ignore_index) & (targets >= 0) & (targets < V)
    return torch.where(counted, weight[targets.clamp(0, V - 1)], 0.0).sum()


def reduce_loss(loss_rows: torch.Tensor, reduction: str, n_valid: torch.Tensor | None,
                z_rows: torch.Tensor | None = None, weight_sum: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row losses -> the requested reduction (mean over non-ignored rows; 0.0 when none are).

    With class weights the mean divides by `weight_sum` (the non-ignored targets' weights) instead,
    as PyTorch does; a sum of 0 counts as 1. The z-loss rows `z_rows` are added, averaged over the
    non-ignored rows (the z-loss is a property of a token's logits, not of its target's class).
    """
    if reduction == "none":
        return loss_rows if z_rows is None else loss_rows + z_rows
    if reduction == "sum":
        return loss_rows.sum() if z_rows is None else loss_rows.sum() + z_rows.sum()
    if weight_sum is None:
        loss = loss_rows.sum() / n_valid.clamp(min=1)
    else:
        loss = loss_rows.sum() / torch.where(weight_sum != 0, weight_sum, 1.0)
    return loss if z_rows is None else loss + z_rows.sum() / n_valid.clamp(min=1)


def check_targets_and_reduction(targets, reduction: str) -> None:
    """The checks every loss of this playbook makes on its targets and reduction."""
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an int64 (or int32) tensor of class indices, got {got}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_options(vocab: int, device: torch.device, weight=None, label_smoothing=0.0, lse_square_scale=0.0,
                  softcap=None, weight_name: str = "weight") -> LossOptions:
    """Check the loss options (Python numbers, and a [vocab] float tensor of class weights on
    `device`); returns them as the kernel takes them, the weights as fp32 and contiguous."""
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{weight_name} (class weights) must be a floating-point tensor, got {got}")
        if tuple(weight.shape) != (vocab,):
            raise ValueError(f"{weight_name} (class weights) must have shape [{vocab}] (one per class), "
                             f"got {tuple(weight.shape)}")
        if weight.device != device:
            raise ValueError(f"{weight_name} (class weights) is on {weight.device}, the logits on {device}")
        weight = weight.detach().to(torch.float32).contiguous()
    label_smoothing, lse_square_scale = float(label_smoothing), float(lse_square_scale)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(lse_square_scale) and lse_square_scale >= 0):
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {lse_square_scale}")
    if softcap is not None:
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a finite number > 0 (or None for no cap), got {softcap}")
    return LossOptions(weight, label_smoothing, lse_square_scale, softcap)


class CrossEntropyOutput(NamedTuple):
    """What a loss returns when any `return_*` flag is set; None for what is not asked for.

    loss: as without the flags (differentiable). z_loss: the z-loss term alone, reduced like the
    loss (already included in `loss`). token_accuracy: a 0-d fp32 fraction of the non-ignored
    tokens whose argmax is their target (0.0 when all are ignored), whatever the reduction.
    predicted_tokens: each token's argmax (int64, the targets' shape), -1 on ignored tokens.
    None of the extras is differentiable.
    """

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def loss_output(loss, z, pred, targets, ignore_index, return_z_loss, return_token_accuracy,
                return_predicted_tokens, shape) -> CrossEntropyOutput:
    """Assemble the extras: `pred` holds each row's argmax (-1 where ignored); `shape` is the
    per-token shape (reduction="none" losses and the predicted tokens take it)."""
    accuracy = None
    if return_token_accuracy:
        scored = targets != ignore_index
        accuracy = ((pred == targets) & scored).sum() / scored.sum().clamp(min=1)
    return CrossEntropyOutput(loss, z.view(loss.shape) if return_z_loss else None, accuracy,
                              pred.view(shape) if return_predicted_tokens else None)


def check_first_order(what: str) -> None:
    """Refuse `backward(create_graph=True)`: a fused loss's gradient is a buffer, not a function
    PyTorch can differentiate again, and a silent constant would make second derivatives zero."""
    # Autograd runs backward in grad mode only for create_graph=True. A compiled graph is traced in
    # grad mode whatever the caller does, and AOTAutograd refuses double backward itself.
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"the {what} has no second derivative: backward with create_graph=True "
                           "(double backward, gradient penalties) is not supported")


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
