"""AdamW in one Triton launch over every parameter of a group: a multi-tensor kernel and its optimizer.

    p <- p * (1 - lr * wd)                                  decoupled weight decay
    m <- beta1 * m + (1 - beta1) * g                        first moment (exp_avg)
    v <- beta2 * v + (1 - beta2) * g^2                      second moment (exp_avg_sq)
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

What you build here: `TritonAdamW`, a drop-in for `torch.optim.AdamW` whose `step()` is one kernel
launch per parameter group, however many tensors the group holds (291 for LLaMA 3.1 8B).
What you learn: how one launch reaches many separate tensors (a small table of their addresses, read
by each program, an int64 cast to a pointer inside the kernel), how to keep such pointers' loads
vectorized (alignment hints and mask-free full blocks), and which host work an optimizer can do
without ever waiting for the GPU.

Count the bytes before timing anything
--------------------------------------
PyTorch's single-tensor AdamW (`foreach=False`) is eight element-wise kernels per parameter tensor.
For bf16 parameters and states (2 bytes per element), each reads its inputs and writes its output:

    param.mul_(1 - lr * wd)                            # read 2, write 2
    exp_avg.lerp_(grad, 1 - beta1)                     # read 4, write 2
    exp_avg_sq.mul_(beta2)                             # read 2, write 2
    exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)   # read 6, write 2
    denom = exp_avg_sq.sqrt()                          # read 2, write 2
    denom = denom / sqrt(1 - beta2^t)                  # read 2, write 2
    denom.add_(eps)                                    # read 2, write 2
    param.addcdiv_(exp_avg, denom, value=-step_size)   # read 6, write 2
                                                       # 42 bytes per element

`foreach=True` runs the same arithmetic as multi-tensor kernels (fewer launches, the same bytes, plus
temporaries). The least any AdamW can move is one read of param, grad, exp_avg and exp_avg_sq and
one write of param, exp_avg and exp_avg_sq: 14 bytes per element in bf16, 3x less. That is
`ideal_bytes(n_params, param_dtype, state_dtype)`; fp32 states with bf16 parameters make it 22.

The floor for the full fine-tune of LLaMA 3.1 8B (8,030,261,248 bf16 parameters, bf16 states) on an
H200, whose measured device-to-device copy bandwidth is ~4.27 TB/s (bytes read + written):
    ideal_bytes(8_030_261_248, bf16, bf16) = 112,423,657,472 B -> 26.3 ms
PyTorch's fused AdamW, one pass like this kernel, was measured on that H200 at ~41 ms on its own and
~59 ms inside the 8B training step: 1.6x and 2.2x the floor. `benchmark_kernels.py --kernels adamw`
measures this kernel against PyTorch's fused and foreach AdamW on 1.09e9 bf16 parameters in the
tensors of five LLaMA 3.1 8B decoder layers.

Design
------
Each program updates one CHUNK (65536 elements) of one tensor. Two tables, built on the host and
copied to the GPU once, say where: per tensor, the base addresses (param, grad, exp_avg, exp_avg_sq,
and the rounding's buffer if it has one), the element count and a random salt; per program, a tensor
index and a chunk index. Only the
gradients' addresses change between steps, and only when the caching allocator hands out new
gradient buffers; then that one row (8 bytes per tensor) is copied again, asynchronously. When every
address is a multiple of 16 bytes (always, for tensors of PyTorch's allocators) the kernel is told
so and each thread moves 16 bytes per access; otherwise it still runs, with narrower accesses.
Tensors are walked as flat memory, so a parameter must be dense (contiguous in some dimension order)
and its gradient and states must have its strides; a gradient laid out differently is copied into
the parameter's layout first (one extra read and write of that gradient; autograd's gradients follow
their parameter's layout, only hand-made `.grad` tensors may not).

Sharded parameters (FSDP2, `torchrun`): AdamW is element-wise, so each process updating its own shard
is the whole update, exactly. A DTensor parameter's optimizer states are DTensors sharded as it is
(`torch.zeros_like(p)` makes one), which is what torch.distributed.checkpoint's
`get_optimizer_state_dict` / `set_optimizer_state_dict` gather and scatter; the kernel is handed their
local shards (`to_local()`: the very memory FSDP2 all-gathers from, updated in place), one table and
one launch per group as before, and never communicates. A gradient, state or buffer that is not
sharded as its parameter (another mesh or placements, a `Partial` gradient not yet reduced) is refused.
The one difference from an unsharded run is stochastic rounding's random bits, which are drawn per
shard (each shard has its own salt; see `_shard_index`): as unbiased, not the same bits.

Numerics: every value is read in its storage dtype, the update runs in fp32 with correctly rounded
division and square root (`div_rn`, `sqrt_rn`), in the order PyTorch's single-tensor AdamW writes
it, and each result is rounded once to its storage dtype (to nearest, unless `rounding` asks otherwise:
see "Updates that stick" below): the arithmetic of PyTorch's fused AdamW
(on a GPU the compiler may fuse a multiply and an add into one FMA, so the last bit can differ).
PyTorch's single-tensor AdamW on bf16 tensors rounds after each of its eight ops; this kernel is the
more accurate of the two.

The step count `t` and the learning rate: two modes, as PyTorch's AdamW has them.
  - `capturable=False` (the default): `t` stays a float32 CPU tensor per parameter, as in PyTorch's
    default AdamW, so the bias corrections are computed on the host without ever waiting for the GPU.
    Parameters of one group whose counts differ (one skipped a step with no gradient) go to separate
    launches, one per count.
  - `capturable=True`, for a CUDA graph of the whole training step (playbook/run/cuda_graph.py): a graph
    replays GPU work only, so nothing the step needs may live on the host. Each `t` is a float32
    tensor on its parameter's device, advanced there; the rate may be a tensor there too, filled in
    place by the scheduler. A few torch ops on the device turn counts and rate into one small vector:
    1 - lr * wd, then each tensor's lr / (1 - beta1^t) and sqrt(1 - beta2^t), in float64 from the
    float32 counts (as PyTorch's fused AdamW computes them) and rounded once to fp32, which gives the
    very values the host path passes. Each program loads its own tensor's pair from the vector, so
    one launch serves a group whatever its counts. The host reads no GPU value, and only the first
    step (which builds the tables) must run before capture. Under capture, the gradients (new tensors
    in the graph's memory pool) get their address row from a page-locked host buffer the table keeps;
    the graph holds that copy and makes it again before its kernel at every replay.

Updates that stick: rounding the new weight to bf16 (`rounding=`)
-----------------------------------------------------------------
A bf16 number has 8 significant bits (7 stored, 1 implied). Between 2^e and 2^(e+1), where
e = floor(log2|w|), neighbouring bf16 values are one ulp = 2^(e - 7) apart, so rounding the new weight
to the nearest of them keeps a change only if the change exceeds half of that:

    w moves  <=>  |update| > ulp / 2 = 2^(floor(log2|w|) - 8)        (exactly half: ties go to even)

Adam's update is about lr in size (lr * m_hat / sqrt(v_hat): 1 x lr for a gradient of steady sign, less
for a noisy one). A worked example, w = 0.02 and lr = 1e-5: log2(0.02) = -5.64, so e = -6, the ulp is
2^-13 = 1.22e-4 and half of it 2^-14 = 6.1e-5. The exact new weight lies 1e-5 from w and 1.12e-4 from
its next bf16 neighbour, so it rounds back to w: the step is lost, and so is the next one, and every
one after it, where an fp32 weight would have moved 1e-3 in 100 steps. At lr = 1e-5 a weight can move
only if 2^(e - 8) < 1e-5, that is e <= -9, |w| < 2^-8 = 0.0039: 2.0% of the weights of SmolLM2-135M
(`--model smollm2-135m`, median |w| 0.11; 16% at lr 1e-4, 0.4% at 1e-6), and fewer still for the smaller
updates of noisy gradients. Everything else is frozen.

What rounding to nearest throws away can be kept, three ways (bf16 parameters; `rounding` per group):
  - "stochastic": round the exact fp32 result x to one of its two bf16 neighbours lo <= x < lo + ulp at
    random, to lo + ulp with probability (x - lo) / ulp. Then the rounding is unbiased:
        E[round(x)] = lo + ulp * (x - lo) / ulp = x
    Each step's update survives on average: the w = 0.02 weight above moves by one ulp with probability
    1e-5 / 1.22e-4 = 8% per step, and after 100 steps its expected move is the exact 1e-3. Each step's
    rounding error has mean 0 and variance at most ulp^2 / 4, so after S steps the weight's distance from
    the exact one has a standard deviation of at most sqrt(S) / 2 ulps, and a layer, which sums over many
    weights, averages those errors out.
    The bits make it cheap. lo's bf16 bits are the top 16 bits of x's fp32 bits (of its magnitude: for a
    negative x, "up" is away from zero, still unbiased), and the low 16 bits say where x lies between lo
    and lo + ulp, in units of ulp / 2^16. Adding a uniform random 16-bit integer to those low bits carries
    into lo's last bit with probability low / 2^16, and clearing them then leaves lo + ulp with exactly
    that probability, lo otherwise. No extra memory, and a few integer operations per element: the random
    bits come from a counter-based hash (`_hash32`) of the seed, the parameter, the step count and the
    element, so a step is reproducible given the seed, a resumed run draws what the uninterrupted one
    would have, and each replay of a CUDA graph draws new bits (the count it hashes is the device tensor
    the graph advances).
  - "kahan": round to nearest, and keep what was thrown away, c = x - round(x), in a bf16 buffer
    (`state["kahan_comp"]`, 2 bytes per weight); the next step starts from w + c. The pair holds the
    weight to about 16 significant bits: above, c gathers 1e-5 per step, passes half an ulp at the 7th
    step, and w then moves one ulp, every time, without noise. The model computes with w, at most half
    an ulp from the exact weight; what is lost is c's own rounding, at most 2^-8 of c per step.
  - "fp32-master", the reference: AdamW updates an fp32 copy of the weight (`state["master_param"]`,
    4 bytes per weight), and each step writes its nearest bf16 value into the model's weight.
  - "nearest" (the default), as PyTorch's AdamW.
Bytes per element, bf16 parameters and states: 14 for nearest and stochastic, 18 for kahan (c read and
written), 20 for fp32-master (the weight read and written in fp32, its bf16 copy written). exp_avg and
exp_avg_sq are rounded to nearest in every mode. (They have a milder form of the same problem:
exp_avg_sq * 0.999 is 0.1% smaller, less than bf16's relative half-ulp of at least 2^-9 = 0.2%, so a
bf16 exp_avg_sq does not decay on its own; new squared gradients move it.)

Layout of this file: kernels -> tables and launcher -> the optimizer (the drop-in) -> `ideal_bytes` ->
reference. There is no custom operator rung: an optimizer step mutates hundreds of tensors in place
and runs outside the model's autograd graph and outside torch.compile's (playbook/run/training.py compiles the
model, not the step), so there is nothing for a registered operator to describe.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from core.kernel_utils import INTERPRET, check_device, check_float

import triton
import triton.language as tl

CHUNK = 65536  # elements per program: 8.03e9 parameters -> ~123k programs and a ~2 MB table
BLOCK = 1024  # elements per loop iteration: 8 per thread at 4 warps, one 16-byte load of bf16 each
NUM_WARPS = 4
# Triton's interpreter pays the same Python overhead for an operation on 1024 or 8192 elements,
# so on a CPU the loop takes bigger steps (8 per chunk: the loop and the masked tail still run).
INTERPRETER_BLOCK = 8192
ALIGNMENT = 16  # bytes: the address alignment that lets a thread load 16 bytes at once

_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# How the new weight is rounded to its bf16 storage (module docstring, "Updates that stick"), and the
# state each rounding keeps besides AdamW's: the Kahan compensation, or the fp32 master weight
ROUNDINGS = ("nearest", "stochastic", "kahan", "fp32-master")
_BUFFERS = {"kahan": "kahan_comp", "fp32-master": "master_param"}


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _nearest_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), still in fp32: integer arithmetic on its bits.

    Run in Triton's interpreter only. A GPU's fp32 -> bf16 conversion rounds to nearest even; the
    interpreter's truncates, and step after step truncation would drag every parameter and state
    toward zero. Adding half of the 16 dropped bits (ties to even) first makes the truncation exact.
    """
    b = x.to(tl.uint32, bitcast=True)
    return tl.where(x == x, ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True), x)


