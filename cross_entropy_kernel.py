"""Fused cross-entropy in Triton: loss and gradient in one pass over the logits (online softmax).

    loss_i = logsumexp(logits_i) - logits_i[target_i]
    dloss_i/dlogits_i = softmax(logits_i) - onehot(target_i)

What you build here: a kernel that reads each row of logits, computes its loss, and writes the
gradient of that loss right away, so that forward + backward together read the logits once and
write the gradient once (optionally into the logits' own memory), and the same kernel behind
`TritonCrossEntropyLoss`, a drop-in for `torch.nn.CrossEntropyLoss`.
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
The floor is those bytes at the GPU's copy bandwidth (bytes read + written, which
`benchmark_kernels.py` measures before it times anything; docs/kernels.md gives the H200's).

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

Options: what fine-tuning recipes add to the loss
------------------------------------------------
`cross_entropy(..., weight=, label_smoothing=, lse_square_scale=, softcap=)` takes PyTorch's (and
the fused-kernel libraries') options with their names and meaning. Each is a compile-time flag of
the kernel: with none of them the flags vanish and the plain kernel above is what runs, instruction
for instruction. With c = softcap, eps = label_smoothing, s = lse_square_scale, w = weight:

    z     = c * tanh(x / c)                                    (softcap: Gemma 2's final logits)
    loss  = (1 - eps) * w[t] * (lse - z[t]) + eps / V * sum_c w[c] * (lse - z[c])   (PyTorch's)
          + s * lse^2                                          (z-loss, PaLM; lse = logsumexp(z))
    dloss/dx_j = (p_j * ((1 - eps) w[t] + eps / V * sum_c w[c] + 2 s lse)
                  - (1 - eps) w[t] [j = t] - eps / V * w[j]) * (1 - tanh(x_j / c)^2)

(w = 1 without class weights.) "mean" divides the cross-entropy by the sum of the non-ignored
targets' weights, as PyTorch (by their number without weights), and the z-loss by the number of
non-ignored rows: the z-loss belongs to a token's logits, not to its target's class. Sweep 1 also
sums w[c] * (z[c] - z[t]) for the smoothing term and tracks each row's argmax; sweep 2 applies the
cap's derivative. None of it reads more than the logits, except the class weights (V x 4 bytes a
row, the same 0.5 MB for every row, which stay in L2). The return_* flags return a
`CrossEntropyOutput(loss, z_loss, token_accuracy, predicted_tokens)`: the z-loss term alone, the
share of non-ignored tokens whose argmax is their target, and each token's argmax (-1 on ignored
tokens), all from the same pass and none differentiable.

PyTorch sees the kernels as custom ops (`torch.ops.playbook.cross_entropy_*`), each one opaque
node for `torch.compile`, `torch.library.opcheck` and FSDP; Dynamo never traces a Triton launch.
A compiled graph may not rescale the saved gradient in place (see `scale_grad`), so under
`torch.compile` the backward writes the rescaled gradient to a new buffer: one more pass over
N x V than eager mode, the default, which pays nothing for `loss.backward()`.

Layout of this file, one ladder: kernels -> checked launchers -> custom ops (fake implementations
registered) -> one autograd.Function over them (the in-place gradient keeps autograd out of the
ops; the comment above it says why) -> `cross_entropy` -> `TritonCrossEntropyLoss`, a drop-in for
`torch.nn.CrossEntropyLoss` -> `patch_model` for Hugging Face models -> `cross_entropy_ref`. What
every loss of the playbook shares (the options, the checks, the reductions, `CrossEntropyOutput`,
Hugging Face's label shift) is in core/losses.py; the names are importable from here too.

    $ python cross_entropy_test.py   # every check against PyTorch in float64, as a short report
"""

import math
from typing import Optional

import torch
from torch import nn

# direct_launch: eager calls skip the operators' dispatch (step 1 says why)
from core.kernel_utils import as_rows, check_device, check_float, direct_launch, next_power_of_2
# the conventions every loss of the playbook shares (options, checks, reductions, outputs, Hugging Face's shift)
from core.losses import (PLAIN, REDUCTIONS, CrossEntropyOutput, LossOptions, causal_targets,  # noqa: F401
                                  check_first_order, check_options, check_targets_and_reduction, hf_reduction,
                                  loss_output, reduce_loss, target_weight_sum)
from core.model_families import model_type

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
def _softcap(x, softcap):
    """(softcap * tanh(x / softcap), its derivative 1 - tanh(x / softcap)^2), in fp32.

    With e = exp(-2|u|) (u = x / softcap), tanh|u| = (1 - e) / (1 + e) and 1 - tanh^2 = 4e / (1 + e)^2:
    the derivative never computes 1 - tanh^2 by subtraction, which would cancel to a few bits where
    tanh is close to 1. Below |u| = 0.4, 1 - e loses bits instead, and the odd Taylor series of tanh
    (seven terms; the eighth is below 2^-26 of tanh there) takes over. Both stay within 2 ulps.
    """
    u = x / softcap
    a = tl.abs(u)
    e = tl.exp2(a * (-2.0 * LOG2E))  # exp(-2|u|): 1 at u = 0, 0 at |u| = inf (no overflow)
    s = a * a
    series = a + a * s * (-1.0 / 3.0 + s * (2.0 / 15.0 + s * (-17.0 / 315.0 + s * (
        62.0 / 2835.0 + s * (-1382.0 / 155925.0 + s * (21844.0 / 6081075.0))))))
    t = tl.where(a < 0.4, series, (1.0 - e) / (1.0 + e))  # tanh|u|
    t = tl.where(u < 0.0, -t, t)
    one_plus_e = 1.0 + e
    return softcap * t, 4.0 * e / (one_plus_e * one_plus_e)


