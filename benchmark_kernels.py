"""Benchmark the fused kernels against PyTorch eager, torch.compile and (if installed) Liger-Kernel.

    $ python benchmark_kernels.py --kernel all                 # LLaMA 3.1 8B shapes, bf16
    $ python benchmark_kernels.py --kernel rmsnorm --sizes 4096,16384
    $ python benchmark_kernels.py --kernel cross_entropy --dtype float16
    $ python benchmark_kernels.py --tune                       # sweep our launch settings
    $ python benchmark_kernels.py --smoke                      # tiny sizes, runs on a CPU (CI)

Method: the device-to-device copy bandwidth is measured first (bytes read + written), the ceiling
every memory-bound kernel is held against. Each implementation is checked against a float64
reference (the rule of testkit.py) before anything is timed. Times are medians (and p20-p80) of
`triton.testing.do_bench`, which warms up, and flushes the L2 cache before every repetition, so
even small inputs are read from GPU memory; gradients are reset between repetitions; inputs are
random (never zeros). Each call (forward, or forward + backward through autograd) is captured
once in a CUDA graph and do_bench times the graph's replays: that is the GPU time a training step
spends, without the Python and launch overhead that otherwise dominates (and adds run-to-run
noise to) anything under ~0.5 ms. An implementation that cannot be captured (one that waits for
the GPU on the host, for instance) is timed with ordinary launches and marked "+launch". GB/s counts the *ideal* bytes (each input read once, each output written
once), so it says how close an implementation is to the floor, not how many bytes it moved.
Results go to results/benchmark_<gpu>.{json,csv} and PNG plots next to them.

The peers, stated plainly:
  eager           Hugging Face's formulas in PyTorch: LlamaRMSNorm; for the loss, the logits upcast
                  to fp32 before F.cross_entropy (what ForCausalLMLoss does)
  eager-bf16      F.cross_entropy straight on the bf16 logits (no upcast)
  torch.compile   torch.compile of the same eager function (default mode)
  liger           Liger-Kernel's RMSNorm and cross-entropy (gradient written in place), if installed
  ours            rmsnorm_kernel.py / cross_entropy_kernel.py (gradient in place) / swiglu_kernel.py /
                  rope_kernel.py / linear_cross_entropy_kernel.py ("ours" accumulates the weight
                  gradient in fp32, "ours-bf16acc" in the weight's dtype)

The fused linear cross-entropy is compute bound: its floor is 6 N H V flops at the bf16 matmul rate
measured in the same run (a large cuBLAS matmul), and its rows report TFLOP/s instead of GB/s. Its
"peak+" includes the two gradients it returns (dx and dW, which any implementation must
allocate); the table under it also shows the peak beyond them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Graph pools and 8-25 GB peers fragment the caching allocator; expandable segments let freed
# memory be reused by the next size (set before torch touches the GPU).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.nn.functional as F

import kernel_utils  # noqa: F401  (selects the interpreter on machines without a GPU)
from cross_entropy_kernel import cross_entropy
from kernel_utils import DEVICE
from linear_cross_entropy_kernel import linear_cross_entropy
from rmsnorm_kernel import rmsnorm, rmsnorm_backward, rmsnorm_forward, rmsnorm_ref
from rope_kernel import rope, rope_ref
from swiglu_kernel import swiglu, swiglu_ref
from testkit import close_to_reference

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ON_GPU = DEVICE.type == "cuda"


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------
def timed(fn, grad_to_none=None):
    """(median, p20, p80) in microseconds."""
    if ON_GPU:
        import triton.testing

        q = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return tuple(v * 1e3 for v in q)
    times = []  # CPU / interpreter: only proves the harness runs; the numbers mean nothing
    for _ in range(3):
        for t in grad_to_none or []:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), min(times), max(times)


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
    a, b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16), torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
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
    """Run one implementation's measurement; out of GPU memory skips it (with a warning), not the run."""
    try:
        measure()
    except torch.cuda.OutOfMemoryError:
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


