"""Distillation losses in Triton: KL divergence, generalised Jensen-Shannon divergence, and the JSD
fused with the student's and the teacher's lm_heads, so that neither model's logits are ever built.

    kl_div(input, target)                     the semantics of torch.nn.functional.kl_div
    jsd(student_logp, teacher_logp, beta)     generalised JSD between two log-probability tensors
    linear_jsd(x_s, W_s, x_t, W_t, beta, T)   jsd(log_softmax(x_s @ W_s.T / T), log_softmax(x_t @ W_t.T / T))

What you build here: the loss of knowledge distillation (a small student learns to match a large
teacher's next-token distribution) as row kernels over the vocabulary, then as a chunked op that walks
the tokens, multiplies each chunk by both lm_heads, turns the student's logits into their gradient
in place, and spends that gradient right away on dx and dW, exactly as linear_cross_entropy_kernel.py
does for the cross-entropy.
What you learn: how the log-softmax's backward folds into a fused loss (one more sweep over a row),
how to compute a mixture log(b e^y + (1 - b) e^x) without overflow or underflow, and how a
divergence stays finite where a probability is exactly zero (0 log 0 = 0).

The generalised JSD, and the convention this file follows
---------------------------------------------------------
With P the teacher's distribution, Q the student's, and beta in [0, 1]:
    M       = beta * P + (1 - beta) * Q
    JSD_beta = beta * KL(P || M) + (1 - beta) * KL(Q || M)          summed over the vocabulary
beta = 0.5 is the symmetric Jensen-Shannon divergence. At beta = 0 and beta = 1 the formula itself is
0 (M equals Q, or P), so the two ends are *defined* as the two KL divergences, as TRL's
`generalized_jsd_loss` and Liger-Kernel's `LigerJSD` define them:
    beta = 0:  KL(P || Q) = sum P (log P - log Q)    forward KL, mode covering (the classic
                                                     distillation loss of Hinton et al.)
    beta = 1:  KL(Q || P) = sum Q (log Q - log P)    reverse KL, mode seeking
Between the ends the mixture weights the *teacher* by beta (Liger's and TRL's convention).
The per-token divergence is averaged over the tokens whose `shift_labels` is not `ignore_index` (all
tokens when no labels are given); when every token is ignored the loss is 0.0 with a zero gradient,
still attached to the graph. A probability of exactly 0 contributes 0 (0 log 0 = 0), so a teacher
that masks part of the vocabulary with -inf log-probabilities gives a finite loss. The loss is fp32.
Temperature divides both models' logits before the log-softmax; the loss is *not* multiplied by T^2
(Liger and TRL do not either): multiply it yourself if you want Hinton's gradient scale.

`kl_div` follows F.kl_div exactly (pointwise target * (log target - input), reductions "none", "sum",
"mean" over every element, "batchmean" over the first dimension), including its NaN where a zero
target meets an input of -inf; the reduced losses are fp32. For masked vocabularies use
jsd(beta=0), the same forward KL with the 0 log 0 = 0 convention.

Count the bytes before timing anything
--------------------------------------
Distilling LLaMA 3.1 8B (H = 4096) into a LLaMA 3.2 1B-sized student (H = 2048), vocabulary V = 128256,
N = 16384 tokens. Each model's logits are N x V: 4.2 GB in bf16, 8.4 GB once upcast to fp32.

jsd on log-probabilities, plain PyTorch (`jsd_ref` below, the way TRL writes it, in fp32, from bf16
log-probabilities): summing the bytes every aten op reads and writes gives 136 bytes per element
forward and 154 more in backward at beta = 0.5, and 11 N x V fp32 tensors alive at the peak, most of
them saved for backward (`distillation_test.py` counts both); 92 GB at the size above. The fused
kernel reads each bf16 log-probability of both rows once (4 bytes per element) and writes the
student's bf16 gradient in the same pass (2): 6 bytes per element, 48x less. `jsd_ideal_bytes()`
counts it, with the int64 labels read and fp32 per-row losses written:
    forward (the loss):    16384 * 128256 * 4 + 16384 * (8 + 4) = 8,405,581,824 B
    forward + backward:    16384 * 128256 * 6 + 16384 * (8 + 4) = 12,608,274,432 B
Floor on an H200 (measured copy bandwidth ~4.27 TB/s, bytes read + written): 1969 us for the loss,
2953 us for the loss and its gradient.

linear_jsd is compute bound, like the fused linear cross-entropy. Its matmuls:
    forward   student logits 2 N H_s V, teacher logits 2 N H_t V
    backward  dx = dlogits @ W_s  2 N H_s V,  dW = dlogits.T @ x_s  2 N H_s V
      = 2 N V (3 H_s + H_t) = 43,035,572,305,920 flops (4.3e13) = 54 ms at ~790 TFLOP/s of bf16 matmuls.
`linear_jsd_flops()` counts them; `linear_jsd_ideal_bytes()` the least traffic (read x_s, W_s, x_t,
W_t and the labels, write fp32 per-token losses; backward writes dx and dW once):
    forward:              (16384 + 128256) * (2048 + 4096) * 2 + 16384 * (8 + 4) = 1,777,532,928 B
    forward + backward:   ... + (16384 + 128256) * 2048 * 2                  = 2,369,978,368 B
0.56 ms at 4.27 TB/s against 54 ms of matmuls: the bytes do not limit it; memory does. Unfused
(`linear_jsd_ref`: both models' logits, upcast, tempered, log-softmaxed, then `jsd_ref`), 48 bytes per
token and vocabulary entry are alive at the peak of forward + backward (`distillation_test.py`
counts them): 101 GB at this size. Fused, one chunk of C tokens exists at a time: two [C, V] bf16
buffers (CHUNK_BYTES in all, 512 MiB: C = 1024 here), plus the fp32 accumulator of the student's
weight gradient (V x H_s x 4 = 1.05 GB), as in the fused linear cross-entropy. No teacher gradient is ever computed: the teacher is a constant, and passing a
teacher tensor that requires grad is refused rather than silently given no gradient.

How the fused pass gets the gradient of the logits
--------------------------------------------------
Per row, with x = log_softmax(s / T) and y = log_softmax(t / T), the kernel needs the gradient with
respect to the logits s, not x. The log-softmax's backward is
    dL/ds_j = (g_j - Q_j * sum_k g_k) / T,      g = dL/dx (the JSD's own derivative)
so the row kernel sweeps three times: (1) the two log-sum-exps, online, as the cross-entropy kernel
does; (2) the loss and sum_k g_k; (3) the gradient, written over the student's logits. On a GPU the
second and third sweeps mostly hit L2 (a row of 128256 bf16 values is 250 KB per model).
The mean's token count lives on the GPU and is read by the kernels through a pointer, and the
upstream gradient (usually exactly 1.0) is applied in backward without reading it on the host: the
jsd's [N, V] gradient by the cross-entropy's row-scaling op, which skips rows whose factor is 1;
linear_jsd's dx and dW, small beside the logits, by one multiply each. No host syncs anywhere.

PyTorch sees each loss as a custom op (`torch.ops.playbook.kl_div`, `.jsd`, `.linear_jsd`) with a
fake implementation and a registered autograd formula: one opaque node for torch.compile, opcheck
and FSDP. Second-order gradients raise an error, as in the other fused losses.

Layout of this file: kernels -> checked launchers -> custom ops and autograd -> functional API ->
byte and flop counts -> references.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from cross_entropy_kernel import scale_grad
from core.losses import check_first_order
from core.kernel_utils import as_rows, check_device, check_float, next_power_of_2, refuse_double_backward
from linear_cross_entropy_kernel import CHUNK_BYTES, accumulate_grad_weight, tokens_per_chunk

import triton
import triton.language as tl

# Launch settings of the vocabulary sweeps, not yet timed on a GPU (`benchmark_kernels.py --tune`
# sweeps the cross-entropy's only). 16 values per thread, as the cross-entropy's tuned setting has;
# ptxas for sm_90 compiles both row kernels without register spills at these sizes. The linear JSD's
# kernel keeps four online-softmax lanes per value (max and sum, student and teacher) and spills at
# 8192 columns with 16 warps, so it takes 8 values per thread.
BLOCK_V = 8192
LOGITS_BLOCK_V = 4096
NUM_WARPS = 16
MIN_START = tl.constexpr(-1.0e38)  # a finite "minus infinity" for the online max (see the CE kernel)
FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2  # the three forms of the generalised JSD (beta 0, 1, between)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _kl_div_fwd(
    Input,  # pointer to the input log-probabilities, [N, V], unit stride along V
    Target,  # pointer to the target (probabilities, or log-probabilities with LOG_TARGET), [N, V]
    Out,  # pointer to the output: [N, V] pointwise losses (ELEMENTWISE), else [N] fp32 row sums
    stride_i,  # elements between two rows of Input
    stride_t,  # elements between two rows of Target
    stride_o,  # elements between two rows of Out (ELEMENTWISE only)
    V,  # row length
    LOG_TARGET: tl.constexpr,  # the target is given as log-probabilities
    ELEMENTWISE: tl.constexpr,  # write every pointwise loss (reduction="none") instead of row sums
    BLOCK_V: tl.constexpr,  # columns per block of the sweep
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride exceeds 2^31 past ~16.7k rows at 128k
    acc = tl.zeros([BLOCK_V], tl.float32)
    for b in range(0, tl.cdiv(V, BLOCK_V)):
        cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(Input + row * stride_i + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(Target + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG_TARGET:
            loss = tl.exp(t) * (t - x)
        else:
            # xlogy(t, t) - t * x, as PyTorch computes it: 0 where t == 0 (also for NaN-free t*log t)
            loss = tl.where(t == 0.0, 0.0, t * tl.log(t)) - t * x
        if ELEMENTWISE:
            tl.store(Out + row * stride_o + cols, loss.to(Out.dtype.element_ty), mask=mask)
        else:
            acc += tl.where(mask, loss, 0.0)
    if not ELEMENTWISE:
        tl.store(Out + row, tl.sum(acc, axis=0))


@triton.jit
def _kl_div_bwd(
    Input,  # pointer to the input log-probabilities, [N, V] (read only for the target's gradient)
    Target,  # pointer to the target, [N, V]
    GradOut,  # pointer to the upstream gradient: [N, V] (ELEMENTWISE) or one value (the sum's)
    DInput,  # pointer to the input's gradient, [N, V]
    DTarget,  # pointer to the target's gradient, [N, V]
    stride_i,  # elements between two rows of Input
    stride_t,  # elements between two rows of Target
    stride_go,  # elements between two rows of GradOut (ELEMENTWISE only)
    stride_di,  # elements between two rows of DInput
    stride_dt,  # elements between two rows of DTarget
    V,  # row length
    LOG_TARGET: tl.constexpr,  # the target is given as log-probabilities
    ELEMENTWISE: tl.constexpr,  # one upstream value per element (reduction="none")
    NEED_DI: tl.constexpr,  # write the input's gradient
    NEED_DT: tl.constexpr,  # write the target's gradient
    BLOCK_V: tl.constexpr,  # columns per block
):
    row = tl.program_id(0).to(tl.int64)
    if not ELEMENTWISE:
        go_sum = tl.load(GradOut).to(tl.float32)  # the upstream gradient of the sum, one value
    for b in range(0, tl.cdiv(V, BLOCK_V)):
        cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        t = tl.load(Target + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
        if ELEMENTWISE:
            go = tl.load(GradOut + row * stride_go + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            go = go_sum
        if LOG_TARGET:
            prob = tl.exp(t)
        else:
            prob = t
        if NEED_DI:
            tl.store(DInput + row * stride_di + cols, (-prob * go).to(DInput.dtype.element_ty), mask=mask)
        if NEED_DT:
            x = tl.load(Input + row * stride_i + cols, mask=mask, other=0.0).to(tl.float32)
            if LOG_TARGET:
                dt = prob * (t - x + 1.0)
            else:
                # PyTorch differentiates xlogy(t, t) into log(t) + t / t: NaN where t == 0
                dt = tl.where(t == 0.0, float("nan"), tl.log(t) + 1.0 - x)
            tl.store(DTarget + row * stride_dt + cols, (dt * go).to(DTarget.dtype.element_ty), mask=mask)


@triton.jit
def _jsd_pointwise(x, y, beta, log_beta, log_1m_beta, MODE: tl.constexpr):
    """Per element: the generalised JSD term and its derivative with respect to x.

    x = log Q (student), y = log P (teacher), both fp32. Terms whose probability is exactly 0 give 0
    (0 log 0 = 0; also keeps -inf - -inf = NaN out). A NaN in x or y stays NaN (NaN == 0 is false).
    """
    if MODE == 0:  # forward KL(P || Q): P (y - x); d/dx = -P
        p = tl.exp(y)
        loss = tl.where(p == 0.0, 0.0, p * (y - x))
        dx = -p
    elif MODE == 1:  # reverse KL(Q || P): Q (x - y); d/dx = Q (x - y) + Q
        q = tl.exp(x)
        kl = tl.where(q == 0.0, 0.0, q * (x - y))
        loss = kl
        dx = tl.where(q == 0.0, 0.0, kl + q)
    else:
        # log M = log(beta e^y + (1 - beta) e^x) as a log-add-exp: max + log(1 + exp(min - max)).
        # Summing the probabilities instead underflows: (1 - beta) * Q rounds to 0 for a tiny Q, and
        # Q * (x - log 0) is then +inf. Here x - log M <= -log(1 - beta) and y - log M <= -log(beta).
        a = y + log_beta
        c = x + log_1m_beta
        hi = tl.maximum(a, c)
        log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(a, c) - hi))
        p = tl.exp(y)
        q = tl.exp(x)
        kl_p = tl.where(p == 0.0, 0.0, p * (y - log_m))
        kl_q = tl.where(q == 0.0, 0.0, q * (x - log_m))
        loss = beta * kl_p + (1.0 - beta) * kl_q
        # d/dx: the terms through log M cancel (sum of beta P + (1 - beta) Q over M is 1)
        dx = (1.0 - beta) * kl_q
    return loss, dx


@triton.jit
def _jsd_fwd(
    X,  # pointer to the student's log-probabilities, [N, V], unit stride along V
    Y,  # pointer to the teacher's log-probabilities, [N, V], unit stride along V
    DX,  # pointer to the student's gradient, [N, V] (written only with COMPUTE_GRAD)
    Labels,  # pointer to the shift labels, [N], any integer dtype and stride (only with HAS_LABELS)
    Loss,  # pointer to the per-row losses, [N], fp32
    NValid,  # pointer to the number of rows that count (a 0-d int64 tensor on the device)
    stride_x,  # elements between two rows of X
    stride_y,  # elements between two rows of Y
    stride_dx,  # elements between two rows of DX
    stride_lab,  # elements between two labels
    V,  # vocabulary size
    beta,  # the teacher's weight in the mixture M
    log_beta,  # log(beta) (MIXTURE only)
    log_1m_beta,  # log(1 - beta) (MIXTURE only)
    ignore_index,  # label value whose rows are skipped
    MODE: tl.constexpr,  # FORWARD_KL (beta = 0), REVERSE_KL (beta = 1) or MIXTURE
    HAS_LABELS: tl.constexpr,  # without labels every row counts
    COMPUTE_GRAD: tl.constexpr,  # also write the gradient, already divided by the row count
    BLOCK_V: tl.constexpr,  # columns per block
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    dx_row = DX + row * stride_dx
    if HAS_LABELS:
        ignored = tl.load(Labels + row * stride_lab).to(tl.int64) == ignore_index
    else:
        ignored = row < 0  # never
    if ignored:
        # loss 0 and a gradient row of exact zeros, *stored* (the gradient buffer is uninitialised)
        tl.store(Loss + row, 0.0)
        if COMPUTE_GRAD:
            for b in range(0, tl.cdiv(V, BLOCK_V)):
                cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
                tl.store(dx_row + cols, tl.zeros([BLOCK_V], tl.float32).to(DX.dtype.element_ty), mask=cols < V)
    else:
        # The mean's divisor lives on the GPU (no host sync); this row counts, so it is >= 1.
        scale = 1.0 / tl.maximum(tl.load(NValid).to(tl.float32), 1.0)
        acc = tl.zeros([BLOCK_V], tl.float32)
        for b in range(0, tl.cdiv(V, BLOCK_V)):
            cols = b * BLOCK_V + tl.arange(0, BLOCK_V)
            mask = cols < V
            # the tail loads as -inf: probability 0, so it adds exactly 0 to the loss and gradient
            x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            y = tl.load(y_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            loss, dx = _jsd_pointwise(x, y, beta, log_beta, log_1m_beta, MODE)
            acc += tl.where(mask, loss, 0.0)
            if COMPUTE_GRAD:
                tl.store(dx_row + cols, (dx * scale).to(DX.dtype.element_ty), mask=mask)
        tl.store(Loss + row, tl.sum(acc, axis=0))


@triton.jit
def _jsd_logits(
    S,  # pointer to the student's logits, [C, V]; overwritten by their gradient with COMPUTE_GRAD
    T,  # pointer to the teacher's logits, [C, V]
    Labels,  # pointer to the chunk's shift labels, [C], any integer dtype and stride
    Loss,  # pointer to the chunk's per-row losses, [C], fp32
    NValid,  # pointer to the number of rows that count in the *whole* batch (0-d int64)
    stride_s,  # elements between two rows of S
    stride_t,  # elements between two rows of T
    stride_lab,  # elements between two labels
    V,  # vocabulary size
    inv_temp,  # 1 / temperature
    beta,  # the teacher's weight in the mixture M
    log_beta,  # log(beta) (MIXTURE only)
    log_1m_beta,  # log(1 - beta) (MIXTURE only)
    ignore_index,  # label value whose rows are skipped
    MODE: tl.constexpr,  # FORWARD_KL, REVERSE_KL or MIXTURE
    HAS_LABELS: tl.constexpr,  # without labels every row counts
    COMPUTE_GRAD: tl.constexpr,  # overwrite S with dLoss/dS (divided by the row count)
    BLOCK_V: tl.constexpr,  # columns per block
):
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * stride_s
    t_row = T + row * stride_t
    cols0 = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(V, BLOCK_V)
    if HAS_LABELS:
        ignored = tl.load(Labels + row * stride_lab).to(tl.int64) == ignore_index
    else:
        ignored = row < 0  # never
    if ignored:
        tl.store(Loss + row, 0.0)
        if COMPUTE_GRAD:  # the logits become a gradient row of exact zeros
            for b in range(0, n_blocks):
                cols = b * BLOCK_V + cols0
                tl.store(s_row + cols, tl.zeros([BLOCK_V], tl.float32).to(S.dtype.element_ty), mask=cols < V)
    else:
        # ---- sweep 1: both log-sum-exps of the tempered logits, online ---------------------------
        # As in the cross-entropy kernel: every lane keeps its own running max m and sum s of
        # exp(v - m), one exp per element (exp(-|v - m|) serves both cases), merged after the loop.
        ms = tl.full([BLOCK_V], MIN_START, tl.float32)
        ss = tl.zeros([BLOCK_V], tl.float32)
        mt = tl.full([BLOCK_V], MIN_START, tl.float32)
        st = tl.zeros([BLOCK_V], tl.float32)
        for b in range(0, n_blocks):
            cols = b * BLOCK_V + cols0
            mask = cols < V
            vs = tl.load(s_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
            vt = tl.load(t_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
            es = tl.exp(-tl.abs(vs - ms))
            et = tl.exp(-tl.abs(vt - mt))
            ss = tl.where(vs > ms, ss * es + 1.0, ss + es)
            st = tl.where(vt > mt, st * et + 1.0, st + et)
            ms = tl.maximum(ms, vs)
            mt = tl.maximum(mt, vt)
        # The row max and log(sum exp(v - max)), kept apart so that x = (v - max) - log_sum below
        # subtracts nearby numbers first.
        max_s = tl.max(ms, axis=0)
        max_t = tl.max(mt, axis=0)
        log_sum_s = tl.log(tl.sum(ss * tl.exp(ms - max_s), axis=0))
        log_sum_t = tl.log(tl.sum(st * tl.exp(mt - max_t), axis=0))

        # ---- sweep 2: the loss and sum_k g_k, g = dJSD/dx ---------------------------------------
        acc = tl.zeros([BLOCK_V], tl.float32)
        acc_g = tl.zeros([BLOCK_V], tl.float32)
        for b in range(0, n_blocks):
            cols = b * BLOCK_V + cols0
            mask = cols < V
            # x = s/T - max - log(sum): the subtraction of nearby numbers first (see the CE kernel)
            vs = tl.load(s_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            vt = tl.load(t_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            x = (vs * inv_temp - max_s) - log_sum_s
            y = (vt * inv_temp - max_t) - log_sum_t
            loss, g = _jsd_pointwise(x, y, beta, log_beta, log_1m_beta, MODE)
            acc += tl.where(mask, loss, 0.0)
            acc_g += tl.where(mask, g, 0.0)
        tl.store(Loss + row, tl.sum(acc, axis=0))

        # ---- sweep 3: dL/ds = (g - Q sum g) / T, scaled by 1 / n_valid, over the logits ---------
        if COMPUTE_GRAD:
            sum_g = tl.sum(acc_g, axis=0)
            scale = inv_temp / tl.maximum(tl.load(NValid).to(tl.float32), 1.0)
            for b in range(0, n_blocks):
                cols = b * BLOCK_V + cols0
                mask = cols < V
                vs = tl.load(s_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
                vt = tl.load(t_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
                x = (vs * inv_temp - max_s) - log_sum_s
                y = (vt * inv_temp - max_t) - log_sum_t
                _, g = _jsd_pointwise(x, y, beta, log_beta, log_1m_beta, MODE)
                ds = (g - tl.exp(x) * sum_g) * scale
                tl.store(s_row + cols, ds.to(S.dtype.element_ty), mask=mask)  # this block was read above


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
def _launch_settings(V: int, max_block: int = BLOCK_V):
    """(columns per block, warps): NUM_WARPS warps at the largest block, fewer for a short row."""
    block_v = min(max_block, next_power_of_2(V))
    per_thread = max_block // (32 * NUM_WARPS)  # 16 values per thread, 8 for the linear JSD's kernel
    return block_v, max(1, min(NUM_WARPS, block_v // (32 * per_thread)))


def _mode(beta: float):
    """(MODE, log beta, log(1 - beta)) for the kernels; the logs are used by MIXTURE only."""
    if beta == 0.0:
        return FORWARD_KL, 0.0, 0.0
    if beta == 1.0:
        return REVERSE_KL, 0.0, 0.0
    return MIXTURE, math.log(beta), math.log1p(-beta)


def kl_div_forward(input2, target2, log_target: bool, elementwise: bool) -> torch.Tensor:
    """input2, target2: [N, V] with unit column stride. Pointwise losses [N, V] (elementwise, in the
    promoted dtype, as F.kl_div returns them) or the fp32 sum of all of them."""
    N, V = input2.shape
    device = input2.device
    if elementwise:
        out = torch.empty((N, V), dtype=torch.promote_types(input2.dtype, target2.dtype), device=device)
    else:
        out = torch.empty(N, dtype=torch.float32, device=device)
    if N > 0 and V > 0:
        block_v, num_warps = _launch_settings(V)
        _kl_div_fwd[(N,)](input2, target2, out, input2.stride(0), target2.stride(0), out.stride(0), V,
                          LOG_TARGET=log_target, ELEMENTWISE=elementwise, BLOCK_V=block_v, num_warps=num_warps)
    return out if elementwise else out.sum()


def kl_div_backward(grad_out, input2, target2, log_target: bool, elementwise: bool, need_di: bool, need_dt: bool):
    """(dinput or None, dtarget or None) for an upstream gradient of the pointwise losses or their sum."""
    N, V = input2.shape
    di = torch.empty_like(input2) if need_di else None
    dt = torch.empty_like(target2) if need_dt else None
    if N > 0 and V > 0 and (need_di or need_dt):
        go = as_rows(grad_out) if elementwise else grad_out.reshape(1)
        block_v, num_warps = _launch_settings(V)
        _kl_div_bwd[(N,)](input2, target2, go, di if need_di else input2, dt if need_dt else target2,
                          input2.stride(0), target2.stride(0), go.stride(0) if elementwise else 0,
                          di.stride(0) if need_di else 0, dt.stride(0) if need_dt else 0, V,
                          LOG_TARGET=log_target, ELEMENTWISE=elementwise, NEED_DI=need_di, NEED_DT=need_dt,
                          BLOCK_V=block_v, num_warps=num_warps)
    return di, dt


def _count_valid(labels, n_rows: int, ignore_index: int, device) -> torch.Tensor:
    """The mean's divisor as a 0-d int64 tensor on the device (counting on the GPU: no host sync)."""
    if labels is None:
        return torch.full((), n_rows, dtype=torch.int64, device=device)
    return (labels != ignore_index).sum()