@triton.jit
def _cross_entropy_fwd(
    Logits,  # pointer to the logits, [N, V], unit stride along V
    Grad,  # pointer to the gradient output, [N, V] (may be Logits itself: in place)
    Targets,  # pointer to the targets, [N], any integer dtype, any stride (0 for an expanded one)
    Loss,  # pointer to the per-row losses, [N], fp32 (without the z-loss)
    NValid,  # pointer to the number of non-ignored rows (a 0-d int64 tensor on the device)
    ClassWeight,  # pointer to the class weights, [V], fp32 (HAS_WEIGHT)
    WeightSum,  # pointer to the sum of the non-ignored targets' weights, 0-d fp32 (HAS_WEIGHT and MEAN)
    ZLoss,  # pointer to the per-row z-loss, [N], fp32 (Z_LOSS)
    Pred,  # pointer to the per-row argmax, [N], int64 (ARGMAX)
    stride_l,  # elements between two rows of Logits
    stride_g,  # elements between two rows of Grad
    stride_t,  # elements between two targets (a slice like labels[:, 1:].T[0] is not contiguous)
    V,  # vocabulary size
    ignore_index,  # target value whose rows are skipped
    label_smoothing,  # eps: the target distribution is (1 - eps) * onehot + eps / V (SMOOTHING)
    lse_square_scale,  # z-loss coefficient: adds lse_square_scale * lse^2 per row (Z_LOSS)
    softcap,  # logits -> softcap * tanh(logits / softcap) before the softmax (SOFTCAP)
    MEAN: tl.constexpr,  # scale the gradient by 1 / n_valid (reduction="mean")
    COMPUTE_GRAD: tl.constexpr,  # also write the gradient (False when no backward will run)
    HAS_WEIGHT: tl.constexpr,  # weight each row by its target's class weight
    SMOOTHING: tl.constexpr,  # label smoothing (label_smoothing > 0)
    Z_LOSS: tl.constexpr,  # z-loss (lse_square_scale != 0)
    SOFTCAP: tl.constexpr,  # cap the logits with tanh
    ARGMAX: tl.constexpr,  # store each row's argmax (token accuracy, predicted tokens)
    BLOCK_V: tl.constexpr,  # columns per block of the sweep
):
    """One program per row: its loss, and with COMPUTE_GRAD its gradient row.

    Bytes per row of V logits of e bytes: sweep 1 reads V * e; sweep 2 reads V * e again (mostly
    from L2, being backwards) and writes V * e of gradient; plus the target (8) and the loss (4).
    Off the L2, the floor is 2 * V * e + 12: 513 KB a row at LLaMA's V = 128256 in bf16. Class
    weights add V * 4 bytes a row that every row shares (they stay in L2).
    """
    # The options are compile-time flags: with all of them off, every `if` on them below and in the
    # helpers vanishes and this is the plain kernel, instruction for instruction.
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride exceeds 2^31 past ~16.7k rows
    logits_row = Logits + row * stride_l
    grad_row = Grad + row * stride_g

    target = tl.load(Targets + row * stride_t).to(tl.int64)
    if target == ignore_index:
        _store_ignored_row(grad_row, Loss + row, ZLoss + row, Pred + row, V, Z_LOSS, ARGMAX, COMPUTE_GRAD, BLOCK_V)
    else:
        m, log2_s, smooth, w_all, pred = _row_max_and_sum(logits_row, ClassWeight, target, V, softcap, HAS_WEIGHT,
                                                          SMOOTHING, SOFTCAP, ARGMAX, BLOCK_V)
        in_range = (target >= 0) & (target < V)
        # An out-of-range target never reads memory: it gets NaN, which poisons loss and gradient.
        x_target = tl.load(logits_row + target, mask=in_range, other=float("nan")).to(tl.float32)
        dcap_target = 1.0
        if SOFTCAP:
            x_target, dcap_target = _softcap(x_target, softcap)
        # loss = lse - x_target (NaN for an all -inf row, as in PyTorch)
        loss = (m - x_target) + log2_s / LOG2E
        w_target = 1.0
        if HAS_WEIGHT:
            w_target = tl.load(ClassWeight + target, mask=in_range, other=float("nan"))
            loss = w_target * loss
        if SMOOTHING:
            loss = (1.0 - label_smoothing) * loss + (label_smoothing / V) * smooth
        tl.store(Loss + row, loss)
        lse = 0.0
        if Z_LOSS:
            lse = m + log2_s / LOG2E
            tl.store(ZLoss + row, lse_square_scale * lse * lse)
        if ARGMAX:
            tl.store(Pred + row, pred)

        # ---- sweep 2 (backwards, for L2 reuse): gradient = (softmax - onehot) * scale ----------
        if COMPUTE_GRAD:
            coef_p, coef_s, coef_t, scale = _gradient_coefficients(
                NValid, WeightSum, in_range, w_target, w_all, lse, label_smoothing, lse_square_scale, V,
                MEAN, HAS_WEIGHT, SMOOTHING, Z_LOSS)
            _gradient_sweep(logits_row, grad_row, ClassWeight, V, m, log2_s, coef_p, coef_s, softcap,
                            HAS_WEIGHT, SMOOTHING, SOFTCAP, BLOCK_V)
            # The one-hot part touches a single element: fix it up after the sweep instead of
            # comparing every column with the target. The barrier makes the sweep's store of that
            # element (by some other thread of this program) land before this one.
            tl.debug_barrier()
            p_target = tl.exp2((x_target - m) * LOG2E - log2_s)
            if HAS_WEIGHT or SMOOTHING or Z_LOSS or SOFTCAP:
                g_target = p_target * coef_p - coef_t
                if SMOOTHING:
                    if HAS_WEIGHT:
                        g_target -= coef_s * w_target
                    else:
                        g_target -= coef_s
                if SOFTCAP:
                    g_target *= dcap_target
            else:
                g_target = (p_target - 1.0) * scale
            tl.store(grad_row + target, g_target.to(Grad.dtype.element_ty), mask=in_range)


