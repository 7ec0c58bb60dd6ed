"""Benchmark the fused kernels against PyTorch eager, torch.compile and (if installed) Liger-Kernel.

    $ python benchmark_kernels.py                              # every kernel, LLaMA 3.1 8B shapes, bf16
    $ python benchmark_kernels.py --kernels rmsnorm --sizes 4096,16384
    $ python benchmark_kernels.py --kernels cross_entropy,linear_cross_entropy --dtype float16
    $ python benchmark_kernels.py --tune                       # sweep our launch settings
    $ python benchmark_kernels.py --smoke                      # tiny sizes, runs on a CPU (CI)
    $ python benchmark_kernels.py --kernels adamw              # the optimizer step, run only when named
    $ python benchmark_kernels.py --kernels jsd,linear_jsd     # the distillation losses, run only when named

`--kernels` takes the registry's names (playbook/registry.py), comma-separated, or `all` (the default).
Every kernel is one entry of the table `SPECS` below: its cases, how to build random inputs for
one, its implementations, its correctness check, its forward and forward + backward calls, and
its kernel module, whose `ideal_bytes(...)` (and, for the compute-bound fused linear
cross-entropy, `flops(...)`) give the floor each row is held against. `main()` is one loop over
the selected entries; measuring and reporting are shared.

Method: the device-to-device copy bandwidth is measured first (bytes read + written), the ceiling
every memory-bound kernel is held against. Each implementation is checked against a float64
reference (the rule of testkit.py) before anything is timed. Times are medians (and p20-p80) of
`triton.testing.do_bench`, which warms up, and flushes the L2 cache before every repetition, so
even small inputs are read from GPU memory; gradients are reset between repetitions; inputs are
random (never zeros). Each call (forward, or forward + backward through autograd) is captured
once in a CUDA graph and do_bench times the graph's replays: that is the GPU time a training step
spends, without the Python and launch overhead that otherwise dominates (and adds run-to-run
noise to) anything under ~0.5 ms. An implementation that cannot be captured (one that waits for
the GPU on the host, for instance) is timed with ordinary launches and marked "+launch". GB/s
counts the *ideal* bytes (each input read once, each output written once, as the kernel module's
`ideal_bytes` counts them), so it says how close an implementation is to the floor, not how many
bytes it moved. "peak+" is the memory allocated beyond what was live before one forward + backward.

Two more columns show a call as a user makes it, without a CUDA graph. "fwd+bwd us launched" is
the same do_bench timing of plain calls: GPU time plus every gap in which the GPU waited for the
host. "host us/call" is the time the Python host spends to enqueue one forward + backward call
(checks, dispatch, allocations, autograd, kernel launches), measured with a CPU clock: before each
call the GPU is handed a spin kernel (torch.cuda._sleep) that outlasts the call's host work, so the
call only queues its kernels behind it and never waits; time.perf_counter() around the call, with no
synchronisation inside, is then host time alone (the median of 5-30 calls, fewer for slower ones).
An implementation that waits for the GPU itself (a host sync: the "+launch" rows) is timed without
the spin kernel, and its host time includes waiting for its own kernels. Where host us/call exceeds
the CUDA-graph time, a user's call is bound by the host, and "launched" shows it.

The peers, stated plainly:
  eager           Hugging Face's formulas in PyTorch: LlamaRMSNorm; for the loss, the logits upcast
                  to fp32 before F.cross_entropy (what ForCausalLMLoss does)
  eager-bf16      F.cross_entropy straight on the bf16 logits (no upcast)
  torch.compile   torch.compile of the same eager function (default mode)
  torch-chunked   PyTorch's own F.linear_cross_entropy on its chunked path (torch >= 2.13; skipped,
                  with a line saying so, where the installed torch lacks it)
  liger           Liger-Kernel's op for the same kernel (its cross-entropy writes the gradient in
                  place), if installed
  ours            <kernel>_kernel.py ("ours" of cross_entropy writes the gradient in place; "ours" of
                  linear_cross_entropy accumulates the weight gradient in fp32, "ours-bf16acc" in
                  the weight's dtype)

The fused linear cross-entropy is compute bound: its floor is its matmul flops (6 N H V forward +
backward) at the bf16 matmul rate measured in the same run (a large cuBLAS matmul), and its rows
report TFLOP/s instead of GB/s. Its "peak+" includes the two gradients it returns (dx and dW, which
any implementation must allocate); its table also shows the peak beyond them.

Output: results/benchmark_<tag>.{json,csv} (every row of every kernel measured) and one plot per
kernel, results/benchmark_<kernel>_<tag>.png. The tag is "smoke" for --smoke and the GPU's name
otherwise, followed by what sets the run apart from the full default one (the kernels when not all
of them ran, the dtype when not bf16, "sizes<...>" with --sizes), so a partial run never
overwrites the files of a full one. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import playbook  # imports no torch: the handler below is set before torch loads

if __name__ == "__main__":  # Ctrl-C while torch and the kernels load (seconds): one line, exit code 130
    playbook.exit_on_ctrl_c_while_starting("nothing was measured")

# Graph pools and 8-25 GB peers fragment the caching allocator; expandable segments let freed
# memory be reused by the next size (set before torch touches the GPU).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from playbook.core.gpu_arch import describe as describe_arch, device_capability  # noqa: E402
from playbook.core import kernel_utils  # noqa: F401,E402  (selects the interpreter on machines without a GPU)
import adamw_kernel  # noqa: E402
import cross_entropy_kernel  # noqa: E402
import distillation_kernel  # noqa: E402
import linear_cross_entropy_kernel  # noqa: E402
import projections_kernel  # noqa: E402
import rmsnorm_kernel  # noqa: E402
import rope_kernel  # noqa: E402
import swiglu_kernel  # noqa: E402
from playbook.registry import BY_NAME, KERNEL_NAMES  # noqa: E402
from playbook.common import is_out_of_memory  # noqa: E402
from cross_entropy_kernel import cross_entropy  # noqa: E402
from playbook.core.kernel_utils import DEVICE  # noqa: E402
from linear_cross_entropy_kernel import linear_cross_entropy  # noqa: E402
from rmsnorm_kernel import rmsnorm, rmsnorm_backward, rmsnorm_forward, rmsnorm_ref  # noqa: E402
from rope_kernel import rope, rope_ref  # noqa: E402
from swiglu_kernel import swiglu, swiglu_ref  # noqa: E402
from playbook.testkit import close_to_reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ON_GPU = DEVICE.type == "cuda"

# LLaMA 3.1 8B: the shapes of the default sweeps
HIDDEN, INTERMEDIATE, VOCAB = 4096, 14336, 128256
HEADS, KV_HEADS, HEAD_DIM, SEQ = 32, 8, 128, 2048


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------
def timed(fn, grad_to_none=None):
    """(median, p20, p80) in microseconds."""
    if ON_GPU:
        import triton.testing

        q = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return tuple(v * 1e3 for v in q)
    # CPU / Triton's interpreter: one call proves the harness runs; its time means nothing
    for t in grad_to_none or []:
        t.grad = None
    t0 = time.perf_counter()
    fn()
    us = (time.perf_counter() - t0) * 1e6
    return us, us, us


def timed_graph(fn, grads=()):
    """Time the replays of a CUDA graph of `fn`; fall back to plain launches if capture fails.

    Returns ((median, p20, p80) in us, captured: bool). `grads`: tensors whose .grad a call sets;
    they are reset before capture, so every replay *writes* (not accumulates) the same gradients.
    """
    if not ON_GPU:
        return timed(fn, grad_to_none=list(grads)), False
    graph = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the capture (compilation, autotuning)
            for _ in range(2):
                for t in grads:
                    t.grad = None
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if _host_syncs(fn, grads):  # capture would fail; a failed capture can leave the default
            return timed(fn, grad_to_none=list(grads)), False  # generator and a memory pool stuck
        for t in grads:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001  (e.g. a host sync inside fn: capture is not possible)
        graph = None  # drop the failed capture (and its memory pool) before timing plain launches
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return timed(fn, grad_to_none=list(grads)), False
    result = timed(graph.replay)
    del graph
    for t in grads:
        t.grad = None
    torch.cuda.empty_cache()  # a graph's private memory pool is only returned by this
    return result, True


def _host_syncs(fn, grads=()) -> bool:
    """Whether one call of `fn` waits on the GPU from the host (an .item(), a data-dependent shape):
    such a call cannot be captured in a CUDA graph. Checked with PyTorch's sync debug mode, outside
    any capture, because a capture that fails part way can leave the process's default CUDA
    generator marked as capturing (every later torch.randn / nn.init on the GPU then raises) and the
    graph's memory pool allocated."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in grads:
            t.grad = None
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