def jsd_forward(student2, teacher2, labels, beta: float, ignore_index: int, compute_grad: bool):
    """student2, teacher2: [N, V] log-probabilities with unit column stride; labels [N] or None.
    Returns (mean loss, fp32; gradient w.r.t. student2 for an upstream gradient of 1, or None)."""
    N, V = student2.shape
    device = student2.device
    n_valid = _count_valid(labels, N, ignore_index, device)
    loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    grad = torch.empty((N, V), dtype=student2.dtype, device=device) if compute_grad else None
    if N > 0:
        mode, log_beta, log_1m_beta = _mode(beta)
        block_v, num_warps = _launch_settings(V)
        _jsd_fwd[(N,)](
            student2, teacher2, grad if compute_grad else student2, labels if labels is not None else loss_rows,
            loss_rows, n_valid, student2.stride(0), teacher2.stride(0), grad.stride(0) if compute_grad else 0,
            labels.stride(0) if labels is not None else 0, V, beta, log_beta, log_1m_beta, ignore_index,
            MODE=mode, HAS_LABELS=labels is not None, COMPUTE_GRAD=compute_grad, BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return loss_rows.sum() / n_valid.clamp(min=1), grad


def chunk_rows(n: int, vocab: int, student_dtype: torch.dtype, teacher_dtype: torch.dtype,
               budget_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that the two [chunk, V] logits buffers (student's and teacher's) fit in
    `budget_bytes`, in multiples of a tensor-core tile (1024 LLaMA tokens in bf16 for 512 MiB)."""
    return tokens_per_chunk(n, vocab * (student_dtype.itemsize + teacher_dtype.itemsize), budget_bytes)


def linear_jsd_pass(xs, ws, xt, wt, labels, beta: float, temperature: float, ignore_index: int,
                    want_dx: bool, want_dw: bool, accumulate_fp32: bool = True, chunk: int | None = None):
    """One chunked sweep over the tokens. Returns (mean loss, dx or None, dW or None).

    xs [N, H_s], ws [V, H_s] (the student); xt [N, H_t], wt [V, H_t] (the teacher); labels [N] or None.
    Per chunk: both logits (cuBLAS), the row kernel (loss; the student's logits become their gradient),
    then dx and dW from that gradient, like the fused linear cross-entropy.
    """
    N = xs.shape[0]
    V = ws.shape[0]
    device = xs.device
    chunk = chunk or chunk_rows(N, V, xs.dtype, xt.dtype)
    n_chunks = -(-N // chunk) if N else 0
    want_grad = want_dx or want_dw
    n_valid = _count_valid(labels, N, ignore_index, device)  # the whole batch's count, for every chunk
    loss_rows = torch.empty(N, dtype=torch.float32, device=device)
    dx = torch.empty_like(xs) if want_dx else None
    dw = acc = None
    if want_dw:
        dw = torch.empty_like(ws) if N else torch.zeros_like(ws)
        acc = dw if (n_chunks <= 1 or not accumulate_fp32 or ws.dtype == torch.float32) else \
            torch.empty(ws.shape, dtype=torch.float32, device=device)
    rows = min(chunk, N)
    s_buf = torch.empty((rows, V), dtype=xs.dtype, device=device)
    t_buf = torch.empty((rows, V), dtype=xt.dtype, device=device)
    mode, log_beta, log_1m_beta = _mode(beta)
    block_v, num_warps = _launch_settings(V, LOGITS_BLOCK_V)
    for i in range(n_chunks):
        s, e = i * chunk, min(N, (i + 1) * chunk)
        xc, s_logits, t_logits = xs[s:e], s_buf[: e - s], t_buf[: e - s]
        torch.mm(xc, ws.t(), out=s_logits)
        torch.mm(xt[s:e], wt.t(), out=t_logits)
        lab = labels[s:e] if labels is not None else None
        _jsd_logits[(e - s,)](
            s_logits, t_logits, lab if lab is not None else loss_rows, loss_rows[s:e], n_valid,
            s_logits.stride(0), t_logits.stride(0), lab.stride(0) if lab is not None else 0, V,
            1.0 / temperature, beta, log_beta, log_1m_beta, ignore_index,
            MODE=mode, HAS_LABELS=lab is not None, COMPUTE_GRAD=want_grad, BLOCK_V=block_v, num_warps=num_warps,
        )
        if want_dx:
            torch.mm(s_logits, ws, out=dx[s:e])  # s_logits now holds dLoss/dlogits
        if want_dw:
            accumulate_grad_weight(acc, s_logits, xc, first=i == 0)
    if acc is not None and acc is not dw:
        dw.copy_(acc)
    return loss_rows.sum() / n_valid.clamp(min=1), dx, dw


# ------------------------------------------------------------------------------------------------
# Input checks: clear errors before anything is launched
# ------------------------------------------------------------------------------------------------
_KL_REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _check_labels(labels, n_rows: int, leading_shape) -> None:
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"shift_labels must be an int64 (or int32) tensor, got {got}")
    if labels.numel() != n_rows or labels.dim() not in (1, len(leading_shape)) or \
            (labels.dim() > 1 and tuple(labels.shape) != tuple(leading_shape)):
        raise ValueError(f"shift_labels must have one label per token: shape [{n_rows}] or "
                         f"{list(leading_shape)}, got {list(labels.shape)}")


def _check_beta(beta) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
    return float(beta)


def _check_teacher(*tensors) -> None:
    """The teacher gets no gradient: refuse a teacher tensor that asks for one, instead of silently
    returning none (compute the teacher under torch.no_grad() and freeze its weights)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("a teacher tensor requires grad, but the distillation losses give the teacher no "
                         "gradient: run the teacher under torch.no_grad() (or .detach() its outputs) and "
                         "freeze its weights with .requires_grad_(False)")


def _check_kl_inputs(input, target, reduction: str) -> None:
    check_float("input", input)
    check_float("target", target)
    check_device(input, target)
    if reduction not in _KL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {_KL_REDUCTIONS}, got {reduction!r}")
    if input.dim() == 0 or input.shape != target.shape:
        raise ValueError(f"input and target must have the same shape, with at least one dimension; got "
                         f"{list(input.shape)} and {list(target.shape)}")


def _check_jsd_inputs(student_logp, teacher_logp, shift_labels) -> None:
    check_float("student_logp", student_logp)
    check_float("teacher_logp", teacher_logp)
    check_device(student_logp, teacher_logp, *([shift_labels] if isinstance(shift_labels, torch.Tensor) else []))
    if student_logp.dim() < 1 or student_logp.shape != teacher_logp.shape:
        raise ValueError(f"student_logp and teacher_logp must have the same shape [..., V]; got "
                         f"{list(student_logp.shape)} and {list(teacher_logp.shape)}")
    if student_logp.shape[-1] == 0:
        raise ValueError("the log-probabilities have a vocabulary of size 0")
    _check_labels(shift_labels, student_logp.numel() // student_logp.shape[-1], student_logp.shape[:-1])


def _check_linear_jsd_inputs(xs, ws, xt, wt, shift_labels, temperature) -> None:
    for name, t in (("student_input", xs), ("student_weight", ws), ("teacher_input", xt), ("teacher_weight", wt)):
        check_float(name, t)
    check_device(xs, ws, xt, wt, *([shift_labels] if isinstance(shift_labels, torch.Tensor) else []))
    if xs.dim() != 2 or ws.dim() != 2 or xt.dim() != 2 or wt.dim() != 2:
        raise ValueError(f"expected student_input [N, H_s], student_weight [V, H_s], teacher_input [N, H_t] and "
                         f"teacher_weight [V, H_t], got {list(xs.shape)}, {list(ws.shape)}, {list(xt.shape)} "
                         f"and {list(wt.shape)}")
    if xs.shape[1] != ws.shape[1] or xt.shape[1] != wt.shape[1]:
        raise ValueError(f"hidden sizes do not match: student_input {list(xs.shape)} with student_weight "
                         f"{list(ws.shape)}, teacher_input {list(xt.shape)} with teacher_weight {list(wt.shape)}")
    if xs.shape[0] != xt.shape[0]:
        raise ValueError(f"student and teacher must see the same tokens: {xs.shape[0]} and {xt.shape[0]} rows")
    if ws.shape[0] != wt.shape[0]:
        raise ValueError(f"student and teacher must share the vocabulary: {ws.shape[0]} and {wt.shape[0]} rows "
                         f"in their lm_head weights")
    if ws.shape[0] == 0:
        raise ValueError("the lm_head weights have a vocabulary of size 0")
    if xs.dtype != ws.dtype or xt.dtype != wt.dtype:
        raise TypeError(f"each model's input and weight must share a dtype: student {xs.dtype} and {ws.dtype}, "
                        f"teacher {xt.dtype} and {wt.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not (0.0 < float(temperature) < math.inf):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    _check_labels(shift_labels, xs.shape[0], (xs.shape[0],))


# ------------------------------------------------------------------------------------------------
# Custom ops: one opaque node each for torch.compile, opcheck and FSDP, with registered autograd.
# Their inputs are already checked and flattened to [rows, V] (unit stride along V). Gradients that
# are not wanted come back as empty placeholders (an op returns the same outputs every time).
# ------------------------------------------------------------------------------------------------
def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("playbook::kl_div", mutates_args=())
def kl_div_op(input2: torch.Tensor, target2: torch.Tensor, log_target: bool, elementwise: bool) -> torch.Tensor:
    """Pointwise KL losses [N, V], or their fp32 sum (the reductions divide it outside the op)."""
    return kl_div_forward(input2, target2, log_target, elementwise)


@kl_div_op.register_fake
def _(input2, target2, log_target, elementwise):
    if elementwise:
        return input2.new_empty(input2.shape, dtype=torch.promote_types(input2.dtype, target2.dtype))
    return input2.new_empty((), dtype=torch.float32)


@torch.library.custom_op("playbook::kl_div_bwd", mutates_args=())
def kl_div_bwd_op(grad_out: torch.Tensor, input2: torch.Tensor, target2: torch.Tensor, log_target: bool,
                  elementwise: bool, need_di: bool, need_dt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dinput, dtarget); an empty placeholder for a gradient that is not needed."""
    di, dt = kl_div_backward(grad_out, input2, target2, log_target, elementwise, need_di, need_dt)
    return _or_empty(di, input2), _or_empty(dt, target2)


@kl_div_bwd_op.register_fake
def _(grad_out, input2, target2, log_target, elementwise, need_di, need_dt):
    return (input2.new_empty(input2.shape if need_di else (0,)),
            target2.new_empty(target2.shape if need_dt else (0,)))


def _kl_div_setup(ctx, inputs, output):
    input2, target2, log_target, elementwise = inputs
    ctx.save_for_backward(input2, target2)
    ctx.flags = (log_target, elementwise)


def _kl_div_backward(ctx, grad_out):
    input2, target2 = ctx.saved_tensors
    need_di, need_dt = ctx.needs_input_grad[:2]
    di, dt = kl_div_bwd_op(grad_out, input2, target2, *ctx.flags, need_di, need_dt)
    return di if need_di else None, dt if need_dt else None, None, None


kl_div_op.register_autograd(_kl_div_backward, setup_context=_kl_div_setup)
refuse_double_backward(kl_div_bwd_op, "kl_div")


@torch.library.custom_op("playbook::jsd", mutates_args=())
def jsd_op(student2: torch.Tensor, teacher2: torch.Tensor, labels: Optional[torch.Tensor], beta: float,
           ignore_index: int, compute_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, gradient w.r.t. student2 for an upstream gradient of 1, or an empty placeholder)."""
    loss, grad = jsd_forward(student2, teacher2, labels, beta, ignore_index, compute_grad)
    return loss, _or_empty(grad, student2)


@jsd_op.register_fake
def _(student2, teacher2, labels, beta, ignore_index, compute_grad):
    return (student2.new_empty((), dtype=torch.float32),
            student2.new_empty(student2.shape if compute_grad else (0,)))


def _jsd_setup(ctx, inputs, output):
    ctx.compute_grad = inputs[5]
    ctx.consumed = False
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _scale_saved_grad(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """grad * grad_output, for a gradient buffer the forward op computed and returned.

    Eager mode scales the buffer in place, which costs nothing for `loss.backward()` (factor 1.0,
    skipped on the GPU). A traced graph (torch.compile, AOTAutograd, opcheck) must not mutate an output
    of the forward op from its backward, so there the functional op writes a new buffer; tracing shows
    as a tensor subclass (functional or fake tensors) where eager mode has plain tensors.
    """
    if torch.compiler.is_compiling() or type(grad) is not torch.Tensor:
        return torch.ops.playbook.cross_entropy_scale_grad(grad, grad_output)
    return scale_grad(grad, grad_output)


def _check_saved_grad(ctx, what: str, computed: bool) -> None:
    """The checks every backward of a loss whose gradient was computed in the forward pass makes."""
    check_first_order(what)
    if not computed:
        raise RuntimeError(f"the {what} was called with its gradient switched off (compute_grad / want_dx / "
                           "want_dw False) but an input needs one; call the functional API, which decides")
    if ctx.consumed:
        raise RuntimeError(f"the {what}'s gradient buffer was already used by a previous backward; run backward "
                           "once per forward (retain_graph is not supported)")
    ctx.consumed = True


def _jsd_backward(ctx, grad_loss, _grad_grad):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    _check_saved_grad(ctx, "fused JSD", ctx.compute_grad)
    (grad,) = ctx.saved_tensors
    # Usually grad_loss is exactly 1.0, and (in eager mode) the rescale skips every row on the GPU.
    return _scale_saved_grad(grad, grad_loss), None, None, None, None, None


jsd_op.register_autograd(_jsd_backward, setup_context=_jsd_setup)


@torch.library.custom_op("playbook::linear_jsd", mutates_args=())
def linear_jsd_op(xs: torch.Tensor, ws: torch.Tensor, xt: torch.Tensor, wt: torch.Tensor,
                  labels: Optional[torch.Tensor], beta: float, temperature: float, ignore_index: int,
                  want_dx: bool, want_dw: bool, accumulate_fp32: bool,
                  chunk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, dx, dW) for an upstream gradient of 1; dx / dW are empty when not wanted."""
    loss, dx, dw = linear_jsd_pass(xs, ws, xt, wt, labels, beta, temperature, ignore_index, want_dx, want_dw,
                                   accumulate_fp32, chunk)
    return loss, _or_empty(dx, xs), _or_empty(dw, ws)


@linear_jsd_op.register_fake
def _(xs, ws, xt, wt, labels, beta, temperature, ignore_index, want_dx, want_dw, accumulate_fp32, chunk):
    return (xs.new_empty((), dtype=torch.float32), xs.new_empty(xs.shape if want_dx else (0,)),
            ws.new_empty(ws.shape if want_dw else (0,)))


def _linear_jsd_setup(ctx, inputs, output):
    ctx.want = inputs[8:10]
    ctx.consumed = False
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _linear_jsd_backward(ctx, grad_loss, _gdx, _gdw):
    need_dx, need_dw = ctx.needs_input_grad[:2]
    none = (None,) * 10
    if not (need_dx or need_dw):
        return (None, None) + none
    want_dx, want_dw = ctx.want
    _check_saved_grad(ctx, "fused linear JSD", (want_dx or not need_dx) and (want_dw or not need_dw))
    dx, dw = ctx.saved_tensors
    # dx [N, H_s] and dW [V, H_s] are small beside the logits: one multiply each, in place in eager
    # mode (a second dW would raise the peak by V x H_s), into new buffers in a traced graph.
    traced = torch.compiler.is_compiling() or type(dx) is not torch.Tensor
    scale = (lambda g: g * grad_loss) if traced else (lambda g: g.mul_(grad_loss))
    return (scale(dx) if need_dx else None, scale(dw) if need_dw else None) + none


linear_jsd_op.register_autograd(_linear_jsd_backward, setup_context=_linear_jsd_setup)


# ------------------------------------------------------------------------------------------------
# Functional API
# ------------------------------------------------------------------------------------------------
def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean",
           log_target: bool = False) -> torch.Tensor:
    """F.kl_div(input, target, reduction, log_target): `input` holds log-probabilities, `target`
    probabilities (or log-probabilities with log_target=True), same shape, the last dimension the
    distribution's. Differentiable in both (once).

    reduction: "none" (pointwise, in the inputs' promoted dtype), "sum", "mean" (over every element),
    "batchmean" (sum / input.shape[0], the KL divergence per sample). Reduced losses are fp32.
    """
    _check_kl_inputs(input, target, reduction)
    input2, target2 = as_rows(input), as_rows(target)
    out = kl_div_op(input2, target2, bool(log_target), reduction == "none")
    if reduction == "none":
        return out.view(input.shape)
    if reduction == "mean":
        return out / input.numel()
    if reduction == "batchmean":
        return out / input.shape[0]
    return out


def jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5, ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence between two distributions given as log-probabilities.

    student_logp, teacher_logp: [..., V] (flattened to [N, V]); beta in [0, 1] (0: KL(teacher ||
    student), 1: KL(student || teacher); see the module docstring); shift_labels: [N] or the leading
    shape, any stride: tokens whose label is `ignore_index` do not count. Returns the fp32 mean over
    the counted tokens of the per-token divergence summed over the vocabulary; 0.0 when none counts.
    Differentiable with respect to student_logp; the teacher must not require grad.
    """
    _check_jsd_inputs(student_logp, teacher_logp, shift_labels)
    beta = _check_beta(beta)
    _check_teacher(teacher_logp)
    student2, teacher2 = as_rows(student_logp), as_rows(teacher_logp)
    labels = shift_labels.reshape(-1) if shift_labels is not None else None
    compute_grad = student_logp.requires_grad and torch.is_grad_enabled()
    loss, _ = jsd_op(student2, teacher2, labels, beta, int(ignore_index), compute_grad)
    return loss


def linear_jsd(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
               teacher_weight: torch.Tensor, shift_labels: torch.Tensor | None = None, beta: float = 0.5,
               temperature: float = 1.0, ignore_index: int = -100, accumulate_fp32: bool = True,
               chunk: int | None = None) -> torch.Tensor:
    """jsd(log_softmax(x_s @ W_s.T / T), log_softmax(x_t @ W_t.T / T), beta) without the logits.

    student_input [..., H_s], student_weight [V, H_s]; teacher_input [..., H_t], teacher_weight
    [V, H_t] (the hidden sizes may differ; the vocabulary is shared; the leading shapes match);
    shift_labels as in `jsd`. Gradients flow to the student's input and weight only; the teacher must
    not require grad. accumulate_fp32 and chunk as in `linear_cross_entropy` (chunk: tokens per chunk,
    default two [chunk, V] buffers of CHUNK_BYTES in all).
    """
    tensors = (student_input, student_weight, teacher_input, teacher_weight)
    if all(isinstance(t, torch.Tensor) for t in tensors) and student_input.dim() >= 2 \
            and student_input.shape[:-1] == teacher_input.shape[:-1]:
        student_input = student_input.reshape(-1, student_input.shape[-1])
        teacher_input = teacher_input.reshape(-1, teacher_input.shape[-1])
        shift_labels = shift_labels.reshape(-1) if isinstance(shift_labels, torch.Tensor) else shift_labels
    device_type = student_input.device.type if isinstance(student_input, torch.Tensor) else "cpu"
    if isinstance(student_input, torch.Tensor) and torch.is_autocast_enabled(device_type):
        # As in linear_cross_entropy: under autocast both heads run in the autocast dtype (as
        # nn.Linear would); cast once and run the chunk loop with autocast off.
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return linear_jsd(*(t.to(dtype) for t in (student_input, student_weight, teacher_input, teacher_weight)),
                              shift_labels, beta, temperature, ignore_index, accumulate_fp32, chunk)
    _check_linear_jsd_inputs(student_input, student_weight, teacher_input, teacher_weight, shift_labels, temperature)
    beta = _check_beta(beta)
    _check_teacher(teacher_input, teacher_weight)
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    grad_enabled = torch.is_grad_enabled()
    want_dx = student_input.requires_grad and grad_enabled
    want_dw = student_weight.requires_grad and grad_enabled
    loss, _, _ = linear_jsd_op(student_input.contiguous(), student_weight.contiguous(), teacher_input.contiguous(),
                               teacher_weight.contiguous(), shift_labels, beta, float(temperature), int(ignore_index),
                               want_dx, want_dw, bool(accumulate_fp32), chunk)
    return loss


# ------------------------------------------------------------------------------------------------
# What the kernels must move and compute (the floors `benchmark_kernels.py` holds them against)
# ------------------------------------------------------------------------------------------------
# Drop-in modules
# ------------------------------------------------------------------------------------------------
class TritonKLDivLoss(torch.nn.Module):
    """A drop-in for torch.nn.KLDivLoss(reduction, log_target): forward(input, target) with `input`
    log-probabilities and `target` probabilities (log-probabilities with log_target=True), any shape
    whose last dimension is the distribution's. Reduced losses are fp32 (torch returns the inputs'
    dtype); 'batchmean' divides by input.shape[0], as torch does."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False):
        super().__init__()
        if size_average is not None or reduce is not None:
            raise ValueError("size_average and reduce are deprecated in torch.nn.KLDivLoss; use reduction")
        if reduction not in ("none", "sum", "mean", "batchmean"):
            raise ValueError(f"reduction must be 'none', 'sum', 'mean' or 'batchmean', got {reduction!r}")
        self.reduction, self.log_target = reduction, bool(log_target)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, self.reduction, self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"


class TritonJSDLoss(torch.nn.Module):
    """The generalised JSD as a module (no torch counterpart): forward(student_logp, teacher_logp,
    shift_labels=None) -> the fp32 mean over the counted tokens (see `jsd`)."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta, self.ignore_index = _check_beta(beta), int(ignore_index)

    def forward(self, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        return jsd(student_logp, teacher_logp, self.beta, self.ignore_index, shift_labels)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"


# ------------------------------------------------------------------------------------------------
def jsd_ideal_bytes(n_rows: int, vocab: int, dtype: torch.dtype, backward: bool = False,
                    label_dtype: torch.dtype = torch.int64) -> int:
    """Read both log-probability rows and the labels, write fp32 per-row losses; with `backward`,
    write the student's gradient once (computed in the same pass; a rescale by an upstream gradient
    of 1.0 is skipped on the GPU)."""
    elt = dtype.itemsize
    return n_rows * vocab * elt * (3 if backward else 2) + n_rows * (label_dtype.itemsize + 4)


def linear_jsd_flops(n_tokens: int, hidden: int, teacher_hidden: int, vocab: int, backward: bool = True) -> int:
    """Both heads' logits (2 N V (H_s + H_t)), plus the student's dx and dW (2 N V H_s each) in backward."""
    return 2 * n_tokens * vocab * (teacher_hidden + hidden * (3 if backward else 1))


def linear_jsd_ideal_bytes(n_tokens: int, hidden: int, teacher_hidden: int, vocab: int, dtype: torch.dtype,
                           backward: bool = False, label_dtype: torch.dtype = torch.int64) -> int:
    """Read both models' hidden states and weights and the labels, write fp32 per-token losses; with
    `backward`, write the student's dx and dW once (the logits stay on chip in an ideal kernel)."""
    elt = dtype.itemsize
    inputs = (n_tokens + vocab) * (hidden + teacher_hidden) * elt
    return inputs + n_tokens * (label_dtype.itemsize + 4) + ((n_tokens + vocab) * hidden * elt if backward else 0)


# ------------------------------------------------------------------------------------------------
# References: plain PyTorch, the way distillation code writes these losses
# ------------------------------------------------------------------------------------------------
def jsd_ref(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5, ignore_index: int = -100,
            shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """The generalised JSD as TRL's `generalized_jsd_loss` writes it, in fp32 (float64 inputs stay
    float64), averaged over the counted tokens (0.0 when none counts). NaN where a log-probability is
    -inf: F.kl_div's log_target form computes exp(-inf) * (-inf - x)."""
    x = student_logp.reshape(-1, student_logp.shape[-1])
    y = teacher_logp.reshape(-1, teacher_logp.shape[-1])
    x, y = (x.float(), y.float()) if x.dtype != torch.float64 else (x, y)
    if beta == 0.0:
        per_token = F.kl_div(x, y, reduction="none", log_target=True).sum(-1)  # KL(P || Q)
    elif beta == 1.0:
        per_token = F.kl_div(y, x, reduction="none", log_target=True).sum(-1)  # KL(Q || P)
    else:
        log_m = torch.logaddexp(x + math.log1p(-beta), y + math.log(beta))
        per_token = (beta * F.kl_div(log_m, y, reduction="none", log_target=True)
                     + (1 - beta) * F.kl_div(log_m, x, reduction="none", log_target=True)).sum(-1)
    if shift_labels is None:
        return per_token.mean() if per_token.numel() else per_token.sum()
    counted = shift_labels.reshape(-1) != ignore_index
    return (per_token * counted).sum() / counted.sum().clamp(min=1)


def linear_jsd_ref(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, beta=0.5,
                   temperature=1.0, ignore_index=-100) -> torch.Tensor:
    """Both models' full logits, upcast to fp32, divided by the temperature, log-softmax, `jsd_ref`;
    the teacher's side under torch.no_grad()."""
    logits_s = student_input.reshape(-1, student_input.shape[-1]) @ student_weight.t()
    with torch.no_grad():
        logits_t = teacher_input.reshape(-1, teacher_input.shape[-1]) @ teacher_weight.t()
    up = (lambda t: t) if logits_s.dtype == torch.float64 else (lambda t: t.float())
    return jsd_ref(F.log_softmax(up(logits_s) / temperature, dim=-1), F.log_softmax(up(logits_t) / temperature, dim=-1),
                   beta, ignore_index, shift_labels)