def _measure_impls(kernel, impls, N, width, dtype, grads, fwd_bytes, fwdbwd_bytes, check, forward, forward_backward,
                   fwdbwd_flops=None):
    """Check, then time forward and forward + backward of every implementation; one row each.

    check(name, fn), forward(fn), forward_backward(fn): the kernel-specific calls on its inputs.
    grads: the leaf inputs whose .grad a backward sets (reset around every measurement).
    """
    rows = []
    for name, fn in impls.items():
        def measure():
            if check is not None:
                checked(name, lambda: check(name, fn))
            fwd, g1 = timed_graph(lambda: forward(fn))
            fb, g2 = timed_graph(lambda: forward_backward(fn), grads=grads)
            mem = peak_extra_mb(lambda: forward_backward(fn), grad_to_none=grads)
            rows.append(dict(kernel=kernel, impl=_label(name, g1 and g2), tokens=N, width=width,
                             dtype=str(dtype).split(".")[-1], fwd_us=fwd, fwdbwd_us=fb,
                             fwd_bytes=fwd_bytes, fwdbwd_bytes=fwdbwd_bytes, peak_extra_mb=mem,
                             fwdbwd_flops=fwdbwd_flops,
                             grads_mb=sum(t.numel() * t.element_size() for t in grads) / 1e6))
            for t in grads:
                t.grad = None
        guarded(name, f"{N}x{width}", measure)
    return rows