_SLEEP_CYCLES_PER_US = []  # torch.cuda._sleep's clock, measured once


def _gpu_busy(us: float) -> None:
    """Queue a spin kernel that keeps the GPU busy for about `us` microseconds."""
    if not _SLEEP_CYCLES_PER_US:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_US.append(1_000_000 / (start.elapsed_time(end) * 1e3))
    torch.cuda._sleep(int(us * _SLEEP_CYCLES_PER_US[0]))


def host_us_per_call(fn, grads=(), waits: bool = False, gpu_us: float | None = None) -> float:
    """Median wall time, in microseconds, that the host spends in one call of `fn` (see the module
    docstring): the GPU is kept busy by a spin kernel queued before each call, so the call never
    waits for it and a CPU timer around the call measures the host's own work. `waits`: `fn` syncs
    with the GPU (the spin kernel would be timed too), so it runs on an idle GPU instead. `gpu_us`
    (its GPU time) sets how many calls are timed: 30 for short ones, down to 5 for ~0.4 s of work."""
    def once():
        for t in grads:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    if not ON_GPU:  # Triton's interpreter runs the kernels inside the call: host time, but not a launch's
        return sorted(once() for _ in range(3))[1]
    torch.cuda.synchronize()
    estimate = once()  # also refills the allocator's cache after an empty_cache()
    reps = int(min(30, max(5, 4e5 / max(gpu_us or 0.0, estimate, 1.0))))
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if not waits:
            _gpu_busy(min(3 * estimate + 1000, 100_000))  # outlasts the call's host work (capped at 0.1 s)
        samples.append(once())
    torch.cuda.synchronize()
    for t in grads:
        t.grad = None
    return sorted(samples)[len(samples) // 2]


def _label(name: str, captured: bool) -> str:
    return name if captured or not ON_GPU else name + " +launch"


def peak_extra_mb(fn, grad_to_none=()):
    """Peak memory allocated above what was live before one call, in MB (GPU only)."""
    if not ON_GPU:
        return None
    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 1e6


def copy_bandwidth_gbs() -> float | None:
    """Device-to-device copy of 1 GiB, counting bytes read + written: the practical ceiling."""
    if not ON_GPU:
        return None
    src = torch.randn(2**28, device=DEVICE)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src))[0]
    return 2 * src.numel() * 4 / (us * 1e-6) / 1e9


def matmul_tflops() -> float | None:
    """bf16 tensor-core rate of a large cuBLAS matmul (8192^3): the ceiling of compute-bound ops."""
    if not ON_GPU:
        return None
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    us = timed(lambda: a @ b)[0]
    return 2 * n**3 / (us * 1e-6) / 1e12


def compiled(fn):
    return torch.compile(fn) if ON_GPU else fn  # Inductor needs a C++/GPU toolchain; skip on CPU


def liger():
    try:
        import liger_kernel.transformers as lt

        return lt
    except Exception:  # noqa: BLE001  (optional peer: any import failure means "not installed")
        return None


def guarded(name, size, measure):
    """Run one implementation's measurement; out of GPU memory skips it (with a warning), not the run.
    cuBLAS failing to allocate its handle or workspace (a plain RuntimeError) is running out too."""
    try:
        measure()
    except RuntimeError as err:  # torch.cuda.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
        print(f"  WARNING: {name} ran out of GPU memory at {size}; skipped")
    finally:
        if ON_GPU:
            torch.cuda.empty_cache()


def checked(name, check):
    """Run a correctness check: ours must pass; a peer that fails is timed anyway, with a warning."""
    try:
        check()
    except AssertionError as e:
        if name == "ours":
            raise
        print(f"  WARNING: {name} does not match the float64 reference: {e}")


# ------------------------------------------------------------------------------------------------
# The table of kernels: what `main` needs to know about each
# ------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """Random inputs of one case, and the calls that use them."""

    grads: list                 # the leaf inputs whose .grad a backward sets (reset around every measurement)
    forward: Callable           # forward(fn): one forward call, no autograd graph kept
    forward_backward: Callable  # forward_backward(fn): forward, then backward through autograd
    check: Callable             # check(name, fn): against float64 (testkit's rule) on a slice of the inputs


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of the benchmark.

    A case is a dict of the keyword arguments that size the kernel module's `ideal_bytes` (and
    `flops`), e.g. {"n_rows": 16384, "hidden": 4096}: the rows carry it, so every byte count can be
    recomputed from the module.
    """

    name: str
    module: ModuleType            # <name>_kernel: ideal_bytes(**case, dtype, backward), flops(**case, backward)
    cases: Callable               # cases(tokens): the default sweep, or `tokens` (--sizes) at the LLaMA width
    smoke: tuple                  # tiny cases for --smoke (CPU, Triton's interpreter)
    impls: Callable               # impls() -> {name: fn}, "ours" first, "eager" the baseline
    inputs: Callable              # inputs(case, dtype) -> Inputs
    tokens: str                   # the key of the case's token count ("n_rows" or "n_tokens")
    width: Callable               # width(case): the size plotted against tokens (hidden, vocabulary, ...)
    compute_bound: bool = False   # floor = flops at the matmul rate, not ideal bytes at the copy bandwidth

    def ideal_bytes(self, case: dict, dtype: torch.dtype, backward: bool) -> int:
        return self.module.ideal_bytes(**case, dtype=dtype, backward=backward)

    def flops(self, case: dict, backward: bool) -> int | None:
        return self.module.flops(**case, backward=backward) if self.compute_bound else None


def _generator(*sizes) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(sum(sizes))


# ---- RMSNorm -------------------------------------------------------------------------------------
def _rmsnorm_cases(tokens):
    cases = [dict(n_rows=n, hidden=HIDDEN) for n in tokens or (1024, 2048, 4096, 8192, 16384, 32768)]
    if not tokens:  # the hidden sizes of other models, at 16k tokens
        cases += [dict(n_rows=16384, hidden=h) for h in (1024, 2048, 8192, 16384)]
    return cases


def _rmsnorm_impls():
    impls = {"ours": rmsnorm, "eager": rmsnorm_ref, "torch.compile": compiled(rmsnorm_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # Liger's own autograd function, LLaMA casting; in_place=False keeps dy intact between runs
        impls["liger"] = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    return impls


def _rmsnorm_inputs(case, dtype):
    N, H = case["n_rows"], case["hidden"]
    g = _generator(N, H)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(N, H, generator=g).to(DEVICE, dtype)
    return Inputs(
        grads=[x, w],
        forward=lambda fn: fn(x.detach(), w.detach(), 1e-5),
        forward_backward=lambda fn: fn(x, w, 1e-5).backward(dy),
        check=lambda name, fn: _check_rmsnorm(name, fn, x[:256].detach(), w.detach(), dy[:256]),
    )


def _check_rmsnorm(name, fn, x, w, dy):
    outs = []
    for cast in (lambda t: t, lambda t: t.double()):
        xi, wi = cast(x).clone().requires_grad_(), cast(w).clone().requires_grad_()
        y = (fn if not outs else rmsnorm_ref)(xi, wi, 1e-5)
        y.backward(cast(dy).clone())
        outs.append((y, xi.grad, wi.grad))
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    yt = rmsnorm_ref(xt, wt, 1e-5)
    yt.backward(dy.clone())
    for i, what in enumerate(("y", "dx", "dW")):
        n = x.shape[0] if what == "dW" else x.shape[1]
        scale = None
        if what == "dx":
            rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-5).max().item()
            scale = rstd * dy.double().abs().max().item() * w.double().abs().max().item()
        close_to_reference(f"rmsnorm {name} {what}", outs[0][i], (yt, xt.grad, wt.grad)[i], outs[1][i], x.dtype,
                           n=n, scale=scale)


# ---- Cross-entropy -------------------------------------------------------------------------------
def _hf_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)  # Hugging Face upcasts to fp32 first


def _ce_cases(tokens):
    cases = [dict(n_rows=n, vocab=VOCAB) for n in tokens or (512, 1024, 2048, 4096, 8192, 16384)]
    if not tokens:  # the vocabularies of other models (LLaMA 2, Qwen 2, Gemma), at 4k tokens
        cases += [dict(n_rows=4096, vocab=v) for v in (32000, 151936, 256000)]
    return cases


def _ce_impls():
    impls = {
        "ours": lambda lg, t: cross_entropy(lg, t, inplace_grad=True),
        "eager": _hf_loss,
        "eager-bf16": lambda lg, t: F.cross_entropy(lg, t),
        "torch.compile": compiled(_hf_loss),
    }
    lt = liger()
    if lt is not None and ON_GPU:
        mod = lt.LigerCrossEntropyLoss()
        impls["liger"] = lambda lg, t: mod(lg, t)
    return impls


def _ce_inputs(case, dtype):
    N, V = case["n_rows"], case["vocab"]
    g = _generator(N, V)
    logits = (torch.randn(N, V, generator=g) * 2).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    targets[::17] = -100  # a few ignored tokens, as padding produces

    def loss_only(fn):
        with torch.no_grad():
            fn(logits, targets)

    # A model's logits are an intermediate (the lm_head's output), and our kernel refuses to write
    # its gradient into a leaf; a view of the leaf is such an intermediate, at no cost, for every
    # implementation alike. In-place implementations then overwrite `logits` with the gradient, so
    # later repetitions read the previous gradient as logits: finite, non-zero values; the work per
    # element is the same (an exp each), so the time is too.
    return Inputs(
        grads=[logits],
        forward=loss_only,
        forward_backward=lambda fn: fn(logits.view_as(logits), targets).backward(),
        check=lambda name, fn: _check_ce(name, fn, logits[:256].detach(), targets[:256]),
    )


def _check_ce(name, fn, logits, targets):
    x = logits.clone().requires_grad_()
    fn(x * 1, targets).backward()  # x * 1: in-place implementations get a buffer of their own
    xs = logits.clone().requires_grad_()
    same = F.cross_entropy(xs, targets)
    same.backward()
    xr = logits.double().requires_grad_()
    ref = F.cross_entropy(xr, targets)
    ref.backward()
    ours = fn(logits.clone(), targets)
    # A peer that returns its loss in the logits' dtype (eager-bf16) is held to that dtype's precision;
    # the others return fp32 losses and are held to fp32's.
    close_to_reference(f"cross_entropy {name} loss", ours.float(), same.float(), ref, ours.dtype, n=logits.shape[1])
    close_to_reference(f"cross_entropy {name} grad", x.grad, xs.grad, xr.grad, logits.dtype, n=logits.shape[1])


# ---- Fused linear cross-entropy (compute bound) --------------------------------------------------
def _hf_head_loss(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t)  # full logits, upcast, PyTorch's loss


def _flce_cases(tokens):
    return [dict(n_tokens=n, hidden=HIDDEN, vocab=VOCAB) for n in tokens or (4096, 8192, 16384)]


def torch_linear_cross_entropy():
    """PyTorch's own fused op on its chunked path, or (None, why) where this torch lacks it."""
    fn, options = getattr(F, "linear_cross_entropy", None), getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fn is None or options is None:
        return None, f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (chunked)"
    opts = options()  # chunking method and accumulation policy picked by PyTorch for the device and dtype
    # Same semantics as ours: mean over the tokens whose target is not -100 (its default, spelled out)
    return (lambda x, w, t: fn(x, w, t, ignore_index=-100, reduction="mean", options=opts)), None


