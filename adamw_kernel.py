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
copied to the GPU once, say where: per tensor, the four base addresses (param, grad, exp_avg,
exp_avg_sq) and the element count; per program, a tensor index and a chunk index. Only the
gradients' addresses change between steps, and only when the caching allocator hands out new
gradient buffers; then that one row (8 bytes per tensor) is copied again, asynchronously. When every
address is a multiple of 16 bytes (always, for tensors of PyTorch's allocators) the kernel is told
so and each thread moves 16 bytes per access; otherwise it still runs, with narrower accesses.
Tensors are walked as flat memory, so a parameter must be dense (contiguous in some dimension order)
and its gradient and states must have its strides; a gradient laid out differently is copied into
the parameter's layout first (one extra read and write of that gradient; autograd's gradients follow
their parameter's layout, only hand-made `.grad` tensors may not). Sharded (DTensor) parameters are
refused: FSDP2 runs keep PyTorch's fused AdamW.

Numerics: every value is read in its storage dtype, the update runs in fp32 with correctly rounded
division and square root (`div_rn`, `sqrt_rn`), in the order PyTorch's single-tensor AdamW writes
it, and each result is rounded once to its storage dtype: the arithmetic of PyTorch's fused AdamW
(on a GPU the compiler may fuse a multiply and an add into one FMA, so the last bit can differ).
PyTorch's single-tensor AdamW on bf16 tensors rounds after each of its eight ops; this kernel is the
more accurate of the two.

The step count `t` stays a float32 CPU tensor per parameter, as in PyTorch's default AdamW, so the
bias corrections are computed on the host without ever waiting for the GPU. Parameters of one group
whose counts differ (one skipped a step with no gradient) go to separate launches, one per count.

Layout of this file: kernels -> tables and launcher -> the optimizer (the drop-in) -> `ideal_bytes` ->
reference. There is no custom operator rung: an optimizer step mutates hundreds of tensors in place
and runs outside the model's autograd graph and outside torch.compile's (playbook/training.py compiles the
model, not the step), so there is nothing for a registered operator to describe.
"""

from __future__ import annotations

import contextlib
import math

import torch

from playbook import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from playbook.kernel_utils import INTERPRET, check_device, check_float

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


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _round_like_a_gpu(p, m, v, PARAM_BF16: tl.constexpr, STATE_BF16: tl.constexpr):
    """Round fp32 values destined for bf16 to nearest even, in integer arithmetic on their bits.

    Run in Triton's interpreter only. A GPU's fp32 -> bf16 conversion rounds to nearest even; the
    interpreter's truncates, and step after step truncation would drag every parameter and state
    toward zero. Adding half of the 16 dropped bits (ties to even) first makes the truncation exact.
    """
    if PARAM_BF16:
        b = p.to(tl.uint32, bitcast=True)
        p = tl.where(p == p, ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True), p)
    if STATE_BF16:
        b = m.to(tl.uint32, bitcast=True)
        m = tl.where(m == m, ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True), m)
        b = v.to(tl.uint32, bitcast=True)
        v = tl.where(v == v, ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True), v)
    return p, m, v  # NaN is left as it is (tl.where), so it stays NaN


@triton.jit
def _adamw_update(
    P, G, M, V,  # pointers to this block's first element of param, grad, exp_avg, exp_avg_sq
    offs,  # [BLOCK] element offsets
    mask,  # [BLOCK] in-bounds lanes, or None for a full block
    decay,  # 1 - lr * weight_decay
    one_minus_beta1,  # 1 - beta1
    beta2,
    one_minus_beta2,  # 1 - beta2
    eps,
    step_size,  # lr / (1 - beta1^t)
    bias_correction2_sqrt,  # sqrt(1 - beta2^t)
    MAXIMIZE: tl.constexpr,  # ascend the gradient instead of descending it
    ROUND_BY_HAND: tl.constexpr,  # True in Triton's interpreter only (see _round_like_a_gpu)
):
    # Everything below is fp32, in the order of PyTorch's single-tensor AdamW; each output is
    # rounded once, to its storage dtype, by the store.
    p = tl.load(P + offs, mask=mask).to(tl.float32)
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
    p = p - step_size * tl.div_rn(m, denom)
    if ROUND_BY_HAND:
        p, m, v = _round_like_a_gpu(p, m, v, P.dtype.element_ty == tl.bfloat16, M.dtype.element_ty == tl.bfloat16)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_multi_tensor(
    Addresses,  # int64 [4, n_tensors]: base addresses of the params, grads, exp_avgs, exp_avg_sqs
    Numels,  # int64 [n_tensors]: elements of each tensor
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
    PARAM_DTYPE: tl.constexpr,  # dtype of params and grads
    STATE_DTYPE: tl.constexpr,  # dtype of exp_avg and exp_avg_sq
    CHUNK: tl.constexpr,  # elements per program
    BLOCK: tl.constexpr,  # elements per loop iteration
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes (allows 16-byte loads)
    MAXIMIZE: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,  # True in Triton's interpreter only (see _round_like_a_gpu)
):
    pid = tl.program_id(0)
    t = tl.load(ChunkTensor + pid)
    start = tl.load(ChunkIndex + pid) * CHUNK  # int64: a tensor may hold more than 2^31 elements
    n = tl.minimum(tl.load(Numels + t) - start, CHUNK).to(tl.int32)  # elements of this chunk

    # The table holds plain integers; casting one to a typed pointer is what lets one launch reach
    # tensors that were never passed to it. The compiler knows nothing about such a pointer's
    # alignment, so without the hint every thread would load 2 bytes at a time instead of 16.
    P = tl.load(Addresses + t).to(tl.pointer_type(PARAM_DTYPE))
    G = tl.load(Addresses + n_tensors + t).to(tl.pointer_type(PARAM_DTYPE))
    M = tl.load(Addresses + 2 * n_tensors + t).to(tl.pointer_type(STATE_DTYPE))
    V = tl.load(Addresses + 3 * n_tensors + t).to(tl.pointer_type(STATE_DTYPE))
    if ALIGNED:
        P = tl.multiple_of(P, 16)
        G = tl.multiple_of(G, 16)
        M = tl.multiple_of(M, 16)
        V = tl.multiple_of(V, 16)
    P += start
    G += start
    M += start
    V += start

    # Full blocks without a mask: a mask compared against a runtime count would, like an unknown
    # alignment, split every load into single elements. Only the last, partial block is masked.
    n_full = n // BLOCK
    for b in range(0, n_full):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        _adamw_update(P, G, M, V, offs, None, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                      step_size, bias_correction2_sqrt, MAXIMIZE, ROUND_BY_HAND)
    if n_full * BLOCK < n:
        offs = n_full * BLOCK + tl.arange(0, BLOCK)
        _adamw_update(P, G, M, V, offs, offs < n, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                      step_size, bias_correction2_sqrt, MAXIMIZE, ROUND_BY_HAND)


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
    table is built (a state loaded from a checkpoint skips the first)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no sharded parameters
        DTensor = ()
    if isinstance(p, DTensor):
        raise TypeError("TritonAdamW: sharded (DTensor, FSDP2) parameters are not supported; use torch.optim.AdamW "
                        "(fused=True) for sharded training")
    check_float("parameter", p)
    check_device(p)


class TensorTable:
    """Where one launch finds its tensors: addresses, sizes, and each program's (tensor, chunk).

    Built once for a list of parameters and their states, on their device; `set_grads` fills in the
    gradients' addresses each step and copies them only when they changed.
    """

    def __init__(self, params: list, exp_avgs: list, exp_avg_sqs: list, chunk: int = CHUNK):
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
        self.device, self.chunk = device, chunk
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
        addresses = [[t.data_ptr() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs)]
        addresses.insert(1, [0] * T)  # the gradients' row: filled by set_grads before every launch
        host = torch.cat([torch.tensor(addresses, dtype=torch.int64).flatten(), numels, chunk_tensor, chunk_index])
        self.data = torch.empty_like(host, device=device)  # one buffer, one copy; the views below name its parts
        _upload(self.data, host)
        self.addresses = self.data[: 4 * T].view(4, T)
        self.numels = self.data[4 * T: 5 * T]
        self.chunk_tensor = self.data[5 * T: 5 * T + C]
        self.chunk_index = self.data[5 * T + C:]
        self._static_aligned = all(a % ALIGNMENT == 0 for i in (0, 2, 3) for a in addresses[i])
        self.grad_ptrs = None  # the row of gradient addresses is filled by set_grads
        self.aligned = False

    def set_grads(self, grads: list) -> None:
        """Point the table at this step's gradients (a small asynchronous copy, only when they moved)."""
        ptrs = tuple(g.data_ptr() for g in grads)
        if ptrs == self.grad_ptrs:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("TritonAdamW: the gradients moved since the last step, so the address table must be "
                               "copied again, which cannot happen inside CUDA graph capture; run one step "
                               "with the same gradient tensors before capturing")
        _upload(self.addresses[1], torch.tensor(ptrs, dtype=torch.int64))
        self.grad_ptrs = ptrs
        self.aligned = self._static_aligned and all(a % ALIGNMENT == 0 for a in ptrs)


def adamw_multi_tensor_(table: TensorTable, *, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, step: float, maximize: bool = False,
                        block: int | None = None, num_warps: int = NUM_WARPS) -> None:
    """One AdamW step, in place, for every tensor of `table` (whose gradients `set_grads` named).

    `step` is the step count t after this update (1 on the first step). The bias corrections are
    computed here, in float64 on the host, as PyTorch's AdamW computes them.
    """
    if table.n_chunks == 0:
        return
    if INTERPRET and table.device.type != "cpu":
        raise RuntimeError("TritonAdamW: Triton's interpreter runs on the CPU and cannot follow addresses of "
                           f"{table.device} memory; unset TRITON_INTERPRET, or keep the parameters on the CPU")
    block = block or (INTERPRETER_BLOCK if INTERPRET else BLOCK)
    if table.chunk % block:
        raise ValueError(f"block ({block}) must divide the chunk ({table.chunk})")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    # Triton launches on the current CUDA device: make it the tensors' one
    with torch.cuda.device(table.device) if table.device.type == "cuda" else contextlib.nullcontext():
        _adamw_multi_tensor[(table.n_chunks,)](
            table.addresses, table.numels, table.chunk_tensor, table.chunk_index, table.n_tensors,
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, lr / bias_correction1, math.sqrt(bias_correction2),
            PARAM_DTYPE=_TRITON_DTYPES[table.param_dtype], STATE_DTYPE=_TRITON_DTYPES[table.state_dtype],
            CHUNK=table.chunk, BLOCK=block, ALIGNED=table.aligned, MAXIMIZE=bool(maximize), ROUND_BY_HAND=INTERPRET,
            num_warps=num_warps,
        )


# ------------------------------------------------------------------------------------------------
# The optimizer
# ------------------------------------------------------------------------------------------------
def _host_float(value, name: str) -> float:
    """A hyperparameter as a Python float, never by reading GPU memory (that would wait for the GPU)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"TritonAdamW: {name} is a tensor on {value.device}; reading it would make the host wait "
                             "for the GPU at every step. Give a float or a CPU tensor")
        return float(value)
    return float(value)


class TritonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's arithmetic and state, stepped by one multi-tensor Triton launch per group.

        >>> optimizer = TritonAdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
        >>> loss.backward(); optimizer.step(); optimizer.zero_grad()

    The hyperparameters are AdamW's: lr, betas, eps, weight_decay (decoupled: p *= 1 - lr * wd),
    maximize; each param group may have its own, and a scheduler may change `lr` between steps (a
    float, or a CPU tensor). The state is AdamW's too, per parameter: `step` (a float32 CPU tensor),
    `exp_avg` and `exp_avg_sq` (in the parameter's dtype), so `state_dict()` has torch.optim.AdamW's
    structure and a checkpoint of either loads into the other.

    Parameters without a gradient are skipped (their step count stays). Refused, with an error that
    says so: amsgrad, sparse gradients, complex or integer parameters, sharded (DTensor) parameters,
    a parameter that is a strided view rather than one block of memory, and an lr on the GPU.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False):
        lr_value = _host_float(lr, "lr")
        if not 0.0 <= lr_value:
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=maximize)
        super().__init__(params, defaults)
        self._tables = {}  # (device, dtypes, addresses and sizes) -> TensorTable, for the last step's launches

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._tables = {}  # tables hold addresses of this process's memory; never carried over

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Optimizer's, then every `step` as a float32 CPU tensor (a checkpoint of PyTorch's
        fused AdamW keeps it on the GPU): the one read of GPU memory is here, once, not at every step."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "step" in state:
                step = state["step"]
                state["step"] = (step.to("cpu", torch.float32) if isinstance(step, torch.Tensor)
                                 else torch.tensor(float(step), dtype=torch.float32))
        self._tables = {}

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
        return loss

    def _step_group(self, group: dict, tables: dict) -> None:
        if group.get("amsgrad", False):
            raise ValueError("TritonAdamW does not implement amsgrad; this param group (loaded from a state dict?) "
                             "asks for it")
        lr = _host_float(group["lr"], "lr")
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
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            entries.append((p, g, state))
        if not entries:
            return
        steps = [s["step"] for _, _, s in entries]
        torch._foreach_add_(steps, 1.0)  # CPU tensors, as in PyTorch's AdamW: no GPU work, no waiting
        counts = torch.stack(steps).tolist()  # one host-side read of CPU memory for the whole group
        launches = {}
        for (p, g, s), t in zip(entries, counts):  # one launch per device, dtypes and step count
            launches.setdefault((p.device, p.dtype, s["exp_avg"].dtype, t), []).append((p, g, s))
        for (_, _, _, t), members in launches.items():
            table = self._table(members, tables)
            table.set_grads([g for _, g, _ in members])
            adamw_multi_tensor_(table, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"], step=t, maximize=group["maximize"])

    def _table(self, members: list, tables: dict) -> TensorTable:
        """The TensorTable for these tensors: the last step's if their addresses and sizes are unchanged."""
        p0, _, s0 = members[0]
        key = (p0.device, p0.dtype, s0["exp_avg"].dtype,
               tuple((p.data_ptr(), s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr(), p.numel())
                     for p, _, s in members))
        table = tables.get(key) or self._tables.get(key)
        if table is None:
            table = TensorTable([p for p, _, _ in members], [s["exp_avg"] for _, _, s in members],
                                [s["exp_avg_sq"] for _, _, s in members])
        tables[key] = table
        return table


# ------------------------------------------------------------------------------------------------
# Bytes, and the reference
# ------------------------------------------------------------------------------------------------
def ideal_bytes(n_params: int, param_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype | None = None,
                *, dtype: torch.dtype | None = None, backward: bool = False) -> int:
    """The fewest bytes one AdamW step can move for `n_params` parameters.

    It reads the parameter, its gradient (in the parameter's dtype), exp_avg and exp_avg_sq, and writes
    the parameter, exp_avg and exp_avg_sq: 3 parameter-sized and 4 state-sized accesses per element.
    `state_dtype` defaults to the parameter's dtype (PyTorch's choice, and this optimizer's).
    `dtype` and `backward` are the keywords benchmark_kernels.py asks every kernel module with: `dtype`
    stands for both dtypes; an optimizer step has no backward pass, so `backward` changes nothing.
    """
    if dtype is not None:
        param_dtype = state_dtype = dtype
    state_dtype = state_dtype or param_dtype
    return n_params * (3 * param_dtype.itemsize + 4 * state_dtype.itemsize)


def adamw_ref(params, **hyperparameters) -> torch.optim.AdamW:
    """PyTorch's single-tensor AdamW (foreach=False, fused=False) with the same hyperparameters: what
    the tests and the benchmark hold TritonAdamW to (on float64 copies, it is the truth)."""
    return torch.optim.AdamW(params, foreach=False, fused=False, **hyperparameters)