@triton.jit
def _round_like_a_gpu(p, m, v, PARAM_BF16: tl.constexpr, STATE_BF16: tl.constexpr):
    """The values destined for bf16 rounded to nearest even, in the interpreter (see _nearest_bf16)."""
    if PARAM_BF16:
        p = _nearest_bf16(p)
    if STATE_BF16:
        m = _nearest_bf16(m)
        v = _nearest_bf16(v)
    return p, m, v  # NaN is left as it is (tl.where), so it stays NaN


@triton.jit
def _hash32(x):
    """A uint32 -> uint32 bijection whose every output bit flips with probability ~1/2 when any input bit
    does: Chris Wellons' lowbias32 (two multiplies, three xor-shifts). Random bits from a counter, cheaply:
    the same on a GPU and in the interpreter, and nothing to store between steps."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _stochastic_bf16(x, bits):
    """fp32 x rounded to one of its two bf16 neighbours, to the farther one with probability (distance to
    the nearer) / ulp, still in fp32 (so that the conversion to bf16 is exact); `bits`: uniform uint32.

    The low 16 bits of x's fp32 bits are where x lies between its neighbours, in 2^-16 ulps; adding 16
    uniform random bits carries into the bf16 part with exactly that probability. NaN stays NaN; inf
    stays inf (its low bits are 0)."""
    b = x.to(tl.uint32, bitcast=True)
    return tl.where(x == x, ((b + (bits >> 16)) & 0xFFFF0000).to(tl.float32, bitcast=True), x)


@triton.jit
def _adamw_update(
    P, G, M, V,  # pointers to this block's first element of param, grad, exp_avg, exp_avg_sq
    E,  # the same for the rounding's buffer: the Kahan compensation or the fp32 master weight (else unused)
    offs,  # [BLOCK] element offsets
    mask,  # [BLOCK] in-bounds lanes, or None for a full block
    decay,  # 1 - lr * weight_decay
    one_minus_beta1,  # 1 - beta1
    beta2,
    one_minus_beta2,  # 1 - beta2
    eps,
    step_size,  # lr / (1 - beta1^t)
    bias_correction2_sqrt,  # sqrt(1 - beta2^t)
    key,  # ROUNDING "stochastic": uint32, this chunk's key to the random bits (else unused)
    MAXIMIZE: tl.constexpr,  # ascend the gradient instead of descending it
    ROUNDING: tl.constexpr,  # "nearest", "stochastic", "kahan" or "fp32-master" (module docstring)
    ROUND_BY_HAND: tl.constexpr,  # True in Triton's interpreter only (see _round_like_a_gpu)
):
    # Everything below is fp32, in the order of PyTorch's single-tensor AdamW; each output is
    # rounded once, to its storage dtype, by the store.
    if ROUNDING == "fp32-master":
        p = tl.load(E + offs, mask=mask)  # the weight is the fp32 copy; the model's bf16 one is only written
    else:
        p = tl.load(P + offs, mask=mask).to(tl.float32)
    if ROUNDING == "kahan":
        p = p + tl.load(E + offs, mask=mask).to(tl.float32)  # the weight as it would be without rounding
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    m = tl.load(M + offs, mask=mask).to(tl.float32)
    v = tl.load(V + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p * decay
    m = m + one_minus_beta1 * (g - m)  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    # div_rn / sqrt_rn: IEEE-rounded, like PyTorch's kernels (a plain `/` and tl.sqrt compile to
    # faster approximations that can be 1-2 ulp off); free here, since the kernel waits on memory.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)  # the new weight, exact to fp32
    if ROUNDING == "stochastic":
        # A random bf16 neighbour (the store below is exact): the hash of each element's offset in its
        # chunk, mixed with the chunk's key, gives it 32 fresh random bits
        p = _stochastic_bf16(p, _hash32(offs.to(tl.uint32) ^ key))
    elif ROUNDING == "kahan":
        exact = p
        if ROUND_BY_HAND:
            p = _nearest_bf16(p)
        p = p.to(P.dtype.element_ty).to(tl.float32)  # the weight the model gets: rounded to nearest
        c = exact - p  # what that rounding threw away (exact in fp32: less than half a bf16 ulp of p)
        if ROUND_BY_HAND:
            c = _nearest_bf16(c)
        tl.store(E + offs, c.to(E.dtype.element_ty), mask=mask)
    elif ROUNDING == "fp32-master":
        tl.store(E + offs, p, mask=mask)
    if ROUND_BY_HAND:  # (a no-op on p after stochastic or Kahan rounding: it is a bf16 value already)
        p, m, v = _round_like_a_gpu(p, m, v, P.dtype.element_ty == tl.bfloat16, M.dtype.element_ty == tl.bfloat16)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["step_count"])  # one compiled kernel for every step count, not one for 1, ...
def _adamw_multi_tensor(
    Addresses,  # int64 [5, n_tensors]: base addresses of the params, grads, exp_avgs, exp_avg_sqs, buffers
    Numels,  # int64 [n_tensors]: elements of each tensor
    Salts,  # int64 [n_tensors]: each tensor's salt for the random bits (ROUNDING "stochastic")
    ChunkTensor,  # int64 [n_chunks]: the tensor each program updates
    ChunkIndex,  # int64 [n_chunks]: which CHUNK-element piece of it
    n_tensors,  # row length of Addresses
    decay,  # 1 - lr * weight_decay
    one_minus_beta1,  # 1 - beta1
    beta2,
    one_minus_beta2,  # 1 - beta2
    eps,
    step_size,  # lr / (1 - beta1^t)
    bias_correction2_sqrt,  # sqrt(1 - beta2^t)
    Scalars,  # DEVICE_SCALARS: float32 [1 + 3 * n_tensors], the three above and the counts from the device
    step_count,  # the step count t, for the random bits (host path, ROUNDING "stochastic"; else unused)
    PARAM_DTYPE: tl.constexpr,  # dtype of params and grads
    STATE_DTYPE: tl.constexpr,  # dtype of exp_avg and exp_avg_sq
    CHUNK: tl.constexpr,  # elements per program
    BLOCK: tl.constexpr,  # elements per loop iteration
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes (allows 16-byte loads)
    MAXIMIZE: tl.constexpr,
    DEVICE_SCALARS: tl.constexpr,  # capturable mode: decay, step_size, bias_correction2_sqrt come from Scalars
    ROUNDING: tl.constexpr,  # how the new weight is rounded: "nearest", "stochastic", "kahan", "fp32-master"
    ROUND_BY_HAND: tl.constexpr,  # True in Triton's interpreter only (see _round_like_a_gpu)
):
    pid = tl.program_id(0)
    t = tl.load(ChunkTensor + pid)
    chunk = tl.load(ChunkIndex + pid)
    start = chunk * CHUNK  # int64: a tensor may hold more than 2^31 elements
    n = tl.minimum(tl.load(Numels + t) - start, CHUNK).to(tl.int32)  # elements of this chunk
    if DEVICE_SCALARS:
        # Capturable mode: the host never saw the step counts or the rate, so the scalar arguments are
        # placeholders and the values come from the vector `_device_scalars` wrote on the device:
        # [1 - lr * wd, step_size of tensor 0 .. n_tensors - 1, bias_correction2_sqrt of each, count of
        # each]. Per tensor, because parameters of one group may have taken different numbers of steps.
        # Three scalar loads (four for stochastic rounding) per 65536-element program: nothing next to the
        # 14 bytes per element it moves.
        decay = tl.load(Scalars)
        step_size = tl.load(Scalars + 1 + t)
        bias_correction2_sqrt = tl.load(Scalars + 1 + n_tensors + t)
    key = 0
    if ROUNDING == "stochastic":
        # This chunk's key to its random bits: a hash of the tensor's salt (from the seed and the
        # parameter's place in the optimizer), the step count and the chunk; for a given tensor and chunk,
        # a bijection of the count, so no two steps of an element draw alike. Capturable mode hashes the count
        # the device holds (exact in float32 up to 2^24 steps): each replay of a CUDA graph advances it.
        if DEVICE_SCALARS:
            step_count = tl.load(Scalars + 1 + 2 * n_tensors + t)
        salt = tl.load(Salts + t).to(tl.uint32)
        key = _hash32(_hash32(salt ^ _hash32(step_count.to(tl.uint32))) ^ chunk.to(tl.uint32))

    # The table holds plain integers; casting one to a typed pointer is what lets one launch reach
    # tensors that were never passed to it. The compiler knows nothing about such a pointer's
    # alignment, so without the hint every thread would load 2 bytes at a time instead of 16.
    P = tl.load(Addresses + t).to(tl.pointer_type(PARAM_DTYPE))
    G = tl.load(Addresses + n_tensors + t).to(tl.pointer_type(PARAM_DTYPE))
    M = tl.load(Addresses + 2 * n_tensors + t).to(tl.pointer_type(STATE_DTYPE))
    V = tl.load(Addresses + 3 * n_tensors + t).to(tl.pointer_type(STATE_DTYPE))
    E = P  # a placeholder where the rounding has no buffer: never read
    if ROUNDING == "kahan":  # the compensation, in the parameter's dtype
        E = tl.load(Addresses + 4 * n_tensors + t).to(tl.pointer_type(PARAM_DTYPE))
    if ROUNDING == "fp32-master":
        E = tl.load(Addresses + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        P = tl.multiple_of(P, 16)
        G = tl.multiple_of(G, 16)
        M = tl.multiple_of(M, 16)
        V = tl.multiple_of(V, 16)
        E = tl.multiple_of(E, 16)
    P += start
    G += start
    M += start
    V += start
    E += start

    # Full blocks without a mask: a mask compared against a runtime count would, like an unknown
    # alignment, split every load into single elements. Only the last, partial block is masked.
    n_full = n // BLOCK
    for b in range(0, n_full):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        _adamw_update(P, G, M, V, E, offs, None, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                      step_size, bias_correction2_sqrt, key, MAXIMIZE, ROUNDING, ROUND_BY_HAND)
    if n_full * BLOCK < n:
        offs = n_full * BLOCK + tl.arange(0, BLOCK)
        _adamw_update(P, G, M, V, E, offs, offs < n, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                      step_size, bias_correction2_sqrt, key, MAXIMIZE, ROUNDING, ROUND_BY_HAND)


# ------------------------------------------------------------------------------------------------
# The tables and the launcher
# ------------------------------------------------------------------------------------------------
def _upload(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a small host table into `dst` without making the host wait for the GPU: from pinned
    memory, asynchronously (the caching host allocator keeps that memory until the copy is done)."""
    dst.copy_(host.pin_memory() if dst.is_cuda else host, non_blocking=True)