def _flce_impls():
    impls = {
        "ours": lambda x, w, t: linear_cross_entropy(x, w, t),
        "ours-bf16acc": lambda x, w, t: linear_cross_entropy(x, w, t, accumulate_fp32=False),
        "eager": _hf_head_loss,
        "torch.compile": compiled(_hf_head_loss),
    }
    fn, why = torch_linear_cross_entropy()
    if fn is not None:
        impls["torch-chunked"] = fn
    else:
        print(f"  torch-chunked skipped: {why}")
    if liger() is not None and ON_GPU:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w, t: mod(w, x, t)  # Liger takes (weight, input, target)
    return impls


def _flce_inputs(case, dtype):
    N, H, V = case["n_tokens"], case["hidden"], case["vocab"]
    g = _generator(N, V)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(DEVICE, dtype).requires_grad_()  # logits ~ N(0, 2)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    t[::17] = -100
    n_check = min(N, 2304)  # > 2048 tokens: our default chunking takes two chunks

    def loss_only(fn):
        with torch.no_grad():
            fn(x, w, t)

    return Inputs(
        grads=[x, w],
        forward=loss_only,
        forward_backward=lambda fn: fn(x, w, t).backward(),
        check=lambda name, fn: _check_flce(name, fn, x[:n_check].detach(), w.detach(), t[:n_check]),
    )


def _check_flce(name, fn, x, w, t):
    outs = []
    # fp32 serves as the truth here: a float64 copy of a 128256 x 4096 head would take 4 GB
    for f, cast in ((fn, lambda v: v), (_hf_head_loss, lambda v: v), (_hf_head_loss, lambda v: v.float())):
        xi, wi = cast(x).clone().requires_grad_(), cast(w).clone().requires_grad_()
        loss = f(xi, wi, t)
        loss.backward()
        outs.append((loss.detach(), xi.grad, wi.grad))
    V = w.shape[0]
    # As in _check_ce: a loss returned in the inputs' dtype (torch-chunked's) is held to that dtype's
    # precision; fp32 losses (ours, eager, Liger) to fp32's.
    close_to_reference(f"flce {name} loss", outs[0][0].float(), outs[1][0].float(), outs[2][0].float(),
                       outs[0][0].dtype, n=V)
    close_to_reference(f"flce {name} dx", outs[0][1], outs[1][1], outs[2][1], x.dtype, n=V)
    close_to_reference(f"flce {name} dW", outs[0][2], outs[1][2], outs[2][2], x.dtype, n=x.shape[0])


# ---- SwiGLU --------------------------------------------------------------------------------------
def _swiglu_cases(tokens):
    return [dict(n_rows=n, width=INTERMEDIATE) for n in tokens or (1024, 4096, 8192, 16384)]