# ------------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------------
def rmsnorm_impls(H, dtype):
    impls = {"ours": rmsnorm, "eager": rmsnorm_ref, "torch.compile": compiled(rmsnorm_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # Liger's own autograd function, LLaMA casting; in_place=False keeps dy intact between runs
        impls["liger"] = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    return impls


def bench_rmsnorm(N, H, dtype, impls, check=True):
    g = torch.Generator(device="cpu").manual_seed(N + H)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(N, H, generator=g).to(DEVICE, dtype)
    elt = x.element_size()
    return _measure_impls(
        "rmsnorm", impls, N, H, dtype, grads=[x, w], fwd_bytes=2 * N * H * elt, fwdbwd_bytes=5 * N * H * elt,
        check=(lambda name, fn: _check_rmsnorm(name, fn, x[:256].detach(), w.detach(), dy[:256])) if check else None,
        forward=lambda fn: fn(x.detach(), w.detach(), 1e-5),
        forward_backward=lambda fn: fn(x, w, 1e-5).backward(dy),
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


# ------------------------------------------------------------------------------------------------
# Cross-entropy
# ------------------------------------------------------------------------------------------------
def _hf_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)  # Hugging Face upcasts to fp32 first


def ce_impls():
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


def bench_cross_entropy(N, V, dtype, impls, check=True):
    g = torch.Generator(device="cpu").manual_seed(N + V)
    logits = (torch.randn(N, V, generator=g) * 2).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    targets[::17] = -100  # a few ignored tokens, as padding produces
    elt = logits.element_size()

    def loss_only(fn):
        with torch.no_grad():
            fn(logits, targets)

    # In-place implementations overwrite `logits` with the gradient, so later repetitions read the
    # previous gradient as logits: finite, non-zero values; the work per element is the same (an exp
    # each), so the time is too.
    return _measure_impls(
        "cross_entropy", impls, N, V, dtype, grads=[logits], fwd_bytes=N * V * elt, fwdbwd_bytes=2 * N * V * elt,
        check=(lambda name, fn: _check_ce(name, fn, logits[:256].detach(), targets[:256])) if check else None,
        forward=loss_only,
        forward_backward=lambda fn: fn(logits, targets).backward(),
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


# ------------------------------------------------------------------------------------------------
# SwiGLU
# ------------------------------------------------------------------------------------------------
def swiglu_impls():
    impls = {"ours": swiglu, "eager": swiglu_ref, "torch.compile": compiled(swiglu_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        impls["liger"] = LigerSiLUMulFunction.apply
    return impls


def bench_swiglu(N, I, dtype, impls, check=True):
    g = torch.Generator(device="cpu").manual_seed(N + I)
    gate = (torch.randn(N, I, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    up = torch.randn(N, I, generator=g).to(DEVICE, dtype).requires_grad_()
    dh = torch.randn(N, I, generator=g).to(DEVICE, dtype)
    elt = gate.element_size()
    return _measure_impls(
        "swiglu", impls, N, I, dtype, grads=[gate, up], fwd_bytes=3 * N * I * elt, fwdbwd_bytes=8 * N * I * elt,
        check=(lambda name, fn: _check_swiglu(name, fn, gate[:64].detach(), up[:64].detach(), dh[:64])) if check else None,
        forward=lambda fn: fn(gate.detach(), up.detach()),
        forward_backward=lambda fn: fn(gate, up).backward(dh),
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


# ------------------------------------------------------------------------------------------------
# Fused linear cross-entropy (compute bound)
# ------------------------------------------------------------------------------------------------
def _hf_head_loss(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t)  # full logits, upcast, PyTorch's loss


def flce_impls():
    impls = {
        "ours": lambda x, w, t: linear_cross_entropy(x, w, t),
        "ours-bf16acc": lambda x, w, t: linear_cross_entropy(x, w, t, accumulate_fp32=False),
        "eager": _hf_head_loss,
        "torch.compile": compiled(_hf_head_loss),
    }
    if liger() is not None and ON_GPU:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mod = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w, t: mod(w, x, t)  # Liger takes (weight, input, target)
    return impls


def bench_flce(N, V, H, dtype, impls, check=True):
    g = torch.Generator(device="cpu").manual_seed(N + V)
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(DEVICE, dtype).requires_grad_()  # logits ~ N(0, 2)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    t[::17] = -100
    elt = x.element_size()
    n_check = min(N, 2304)  # > 2048 tokens: our default chunking takes two chunks

    def loss_only(fn):
        with torch.no_grad():
            fn(x, w, t)

    return _measure_impls(
        "linear_cross_entropy", impls, N, V, dtype, grads=[x, w],
        fwd_bytes=(N * H + V * H) * elt, fwdbwd_bytes=2 * (N * H + V * H) * elt,
        check=(lambda name, fn: _check_flce(name, fn, x[:n_check].detach(), w.detach(), t[:n_check])) if check else None,
        forward=loss_only, forward_backward=lambda fn: fn(x, w, t).backward(), fwdbwd_flops=6 * N * H * V,
    )


def _check_flce(name, fn, x, w, t):
    outs = []
    # fp32 serves as the truth here: a float64 copy of a 128256 x 4096 head would take 4 GB
    for f, cast in ((fn, lambda v: v), (_hf_head_loss, lambda v: v), (_hf_head_loss, lambda v: v.float())):
        xi, wi = cast(x).clone().requires_grad_(), cast(w).clone().requires_grad_()
        loss = f(xi, wi, t)
        loss.backward()
        outs.append((loss.detach().float(), xi.grad, wi.grad))
    V = w.shape[0]
    close_to_reference(f"flce {name} loss", outs[0][0], outs[1][0], outs[2][0], torch.float32, n=V)
    close_to_reference(f"flce {name} dx", outs[0][1], outs[1][1], outs[2][1], x.dtype, n=V)
    close_to_reference(f"flce {name} dW", outs[0][2], outs[1][2], outs[2][2], x.dtype, n=x.shape[0])


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------
def rope_impls():
    impls = {"ours": rope, "eager": rope_ref, "torch.compile": compiled(rope_ref)}
    if liger() is not None and ON_GPU:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        impls["liger"] = liger_rotary_pos_emb
    return impls


def bench_rope(N, heads, dtype, impls, check=True, head_dim=128, seq=2048):
    """N tokens as N / seq sequences; heads = (query heads, KV heads); q/k as attention makes them."""
    hq, hk = heads
    B, T = max(1, N // seq), min(N, seq)
    g = torch.Generator(device="cpu").manual_seed(N + hq)
    q = torch.randn(B, T, hq, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, hk, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    ang = torch.arange(T, dtype=torch.float32)[:, None] * (500000.0 ** (-torch.arange(0, head_dim, 2) / head_dim))
    ang = torch.cat([ang, ang], dim=-1)[None].to(DEVICE)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(DEVICE, dtype), torch.randn(k.shape, generator=g).to(DEVICE, dtype)
    elt = q.element_size()
    n_vals = B * T * (hq + hk) * head_dim

    def fwd_bwd(fn):
        qo, ko = fn(q, k, cos, sin)
        torch.autograd.backward([qo, ko], [dq, dk])

    return _measure_impls(
        "rope", impls, B * T, hq * head_dim, dtype, grads=[q, k], fwd_bytes=2 * n_vals * elt,
        fwdbwd_bytes=4 * n_vals * elt,
        check=(lambda name, fn: _check_rope(name, fn, q[:1, :, :64].detach(), k[:1, :, :64].detach(), cos[:, :64],
                                            sin[:, :64])) if check else None,
        forward=lambda fn: fn(q.detach(), k.detach(), cos, sin), forward_backward=fwd_bwd,
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


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------
def add_derived(rows, copy_gbs, mm_tflops=None):
    by_case = {}
    for r in rows:
        by_case.setdefault((r["kernel"], r["tokens"], r["width"]), []).append(r)
    for case in by_case.values():
        eager = next((r for r in case if r["impl"].split(" ")[0] == "eager"), None)
        for r in case:
            for phase in ("fwd", "fwdbwd"):
                us = r[f"{phase}_us"][0]
                r[f"{phase}_gbs"] = r[f"{phase}_bytes"] / (us * 1e-6) / 1e9
                r[f"{phase}_pct_copy"] = 100 * r[f"{phase}_gbs"] / copy_gbs if copy_gbs else None
                r[f"{phase}_floor_us"] = r[f"{phase}_bytes"] / (copy_gbs * 1e9) * 1e6 if copy_gbs else None
                r[f"{phase}_x_eager"] = eager[f"{phase}_us"][0] / us if eager else None
                others = [o[f"{phase}_us"][0] for o in case if o["impl"] != r["impl"]]
                r[f"{phase}_x_best_other"] = min(others) / us if others else None
            if r.get("fwdbwd_flops"):  # compute bound: TFLOP/s and the matmul floor replace GB/s
                us = r["fwdbwd_us"][0]
                r["fwdbwd_tflops"] = r["fwdbwd_flops"] / (us * 1e-6) / 1e12
                r["fwdbwd_floor_us"] = r["fwdbwd_flops"] / (mm_tflops * 1e12) * 1e6 if mm_tflops else None
                r["fwd_gbs"] = r["fwdbwd_gbs"] = r["fwd_pct_copy"] = r["fwdbwd_pct_copy"] = r["fwd_floor_us"] = None
            if r.get("peak_extra_mb") is not None:
                r["peak_beyond_grads_mb"] = r["peak_extra_mb"] - r.get("grads_mb", 0.0)
    return rows


def table(rows):
    from tabulate import tabulate

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    out = []
    for r in rows:
        out.append([
            r["kernel"], f"{r['tokens']}x{r['width']}", r["impl"],
            f"{r['fwd_us'][0]:.1f} ({r['fwd_us'][1]:.0f}-{r['fwd_us'][2]:.0f})", f(r["fwd_gbs"], ".0f"), f(r["fwd_pct_copy"], ".0f"),
            f"{r['fwdbwd_us'][0]:.1f} ({r['fwdbwd_us'][1]:.0f}-{r['fwdbwd_us'][2]:.0f})", f(r["fwdbwd_gbs"], ".0f"),
            f(r["fwdbwd_pct_copy"], ".0f"), f(r.get("fwdbwd_tflops"), ".0f"), f(r["fwdbwd_floor_us"], ".0f"),
            f(r["peak_extra_mb"], ".0f"), f(r.get("peak_beyond_grads_mb"), ".0f"),
            f(r["fwdbwd_x_eager"], ".2f"), f(r["fwdbwd_x_best_other"], ".2f"),
        ])
    headers = ["kernel", "tokens x width", "impl", "fwd us (p20-p80)", "fwd GB/s", "fwd %copy",
               "fwd+bwd us (p20-p80)", "fwd+bwd GB/s", "fwd+bwd %copy", "fwd+bwd TFLOP/s", "floor us", "peak+ MB",
               "peak+ beyond grads MB", "x eager", "x best other"]
    return tabulate(out, headers=headers, tablefmt="github", disable_numparse=True)


def save(rows, meta, tag):
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"benchmark_{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(RESULTS / f"benchmark_{tag}.csv", "w", newline="") as fh:
        flat = [{k: (v[0] if isinstance(v, tuple) else v) for k, v in r.items()} for r in rows]
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
        w.writeheader()
        w.writerows(flat)
    return plot(rows, meta, tag)


def plot(rows, meta, tag):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for kernel in ("rmsnorm", "cross_entropy", "swiglu", "rope"):
        widths = [r["width"] for r in rows if r["kernel"] == kernel]
        if not widths:
            continue
        sweep_width = max(set(widths), key=widths.count)  # the token sweep's width (4096 / 128256)
        sel = [r for r in rows if r["kernel"] == kernel and r["width"] == sweep_width]
        fig, axes = plt.subplots(1, 2 if kernel == "cross_entropy" else 1, figsize=(13 if kernel == "cross_entropy" else 7, 4.5))
        axes = axes if isinstance(axes, (list, tuple)) or hasattr(axes, "__len__") else [axes]
        ax = axes[0]
        base = lambda r: r["impl"].split(" +")[0]  # noqa: E731  (one line per implementation)
        for impl in dict.fromkeys(base(r) for r in sel):
            pts = sorted((r["tokens"], r["fwdbwd_gbs"], "+launch" in r["impl"]) for r in sel if base(r) == impl)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            launched = [p for p in pts if p[2]]  # hollow markers: timed with plain launches
            ax.plot([p[0] for p in launched], [p[1] for p in launched], "o", mfc="white", color=line.get_color())
        if meta.get("copy_gbs"):
            ax.axhline(meta["copy_gbs"], color="k", linestyle="--", label=f"copy bandwidth {meta['copy_gbs']:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("forward+backward GB/s (ideal bytes / time)")
        ax.set_title(f"{kernel}, width {sweep_width}, {meta['dtype']}, {meta['gpu']}\n"
                     "(hollow: timed with plain launches, no CUDA graph)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        if kernel == "cross_entropy":
            ax2 = axes[1]
            for impl in dict.fromkeys(base(r) for r in sel):
                pts = sorted((r["tokens"], r["peak_extra_mb"] or 0) for r in sel if base(r) == impl)
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax2.set_xscale("log", base=2)
            ax2.set_xlabel("tokens")
            ax2.set_ylabel("peak extra memory, forward+backward (MB)")
            ax2.set_title("memory beyond the logits")
            ax2.legend(fontsize=8)
            ax2.grid(alpha=0.3)
        fig.tight_layout()
        path = RESULTS / f"benchmark_{kernel}_{tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------
# Tuning sweep for our own launch settings
# ------------------------------------------------------------------------------------------------
def tune(dtype):
    from tabulate import tabulate

    import cross_entropy_kernel as cek

    copy = copy_bandwidth_gbs()
    N, H = 16384, 4096
    x = torch.randn(N, H, device=DEVICE, dtype=dtype)
    w = torch.rand(H, device=DEVICE, dtype=dtype) + 0.5
    dy = torch.randn_like(x)
    rows = []
    for bm, nw in ((1, 4), (1, 8), (2, 8), (2, 16), (4, 16)):
        us = timed(lambda: rmsnorm_forward(x, w, 1e-5, block_m=bm, num_warps=nw))[0]
        rows.append(("rmsnorm fwd", f"rows {bm}, warps {nw}", us, 2 * N * H * 2 / us / 1e3))
    _, rstd = rmsnorm_forward(x, w, 1e-5)
    for bm, nw, pps in ((1, 4, 2), (1, 4, 3), (1, 4, 4), (1, 8, 2), (1, 8, 3), (1, 16, 2), (2, 8, 2), (2, 16, 1)):
        us = timed(lambda: rmsnorm_backward(dy, x, w, rstd, True, programs_per_sm=pps, block_m=bm, num_warps=nw))[0]
        rows.append(("rmsnorm bwd", f"rows {bm}, warps {nw}, programs/SM {pps}", us, 3 * N * H * 2 / us / 1e3))
    V = 128256
    for n_tok in (16384, 1024):
        logits = torch.randn(n_tok, V, device=DEVICE, dtype=dtype)
        t = torch.randint(0, V, (n_tok,), device=DEVICE)
        for bv, nw in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 32)):
            us = timed(lambda: cek.cross_entropy_forward(logits, t, -100, "mean", True, True, block_v=bv, num_warps=nw))[0]
            rows.append((f"ce fwd+grad N={n_tok}", f"block {bv}, warps {nw}", us, 2 * n_tok * V * 2 / us / 1e3))
        del logits
    print(tabulate([(a, b, f"{c:.1f}", f"{d:.0f}", f"{100 * d / copy:.0f}") for a, b, c, d in rows],
                   headers=["kernel", "setting", "us", "GB/s", "% copy"], tablefmt="github"))
    print(f"copy bandwidth {copy:.0f} GB/s")


# ------------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=["rmsnorm", "cross_entropy", "swiglu", "rope", "linear_cross_entropy", "all"],
                   default="all")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--sizes", default=None, help="comma-separated token counts (replaces the default sweeps)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: runs the harness end to end, even on a CPU")
    p.add_argument("--tune", action="store_true", help="sweep our kernels' launch settings at LLaMA shapes")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    if args.tune:
        if not ON_GPU:
            raise SystemExit("--tune needs a GPU")
        return tune(dtype)
    if not ON_GPU and not args.smoke:
        raise SystemExit("Timings need a CUDA GPU: none found. `--smoke` runs the harness at tiny sizes on the "
                         "CPU (through Triton's interpreter) to check that it works; its numbers mean nothing.")
    if args.smoke:
        rms_cases = [(64, 256), (48, 100)]
        ce_cases = [(16, 1000), (8, 32001)]
        swiglu_cases = [(32, 300)]
        rope_cases = [(64, (4, 2), 16, 32)]  # tokens, (query heads, KV heads), head_dim, seq
        flce_cases = [(40, 300, 32)]  # tokens, vocabulary, hidden
    else:
        toks = [int(s) for s in args.sizes.split(",")] if args.sizes else None
        rms_cases = [(n, 4096) for n in (toks or [1024, 2048, 4096, 8192, 16384, 32768])]
        ce_cases = [(n, 128256) for n in (toks or [512, 1024, 2048, 4096, 8192, 16384])]
        swiglu_cases = [(n, 14336) for n in (toks or [1024, 4096, 8192, 16384])]
        rope_cases = [(n, (32, 8), 128, 2048) for n in (toks or [2048, 8192, 16384])]
        flce_cases = [(n, 128256, 4096) for n in (toks or [4096, 8192, 16384])]
        if not toks:
            rms_cases += [(16384, h) for h in (1024, 2048, 8192, 16384)]
            ce_cases += [(4096, v) for v in (32000, 151936, 256000)]
    copy = copy_bandwidth_gbs()
    mm = matmul_tflops() if args.kernel in ("linear_cross_entropy", "all") else None
    gpu = torch.cuda.get_device_name() if ON_GPU else "CPU (interpreter)"
    import transformers
    import triton

    meta = dict(gpu=gpu, dtype=args.dtype, copy_gbs=copy, matmul_tflops=mm, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, liger=getattr(liger(), "__name__", None) and _liger_version())
    print(f"{gpu}; torch {torch.__version__}, Triton {triton.__version__}; Liger-Kernel: {meta['liger'] or 'not installed'}")
    if copy:
        print(f"device-to-device copy bandwidth: {copy:.0f} GB/s (bytes read + written)")
    if mm:
        print(f"bf16 matmul rate (cuBLAS, 8192^3): {mm:.0f} TFLOP/s")
    print("Each implementation is checked against float64 (testkit's rule) before it is timed.")
    rows = []
    if args.kernel in ("rmsnorm", "all"):
        impls = {}
        for N, H in rms_cases:
            impls.setdefault(H, rmsnorm_impls(H, dtype))
            guarded("inputs", f"{N}x{H}", lambda: rows.extend(bench_rmsnorm(N, H, dtype, impls[H])))
            print(f"  rmsnorm {N}x{H} done", flush=True)
    if args.kernel in ("cross_entropy", "all"):
        impls = ce_impls()
        for N, V in ce_cases:
            guarded("inputs", f"{N}x{V}", lambda: rows.extend(bench_cross_entropy(N, V, dtype, impls)))
            print(f"  cross_entropy {N}x{V} done", flush=True)
    if args.kernel in ("swiglu", "all"):
        impls = swiglu_impls()
        for N, I in swiglu_cases:
            guarded("inputs", f"{N}x{I}", lambda: rows.extend(bench_swiglu(N, I, dtype, impls)))
            print(f"  swiglu {N}x{I} done", flush=True)
    if args.kernel in ("rope", "all"):
        impls = rope_impls()
        for N, heads, D, T in rope_cases:
            guarded("inputs", f"{N} tokens", lambda: rows.extend(bench_rope(N, heads, dtype, impls, head_dim=D, seq=T)))
            print(f"  rope {N} tokens x {heads} heads done", flush=True)
    if args.kernel in ("linear_cross_entropy", "all"):
        impls = flce_impls()
        for N, V, H in flce_cases:
            guarded("inputs", f"{N}x{V}", lambda: rows.extend(bench_flce(N, V, H, dtype, impls)))
            print(f"  linear_cross_entropy {N}x{H}x{V} done", flush=True)
    add_derived(rows, copy, mm)
    tag = "smoke" if args.smoke else gpu.replace("NVIDIA ", "").replace(" ", "_")
    paths = save(rows, meta, tag)
    print(table(rows))
    print("Saved " + ", ".join(str(p.relative_to(RESULTS.parent)) for p in [RESULTS / f"benchmark_{tag}.json", RESULTS / f"benchmark_{tag}.csv", *paths]))


def _liger_version():
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001
        return "installed"


if __name__ == "__main__":
    sys.exit(main())