@triton.jit
def _store_ignored_row(grad_row, loss, z_loss, pred, V, Z_LOSS: tl.constexpr, ARGMAX: tl.constexpr,
                       COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """An ignored row: loss 0 and a gradient row of exact zeros. The zeros must be *stored* (the
    gradient buffer is uninitialised, or holds logits when in place)."""
    tl.store(loss, 0.0)
    if Z_LOSS:
        tl.store(z_loss, 0.0)
    if ARGMAX:
        tl.store(pred, -1)  # no prediction is scored on an ignored row
    if COMPUTE_GRAD:
        cols0 = tl.arange(0, BLOCK_V)
        for b in range(0, tl.cdiv(V, BLOCK_V)):
            cols = b * BLOCK_V + cols0
            tl.store(grad_row + cols, tl.zeros([BLOCK_V], tl.float32).to(grad_row.dtype.element_ty), mask=cols < V)


@triton.jit
def _row_max_and_sum(logits_row, ClassWeight, target, V, softcap, HAS_WEIGHT: tl.constexpr,
                     SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, ARGMAX: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sweep 1 over a row: (m, log2_s, smooth, w_all, pred), the row's max m and log2 of
    s = sum(exp(x - m)); with SMOOTHING, smooth = sum_c w_c (lse - z_c) and w_all = sum_c w_c;
    with ARGMAX, pred = the row's argmax. What an option does not ask for is returned as 0."""
    # Every lane (position in the block) keeps its own max m and sum s over the values it has
    # seen. A lane sees x and either adds exp(x - m) (x <= m), or makes x its new max and
    # rescales: s * exp(m - x) + 1 (x > m). Both cases need exp(-|x - m|): one exp per
    # element, and no reduction across the block inside the loop. Reductions synchronise all
    # the warps of a program, which would stall the loads; here they happen once, after it.
    # The lanes start at a finite MIN_START rather than -inf, so that x - m is never
    # -inf - (-inf) = NaN: a -inf logit (or the masked tail) then adds exp(-inf) = 0.
    # Each iteration also *prefetches* the next block: its load is in flight while this block
    # is computed, which doubles the bytes each warp has on the way (a loop that loads, waits
    # and then computes leaves the memory system idle while it computes).
    cols0 = tl.arange(0, BLOCK_V)
    m_lane = tl.full([BLOCK_V], MIN_START, tl.float32)
    s_lane = tl.zeros([BLOCK_V], tl.float32)
    if SMOOTHING:
        # The smoothing term needs sum_c w_c * (lse - z_c) (w_c = 1 without class weights).
        # Each lane sums w_c * (z_c - z_target) and w_c; measuring from the target's logit
        # keeps the sum as small as the logits' spread even when they all sit near 1000.
        z_ref = tl.load(logits_row + target, mask=(target >= 0) & (target < V), other=float("nan")).to(tl.float32)
        if SOFTCAP:
            z_ref = _softcap(z_ref, softcap)[0]
        zsum_lane = tl.zeros([BLOCK_V], tl.float32)
        if HAS_WEIGHT:
            wsum_lane = tl.zeros([BLOCK_V], tl.float32)
    if ARGMAX:
        # Each lane keeps the first column holding its largest *raw* logit (x > max, strictly).
        # The cap is monotonic, so this is the capped logits' argmax too, free of tanh rounding.
        xmax_lane = tl.full([BLOCK_V], MIN_START, tl.float32)
        arg_lane = tl.zeros([BLOCK_V], tl.int32)
    x_next = tl.load(logits_row + cols0, mask=cols0 < V, other=-float("inf"))
    for b in range(0, tl.cdiv(V, BLOCK_V)):
        x = x_next.to(tl.float32)
        cols = (b + 1) * BLOCK_V + cols0  # the next block (all masked off after the last)
        x_next = tl.load(logits_row + cols, mask=cols < V, other=-float("inf"))
        if ARGMAX:
            arg_lane = tl.where(x > xmax_lane, cols - BLOCK_V, arg_lane)
            xmax_lane = tl.maximum(xmax_lane, x)
        if SOFTCAP:
            # the tail must stay -inf (a capped -inf is -softcap, a real logit's value)
            x = tl.where(cols - BLOCK_V < V, _softcap(x, softcap)[0], -float("inf"))
        e = tl.exp2(tl.abs(x - m_lane) * -LOG2E)  # exp(-|x - m|); exp2 is the native unit
        s_lane = tl.where(x > m_lane, s_lane * e + 1.0, s_lane + e)
        m_lane = tl.maximum(m_lane, x)
        if SMOOTHING:
            in_row = cols - BLOCK_V < V
            if HAS_WEIGHT:
                w = tl.load(ClassWeight + cols - BLOCK_V, mask=in_row, other=0.0)
                zsum_lane += w * tl.where(in_row, x - z_ref, 0.0)
                wsum_lane += w
            else:
                zsum_lane += tl.where(in_row, x - z_ref, 0.0)
    m = tl.max(m_lane, axis=0)  # the row max; bring every lane's sum to it and add them up
    s = tl.sum(s_lane * tl.exp2((m_lane - m) * LOG2E), axis=0)  # lanes that saw nothing: 0
    # log-sum-exp = m + log(s). Keep m and log(s) apart: m may be ~1000, and their rounded sum
    # would carry an absolute error of ~1e-4 into every exponent below.
    log2_s = tl.log2(s)
    smooth = 0.0
    w_all = 0.0
    if SMOOTHING:
        # sum_c w_c (lse - z_c) = W * (lse - z_target) - sum_c w_c (z_c - z_target), W = sum_c w_c
        if HAS_WEIGHT:
            w_all = tl.sum(wsum_lane, axis=0)
        else:
            w_all = V * 1.0
        smooth = w_all * ((m - z_ref) + log2_s / LOG2E) - tl.sum(zsum_lane, axis=0)
    pred = 0
    if ARGMAX:
        # the first column among the lanes that hold the row's maximum, as torch.argmax
        xmax = tl.max(xmax_lane, axis=0)
        pred = tl.min(tl.where(xmax_lane == xmax, arg_lane, V), axis=0).to(tl.int64)
    return m, log2_s, smooth, w_all, pred


@triton.jit
def _gradient_coefficients(NValid, WeightSum, in_range, w_target, w_all, lse, label_smoothing, lse_square_scale, V,
                           MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr,
                           Z_LOSS: tl.constexpr):
    """(coef_p, coef_s, coef_t, scale) of a row's gradient. With the options, it is
        d loss / d z_j = p_j * coef_p - coef_s * w_j - [j = target] * coef_t
    with p = softmax(z), coef_t = scale * (1 - eps) * w_target, coef_s = scale * eps / V,
    coef_p = coef_t + coef_s * W (the weights of the target distribution add up to that)
    plus the z-loss's 2 * lse_square_scale * lse, and then, through the cap,
    d loss / d x_j = d loss / d z_j * (1 - tanh^2). Without options: (p_j - [j = target]) * scale."""
    scale = 1.0
    if MEAN:
        # The count lives on the GPU; reading it here avoids a host sync. max(., 1): an
        # all-ignored batch never reaches this branch, but stay safe against 1/0.
        n_valid = tl.load(NValid).to(tl.float32)
        scale = 1.0 / tl.maximum(n_valid, 1.0)
    z_scale = scale  # the z-loss is a mean over tokens, unweighted
    if HAS_WEIGHT:
        if MEAN:
            # mean over the targets' weights, as PyTorch; a zero sum counts as 1
            w_valid = tl.load(WeightSum)
            scale = 1.0 / tl.where(w_valid != 0.0, w_valid, 1.0)
    scale = tl.where(in_range, scale, float("nan"))
    coef_p = scale
    if HAS_WEIGHT:
        coef_p = coef_p * w_target
    coef_s = 0.0
    if SMOOTHING:
        coef_s = scale * (label_smoothing / V)
        coef_t = coef_p * (1.0 - label_smoothing)
        coef_p = coef_t + coef_s * w_all
    else:
        coef_t = coef_p
    if Z_LOSS:
        coef_p += z_scale * (2.0 * lse_square_scale) * lse
    return coef_p, coef_s, coef_t, scale


@triton.jit
def _gradient_sweep(logits_row, grad_row, ClassWeight, V, m, log2_s, coef_p, coef_s, softcap,
                    HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sweep 2 over a row, from its last block back to its first (those read last in sweep 1 are
    still in L2): writes p_j * coef_p - coef_s * w_j, through the cap; the one-hot part is the caller's."""
    # softmax * scale = exp(x - m) / s * scale = exp2((x - m) * log2(e) - log2(s)) * scale:
    # a subtraction, a fused multiply-add, one exp2 and a multiply per element. x - m comes
    # first (two nearby numbers: exact enough); folding m into the fused multiply-add would
    # subtract large numbers and lose ~1e-4 of relative precision at logits ~ 1000.
    n_blocks = tl.cdiv(V, BLOCK_V)
    cols = (n_blocks - 1) * BLOCK_V + tl.arange(0, BLOCK_V)
    x_next = tl.load(logits_row + cols, mask=cols < V, other=-float("inf"))
    for i in range(0, n_blocks):
        x = x_next.to(tl.float32)
        mask = cols < V
        cols_next = cols - BLOCK_V  # prefetch the block before; none after the first
        x_next = tl.load(logits_row + cols_next, mask=(cols_next >= 0) & (cols_next < V), other=-float("inf"))
        if SOFTCAP:
            x, dcap = _softcap(x, softcap)
        g = tl.exp2((x - m) * LOG2E - log2_s) * coef_p
        if SMOOTHING:
            if HAS_WEIGHT:
                g -= coef_s * tl.load(ClassWeight + cols, mask=mask, other=0.0)
            else:
                g -= coef_s
        if SOFTCAP:
            g *= dcap
        # evict_first: the gradient is not read again here, so its lines leave L2 before the
        # logits this sweep still re-reads (docs/kernels.md has the measurement, in place at 16384 x
        # 128256; eviction hints on the loads did no better)
        tl.store(grad_row + cols, g.to(grad_row.dtype.element_ty), mask=mask, eviction_policy="evict_first")
        cols = cols_next


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
    """One program per row: Out = Grad * GradOut[row]. Bytes per row of V elements of e bytes:
    2 * V * e (read and write), or none in place when the row's factor is exactly 1."""
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
def _launch_settings(V: int, block_v: int | None, num_warps: int | None, lane_state: bool = False):
    """Block and warps of a launch. `lane_state`: options that keep more per-lane values through
    the sweep (label smoothing's sums, the argmax, the cap's temporaries) get half the block with
    the same warps, 8 values per thread, which ptxas fits in registers where 16 would spill."""
    if lane_state:
        block_v = block_v or min(BLOCK_V // 2, next_power_of_2(V))
        num_warps = num_warps or max(1, min(NUM_WARPS, block_v // 256))
        return block_v, num_warps
    block_v = block_v or min(BLOCK_V, next_power_of_2(V))
    num_warps = num_warps or max(1, min(NUM_WARPS, block_v // 512))
    return block_v, num_warps


def rows_overlap(rows: torch.Tensor) -> bool:
    """True when two rows of a [N, V] matrix (unit column stride) share memory (stride 0, expand)."""
    return rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]


def cross_entropy_forward(logits2, targets, ignore_index, reduction, compute_grad, inplace_grad,
                          block_v=None, num_warps=None, n_valid=None, loss_rows=None, options=PLAIN,
                          weight_sum=None, z_rows=None, pred_rows=None):
    """logits2: [N, V], unit stride along V; targets: [N], any stride. Returns (loss, gradient or None).

    A caller that splits one batch into several calls (the fused linear cross-entropy walks the
    tokens in chunks) passes the whole batch's non-ignored count `n_valid` (a 0-d tensor on the
    device) so that each chunk's "mean" gradient is scaled by the global count, and its own slice
    of the per-row losses as `loss_rows`; it then reduces those itself.

    `options` (a checked LossOptions) adds class weights, label smoothing, the z-loss and the cap;
    with class weights a chunking caller also passes the batch's `weight_sum`. The per-row z-loss
    goes to `z_rows` ([N] fp32, allocated when not given) and into the returned loss. With
    `pred_rows` ([N] int64) each row's argmax is stored there too (-1 on ignored rows).
    """
    N, V = logits2.shape
    if V > 1 and logits2.stride(1) != 1:
        raise ValueError(f"logits2 needs unit stride along the vocabulary, got strides {logits2.stride()}")
    if compute_grad and inplace_grad and rows_overlap(logits2):
        raise ValueError(f"cannot write the gradient in place: rows of the logits share memory "
                         f"(strides {logits2.stride()}, an expanded tensor?)")
    device = logits2.device
    weight, label_smoothing, lse_square_scale, softcap = options
    if loss_rows is None:
        loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    # The mean's token count stays on the GPU (no sync); only "mean" reads it.
    if n_valid is None and reduction == "mean":
        n_valid = (targets != ignore_index).sum()
    if weight is not None and weight_sum is None and reduction == "mean":
        weight_sum = target_weight_sum(targets, ignore_index, weight)
    if lse_square_scale == 0:
        z_rows = None
    elif z_rows is None:
        z_rows = torch.empty(N, dtype=torch.float32, device=device)
    grad = None
    if compute_grad:
        grad = logits2 if inplace_grad else torch.empty((N, V), dtype=logits2.dtype, device=device)
    if N > 0:
        lane_state = label_smoothing > 0 or softcap is not None or pred_rows is not None
        block_v, num_warps = _launch_settings(V, block_v, num_warps, lane_state)
        _cross_entropy_fwd[(N,)](
            logits2, grad if compute_grad else logits2, targets, loss_rows,
            n_valid if n_valid is not None else loss_rows,  # never read unless MEAN
            # each of these is touched only when its option is on
            weight if weight is not None else loss_rows,
            weight_sum if weight_sum is not None else loss_rows,
            z_rows if z_rows is not None else loss_rows,
            pred_rows if pred_rows is not None else loss_rows,
            logits2.stride(0), grad.stride(0) if compute_grad else 0, targets.stride(0), V, ignore_index,
            float(label_smoothing), float(lse_square_scale), float(softcap or 1.0),
            MEAN=reduction == "mean", COMPUTE_GRAD=compute_grad,
            HAS_WEIGHT=weight is not None, SMOOTHING=label_smoothing > 0, Z_LOSS=z_rows is not None,
            SOFTCAP=softcap is not None, ARGMAX=pred_rows is not None, BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return reduce_loss(loss_rows, reduction, n_valid, z_rows, weight_sum), grad


def scale_gradient_(grad: torch.Tensor, grad_output: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = grad * grad_output (a scalar, or one value per row) without a host sync; in place
    (the default, out=grad) rows whose factor is exactly 1 cost nothing."""
    N, V = grad.shape
    out = grad if out is None else out
    if N == 0:
        return out
    grad_output = grad_output.reshape(-1) if grad_output.dim() else grad_output.reshape(1)
    stride_go = 0 if grad_output.numel() == 1 else grad_output.stride(0)
    in_place, rows, out_rows = out is grad, grad, out
    # One factor for every element of contiguous tensors: the row length is free, so short rows (the
    # lm_head's [V, H] gradient at a small H) are launched as fewer, longer ones: the largest power of
    # two up to BLOCK_V that divides the size. The same products; fewer programs (the interpreter
    # pays a fixed cost per program, whatever its length).
    width = math.gcd(N * V, BLOCK_V)
    if stride_go == 0 and 0 < V < width and grad.is_contiguous() and out.is_contiguous():
        rows, out_rows = grad.view(-1, width), out.view(-1, width)
    block_v, num_warps = _launch_settings(rows.shape[1], None, None)
    _scale_rows[(rows.shape[0],)](rows, out_rows, grad_output, rows.stride(0), out_rows.stride(0), stride_go,
                                  rows.shape[1], IN_PLACE=in_place, BLOCK_V=block_v, num_warps=num_warps)
    return out


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
# The options arguments default to the plain loss. Each forward op also returns the z-loss (reduced
# like the loss) and the per-row argmax when asked (want_z, want_pred), else empty placeholders
# (an op returns the same number of tensors every time).
# ------------------------------------------------------------------------------------------------
def _loss_like(logits2: torch.Tensor, reduction: str) -> torch.Tensor:
    shape = (logits2.shape[0],) if reduction == "none" else ()
    return logits2.new_empty(shape, dtype=torch.float32)


def _extras_like(logits2: torch.Tensor, reduction: str, want_z: bool, want_pred: bool):
    z = _loss_like(logits2, reduction) if want_z else logits2.new_empty(0, dtype=torch.float32)
    pred = logits2.new_empty(logits2.shape[0] if want_pred else 0, dtype=torch.int64)
    return z, pred


def _forward(logits2, targets, ignore_index, reduction, compute_grad, inplace_grad, weight, label_smoothing,
             lse_square_scale, softcap, want_z, want_pred):
    """(loss, gradient or None, z-loss, argmax rows): the ops' shared body."""
    options = LossOptions(weight, label_smoothing, lse_square_scale, softcap)
    z, pred = _extras_like(logits2, reduction, want_z, want_pred)
    n_valid = (targets != ignore_index).sum() if reduction == "mean" else None
    z_rows = torch.empty(logits2.shape[0], dtype=torch.float32, device=logits2.device) \
        if want_z and lse_square_scale != 0 else None
    loss, grad = cross_entropy_forward(logits2, targets, ignore_index, reduction, compute_grad, inplace_grad,
                                       n_valid=n_valid, options=options, z_rows=z_rows,
                                       pred_rows=pred if want_pred else None)
    if want_z:  # no z-loss asked for (lse_square_scale = 0): it is 0
        z = reduce_loss(z_rows, reduction, n_valid) if z_rows is not None else z.zero_()
    return loss, grad, z, pred


@torch.library.custom_op("playbook::cross_entropy_loss", mutates_args=())
def _loss_op(logits2: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
             weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
             softcap: Optional[float] = None, want_z: bool = False,
             want_pred: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z-loss, argmax rows) alone (evaluation, or logits that need no gradient): reads the logits once."""
    loss, _, z, pred = _forward(logits2, targets, ignore_index, reduction, False, False, weight, label_smoothing,
                                lse_square_scale, softcap, want_z, want_pred)
    return loss, z, pred


@torch.library.custom_op("playbook::cross_entropy_fwd", mutates_args=())
def _fwd_op(logits2: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
            weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
            softcap: Optional[float] = None, want_z: bool = False,
            want_pred: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, gradient for an upstream gradient of 1, z-loss, argmax rows), the gradient in a new
    [N, V] buffer."""
    return _forward(logits2, targets, ignore_index, reduction, True, False, weight, label_smoothing,
                    lse_square_scale, softcap, want_z, want_pred)


@torch.library.custom_op("playbook::cross_entropy_fwd_inplace", mutates_args=("logits2",))
def _fwd_inplace_op(logits2: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
                    weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
                    lse_square_scale: float = 0.0, softcap: Optional[float] = None, want_z: bool = False,
                    want_pred: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z-loss, argmax rows); the gradient (for an upstream gradient of 1) overwrites `logits2`."""
    loss, _, z, pred = _forward(logits2, targets, ignore_index, reduction, True, True, weight, label_smoothing,
                                lse_square_scale, softcap, want_z, want_pred)
    return loss, z, pred


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
def _(logits2, targets, ignore_index, reduction, weight=None, label_smoothing=0.0, lse_square_scale=0.0,
      softcap=None, want_z=False, want_pred=False):
    return _loss_like(logits2, reduction), *_extras_like(logits2, reduction, want_z, want_pred)


@_fwd_op.register_fake
def _(logits2, targets, ignore_index, reduction, weight=None, label_smoothing=0.0, lse_square_scale=0.0,
      softcap=None, want_z=False, want_pred=False):
    return (_loss_like(logits2, reduction), logits2.new_empty(logits2.shape),
            *_extras_like(logits2, reduction, want_z, want_pred))


@_fwd_inplace_op.register_fake
def _(logits2, targets, ignore_index, reduction, weight=None, label_smoothing=0.0, lse_square_scale=0.0,
      softcap=None, want_z=False, want_pred=False):
    return _loss_like(logits2, reduction), *_extras_like(logits2, reduction, want_z, want_pred)


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
    # A graph is traced under torch.compile (Dynamo: is_compiling), or by AOTAutograd called
    # directly (aot_function, torch.library.opcheck), which functionalizes what it traces. Dynamo
    # folds is_compiling() to True and never reaches the dispatch-mode query, which it cannot trace.
    if torch.compiler.is_compiling() or \
            torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None:
        return torch.ops.playbook.cross_entropy_scale_grad(grad, grad_output)
    if direct_launch(grad, grad_output):  # eager: the launcher itself, and the write declared by hand
        scale_gradient_(grad, grad_output)
        torch.autograd.graph.increment_version(grad)
        return grad
    torch.ops.playbook.cross_entropy_scale_grad_inplace(grad, grad_output)
    return grad


# ------------------------------------------------------------------------------------------------
# Autograd over the custom ops, and the functional API
# ------------------------------------------------------------------------------------------------
# Autograd is one torch.autograd.Function over the launchers (eager) or the custom ops (traced), not
# torch.library.register_autograd on the forward op, because of the in-place gradient. That op
# writes the gradient into the logits, so it declares the mutation (mutates_args=("logits2",)), and
# register_autograd refuses any op that mutates an input ("Cannot register autograd formula for
# non-functional operator"). A functional
# op cannot carry the trick either: a custom op may not return an alias of an input, so its gradient
# would need a new [N, V] buffer (4.2 GB at 16384 tokens of LLaMA 3.1 8B, in bf16). The Function
# only picks the op, keeps the gradient buffer it returns, and calls the scale op in backward;
# torch.compile and opcheck see the custom ops alone, and no host sync is added. An eager call on
# plain tensors (`direct_launch`) calls the ops' Python bodies instead of dispatching the ops: the
# same launches, without the dispatcher's host time before the GPU gets its work; the in-place
# write is then declared by hand (the version counter), as the op's schema declares it.
class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, inplace_grad, grad_enabled, weight=None,
                label_smoothing=0.0, lse_square_scale=0.0, softcap=None, want_z=False, want_pred=False):
        rows = as_rows(logits)  # logits itself, or a contiguous copy (never a view made here)
        # The plain loss calls the ops with their four plain arguments; the options follow them.
        extras = want_z or want_pred
        plain = weight is None and label_smoothing == 0 and lse_square_scale == 0 and softcap is None
        options = () if plain and not extras else (weight, label_smoothing, lse_square_scale, softcap,
                                                   want_z, want_pred)
        # needs_input_grad says whether the logits require grad, even under torch.no_grad();
        # grad_enabled (the caller's grad mode) says whether a backward can happen at all.
        ctx.consumed = False
        compute_grad = bool(ctx.needs_input_grad[0] and grad_enabled)
        if direct_launch(rows, targets) and (weight is None or direct_launch(weight)):
            in_place = compute_grad and inplace_grad and not rows_overlap(rows)
            if extras:
                loss, grad, z, pred = _forward(rows, targets, ignore_index, reduction, compute_grad, in_place,
                                               weight, label_smoothing, lse_square_scale, softcap, want_z, want_pred)
            else:  # the plain loss: no placeholder tensors for the extras
                loss, grad = cross_entropy_forward(rows, targets, ignore_index, reduction, compute_grad, in_place,
                                                   options=LossOptions(weight, label_smoothing, lse_square_scale,
                                                                       softcap))
            if in_place:
                torch.autograd.graph.increment_version(rows)  # what the in-place op's schema declares
            if compute_grad:
                ctx.save_for_backward(grad)
            if not extras:
                return loss
            ctx.mark_non_differentiable(z, pred)
            return loss, z, pred
        if not compute_grad:
            loss, z, pred = torch.ops.playbook.cross_entropy_loss(rows, targets, ignore_index, reduction, *options)
        elif inplace_grad and not rows_overlap(rows):
            # The op declares that it mutates `rows`, so PyTorch bumps the version counter that
            # `rows` shares with `logits`: an op that saved the logits for its own backward (a
            # softmax before the loss, say) then raises "modified by an inplace operation".
            loss, z, pred = torch.ops.playbook.cross_entropy_fwd_inplace(rows, targets, ignore_index, reduction,
                                                                         *options)
            ctx.save_for_backward(rows)
        else:
            loss, grad, z, pred = torch.ops.playbook.cross_entropy_fwd(rows, targets, ignore_index, reduction,
                                                                       *options)
            ctx.save_for_backward(grad)
        if not extras:
            return loss
        ctx.mark_non_differentiable(z, pred)
        return loss, z, pred

    @staticmethod
    def backward(ctx, grad_output, *extras_grads):
        check_first_order("fused cross-entropy")
        if ctx.consumed:
            raise RuntimeError(
                "the fused cross-entropy's gradient buffer was already used by a previous "
                "backward; run backward once per forward (retain_graph is not supported)"
            )
        ctx.consumed = True
        (grad,) = ctx.saved_tensors
        return (scale_grad(grad, grad_output),) + (None,) * 11


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", inplace_grad: bool = False, *, weight: torch.Tensor | None = None,
                  label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                  return_z_loss: bool = False, return_token_accuracy: bool = False,
                  return_predicted_tokens: bool = False):
    """Cross-entropy of `logits` [N, V] (or [B, T, V]) against int64 `targets` [N] (or [B, T]).

    Same semantics as `torch.nn.functional.cross_entropy` (mean over non-ignored rows), except:
    all rows ignored -> 0.0 for "mean"; out-of-range targets -> NaN; the loss is fp32.
    reduction="none" returns one loss per row, in the targets' shape.
    inplace_grad: write the gradient into the logits' memory (see the module docstring); logits
    whose rows share memory (an expanded tensor) get a new gradient buffer instead.

    Options (keyword only; see the module docstring):
    weight: class weights [V], as PyTorch's `weight` ("mean" divides by the non-ignored targets' weights).
    label_smoothing: eps in [0, 1], as PyTorch's (with class weights too).
    lse_square_scale: z-loss, adds lse_square_scale * logsumexp(logits)^2 per non-ignored token.
    softcap: logits -> softcap * tanh(logits / softcap) first (Gemma 2's final_logit_softcapping).
    return_z_loss / return_token_accuracy / return_predicted_tokens: return a CrossEntropyOutput
    with these extras (not differentiable) instead of the loss tensor alone.
    """
    _check_inputs(logits, targets, reduction)
    options = check_options(logits.shape[-1], logits.device, weight, label_smoothing, lse_square_scale, softcap)
    if inplace_grad and logits.is_leaf and logits.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("inplace_grad=True would overwrite a leaf tensor that requires grad; pass the "
                           "logits computed by the model (an intermediate), or use inplace_grad=False")
    # Flatten [B, T, V] here, in the caller's grad mode: autograd forbids writing in place into a
    # view that was made inside the Function's forward (where grad mode is off).
    logits2 = logits.reshape(-1, logits.shape[-1]) if logits.dim() == 3 else logits
    want_pred = bool(return_token_accuracy or return_predicted_tokens)
    if not (return_z_loss or want_pred):
        loss = CrossEntropyFunction.apply(logits2, targets.reshape(-1), int(ignore_index), reduction,
                                          bool(inplace_grad), torch.is_grad_enabled(), *options)
        return loss.view(targets.shape) if reduction == "none" else loss
    loss, z, pred = CrossEntropyFunction.apply(logits2, targets.reshape(-1), int(ignore_index), reduction,
                                               bool(inplace_grad), torch.is_grad_enabled(), *options,
                                               bool(return_z_loss), want_pred)
    loss = loss.view(targets.shape) if reduction == "none" else loss
    return loss_output(loss, z, pred, targets.reshape(-1), int(ignore_index), return_z_loss,
                       return_token_accuracy, return_predicted_tokens, targets.shape)


def ideal_bytes(n_rows: int, vocab: int, dtype: torch.dtype, backward: bool = False,
                target_dtype: torch.dtype = torch.int64) -> int:
    """Bytes the fused kernel must move at least: read the logits and targets, write fp32 losses,
    and with `backward` write the gradient once (the upstream-gradient rescale is skipped on the
    GPU when that gradient is 1.0, as for `loss.backward()`; any other value rereads and rewrites it)."""
    elt, t_elt = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=target_dtype).element_size()
    logits = n_rows * vocab * elt
    return logits * (2 if backward else 1) + n_rows * (t_elt + 4)


# ------------------------------------------------------------------------------------------------
# Drop-in module: torch.nn.CrossEntropyLoss
# ------------------------------------------------------------------------------------------------
class TritonCrossEntropyLoss(nn.Module):
    """A drop-in for `torch.nn.CrossEntropyLoss`: the same arguments and results, loss and gradient
    from one pass of the fused kernel.

        loss_fn = TritonCrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
        loss = loss_fn(logits, labels)  # logits [N, V] or [B, T, V]; labels [N] or [B, T]

    PyTorch's arguments, with PyTorch's meaning:
    weight: class weights [V] (a buffer, so `.to(device)` moves it); "mean" divides by the sum of
        weight[target] over the non-ignored rows.
    ignore_index: rows with this target give loss 0 and a gradient row of 0 (any integer, also a
        class inside [0, V), which then still takes part in the other rows' softmax).
    reduction: "mean", "sum" or "none" (one loss per row in the target's shape, 0 on ignored rows).
    label_smoothing: eps in [0, 1]; with class weights exactly as PyTorch defines it.
    Beyond PyTorch's:
    z_loss: adds z_loss * logsumexp(logits)^2 per non-ignored row (the z-loss of PaLM); "mean"
        averages it over the non-ignored rows, unweighted (the kernel's `lse_square_scale`).
    softcap: logits -> softcap * tanh(logits / softcap) before the softmax (Gemma 2's final cap).
    inplace_grad: write the gradient into the input's memory during the forward pass; the input
        then holds gradients, not logits (see the module docstring). Off by default.

    Layouts accepted, classes in the last dimension: input [V] with target [] (one sample),
    [N, V] with [N], and [B, T, V] with [B, T] (Hugging Face's logits and labels). Any strides
    (a transposed or sliced input is read as it is when its classes are contiguous, else copied
    once). PyTorch's K-dimensional layout with classes in dimension 1 ([B, V, T] with [B, T]) is
    refused with a ValueError that names the transpose to use; when T == V the two layouts cannot
    be told apart, and the input is read as [B, T, V]. Other ranks raise a ValueError.
    Input dtypes: fp32, bf16, fp16; targets: int64 or int32 class indices.

    Where the results differ from PyTorch's, by design: the loss is fp32 whatever the input's
    dtype (PyTorch returns the input's dtype); "mean" over a batch whose rows are all ignored is
    0.0 with a zero gradient (PyTorch gives NaN), and so is a weighted mean whose target weights
    sum to 0; a target outside [0, V) that is not ignore_index gives NaN (PyTorch raises);
    class-probability (float) targets are refused with a TypeError; second-order gradients raise.
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 inplace_grad: bool = False):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if weight is not None and not (isinstance(weight, torch.Tensor) and weight.dim() == 1):
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"weight (class weights) must be a 1-D tensor [V], got {got}")
        # the vocabulary is known only in forward, which checks the weight's length against it
        check_options(0 if weight is None else weight.shape[0], None if weight is None else weight.device,
                      weight, label_smoothing, z_loss, softcap)
        self.register_buffer("weight", weight)
        self.ignore_index = int(ignore_index)
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.z_loss = float(z_loss)
        self.softcap = None if softcap is None else float(softcap)
        self.inplace_grad = bool(inplace_grad)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, targets = _class_last(input, target)
        loss = cross_entropy(logits, targets, self.ignore_index, self.reduction, self.inplace_grad,
                             weight=self.weight, label_smoothing=self.label_smoothing,
                             lse_square_scale=self.z_loss, softcap=self.softcap)
        return loss.view(target.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        options = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        options += [f"{name}={getattr(self, name)}" for name in ("label_smoothing", "z_loss", "softcap", "inplace_grad")
                    if getattr(self, name) not in (0.0, None, False)]
        return ", ".join(options)


def _class_last(input, target) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, V] or [B, T, V], targets [N] or [B, T]) from the layouts TritonCrossEntropyLoss
    accepts; a clear error for the others."""
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"input and target must be tensors, got {type(input).__name__} and {type(target).__name__}")
    if target.is_floating_point():
        raise TypeError("class-probability (float) targets are not supported: pass class indices (int64)")
    if input.dim() == 1 and target.dim() == 0:
        return input.unsqueeze(0), target.reshape(1)  # one sample
    if input.dim() in (2, 3) and tuple(target.shape) == tuple(input.shape[:-1]):
        return input, target
    if input.dim() == 3 and tuple(target.shape) == (input.shape[0], input.shape[2]):
        raise ValueError(f"input {tuple(input.shape)} with target {tuple(target.shape)} has its classes in "
                         f"dimension 1 (PyTorch's [B, C, T] layout); this loss takes them last: pass "
                         f"input.transpose(1, 2)")
    raise ValueError(f"expected input [V] with target [], [N, V] with [N], or [B, T, V] with [B, T] "
                     f"(classes last); got input {tuple(input.shape)} and target {tuple(target.shape)}")


# ------------------------------------------------------------------------------------------------
# Hugging Face drop-in: the causal-LM loss
# ------------------------------------------------------------------------------------------------
def fused_causal_lm_loss(inplace_grad: bool = True):
    """A drop-in for Hugging Face's `ForCausalLMLoss` that calls the fused cross-entropy.

    Same semantics: labels shifted left with `ignore_index` padding (the logits are not shifted,
    so no [tokens, vocab] copy is made), mean over non-ignored tokens, or sum / num_items_in_batch
    under gradient accumulation. Unlike HF it does not upcast the logits to fp32: the kernel reads
    bf16 and computes in fp32. With `inplace_grad` the gradient overwrites the logits during the
    forward pass: after `model(..., labels=...)`, `outputs.logits` holds gradients, not logits.
    Gemma 2 caps its logits (`final_logit_softcapping`) in its own forward, before it calls the
    loss: they arrive capped, and this loss must not cap them again (no `softcap` here; the fused
    linear cross-entropy, which replaces that forward, applies the cap itself).
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
                      reduction: str = "mean", *, weight: torch.Tensor | None = None, label_smoothing: float = 0.0,
                      lse_square_scale: float = 0.0, softcap: float | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PyTorch on logits cast to `dtype`: fp32 by default, as Hugging Face computes its loss (NaN
    when all rows are ignored); the tests also run it in the logits' own dtype and in float64.
    The options are PyTorch's own (weight, label_smoothing) or spelled out (softcap, z-loss)."""
    z = logits.to(dtype).reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = nn.functional.cross_entropy(z, t, weight=None if weight is None else weight.to(dtype),
                                       ignore_index=ignore_index, reduction=reduction,
                                       label_smoothing=label_smoothing)
    if lse_square_scale:
        loss = loss + z_loss_ref(z, t, ignore_index, reduction, lse_square_scale)
    return loss.view(targets.shape if reduction == "none" else ())


def z_loss_ref(z: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
               lse_square_scale: float) -> torch.Tensor:
    """lse_square_scale * logsumexp(z)^2 per non-ignored row of the (capped) logits z [N, V],
    reduced like the loss: "mean" divides by the number of non-ignored rows."""
    scored = targets != ignore_index
    rows = torch.where(scored, lse_square_scale * torch.logsumexp(z, dim=-1).square(), 0.0)
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / scored.sum()