def _layout(t: torch.Tensor) -> tuple:
    """The strides that matter: those of dimensions longer than 1."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill numel() consecutive slots of memory (contiguous in some order of
    its dimensions, e.g. a transposed matrix): the kernel then walks them as one flat array."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_param(p: torch.Tensor) -> None:
    """What the kernel cannot update: refused when the parameter's state is created, and again when a
    table is built (a state loaded from a checkpoint skips the first). A sharded parameter is checked
    by its local shard, what the kernel reads."""
    if _is_dtensor(p):
        p = p.to_local()
    check_float("parameter", p)
    check_device(p)


@functools.cache
def _dtensor_class() -> type | tuple:
    """torch.distributed's DTensor, imported once, when a step first asks (an empty tuple, which no
    tensor is an instance of, in a torch built without distributed support)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return DTensor


def _is_dtensor(t) -> bool:
    """A sharded (or replicated) tensor of torch.distributed (FSDP2's parameters, their gradients and states)."""
    return isinstance(t, _dtensor_class())


def _local(p: torch.Tensor, t: torch.Tensor, name: str) -> torch.Tensor:
    """What the kernel updates of `t`, parameter p's gradient, state or buffer: t itself for a plain p; for a
    DTensor p, t's local shard, once t is checked to be sharded exactly as p (same mesh, same placements),
    so that element i of one local shard is element i of the other. A `Partial` gradient (summed over the
    ranks only when redistributed) has placements unlike its parameter's and is refused with the rest."""
    if not _is_dtensor(p):
        if _is_dtensor(t):
            raise TypeError(f"TritonAdamW: a plain parameter of shape {tuple(p.shape)} has a sharded (DTensor) {name}")
        return t
    if not _is_dtensor(t) or t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):
        got = f"{tuple(t.placements)} on {t.device_mesh}" if _is_dtensor(t) else "a plain tensor"
        raise ValueError(f"TritonAdamW: the {name} of a sharded parameter of shape {tuple(p.shape)} must be a DTensor "
                         f"sharded as it is ({tuple(p.placements)} on {p.device_mesh}); got {got}")
    return t.to_local()