def _swiglu_impls():
    impls = {"ours": swiglu, "eager": swiglu_ref, "torch.compile": compiled(swiglu_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        impls["liger"] = LigerSiLUMulFunction.apply
    return impls


def _swiglu_inputs(case, dtype):
    N, I = case["n_rows"], case["width"]
    g = _generator(N, I)
    gate = (torch.randn(N, I, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    up = torch.randn(N, I, generator=g).to(DEVICE, dtype).requires_grad_()
    dh = torch.randn(N, I, generator=g).to(DEVICE, dtype)
    return Inputs(
        grads=[gate, up],
        forward=lambda fn: fn(gate.detach(), up.detach()),
        forward_backward=lambda fn: fn(gate, up).backward(dh),
        check=lambda name, fn: _check_swiglu(name, fn, gate[:64].detach(), up[:64].detach(), dh[:64]),
    )


def _check_swiglu(name, fn, gate, up, dh):
    outs = []
    for f, cast in ((fn, lambda t: t), (swiglu_ref, lambda t: t), (swiglu_ref, lambda t: t.double())):
        gi, ui = cast(gate).clone().requires_grad_(), cast(up).clone().requires_grad_()
        h = f(gi, ui)
        h.backward(cast(dh).clone())
        outs.append((h, gi.grad, ui.grad))
    for i, what in enumerate(("h", "dgate", "dup")):
        close_to_reference(f"swiglu {name} {what}", outs[0][i], outs[1][i], outs[2][i], gate.dtype)


# ---- Joined projections --------------------------------------------------------------------------
def _proj_cases(tokens):
    groups = (f"{HEADS * HEAD_DIM}+{KV_HEADS * HEAD_DIM}+{KV_HEADS * HEAD_DIM}", f"{INTERMEDIATE}+{INTERMEDIATE}")
    return [dict(n_tokens=n, hidden=HIDDEN, outputs=o) for o in groups for n in tokens or (8192,)]


def _proj_impls():
    return {"ours": projections_kernel.joined_matmul, "eager": projections_kernel.separate_matmuls,
            "torch.compile": compiled(projections_kernel.separate_matmuls)}


def _proj_inputs(case, dtype):
    N, H, sizes = case["n_tokens"], case["hidden"], projections_kernel._sizes(case["outputs"])
    g = _generator(N, H, *sizes)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    joint = (torch.randn(sum(sizes), H, generator=g) * H**-0.5).to(DEVICE, dtype)
    weights = [w.requires_grad_() for w in joint.split(sizes)]  # side by side: rows of one buffer
    dys = [torch.randn(N, n, generator=g).to(DEVICE, dtype) for n in sizes]
    return Inputs(
        grads=[x, *weights],
        forward=lambda fn: fn(x.detach(), [w.detach() for w in weights]),
        forward_backward=lambda fn: torch.autograd.backward(fn(x, weights), dys),
        check=lambda name, fn: _check_proj(name, fn, x[:256].detach(), [w.detach() for w in weights],
                                           [d[:256] for d in dys]),
    )


def _check_proj(name, fn, x, weights, dys):
    outs = []
    for f, cast in ((fn, lambda t: t), (projections_kernel.separate_matmuls, lambda t: t),
                    (projections_kernel.separate_matmuls, lambda t: t.double())):
        xi = cast(x).clone().requires_grad_()
        joint = torch.cat([cast(w) for w in weights]).requires_grad_()
        wi = list(joint.split([w.shape[0] for w in weights]))
        ys = f(xi, wi)
        torch.autograd.backward(ys, [cast(d) for d in dys])
        outs.append((torch.cat(ys, dim=-1), xi.grad, joint.grad))
    lengths = (x.shape[1], sum(w.shape[0] for w in weights), x.shape[0])  # the sum behind each y, dx, dW value
    for what, n, ours, torch_impl, ref in zip(("y", "dx", "dW"), lengths, *outs):
        close_to_reference(f"projections {name} {what}", ours, torch_impl, ref, x.dtype, n=n)


# ---- RoPE ----------------------------------------------------------------------------------------
def _rope_cases(tokens):
    # Whole sequences of SEQ tokens (fewer tokens: one shorter sequence), as attention sees them
    sizes = [n if n <= SEQ else n - n % SEQ for n in tokens or (2048, 8192, 16384)]
    return [dict(n_tokens=n, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM) for n in sizes]


def _rope_impls():
    impls = {"ours": rope, "eager": rope_ref, "torch.compile": compiled(rope_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        impls["liger"] = liger_rotary_pos_emb
    return impls


def _rope_inputs(case, dtype):
    """n_tokens as sequences of up to SEQ tokens; q/k [B, heads, T, D] as attention makes them."""
    N, hq, hk, D = case["n_tokens"], case["n_heads"], case["n_kv_heads"], case["head_dim"]
    T = min(N, SEQ)
    B = N // T
    g = _generator(N, hq)
    q = torch.randn(B, T, hq, D, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, hk, D, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    ang = torch.arange(T, dtype=torch.float32)[:, None] * (500000.0 ** (-torch.arange(0, D, 2) / D))
    ang = torch.cat([ang, ang], dim=-1)[None].to(DEVICE)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(DEVICE, dtype), torch.randn(k.shape, generator=g).to(DEVICE, dtype)

    def fwd_bwd(fn):
        qo, ko = fn(q, k, cos, sin)
        torch.autograd.backward([qo, ko], [dq, dk])

    return Inputs(
        grads=[q, k],
        forward=lambda fn: fn(q.detach(), k.detach(), cos, sin),
        forward_backward=fwd_bwd,
        check=lambda name, fn: _check_rope(name, fn, q[:1, :, :64].detach(), k[:1, :, :64].detach(),
                                           cos[:, :64], sin[:, :64]),
    )


def _check_rope(name, fn, q, k, cos, sin):
    outs = []
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    for f, cast in ((fn, lambda v: v), (rope_ref, lambda v: v), (rope_ref, lambda v: v.double())):
        qi, ki = cast(q).clone().requires_grad_(), cast(k).clone().requires_grad_()
        qo, ko = f(qi, ki, cast(cos), cast(sin))
        torch.autograd.backward([qo, ko], [cast(dq), cast(dk)])
        outs.append((qo, ko, qi.grad, ki.grad))
    for i, what in enumerate(("q_embed", "k_embed", "dq", "dk")):
        close_to_reference(f"rope {name} {what}", outs[0][i], outs[1][i], outs[2][i], q.dtype, n=2)


# ---- AdamW (an optimizer step has no backward: "fwd" and "fwd+bwd" both time one step) ----------
def _adamw_shapes(n_params):
    """LLaMA 3.1 8B's decoder-layer tensors (q, k, v, o, gate, up, down, two norms), repeated until
    n_params are reached (the last tensor cut short if need be); hidden 64 for --smoke's tiny sizes."""
    h = HIDDEN if n_params >= 10**8 else 64
    i, kv = h * INTERMEDIATE // HIDDEN, h * KV_HEADS // HEADS
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    shapes, left = [], n_params
    while left > 0:
        for s in layer:
            n = min(left, torch.Size(s).numel())
            shapes.append(s if n == torch.Size(s).numel() else (n,))
            left -= n
            if not left:
                break
    return shapes


def _adamw_cases(tokens):
    """5 decoder layers of LLaMA 3.1 8B: 45 tensors, 1,090,560,000 parameters (--sizes does not apply)."""
    return [dict(n_params=5 * sum(torch.Size(s).numel() for s in _adamw_shapes(10**9)[:9]))]


def _adamw_impls():
    return {
        "ours": lambda params: adamw_kernel.TritonAdamW(params, lr=1e-3, weight_decay=0.1),
        "torch-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True),
        "torch-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True),
    }


def _adamw_inputs(case, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(case["n_params"] % 2**31)
    params = [torch.randn(s, generator=g, device=DEVICE, dtype=dtype) for s in _adamw_shapes(case["n_params"])]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=DEVICE, dtype=dtype)
    optimizers = {}  # one per implementation, built on its first step; all step the same tensors

    def step(fn):
        optimizers.setdefault(fn, fn(params)).step()

    return Inputs(grads=[], forward=step, forward_backward=step,
                  check=lambda name, fn: _check_adamw(name, fn, dtype))


def _check_adamw(name, fn, dtype):
    """Three steps on small tensors of odd shapes against PyTorch's single-tensor AdamW in float64,
    with PyTorch's fused AdamW in `dtype` as the yardstick (testkit's rule; adamw_test.py says why)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    shapes = [(37, 53), (129,), (5, 3, 7)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    fused = _adamw_impls()["torch-fused"]
    runs = []
    for make, cast in ((fn, dtype), (fused, dtype), (adamw_kernel.adamw_ref, torch.float64)):
        params = [p.to(DEVICE, cast) for p in start]
        opt = make(params) if make is not adamw_kernel.adamw_ref else make(params, lr=1e-3, weight_decay=0.1)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(DEVICE, cast)
            opt.step()
        runs.append(params)
    for i, s in enumerate(shapes):
        close_to_reference(f"adamw {name} param {list(s)}", runs[0][i], runs[1][i], runs[2][i], dtype)


# ---- Distillation losses (distillation_kernel.py: jsd, linear_jsd; run only when named) --------
# A student LLaMA 3.2 1B (hidden 2048) distilled from LLaMA 3.1 8B (HIDDEN), sharing VOCAB. The JSD
# at beta 0.5; the fused linear JSD at temperature 2, as distillation runs it.
STUDENT_HIDDEN = 2048


def _op_costs(op: str) -> ModuleType:
    """distillation_kernel holds two ops: a view of it whose ideal_bytes / flops are that op's
    (distillation_kernel.<op>_ideal_bytes, <op>_flops), the names KernelSpec calls."""
    view = ModuleType(f"distillation_kernel.{op}")
    view.ideal_bytes = getattr(distillation_kernel, f"{op}_ideal_bytes")
    view.flops = getattr(distillation_kernel, f"{op}_flops", None)
    return view


def _liger_distillation(name):
    """Liger-Kernel's module `name` (from liger_kernel.transformers), or None with a line saying why."""
    if liger() is None or not ON_GPU:
        print(f"  liger skipped: {'Liger-Kernel is not installed' if liger() is None else 'its kernels need a GPU'}")
        return None
    return getattr(liger(), name)


def _jsd_eager(x, y, labels):
    return distillation_kernel.jsd_ref(x, y, 0.5, shift_labels=labels)  # fp32 math, as TRL writes it


def _jsd_cases(tokens):
    return [dict(n_rows=n, vocab=VOCAB) for n in tokens or (1024, 4096, 8192, 16384)]


def _jsd_impls():
    impls = {"ours": lambda x, y, t: distillation_kernel.jsd(x, y, 0.5, shift_labels=t), "eager": _jsd_eager,
             "torch.compile": compiled(_jsd_eager)}
    module = _liger_distillation("LigerJSD")
    if module is not None:
        mod = module(beta=0.5)
        impls["liger"] = lambda x, y, t: mod(x, y, t)  # Liger takes (student log q, teacher log p, shift_labels)
    return impls


def _jsd_inputs(case, dtype):
    """Bf16 log-probabilities of a teacher and of a student whose logits are the teacher's plus noise;
    every 17th token ignored. Generated on the device (three N x V tensors at N = 16384)."""
    N, V = case["n_rows"], case["vocab"]
    g = torch.Generator(device=DEVICE).manual_seed(N + V)
    z = torch.randn(N, V, generator=g, device=DEVICE) * 2
    y = F.log_softmax(z, -1).to(dtype)
    z += torch.randn(N, V, generator=g, device=DEVICE) * 0.7
    x = F.log_softmax(z, -1).to(dtype).requires_grad_()
    del z
    t = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    t[::17] = -100

    def loss_only(fn):
        with torch.no_grad():
            fn(x, y, t)

    return Inputs(grads=[x], forward=loss_only, forward_backward=lambda fn: fn(x, y, t).backward(),
                  check=lambda name, fn: _check_jsd(name, fn, x[:256].detach(), y[:256], t[:256]))


def _check_jsd(name, fn, x, y, t):
    outs = []
    for f, cast in ((fn, lambda v: v), (_jsd_eager, lambda v: v), (_jsd_eager, lambda v: v.double())):
        xi = cast(x).clone().requires_grad_()
        loss = f(xi, cast(y), t)
        loss.backward()
        outs.append((loss.detach(), xi.grad))
    close_to_reference(f"jsd {name} loss", outs[0][0].float(), outs[1][0], outs[2][0], outs[0][0].dtype,
                       n=x.shape[1], scale=1.0)  # scale: the terms (p log p ~ 1 a token) exceed the divergence
    close_to_reference(f"jsd {name} grad", outs[0][1], outs[1][1], outs[2][1], x.dtype)


def _ljsd_eager(xs, ws, xt, wt, t):
    return distillation_kernel.linear_jsd_ref(xs, ws, xt, wt, t, beta=0.5, temperature=2.0)


def _ljsd_cases(tokens):
    return [dict(n_tokens=n, hidden=STUDENT_HIDDEN, teacher_hidden=HIDDEN, vocab=VOCAB)
            for n in tokens or (4096, 8192, 16384)]


def _ljsd_impls():
    impls = {"ours": lambda xs, ws, xt, wt, t: distillation_kernel.linear_jsd(xs, ws, xt, wt, t, 0.5, 2.0),
             "eager": _ljsd_eager, "torch.compile": compiled(_ljsd_eager)}
    module = _liger_distillation("LigerFusedLinearJSD")
    if module is not None:
        mod = module(jsd_beta=0.5, temperature=2.0)
        impls["liger"] = lambda xs, ws, xt, wt, t: mod(xs, ws, xt, wt, t)  # same argument order as ours
    return impls


def _ljsd_inputs(case, dtype):
    N, Hs, Ht, V = case["n_tokens"], case["hidden"], case["teacher_hidden"], case["vocab"]
    g = torch.Generator(device=DEVICE).manual_seed(N + V)
    xs = torch.randn(N, Hs, generator=g, device=DEVICE).to(dtype).requires_grad_()
    ws = (torch.randn(V, Hs, generator=g, device=DEVICE) * Hs**-0.5 * 2).to(dtype).requires_grad_()
    xt = torch.randn(N, Ht, generator=g, device=DEVICE).to(dtype)
    wt = (torch.randn(V, Ht, generator=g, device=DEVICE) * Ht**-0.5 * 2).to(dtype)  # logits ~ N(0, 2)
    t = torch.randint(0, V, (N,), generator=g, device=DEVICE)
    t[::17] = -100
    n_check = min(N, 1152)  # > 1024 tokens: our default chunking takes two chunks

    def loss_only(fn):
        with torch.no_grad():
            fn(xs, ws, xt, wt, t)

    return Inputs(grads=[xs, ws], forward=loss_only, forward_backward=lambda fn: fn(xs, ws, xt, wt, t).backward(),
                  check=lambda name, fn: _check_ljsd(name, fn, xs[:n_check].detach(), ws.detach(), xt[:n_check],
                                                     wt, t[:n_check]))


def _check_ljsd(name, fn, xs, ws, xt, wt, t):
    outs = []
    # fp32 serves as the truth, as for the fused linear cross-entropy: float64 heads would take 6 GB
    for f, cast in ((fn, lambda v: v), (_ljsd_eager, lambda v: v), (_ljsd_eager, lambda v: v.float())):
        xi, wi = cast(xs).clone().requires_grad_(), cast(ws).clone().requires_grad_()
        loss = f(xi, wi, cast(xt), cast(wt), t)
        loss.backward()
        outs.append((loss.detach(), xi.grad, wi.grad))
    V = ws.shape[0]
    close_to_reference(f"linear_jsd {name} loss", outs[0][0].float(), outs[1][0].float(), outs[2][0].float(),
                       outs[0][0].dtype, n=V, scale=1.0)
    close_to_reference(f"linear_jsd {name} dx", outs[0][1], outs[1][1], outs[2][1], xs.dtype, n=V)
    close_to_reference(f"linear_jsd {name} dW", outs[0][2], outs[1][2], outs[2][2], xs.dtype, n=xs.shape[0])


# ---- The table -----------------------------------------------------------------------------------
SPECS = {spec.name: spec for spec in (
    KernelSpec("rmsnorm", rmsnorm_kernel, _rmsnorm_cases,
               smoke=(dict(n_rows=64, hidden=256), dict(n_rows=48, hidden=100)),
               impls=_rmsnorm_impls, inputs=_rmsnorm_inputs, tokens="n_rows", width=lambda c: c["hidden"]),
    KernelSpec("cross_entropy", cross_entropy_kernel, _ce_cases,
               smoke=(dict(n_rows=16, vocab=1000), dict(n_rows=8, vocab=32001)),
               impls=_ce_impls, inputs=_ce_inputs, tokens="n_rows", width=lambda c: c["vocab"]),
    KernelSpec("linear_cross_entropy", linear_cross_entropy_kernel, _flce_cases,
               smoke=(dict(n_tokens=40, hidden=32, vocab=300),),
               impls=_flce_impls, inputs=_flce_inputs, tokens="n_tokens", width=lambda c: c["vocab"],
               compute_bound=True),
    KernelSpec("swiglu", swiglu_kernel, _swiglu_cases,
               smoke=(dict(n_rows=32, width=300),),
               impls=_swiglu_impls, inputs=_swiglu_inputs, tokens="n_rows", width=lambda c: c["width"]),
    KernelSpec("rope", rope_kernel, _rope_cases,
               smoke=(dict(n_tokens=64, n_heads=4, n_kv_heads=2, head_dim=16),),
               impls=_rope_impls, inputs=_rope_inputs, tokens="n_tokens",
               width=lambda c: c["n_heads"] * c["head_dim"]),
    KernelSpec("projections", projections_kernel, _proj_cases,
               smoke=(dict(n_tokens=48, hidden=64, outputs="64+16+16"),),
               impls=_proj_impls, inputs=_proj_inputs, tokens="n_tokens",
               width=lambda c: sum(projections_kernel._sizes(c["outputs"])), compute_bound=True),
    KernelSpec("adamw", adamw_kernel, _adamw_cases,
               smoke=(dict(n_params=100_000),),
               impls=_adamw_impls, inputs=_adamw_inputs, tokens="n_params",
               width=lambda c: len(_adamw_shapes(c["n_params"]))),
    KernelSpec("jsd", _op_costs("jsd"), _jsd_cases,
               smoke=(dict(n_rows=8, vocab=1000),),
               impls=_jsd_impls, inputs=_jsd_inputs, tokens="n_rows", width=lambda c: c["vocab"]),
    KernelSpec("linear_jsd", _op_costs("linear_jsd"), _ljsd_cases,
               smoke=(dict(n_tokens=24, hidden=32, teacher_hidden=48, vocab=300),),
               impls=_ljsd_impls, inputs=_ljsd_inputs, tokens="n_tokens", width=lambda c: c["vocab"],
               compute_bound=True),
)}


def describe(case: dict) -> str:
    """{"n_rows": 16384, "hidden": 4096} -> "16384 x 4096" (the keys are in the table's heading)."""
    return " x ".join(str(v) for v in case.values())


# ------------------------------------------------------------------------------------------------
# Measuring one case of one kernel
# ------------------------------------------------------------------------------------------------
def _measure_impls(spec: KernelSpec, case: dict, dtype: torch.dtype, impls: dict, check: bool = True):
    """Check, then time forward and forward + backward of every implementation; one row each."""
    inputs = spec.inputs(case, dtype)
    grads = inputs.grads
    common = dict(shape=case, tokens=case[spec.tokens], width=spec.width(case),
                  dtype=str(dtype).split(".")[-1],
                  fwd_bytes=spec.ideal_bytes(case, dtype, backward=False),
                  fwdbwd_bytes=spec.ideal_bytes(case, dtype, backward=True),
                  fwd_flops=spec.flops(case, backward=False), fwdbwd_flops=spec.flops(case, backward=True),
                  grads_mb=sum(t.numel() * t.element_size() for t in grads) / 1e6)
    rows = []
    for name, fn in impls.items():
        def measure():
            if check:
                checked(name, lambda: inputs.check(name, fn))
            fwd, g1 = timed_graph(lambda: inputs.forward(fn))
            fb, g2 = timed_graph(lambda: inputs.forward_backward(fn), grads=grads)
            # as a user calls it: plain launches (the same timing when capture was not possible), and
            # the host's own time per call
            launched = timed(lambda: inputs.forward_backward(fn), grad_to_none=grads) if g2 else fb
            host = host_us_per_call(lambda: inputs.forward_backward(fn), grads, waits=ON_GPU and not g2,
                                    gpu_us=fb[0])
            mem = peak_extra_mb(lambda: inputs.forward_backward(fn), grad_to_none=grads)
            rows.append(dict(kernel=spec.name, impl=_label(name, g1 and g2), **common, fwd_us=fwd, fwdbwd_us=fb,
                             fwdbwd_launched_us=launched, host_us=host, peak_extra_mb=mem))
            for t in grads:
                t.grad = None
        guarded(name, describe(case), measure)
    return rows


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------
def add_derived(rows, copy_gbs, mm_tflops=None):
    """Rates, % of the ceiling, the floor, and speed-ups, per row (compute-bound rows in TFLOP/s)."""
    by_case = {}
    for r in rows:
        by_case.setdefault((r["kernel"], json.dumps(r["shape"])), []).append(r)
    for case in by_case.values():
        eager = next((r for r in case if r["impl"].split(" ")[0] == "eager"), None)
        for r in case:
            for phase in ("fwd", "fwdbwd"):
                us = r[f"{phase}_us"][0]
                if r[f"{phase}_flops"]:  # compute bound: TFLOP/s against the matmul rate
                    r[f"{phase}_tflops"] = r[f"{phase}_flops"] / (us * 1e-6) / 1e12
                    r[f"{phase}_pct_matmul"] = 100 * r[f"{phase}_tflops"] / mm_tflops if mm_tflops else None
                    r[f"{phase}_floor_us"] = r[f"{phase}_flops"] / (mm_tflops * 1e12) * 1e6 if mm_tflops else None
                else:  # memory bound: ideal bytes against the copy bandwidth
                    r[f"{phase}_gbs"] = r[f"{phase}_bytes"] / (us * 1e-6) / 1e9
                    r[f"{phase}_pct_copy"] = 100 * r[f"{phase}_gbs"] / copy_gbs if copy_gbs else None
                    r[f"{phase}_floor_us"] = r[f"{phase}_bytes"] / (copy_gbs * 1e9) * 1e6 if copy_gbs else None
                r[f"{phase}_x_eager"] = eager[f"{phase}_us"][0] / us if eager else None
                others = [o[f"{phase}_us"][0] for o in case if o["impl"] != r["impl"]]
                r[f"{phase}_x_best_other"] = min(others) / us if others else None
            if r.get("peak_extra_mb") is not None:
                r["peak_beyond_grads_mb"] = r["peak_extra_mb"] - r["grads_mb"]
    return rows


def table(rows) -> str:
    """One aligned table per kernel; compute-bound kernels get TFLOP/s where the others get GB/s."""
    from tabulate import tabulate

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    def us(t):
        return f"{t[0]:.1f} ({t[1]:.0f}-{t[2]:.0f})"

    out = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        sel = [r for r in rows if r["kernel"] == kernel]
        flops = sel[0]["fwdbwd_flops"] is not None
        rate, pct = ("tflops", "pct_matmul") if flops else ("gbs", "pct_copy")
        unit, ceiling = ("TFLOP/s", "%matmul") if flops else ("GB/s", "%copy")
        headers = ["shape", "impl", "fwd us (p20-p80)", f"fwd {unit}", f"fwd {ceiling}", "fwd+bwd us (p20-p80)",
                   f"fwd+bwd {unit}", f"fwd+bwd {ceiling}", "floor us", "fwd+bwd us launched (no graph)",
                   "host us/call (CPU clock, GPU kept busy)", "peak+ MB"]
        headers += ["peak+ beyond grads MB"] if flops else []
        headers += ["x eager", "x best other"]
        body = []
        for r in sel:
            line = [describe(r["shape"]), r["impl"], us(r["fwd_us"]), f(r[f"fwd_{rate}"], ".0f"),
                    f(r[f"fwd_{pct}"], ".0f"), us(r["fwdbwd_us"]), f(r[f"fwdbwd_{rate}"], ".0f"),
                    f(r[f"fwdbwd_{pct}"], ".0f"), f(r["fwdbwd_floor_us"], ".0f"), us(r["fwdbwd_launched_us"]),
                    f(r["host_us"], ".1f"), f(r["peak_extra_mb"], ".0f")]
            line += [f(r.get("peak_beyond_grads_mb"), ".0f")] if flops else []
            line += [f(r["fwdbwd_x_eager"], ".2f"), f(r["fwdbwd_x_best_other"], ".2f")]
            body.append(line)
        out.append(f"\n{kernel} ({' x '.join(sel[0]['shape'])}), {sel[0]['dtype']}; "
                   f"floor: {'flops at the matmul rate' if flops else 'ideal bytes at the copy bandwidth'}")
        out.append(tabulate(body, headers=headers, tablefmt="github", disable_numparse=True))
    return "\n".join(out)


@contextmanager
def _atomic(path: Path):
    """Yield a temporary path beside `path`; rename it to `path` once written (never half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save(rows, meta, tag):
    """JSON and CSV of every row, one PNG per kernel; returns the paths written."""
    RESULTS.mkdir(exist_ok=True)
    paths = [RESULTS / f"benchmark_{tag}.json", RESULTS / f"benchmark_{tag}.csv"]
    with _atomic(paths[0]) as tmp:
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    flat = [{k: (v[0] if isinstance(v, tuple) else describe(v) if isinstance(v, dict) else v) for k, v in r.items()}
            for r in rows]  # times: the median; shape: "16384 x 4096" (keys in the JSON)
    with _atomic(paths[1]) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
        w.writeheader()
        w.writerows(flat)
    return paths + plot(rows, meta, tag)


def plot(rows, meta, tag):
    """One figure per kernel in `rows`: forward + backward rate against tokens at the sweep's width,
    with the ceiling (copy bandwidth, or the matmul rate for compute-bound kernels); beside it the
    peak extra memory, when measured (GPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def base(r):
        return r["impl"].split(" +")[0]  # one line per implementation, captured or not

    paths = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        widths = [r["width"] for r in rows if r["kernel"] == kernel]
        sweep_width = max(set(widths), key=widths.count)  # the token sweep's width (4096, 128256, ...)
        sel = [r for r in rows if r["kernel"] == kernel and r["width"] == sweep_width]
        flops = sel[0]["fwdbwd_flops"] is not None
        memory = any(r["peak_extra_mb"] is not None for r in sel)
        fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(13 if memory else 7, 4.5), squeeze=False)
        ax = axes[0][0]
        rate = "fwdbwd_tflops" if flops else "fwdbwd_gbs"
        for impl in dict.fromkeys(base(r) for r in sel):
            pts = sorted((r["tokens"], r[rate], "+launch" in r["impl"]) for r in sel if base(r) == impl)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            launched = [p for p in pts if p[2]]  # hollow markers: timed with plain launches
            ax.plot([p[0] for p in launched], [p[1] for p in launched], "o", mfc="white", color=line.get_color())
        if flops and meta.get("matmul_tflops"):
            ax.axhline(meta["matmul_tflops"], color="k", linestyle="--",
                       label=f"bf16 matmul rate {meta['matmul_tflops']:.0f} TFLOP/s")
        elif not flops and meta.get("copy_gbs"):
            ax.axhline(meta["copy_gbs"], color="k", linestyle="--", label=f"copy bandwidth {meta['copy_gbs']:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("forward+backward TFLOP/s (matmul flops / time)" if flops
                      else "forward+backward GB/s (ideal bytes / time)")
        fixed = ", ".join(f"{k} {v}" for k, v in sel[0]["shape"].items() if k not in ("n_rows", "n_tokens"))
        ax.set_title(f"{kernel}, {fixed}, {meta['dtype']}, {meta['gpu']}\n"
                     "(hollow: timed with plain launches, no CUDA graph)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        if memory:
            ax2 = axes[0][1]
            for impl in dict.fromkeys(base(r) for r in sel):
                pts = sorted((r["tokens"], r["peak_extra_mb"] or 0) for r in sel if base(r) == impl)
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax2.set_xscale("log", base=2)
            ax2.set_xlabel("tokens")
            ax2.set_ylabel("peak extra memory, forward+backward (MB)")
            ax2.set_title("memory beyond the inputs" + (" (gradients included)" if flops else ""))
            ax2.legend(fontsize=8)
            ax2.grid(alpha=0.3)
        fig.tight_layout()
        path = RESULTS / f"benchmark_{kernel}_{tag}.png"
        with _atomic(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------
# Tuning sweep for our own launch settings
# ------------------------------------------------------------------------------------------------
def tune(dtype):
    from tabulate import tabulate

    copy = copy_bandwidth_gbs()
    N, H = 16384, HIDDEN
    x = torch.randn(N, H, device=DEVICE, dtype=dtype)
    w = torch.rand(H, device=DEVICE, dtype=dtype) + 0.5
    dy = torch.randn_like(x)
    fwd_bytes = rmsnorm_kernel.ideal_bytes(N, H, dtype)
    bwd_bytes = rmsnorm_kernel.ideal_bytes(N, H, dtype, backward=True) - fwd_bytes
    rows = []
    for bm, nw in ((1, 4), (1, 8), (2, 8), (2, 16), (4, 16)):
        us = timed(lambda: rmsnorm_forward(x, w, 1e-5, block_m=bm, num_warps=nw))[0]
        rows.append(("rmsnorm fwd", f"rows {bm}, warps {nw}", us, fwd_bytes / us / 1e3))
    _, rstd = rmsnorm_forward(x, w, 1e-5)
    for bm, nw, pps in ((1, 4, 2), (1, 4, 3), (1, 4, 4), (1, 8, 2), (1, 8, 3), (1, 16, 2), (2, 8, 2), (2, 16, 1)):
        us = timed(lambda: rmsnorm_backward(dy, x, w, rstd, True, programs_per_sm=pps, block_m=bm, num_warps=nw))[0]
        rows.append(("rmsnorm bwd", f"rows {bm}, warps {nw}, programs/SM {pps}", us, bwd_bytes / us / 1e3))
    for n_tok in (16384, 1024):
        logits = torch.randn(n_tok, VOCAB, device=DEVICE, dtype=dtype)
        t = torch.randint(0, VOCAB, (n_tok,), device=DEVICE)
        nbytes = cross_entropy_kernel.ideal_bytes(n_tok, VOCAB, dtype, backward=True)  # loss and gradient in one pass
        for bv, nw in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 32)):
            us = timed(lambda: cross_entropy_kernel.cross_entropy_forward(logits, t, -100, "mean", True, True,
                                                                          block_v=bv, num_warps=nw))[0]
            rows.append((f"ce fwd+grad N={n_tok}", f"block {bv}, warps {nw}", us, nbytes / us / 1e3))
        del logits
    print(tabulate([(a, b, f"{c:.1f}", f"{d:.0f}", f"{100 * d / copy:.0f}") for a, b, c, d in rows],
                   headers=["kernel", "setting", "us", "GB/s", "% copy"], tablefmt="github"))
    print(f"copy bandwidth {copy:.0f} GB/s")


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def kernel_list(spec: str) -> tuple:
    """'rope,rmsnorm' -> ('rmsnorm', 'rope') (the registry's order); 'all' -> every kernel."""
    words = [w.strip().lower() for w in spec.split(",") if w.strip()]
    if words == ["all"]:
        return KERNEL_NAMES
    # a registry name stands for its benchmark entries (distillation: jsd, linear_jsd)
    expanded = []
    for w in words:
        entry = BY_NAME.get(w)
        if entry is not None and w not in SPECS:
            if not entry.benchmarks:
                raise argparse.ArgumentTypeError(
                    f"{w} has no kernel benchmark of its own: its benchmark is the training step "
                    f"(finetune_optimized.py --kernels default,{w}; docs/optimizations.md)")
            expanded += entry.benchmarks
        else:
            expanded.append(w)
    # SPECS: the model's kernels (KERNEL_NAMES, 'all'), then entries that run only when named
    unknown = [w for w in expanded if w not in SPECS] or ([] if expanded else ["(none)"])
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kernel {', '.join(unknown)}; choose from "
                                         f"{', '.join(SPECS)} (or a registry name), comma-separated, or 'all'")
    return tuple(n for n in SPECS if n in expanded)


def token_counts(spec: str) -> list:
    """'4096,16384' -> [4096, 16384]."""
    try:
        sizes = [int(v) for v in spec.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts, got {spec!r}")
    return sizes


def gpu_arch() -> str:
    """'Hopper, sm_90', 'Blackwell, datacenter, sm_103': the architecture and compute capability of the
    current GPU (the family from playbook.core.gpu_arch, which tells a GB300 from an RTX 5090)."""
    major, minor = device_capability(torch.cuda.current_device())
    older = {(7, 0): "Volta", (7, 5): "Turing", (8, 9): "Ada"}.get((major, minor)) or {8: "Ampere"}.get(major)
    return f"{older}, sm_{major}{minor}" if older else describe_arch((major, minor))


def run_tag(gpu: str, smoke: bool, kernels: tuple, dtype: str, sizes: list | None) -> str:
    """'H200' for a full default run; 'H200_rope', 'H200_float16_sizes8192', 'smoke' ... otherwise."""
    parts = ["smoke" if smoke else gpu.replace("NVIDIA ", "").replace(" ", "_")]
    if set(kernels) != set(KERNEL_NAMES):
        parts.append("-".join(kernels))
    if dtype != "bfloat16":
        parts.append(dtype)
    if sizes and not smoke:
        parts.append("sizes" + "-".join(map(str, sizes)))
    return "_".join(parts)


def release_memory():
    """Between kernels: drop compiled peers and cached blocks, so one kernel's 25 GB peers (the eager
    cross-entropy at a 256k vocabulary) do not leave the next kernel too little memory."""
    import gc

    torch._dynamo.reset()  # compiled peers hold their graphs (and inputs) alive
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


# ---- FP8 crossover: where an FP8 projection starts to pay ------------------------------------------
# (tokens, in_features, out_features): SmolLM2-135M's projections at 8 x 512 tokens, widths between, and
# LLaMA 3.1 8B's at 8 x 512 and 4 x 2048 tokens
CROSSOVER_SHAPES = tuple((m, k, n) for m in (4096, 8192) for k, n in (
    (576, 192), (576, 576), (576, 1536), (1536, 576), (1024, 1024), (1024, 4096), (2048, 2048), (2048, 512),
    (4096, 1024), (4096, 4096), (4096, 14336), (14336, 4096)))


def fp8_crossover(recipes=("rowwise", "tensorwise")) -> int:
    """Time one projection's forward and backward (dx and dW) as a bf16 nn.Linear and as a Float8Linear
    of each recipe, captured as CUDA graphs (the training step replays one, so launch costs do not count),
    over CROSSOVER_SHAPES; prints the table and saves results/fp8_crossover_<gpu>.json. fp8_linear_kernel's
    size rule (FP8_MIN_WIDTH) is read off these rows."""
    import json

    import fp8_linear_kernel as f8
    import fp8_recipes_kernel

    gpu = torch.cuda.get_device_name()
    rows = []
    print(f"{gpu}: one projection, forward + backward, CUDA graph replays; us per call (median)")
    print(f"{'tokens':>7} {'in':>6} {'out':>6} {'width':>6} {'bf16':>9} " + " ".join(f"{r:>12}" for r in recipes))
    for m, k, n in CROSSOVER_SHAPES:
        g = _generator(m, k, n)
        x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
        dy = torch.randn(m, n, generator=g).to(DEVICE, torch.bfloat16)
        base = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            base.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
        row = dict(tokens=m, in_features=k, out_features=n, width=f8.harmonic_width(k, n))
        (row["bf16_us"], _, _), _ = timed_graph(lambda: base(x).backward(dy), grads=(x, base.weight))
        for r in recipes:
            layer = fp8_recipes_kernel.layer_class(r).from_linear(base, recipe=r)
            (us, _, _), _ = timed_graph(lambda: layer(x).backward(dy), grads=(x, base.weight))
            row[f"{r}_us"] = us
        rows.append(row)
        print(f"{m:>7} {k:>6} {n:>6} {row['width']:>6.0f} {row['bf16_us']:>9.1f} "
              + " ".join(f"{row[f'{r}_us']:>7.1f} {row['bf16_us'] / row[f'{r}_us']:>3.2f}x" for r in recipes), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fp8_crossover_{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, rows=rows), indent=1) + "\n")
    print(f"Saved {path.relative_to(RESULTS.parent)}")
    return 0


# ---- FP8 producers: a kernel that writes a tensor also writes its FP8 row copy ---------------------
PRODUCER_TOKENS = (8192, 16384)  # LLaMA 3.1 8B's 4 x 2048 and 8 x 2048 tokens
PRODUCER_PROGRAMS_PER_SM = (4, 2, 8, 16)  # the RMSNorm producer's persistent grid (fp8_producers_kernel's default first)
SWIGLU_PROGRAMS_PER_SM = (2, 1, 3, 4)  # the SwiGLU producer's (likewise)


def fp8_producers() -> int:
    """Time each FP8 producer against the pair it replaces (the kernel that writes the tensor, then the
    row quantizer that reads it back), at LLaMA 3.1 8B's width, as CUDA graph replays; with the bytes
    each moves (the `*_ideal_bytes` counts) and the rate that implies. Prints the table and saves
    results/fp8_producers_<gpu>.json."""
    import json

    import fp8_linear_kernel as f8
    import fp8_producers_kernel as f8p
    import rmsnorm_kernel

    gpu = torch.cuda.get_device_name()
    copy = copy_bandwidth_gbs()
    rows = []
    print(f"{gpu}: device-to-device copy {copy:.0f} GB/s; CUDA graph replays, us per call (median)")
    print(f"{'producer':<28} {'tokens':>7} {'width':>6} {'pair us':>9} {'fused us':>9} {'saved':>7} "
          f"{'pair GB/s':>10} {'fused GB/s':>11}")
    for m in PRODUCER_TOKENS:
        h = 4096
        g = _generator(m, h)
        x = torch.randn(m, h, generator=g).to(DEVICE, torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE, torch.bfloat16)

        def pair():
            y, _ = rmsnorm_kernel.rmsnorm_forward(x, w, 1e-5)
            f8.quantize_rows(y, True, True)

        pair_b = rmsnorm_kernel.ideal_bytes(m, h, torch.bfloat16) + f8.ideal_bytes(m, h, torch.bfloat16, "rows")
        fused_b = f8p.rmsnorm_rows_ideal_bytes(m, h, torch.bfloat16)
        (pair_us, _, _), _ = timed_graph(pair)
        for per_sm in PRODUCER_PROGRAMS_PER_SM:  # the persistent grid's size: the default, then the others
            (fused_us, _, _), _ = timed_graph(lambda: f8p.rmsnorm_quantize_rows(x, w, 1e-5, programs_per_sm=per_sm))
            row = dict(producer=f"rmsnorm -> fp8 rows, {per_sm}/SM", tokens=m, width=h, pair_us=pair_us,
                       fused_us=fused_us, pair_bytes=pair_b, fused_bytes=fused_b, programs_per_sm=per_sm)
            rows.append(row)
            print(f"{row['producer']:<28} {m:>7} {h:>6} {pair_us:>9.1f} {fused_us:>9.1f} {pair_us - fused_us:>7.1f} "
                  f"{pair_b / pair_us / 1e3:>10.0f} {fused_b / fused_us / 1e3:>11.0f}", flush=True)
    import swiglu_kernel

    for m in PRODUCER_TOKENS:
        width = 14336
        g = _generator(m, width)
        gate_up = torch.randn(m, 2 * width, generator=g).to(DEVICE, torch.bfloat16)
        gate, up = swiglu_kernel.halves(gate_up)

        def pair():
            h = swiglu_kernel.swiglu_forward(gate, up)
            f8.quantize_rows(h, True, True)

        pair_b = 3 * m * width * 2 + f8.ideal_bytes(m, width, torch.bfloat16, "rows")
        fused_b = f8p.swiglu_rows_ideal_bytes(m, width, torch.bfloat16)
        (pair_us, _, _), _ = timed_graph(pair)
        for per_sm in SWIGLU_PROGRAMS_PER_SM:
            (fused_us, _, _), _ = timed_graph(lambda: f8p.swiglu_quantize_rows(gate, up, programs_per_sm=per_sm))
            row = dict(producer=f"swiglu -> fp8 rows, {per_sm}/SM", tokens=m, width=width, pair_us=pair_us,
                       fused_us=fused_us, pair_bytes=pair_b, fused_bytes=fused_b, programs_per_sm=per_sm)
            rows.append(row)
            print(f"{row['producer']:<28} {m:>7} {width:>6} {pair_us:>9.1f} {fused_us:>9.1f} {pair_us - fused_us:>7.1f} "
                  f"{pair_b / pair_us / 1e3:>10.0f} {fused_b / fused_us / 1e3:>11.0f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fp8_producers_{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, copy_gbs=copy, rows=rows), indent=1) + "\n")
    print(f"Saved {path.relative_to(RESULTS.parent)}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=kernel_list, default=KERNEL_NAMES, metavar="NAMES",
                   help=f"comma-separated, from {', '.join(KERNEL_NAMES)}; or 'all' (default), which leaves "
                        f"out what runs only when named: {', '.join(n for n in SPECS if n not in KERNEL_NAMES)}")
    p.add_argument("--kernel", type=kernel_list, dest="kernels", help=argparse.SUPPRESS)  # the former spelling
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--sizes", type=token_counts, default=None,
                   help="comma-separated token counts (replace the default sweeps, at the LLaMA widths)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: runs the harness end to end, even on a CPU")
    p.add_argument("--tune", action="store_true", help="sweep our kernels' launch settings at LLaMA shapes")
    p.add_argument("--fp8-crossover", action="store_true",
                   help="time one projection in bf16 and in FP8 over widths from SmolLM2's to LLaMA 8B's (GPU)")
    p.add_argument("--fp8-producers", action="store_true",
                   help="time each kernel that also writes its output's FP8 row copy against the pair it replaces (GPU)")
    args = p.parse_args()
    if args.fp8_producers:
        if not ON_GPU:
            print("--fp8-producers times kernels at LLaMA 3.1 8B's sizes, which need a CUDA GPU", file=sys.stderr)
            return 2
        return fp8_producers()
    if args.fp8_crossover:
        if not ON_GPU:
            print("--fp8-crossover times FP8 matmuls, which need a CUDA GPU", file=sys.stderr)
            return 2
        return fp8_crossover()
    dtype = DTYPES[args.dtype]
    # every flag given must act: --smoke has its own tiny cases, --tune its own RMSNorm sweep
    if args.smoke and args.sizes:
        print("error: --smoke runs each kernel's own tiny cases, which --sizes would replace: drop one of them "
              "(--sizes needs a GPU)", file=sys.stderr)
        return 2
    unused = [flag for flag, on in (("--smoke", args.smoke), ("--sizes", args.sizes),
                                    ("--kernels", args.kernels != KERNEL_NAMES)) if on]
    if args.tune and unused:
        print(f"error: --tune sweeps RMSNorm's launch settings at LLaMA 3.1 8B's shape, which {', '.join(unused)} "
              "would not change: drop them", file=sys.stderr)
        return 2
    if not ON_GPU and (args.tune or not args.smoke):
        print(f"{'--tune' if args.tune else 'Timings'} need{'s' if args.tune else ''} a CUDA GPU, and none was "
              "found; `--smoke` checks the harness on a CPU (tiny sizes, Triton's interpreter).", file=sys.stderr)
        return 2
    if args.tune:
        return tune(dtype)
    specs = [SPECS[name] for name in args.kernels]
    copy = copy_bandwidth_gbs()
    mm = matmul_tflops() if any(s.compute_bound for s in specs) else None
    gpu = torch.cuda.get_device_name() if ON_GPU else "CPU (interpreter)"
    arch = gpu_arch() if ON_GPU else None
    import transformers
    import triton

    meta = dict(gpu=gpu, arch=arch, dtype=args.dtype, kernels=list(args.kernels), sizes=args.sizes, copy_gbs=copy,
                matmul_tflops=mm, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, liger=liger() and _liger_version())
    print(f"{gpu}{f' ({arch})' if arch else ''}; torch {torch.__version__}, Triton {triton.__version__}; "
          f"Liger-Kernel: {meta['liger'] or 'not installed'}")
    if copy:
        print(f"device-to-device copy bandwidth: {copy:.0f} GB/s (bytes read + written)")
    if mm:
        print(f"bf16 matmul rate (cuBLAS, 8192^3): {mm:.0f} TFLOP/s")
    print("Each implementation is checked against float64 (testkit's rule) before it is timed.")
    rows = []
    tag = run_tag(gpu, args.smoke, args.kernels, args.dtype, args.sizes)
    for spec in specs:
        impls = spec.impls()
        kernel_rows = []
        for case in spec.smoke if args.smoke else spec.cases(args.sizes):
            guarded("inputs", describe(case), lambda: kernel_rows.extend(_measure_impls(spec, case, dtype, impls)))
            print(f"  {spec.name} {describe(case)} done", flush=True)
        del impls
        release_memory()
        # each kernel's table and the files as soon as that kernel is done: a long sweep stopped part
        # way (a time limit, a crash in a peer) keeps every kernel finished before it
        add_derived(kernel_rows, copy, mm)
        rows.extend(kernel_rows)
        if kernel_rows:
            print(table(kernel_rows), flush=True)
        paths = save(rows, meta, tag)
    print("Saved " + ", ".join(str(p.relative_to(RESULTS.parent)) for p in paths))
    return 0


def _liger_version():
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001
        return "installed"


if __name__ == "__main__":
    sys.exit(playbook.run_main(main, "the kernels measured before it are in results/benchmark_*; the one running "
                                     "was not saved"))
