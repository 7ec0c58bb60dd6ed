"""Measuring and reporting for benchmark_kernels.py (its module docstring states the method).

    timed, timed_graph      GPU time: do_bench medians (p20-p80), of CUDA graph replays where capture works
    host_us_per_call        the host's own time per call, the GPU kept busy by a spin kernel
    peak_extra_mb           memory allocated beyond what was live before a call
    copy_bandwidth_gbs      the ceilings rows are held against: device-to-device copy, bf16 matmul rate
    matmul_tflops
    guarded, checked        an implementation out of memory is skipped; a peer off the reference is warned about
    add_derived, table      rates, floors and speed-ups per row; one aligned table per kernel
    save, plot              results/benchmark_<tag>.{json,csv} and one PNG per kernel, written atomically

On a CPU (Triton's interpreter) every timer runs its call once: the harness is checked, its times mean nothing.
"""

from __future__ import annotations

import csv
import json
import time

import torch

from playbook.runtime.common import is_out_of_memory
from playbook.store.files import RESULTS_DIR, atomic_file
from core.kernel_utils import DEVICE

RESULTS = RESULTS_DIR
ON_GPU = DEVICE.type == "cuda"


def generator(*sizes) -> torch.Generator:
    """A CPU generator seeded by a case's sizes: the same random inputs for the same case, run after run."""
    return torch.Generator(device="cpu").manual_seed(sum(sizes))


def describe(case: dict) -> str:
    """{"n_rows": 16384, "hidden": 4096} -> "16384 x 4096" (the keys are in the table's heading)."""
    return " x ".join(str(v) for v in case.values())


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


def impl_label(name: str, captured: bool) -> str:
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


def save(rows, meta, tag):
    """JSON and CSV of every row, one PNG per kernel; returns the paths written."""
    RESULTS.mkdir(exist_ok=True)
    paths = [RESULTS / f"benchmark_{tag}.json", RESULTS / f"benchmark_{tag}.csv"]
    with atomic_file(paths[0]) as tmp:
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    flat = [{k: (v[0] if isinstance(v, tuple) else describe(v) if isinstance(v, dict) else v) for k, v in r.items()}
            for r in rows]  # times: the median; shape: "16384 x 4096" (keys in the JSON)
    with atomic_file(paths[1]) as tmp, open(tmp, "w", newline="") as fh:
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
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        paths.append(path)
    return paths