def _shard_index(p: torch.Tensor) -> int:
    """Which shard of its parameter this process holds: 0 for a plain tensor; for a DTensor, its place
    along the mesh dimensions that shard it (those that replicate it count for nothing: replicas must
    draw the same random bits, or stochastic rounding would make them differ)."""
    if not _is_dtensor(p):
        return 0
    from torch.distributed.tensor import Shard

    coordinate = p.device_mesh.get_coordinate() or [0] * p.device_mesh.ndim
    index = 0
    for placement, size, at in zip(p.placements, p.device_mesh.shape, coordinate):
        if isinstance(placement, Shard):
            index = index * size + at
    return index


class TensorTable:
    """Where one launch finds its tensors: addresses, sizes, salts, and each program's (tensor, chunk).

    Built once for a list of parameters and their states, on their device; `set_grads` fills in the
    gradients' addresses each step and copies them only when they changed (always, inside a CUDA
    graph capture: see there). `buffers`: each parameter's Kahan compensation (its dtype) or fp32
    master weight, for those roundings; `salts`: each parameter's salt for stochastic rounding's bits
    (uint32 values; zeros when not given).
    """

    def __init__(self, params: list, exp_avgs: list, exp_avg_sqs: list, chunk: int = CHUNK, *,
                 buffers: list | None = None, salts: list | None = None):
        device = params[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("TritonAdamW: the first step of a parameter set builds its address table (a copy to "
                               "the GPU), which cannot happen inside CUDA graph capture; run one step before capturing")
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True):
            _check_param(p)
            if not _is_dense(p):
                raise ValueError(f"TritonAdamW: a parameter of shape {tuple(p.shape)} and strides {p.stride()} "
                                 "is a strided view, not one block of memory; the kernel walks each parameter "
                                 "as a flat array. Make it contiguous (p.data = p.data.contiguous())")
            for name, s in (("exp_avg", m), ("exp_avg_sq", v)):
                if s.shape != p.shape or _layout(s) != _layout(p) or s.device != device or s.dtype != m.dtype:
                    raise ValueError(f"TritonAdamW: {name} of a parameter of shape {tuple(p.shape)} must have its "
                                     f"shape, strides and device, and one dtype with the other state; got "
                                     f"{tuple(s.shape)}, {s.stride()}, {s.device}, {s.dtype}")
        for p, b in zip(params, buffers or (), strict=buffers is not None):
            if (b.shape != p.shape or _layout(b) != _layout(p) or b.device != device
                    or b.dtype not in (p.dtype, torch.float32) or b.dtype != buffers[0].dtype):
                raise ValueError(f"TritonAdamW: the rounding's buffer of a parameter of shape {tuple(p.shape)} must "
                                 f"have its shape, strides and device, and its dtype or float32 (one for all); got "
                                 f"{tuple(b.shape)}, {b.stride()}, {b.device}, {b.dtype}")
        self.device, self.chunk = device, chunk
        self.buffer_dtype = buffers[0].dtype if buffers else None  # (the kernel's ROUNDING says which it reads)
        self.has_buffers = buffers is not None
        self.param_dtype, self.state_dtype = params[0].dtype, exp_avgs[0].dtype
        self.n_tensors = T = len(params)
        numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        counts = (numels + chunk - 1) // chunk  # programs per tensor (none for an empty one)
        self.n_chunks = C = int(counts.sum())
        if C > 2**31 - 1:
            raise ValueError(f"TritonAdamW: {C} chunks of {chunk} elements exceed the launch grid's 2^31 - 1")
        chunk_tensor = torch.repeat_interleave(torch.arange(T, dtype=torch.int64), counts)
        first = torch.cumsum(counts, 0) - counts  # each tensor's first program
        chunk_index = torch.arange(C, dtype=torch.int64) - torch.repeat_interleave(first, counts)
        addresses = [[t.data_ptr() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, buffers or [])]
        addresses[3] = addresses[3] or [0] * T  # no buffers: a row of zeros, never read
        addresses.insert(1, [0] * T)  # the gradients' row: filled by set_grads before every launch
        salts = torch.tensor(salts if salts is not None else [0] * T, dtype=torch.int64)
        host = torch.cat([torch.tensor(addresses, dtype=torch.int64).flatten(), numels, salts, chunk_tensor,
                          chunk_index])
        self.data = torch.empty_like(host, device=device)  # one buffer, one copy; the views below name its parts
        _upload(self.data, host)
        self.addresses = self.data[: 5 * T].view(5, T)
        self.numels = self.data[5 * T: 6 * T]
        self.salts = self.data[6 * T: 7 * T]
        self.chunk_tensor = self.data[7 * T: 7 * T + C]
        self.chunk_index = self.data[7 * T + C:]
        self._static_aligned = all(a % ALIGNMENT == 0 for i in (0, 2, 3, 4) for a in addresses[i])
        self.grad_ptrs = None  # the row of gradient addresses is filled by set_grads
        self.aligned = False
        # For CUDA graphs (set_grads under capture): the page-locked rows captured graphs copy from,
        # kept as long as the table and never written again; and one fresh row, allocated outside any
        # capture (a capture should allocate nothing on the host), for the next capture to take.
        self._graph_rows = []
        self._spare_row = None
        self._replays_write_row = False  # True once a graph holds a copy into the row: see set_grads

    def set_grads(self, grads: list) -> None:
        """Point the table at this step's gradients (a small asynchronous copy, only when they moved).

        Inside a CUDA graph capture the copy is recorded instead, from a page-locked host row that
        belongs to that graph. Its gradients are the graph's own tensors, in its private memory pool
        (usually not where the eager step's were), and that pool hands out the same addresses at every
        replay, so one row, written now and never again, is right for every replay; the graph copies it
        into the table before its kernel each time. The copy is recorded even when the addresses did not move:
        an eager step between two replays may point the table at other gradients, and a replay must
        not inherit them. For the same reason, once a graph holds such a copy, an eager step cannot
        trust its memory of what the table holds and copies its row every time (8 bytes per tensor).
        """
        ptrs = tuple(g.data_ptr() for g in grads)
        cuda = self.device.type == "cuda"
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            self._capture_grad_row(ptrs)
        elif ptrs != self.grad_ptrs or self._replays_write_row:
            _upload(self.addresses[1], torch.tensor(ptrs, dtype=torch.int64))
        else:
            return
        self.grad_ptrs = ptrs
        self.aligned = self._static_aligned and all(a % ALIGNMENT == 0 for a in ptrs)
        if cuda and not capturing and self._spare_row is None:
            # Outside capture: a row for the next capture to take (one small pinned allocation each)
            self._spare_row = torch.empty(self.n_tensors, dtype=torch.int64, pin_memory=True)

    def _capture_grad_row(self, ptrs: tuple) -> None:
        """Record, in the graph being captured, a copy of `ptrs` from pinned memory into the table."""
        row, self._spare_row = self._spare_row, None
        if row is None:  # a second capture with no eager step since the first: allocate under capture
            try:  # (PyTorch's pinned-memory allocator serves a capture from the graph's own host pool)
                row = torch.empty(self.n_tensors, dtype=torch.int64, pin_memory=True)
            except RuntimeError as err:
                raise RuntimeError("TritonAdamW: could not allocate page-locked memory for the gradients' addresses "
                                   "inside CUDA graph capture; run one eager step between two captures") from err
        # Written on the host now, before the graph exists: no copy has ever read this row, and none
        # will until a replay; from then on it is read-only (a later capture takes another row).
        row.copy_(torch.tensor(ptrs, dtype=torch.int64))
        # A memcpy node from page-locked memory (from pageable memory a capture refuses the copy)
        self.addresses[1].copy_(row, non_blocking=True)
        self._graph_rows.append(row)
        self._replays_write_row = True


def adamw_multi_tensor_(table: TensorTable, *, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float,
                        weight_decay: float, step: float | torch.Tensor, maximize: bool = False,
                        rounding: str = "nearest", block: int | None = None, num_warps: int = NUM_WARPS) -> None:
    """One AdamW step, in place, for every tensor of `table` (whose gradients `set_grads` named).

    `step` is the step count t after this update (1 on the first step). Given as a float (with a
    float `lr`), the bias corrections are computed here, in float64 on the host, as PyTorch's AdamW
    computes them. Given as a tensor of the table's n_tensors counts on its device (capturable mode;
    `lr` a float or a 0-d tensor there), they are computed on the device (`_device_scalars`), per
    tensor, and nothing is read back: the launch can be captured in a CUDA graph.
    `rounding`: how each new weight is rounded to bf16 (ROUNDINGS; the module docstring); "kahan" and
    "fp32-master" need a table built with their buffers, "stochastic" the salts (zeros otherwise).
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"TritonAdamW: rounding {rounding!r} is not one of {', '.join(ROUNDINGS)}")
    if (rounding in _BUFFERS) != table.has_buffers:
        raise ValueError(f"TritonAdamW: rounding {rounding!r} " + ("needs a table built with its buffers"
                         if rounding in _BUFFERS else "takes a table without buffers"))
    wanted = {"kahan": table.param_dtype, "fp32-master": torch.float32}.get(rounding)
    if table.has_buffers and table.n_tensors and table.buffer_dtype != wanted:
        raise ValueError(f"TritonAdamW: rounding {rounding!r} keeps its buffers in {wanted}, not {table.buffer_dtype}")
    if rounding in ("stochastic", "kahan") and table.param_dtype != torch.bfloat16:
        raise ValueError(f"TritonAdamW: rounding {rounding!r} rounds bf16 weights; these are {table.param_dtype}")
    if table.n_chunks == 0:
        return
    if INTERPRET and table.device.type != "cpu":
        raise RuntimeError("TritonAdamW: Triton's interpreter runs on the CPU and cannot follow addresses of "
                           f"{table.device} memory; unset TRITON_INTERPRET, or keep the parameters on the CPU")
    block = block or (INTERPRETER_BLOCK if INTERPRET else BLOCK)
    if table.chunk % block:
        raise ValueError(f"block ({block}) must divide the chunk ({table.chunk})")
    step_count = 0  # the host path's count, for stochastic rounding's bits (capturable: read on the device)
    if isinstance(step, torch.Tensor) or isinstance(lr, torch.Tensor):
        scalars = _device_scalars(table, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, step=step)
        decay = step_size = bias_correction2_sqrt = 1.0  # placeholders: the kernel reads `scalars`
    else:
        step_count = int(step) if rounding == "stochastic" else 0
        scalars = None  # a constexpr None to Triton: the host path's compiled kernel is the one it always was
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        decay, step_size = 1 - lr * weight_decay, lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
    # Triton launches on the current CUDA device: make it the tensors' one
    with torch.cuda.device(table.device) if table.device.type == "cuda" else contextlib.nullcontext():
        _adamw_multi_tensor[(table.n_chunks,)](
            table.addresses, table.numels, table.salts, table.chunk_tensor, table.chunk_index, table.n_tensors,
            decay, 1 - beta1, beta2, 1 - beta2, eps, step_size, bias_correction2_sqrt, scalars, step_count,
            PARAM_DTYPE=_TRITON_DTYPES[table.param_dtype], STATE_DTYPE=_TRITON_DTYPES[table.state_dtype],
            CHUNK=table.chunk, BLOCK=block, ALIGNED=table.aligned, MAXIMIZE=bool(maximize),
            DEVICE_SCALARS=scalars is not None, ROUNDING=rounding, ROUND_BY_HAND=INTERPRET, num_warps=num_warps,
        )


def _device_scalars(table: TensorTable, *, lr: float | torch.Tensor, beta1: float, beta2: float, weight_decay: float,
                    step: float | torch.Tensor) -> torch.Tensor:
    """The kernel's per-tensor scalars, computed on the table's device from device tensors, never read
    on the host: float32 [1 - lr * wd, lr / (1 - beta1^t_i) for each tensor i, sqrt(1 - beta2^t_i) for each,
    t_i for each (the counts stochastic rounding hashes)].

    About a dozen tiny kernels (a few microseconds each in a graph), next to one AdamW pass over the
    group's parameters. The arithmetic is float64 from the float32 counts and rate, as in PyTorch's
    fused AdamW (which reads both from the device too) and as the host path computes in Python floats;
    one rounding to fp32 at the end gives the kernel the very values the host path would pass (but for
    a last-bit difference between pow implementations, which fp32 almost never sees). PyTorch's
    single-tensor and foreach capturable AdamW compute them in fp32 instead, where 1 - 0.999 is already
    1e-5 off: the more accurate choice is also the one that matches both of our references.
    """
    device, n = table.device, table.n_tensors
    for name, value in (("lr", lr), ("step", step)):
        if isinstance(value, torch.Tensor) and value.device != device:
            raise ValueError(f"TritonAdamW: in capturable mode {name} must be a float or a tensor on the parameters' "
                             f"device ({device}), got a tensor on {value.device}: it is never read on the host")
    f64 = torch.float64
    t = step.to(f64) if isinstance(step, torch.Tensor) else torch.full((), float(step), dtype=f64, device=device)
    t = t.reshape(-1).expand(n)  # one count per tensor (a single count stands for all)
    if isinstance(lr, torch.Tensor):
        rate = lr.to(f64).reshape(())
    else:  # a constant of the graph, if captured
        rate = torch.full((), float(lr), dtype=f64, device=device)
    bias_correction1 = 1 - torch.pow(beta1, t)
    bias_correction2 = 1 - torch.pow(beta2, t)
    return torch.cat([(1 - rate * weight_decay).reshape(1), rate / bias_correction1, bias_correction2.sqrt(),
                      t]).float()


# ------------------------------------------------------------------------------------------------
# The optimizer
# ------------------------------------------------------------------------------------------------
def _host_float(value, name: str) -> float:
    """A hyperparameter as a Python float, never by reading GPU memory (that would wait for the GPU)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"TritonAdamW: {name} is a tensor on {value.device}; reading it would make the host wait "
                             "for the GPU at every step. Give a float or a CPU tensor, or (for lr) pass "
                             "capturable=True, which never reads it")
        return float(value)
    return float(value)


_CPU = torch.device("cpu")


def _capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (never without a CUDA GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _placed_step(step, device: torch.device) -> torch.Tensor:
    """A step count as a float32 tensor on `device` (the CPU, or the parameter's device when capturable)."""
    if isinstance(step, torch.Tensor):
        return step.to(device=device, dtype=torch.float32)
    return torch.tensor(float(step), dtype=torch.float32, device=device)  # a number, from an old checkpoint


def _mix32(x: int) -> int:
    """_hash32 on the host, in Python integers."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _salt(seed: int, index: int) -> int:
    """The salt of the parameter at place `index` of an optimizer seeded with `seed` (0 <= seed < 2^64):
    a bijection of `index` for each seed, so no two parameters of one optimizer share their random bits."""
    return _mix32(index ^ _mix32((seed >> 32) ^ _mix32(seed)))


def _rounding_state(p: torch.Tensor, state: dict, rounding: str) -> None:
    """Check that `rounding` applies to p's dtype, and make its buffer where the state has none yet (a new
    parameter, or a state loaded from a checkpoint of another rounding): compensation 0, master = p."""
    if rounding in ("stochastic", "kahan") and p.dtype != torch.bfloat16:
        raise ValueError(f"TritonAdamW: rounding={rounding!r} keeps the updates that rounding to bf16 loses; this "
                         f"parameter is {p.dtype} (use rounding='nearest')")
    if rounding == "fp32-master" and p.dtype == torch.float32:
        raise ValueError("TritonAdamW: rounding='fp32-master' keeps an fp32 copy of a low-precision weight; this "
                         "parameter is float32 already (use rounding='nearest')")
    name = _BUFFERS.get(rounding)
    if name is not None and name not in state:
        state[name] = (torch.zeros_like(p, memory_format=torch.preserve_format) if rounding == "kahan"
                       else p.detach().to(torch.float32, memory_format=torch.preserve_format, copy=True))


class TritonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's arithmetic and state, stepped by one multi-tensor Triton launch per group.

        >>> optimizer = TritonAdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
        >>> loss.backward(); optimizer.step(); optimizer.zero_grad()

    The hyperparameters are AdamW's: lr, betas, eps, weight_decay (decoupled: p *= 1 - lr * wd),
    maximize, capturable; each param group may have its own, and a scheduler may change `lr` between
    steps. The state is AdamW's too, per parameter: `step` (a float32 tensor), `exp_avg` and
    `exp_avg_sq` (in the parameter's dtype), so `state_dict()` has torch.optim.AdamW's structure and a
    checkpoint of either loads into the other (a rounding's buffer, below, is one more key of the state).

    Two modes, per group (`group["capturable"]`, as in PyTorch's AdamW); both compute the same values:
      - capturable=False (the default): `step` lives on the CPU, `lr` is a float or a CPU tensor, and
        the bias corrections are computed on the host, which never waits for the GPU.
      - capturable=True: `step` lives on the parameter's device, and `lr` is a float or a 0-d tensor
        there (fill it in place to change the rate of a captured step; a float is a constant of the
        graph). `step()` reads no GPU value, so once one eager step has built the address tables, a
        step can be captured with `torch.cuda.graph` and replayed.
    `load_state_dict` keeps each group's own mode (PyTorch's AdamW takes the checkpoint's) and puts the
    loaded counts where that mode keeps them.

    `rounding` (per group; the module docstring explains): how each new bf16 weight is rounded.
    "nearest" (the default) as PyTorch; "stochastic", unbiased, its random bits drawn from `seed`, the
    parameter's place in the optimizer and the step count; "kahan", with a bf16 compensation buffer per
    parameter (`state["kahan_comp"]`); "fp32-master", an fp32 copy of each weight
    (`state["master_param"]`) that AdamW updates, written rounded to nearest into the weight. Stochastic
    and Kahan rounding need bf16 parameters, the fp32 master bf16 or fp16 ones. Like `capturable`, each
    group keeps its own rounding and seed through `load_state_dict`: a buffer the checkpoint lacks starts
    from the weights (compensation 0, master = the bf16 weight), and one this rounding does not use is
    dropped (a stale fp32 master must not come back at a later resume). The fp32 master stays fp32 when
    loaded (PyTorch's loader would cast it to the parameter's dtype).

    Sharded (DTensor, FSDP2) parameters are updated shard by shard, each process its own, with states
    that are DTensors sharded like their parameter (the module docstring): the same values as an
    unsharded run, bit for bit (but for stochastic rounding's bits, drawn per shard).

    Parameters without a gradient are skipped (their step count stays). Refused, with an error that
    says so: amsgrad, sparse gradients, complex or integer parameters, a gradient or state sharded
    unlike its parameter, a parameter that is a strided view rather than one block of memory, and an
    lr on the GPU without capturable=True.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 capturable: bool = False, rounding: str = "nearest", seed: int = 0):
        if capturable and isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            # Its value is not checked: that would read GPU memory, which is what capturable avoids
            if lr.numel() != 1 or not lr.is_floating_point():
                raise ValueError(f"TritonAdamW: a tensor lr must hold one floating-point value, got {lr.dtype} "
                                 f"of shape {tuple(lr.shape)}")
        elif not 0.0 <= _host_float(lr, "lr"):
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas} (each must be in [0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay value: {weight_decay}")
        if amsgrad:
            raise ValueError("TritonAdamW does not implement amsgrad (a third state, the running maximum of "
                             "exp_avg_sq); use torch.optim.AdamW(amsgrad=True)")
        if rounding not in ROUNDINGS:
            raise ValueError(f"TritonAdamW: rounding {rounding!r} is not one of {', '.join(ROUNDINGS)}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"TritonAdamW: seed {seed} is not in [0, 2^64)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=maximize,
                        capturable=bool(capturable), rounding=rounding, seed=int(seed))
        super().__init__(params, defaults)
        self._tables = {}  # (device, dtypes, addresses and sizes) -> TensorTable, for the last step's launches
        self._graph_tables = {}  # the same, for every table a captured step used: see step()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups pickled before these existed
            group.setdefault("capturable", False)
            group.setdefault("rounding", "nearest")
            group.setdefault("seed", 0)
        self._tables = {}  # tables hold addresses of this process's memory; never carried over
        self._graph_tables = {}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Optimizer's, then each group back in its own mode, its counts where that mode keeps them.

        PyTorch's AdamW takes the checkpoint's `capturable` flag along with its groups; here each group
        keeps this optimizer's, since how steps are run belongs to this run, not to the training state
        (a CUDA-graph run's checkpoint resumes in an eager run, and the other way round). Then:
          - a group on the host path gets every `step` as a float32 CPU tensor (a checkpoint of PyTorch's
            fused or capturable AdamW keeps it on the GPU) and a GPU-tensor `lr` as a float: the one read
            of GPU memory is here, once, not at every step;
          - a capturable group gets every `step` as a float32 tensor on its parameter's device, and keeps
            its own `lr` tensor, if it had one, with the checkpoint's rate written into it (a graph
            captured with that tensor, or a scheduler holding it, keeps working).
        Each group keeps its own `rounding` and `seed` too, with the buffer that rounding uses: an fp32
        master as saved (not cast to the parameter's dtype), none of another rounding's (the class docstring).
        """
        modes = [(g.get("capturable", False), g.get("rounding", "nearest"), g.get("seed", 0))
                 for g in self.param_groups]
        rates = [g["lr"] for g in self.param_groups]
        state_dict, masters = self._take_masters(state_dict)
        super().load_state_dict(state_dict)
        for group, (capturable, rounding, seed), rate in zip(self.param_groups, modes, rates):
            group["capturable"], group["rounding"], group["seed"] = capturable, rounding, seed
            lr = group["lr"]
            if not capturable and isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                group["lr"] = float(lr)
            elif capturable and isinstance(rate, torch.Tensor) and lr is not rate:
                if isinstance(lr, torch.Tensor):
                    rate.copy_(lr)  # a device-side copy (or an upload), never a read on the host
                else:
                    rate.fill_(float(lr))
                group["lr"] = rate
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = _placed_step(state["step"], p.device if capturable else _CPU)
                if state and p in masters and rounding == "fp32-master":
                    state["master_param"] = masters[p].to(device=p.device, dtype=torch.float32, copy=True)
                for name in _BUFFERS.values():
                    if state and name in state and name != _BUFFERS.get(rounding):
                        del state[name]  # another rounding's buffer: see the class docstring
        self._tables = {}

    def _take_masters(self, state_dict: dict) -> tuple[dict, dict]:
        """(state_dict without its fp32 master weights, {parameter: its saved master}).

        torch.optim.Optimizer.load_state_dict casts every floating-point state to its parameter's dtype,
        which would round an fp32 master to bf16; load_state_dict puts them back as they were saved."""
        saved = state_dict["state"]
        if not any(isinstance(s, dict) and "master_param" in s for s in saved.values()):
            return state_dict, {}
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        ours = [p for g in self.param_groups for p in g["params"]]
        masters = {p: saved[i]["master_param"] for i, p in zip(ids, ours) if "master_param" in saved.get(i, {})}
        rest = {i: {k: v for k, v in s.items() if k != "master_param"} for i, s in saved.items()}
        return {**state_dict, "state": rest}, masters

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tables = {}
        for group in self.param_groups:
            self._step_group(group, tables)
        self._tables = tables  # tables of parameter sets not stepped this time are dropped
        if _capturing():
            # ... except those of a captured step: every replay reads their device buffer and copies
            # from their page-locked rows, so freeing them would let a replay follow stale addresses.
            # Nothing says when the graph is gone, so they stay as long as the optimizer (usually they
            # are the very tables the eager steps use: no extra memory).
            self._graph_tables.update(tables)
        return loss

    def _step_group(self, group: dict, tables: dict) -> None:
        if group.get("amsgrad", False):
            raise ValueError("TritonAdamW does not implement amsgrad; this param group (loaded from a state dict?) "
                             "asks for it")
        capturable = group.get("capturable", False)
        rounding = group.get("rounding", "nearest")
        lr = group["lr"] if capturable else _host_float(group["lr"], "lr")  # capturable: never read here
        beta1, beta2 = (_host_float(b, "betas") for b in group["betas"])
        entries = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("TritonAdamW does not support sparse gradients; use torch.optim.SparseAdam")
            if g.dtype != p.dtype:
                raise TypeError(f"TritonAdamW: a {p.dtype} parameter has a {g.dtype} gradient; they must match")
            if g.stride() != p.stride() and _layout(g) != _layout(p):
                g = torch.empty_like(p).copy_(g)  # into the parameter's layout: one extra read + write of g
            state = self.state[p]
            if not state:
                _check_param(p)
                # capturable: on the parameter's device, as PyTorch's capturable AdamW keeps it
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if capturable
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif capturable and state["step"].device != p.device:  # the flag was switched by hand
                state["step"] = self._moved_step(state["step"], p.device)
            if rounding != "nearest":
                _rounding_state(p, state, rounding)
            # What the kernel reads and writes: the tensors themselves, or for a sharded parameter their
            # local shards (the module docstring); the step count is a plain tensor either way
            local = {k: v if k == "step" else _local(p, v, k) for k, v in state.items() if isinstance(v, torch.Tensor)}
            entries.append((_local(p, p, "parameter"), _local(p, g, "gradient"), local, p))
        if not entries:
            return
        steps = [s["step"] for _, _, s, _ in entries]
        # Host path: CPU tensors, as in PyTorch's AdamW: no GPU work, no waiting. Capturable: on the
        # device, so that a graph's replay counts its step too.
        torch._foreach_add_(steps, 1.0)
        # Host path: one launch per device, dtypes and step count (read once, from CPU memory, for the
        # whole group). Capturable: one per device and dtypes, whatever the counts: the kernel reads each
        # tensor's own count on the device.
        counts = [None] * len(entries) if capturable else torch.stack(steps).tolist()
        launches = {}
        for entry, t in zip(entries, counts):
            p, _, s, _ = entry
            launches.setdefault((p.device, p.dtype, s["exp_avg"].dtype, t), []).append(entry)
        for (_, _, _, t), members in launches.items():
            table = self._table(members, tables, rounding, group.get("seed", 0))
            table.set_grads([g for _, g, _, _ in members])
            step = torch.stack([s["step"] for _, _, s, _ in members]) if capturable else t
            adamw_multi_tensor_(table, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"], step=step, maximize=group["maximize"],
                                rounding=rounding)

    @staticmethod
    def _moved_step(step: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The count of a capturable group found off its parameter's device (group["capturable"] set by
        hand, without moving the counts as load_state_dict does): moved there once, before any capture.
        (The host path takes a count on the GPU as it is; reading it there makes each step wait.)"""
        if _capturing():
            raise RuntimeError(f"TritonAdamW: a step count is on {step.device} but a capturable group keeps it on "
                               f"{device}; the copy cannot happen inside CUDA graph capture. Run one step after "
                               "setting group['capturable'], before capturing")
        return _placed_step(step, device)

    def _table(self, members: list, tables: dict, rounding: str = "nearest", seed: int = 0) -> TensorTable:
        """The TensorTable for these tensors: the last step's if their addresses and sizes are unchanged.
        `members`: (parameter, gradient, state) as the kernel sees them (local shards of a sharded
        parameter), and the parameter itself (for its place in the optimizer)."""
        p0, _, s0, _ = members[0]
        buffer = _BUFFERS.get(rounding)
        key = (p0.device, p0.dtype, s0["exp_avg"].dtype, rounding, seed,
               tuple((p.data_ptr(), s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr(),
                      s[buffer].data_ptr() if buffer else 0, p.numel()) for p, _, s, _ in members))
        table = tables.get(key) or self._tables.get(key) or self._graph_tables.get(key)
        if table is None:
            salts = None
            if rounding == "stochastic":
                # Each parameter's own, from its place in the optimizer (stable); each shard of a sharded one
                # its own too (place + shard * n: distinct for every pair, and the unsharded salt for shard 0)
                place = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
                salts = [_salt(seed, place[q] + _shard_index(q) * len(place)) for _, _, _, q in members]
            table = TensorTable([p for p, _, _, _ in members], [s["exp_avg"] for _, _, s, _ in members],
                                [s["exp_avg_sq"] for _, _, s, _ in members],
                                buffers=[s[buffer] for _, _, s, _ in members] if buffer else None, salts=salts)
        tables[key] = table
        return table


# ------------------------------------------------------------------------------------------------
# Bytes, and the reference
# ------------------------------------------------------------------------------------------------
def ideal_bytes(n_params: int, param_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype | None = None,
                *, dtype: torch.dtype | None = None, backward: bool = False, rounding: str = "nearest") -> int:
    """The fewest bytes one AdamW step can move for `n_params` parameters.

    It reads the parameter, its gradient (in the parameter's dtype), exp_avg and exp_avg_sq, and writes
    the parameter, exp_avg and exp_avg_sq: 3 parameter-sized and 4 state-sized accesses per element.
    `state_dtype` defaults to the parameter's dtype (PyTorch's choice, and this optimizer's).
    `dtype` and `backward` are the keywords benchmark_kernels.py asks every kernel module with: `dtype`
    stands for both dtypes; an optimizer step has no backward pass, so `backward` changes nothing.
    `rounding`: "kahan" also reads and writes the compensation (2 parameter-sized accesses more);
    "fp32-master" reads and writes the fp32 weight instead of reading the parameter (8 bytes for 1 access);
    "stochastic" moves what "nearest" does.
    """
    if dtype is not None:
        param_dtype = state_dtype = dtype
    state_dtype = state_dtype or param_dtype
    extra = {"kahan": 2 * param_dtype.itemsize, "fp32-master": 8 - param_dtype.itemsize}.get(rounding, 0)
    return n_params * (3 * param_dtype.itemsize + 4 * state_dtype.itemsize + extra)


def adamw_ref(params, **hyperparameters) -> torch.optim.AdamW:
    """PyTorch's single-tensor AdamW (foreach=False, fused=False) with the same hyperparameters: what
    the tests and the benchmark hold TritonAdamW to (on float64 copies, it is the truth)."""
    return torch.optim.AdamW(params, foreach=False, fused=False, **hyperparameters)
