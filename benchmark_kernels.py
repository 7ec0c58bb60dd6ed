"""Benchmark the fused kernels against PyTorch eager, torch.compile and (if installed) Liger-Kernel.

    $ python benchmark_kernels.py                              # every kernel, LLaMA 3.1 8B shapes, bf16
    $ python benchmark_kernels.py --kernels rmsnorm --sizes 4096,16384
    $ python benchmark_kernels.py --kernels cross_entropy,linear_cross_entropy --dtype float16
    $ python benchmark_kernels.py --tune                       # sweep our launch settings
    $ python benchmark_kernels.py --smoke                      # tiny sizes, runs on a CPU (CI)
    $ python benchmark_kernels.py --kernels adamw              # the optimizer step, run only when named
    $ python benchmark_kernels.py --kernels jsd,linear_jsd     # the distillation losses, run only when named
    $ python benchmark_kernels.py --mx-quant                   # MXFP8 / NVFP4 quantizers against copy bandwidth,
                                                               # and the MXFP8 producers against their pairs

`--kernels` takes the registry's names (playbook/model/registry.py), comma-separated, or `all` (the default).
Every kernel is one entry of the table `SPECS` (benchmarks/specs.py): its cases, how to
build random inputs for one, its implementations, its correctness check, its forward and forward +
backward calls, and its kernel module, whose `ideal_bytes(...)` (and, for the compute-bound fused
linear cross-entropy, `flops(...)`) give the floor each row is held against. `main()` is one loop
over the selected entries; measuring and reporting are shared (benchmarks/timing.py).

Method: the device-to-device copy bandwidth is measured first (bytes read + written), the ceiling
every memory-bound kernel is held against. Each implementation is checked against a float64
reference (testkit's rule) before anything is timed. Times are medians (and p20-p80) of
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
import sys

from playbook.runtime import signals
from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch and the kernels load (seconds): one line, exit code 130
    start("nothing was measured")

import torch  # noqa: E402

from core.gpu_arch import describe as describe_arch, device_capability  # noqa: E402
import cross_entropy_kernel  # noqa: E402
import rmsnorm_kernel  # noqa: E402
from playbook.model.registry import BY_NAME, KERNEL_NAMES  # noqa: E402
from core.kernel_utils import DEVICE  # noqa: E402
from rmsnorm_kernel import rmsnorm_backward, rmsnorm_forward  # noqa: E402
# measuring and reporting (benchmarks/timing.py); the table of kernels (benchmarks/specs.py)
from benchmarks.timing import (ON_GPU, RESULTS, add_derived, checked, copy_bandwidth_gbs, describe,  # noqa: E402
                                generator, guarded, host_us_per_call, impl_label, liger, matmul_tflops,
                                peak_extra_mb, save, table, timed, timed_graph)
from benchmarks.specs import HIDDEN, SPECS, VOCAB, KernelSpec  # noqa: E402
from playbook.store.files import write_atomic  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
            rows.append(dict(kernel=spec.name, impl=impl_label(name, g1 and g2), **common, fwd_us=fwd, fwdbwd_us=fb,
                             fwdbwd_launched_us=launched, host_us=host, peak_extra_mb=mem))
            for t in grads:
                t.grad = None
        guarded(name, describe(case), measure)
    return rows



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
    current GPU (the family from core.gpu_arch, which tells a GB300 from an RTX 5090)."""
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
        g = generator(m, k, n)
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
    write_atomic(path, json.dumps(dict(gpu=gpu, torch=torch.__version__, rows=rows), indent=1) + "\n")
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
        g = generator(m, h)
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
        g = generator(m, width)
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
    write_atomic(path, json.dumps(dict(gpu=gpu, torch=torch.__version__, copy_gbs=copy, rows=rows), indent=1) + "\n")
    print(f"Saved {path.relative_to(RESULTS.parent)}")
    return 0


# ---- Blackwell's block-scaled formats: the MXFP8 and NVFP4 quantizers against copy bandwidth ---------
MX_SHAPES = ((8192, 4096), (8192, 14336))  # LLaMA 3.1 8B at 4 x 2048 tokens: the hidden and the MLP widths
MX_SMOKE_SHAPES = ((70, 96),)  # proves the harness and the correctness check (on a CPU, in the interpreter); times nothing


def _mx_norm_rows(m: int, k: int, rows: list, copy: float | None) -> bool:
    """Check, then time, RMSNorm + MXFP8 along K as two kernels and as the fused producer at [m, k]; append
    both rows to `rows`. The fused copy must be bit for bit `quantize_mxfp8` of the output the producer
    wrote (that output may differ from the plain norm's in its last bit on a GPU: fp8_producers_test.py).
    Returns True (and says why) when the check fails."""
    import fp8_producers_kernel as f8p
    import mx_quant_kernel as mq

    g = generator(m, k + 1)
    x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, torch.bfloat16)
    y, _, q, s = f8p.rmsnorm_quantize_mxfp8(x, w, 1e-5)  # correctness before timing
    q_ref, s_ref, _, _ = mq.quantize_mxfp8(y)
    if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
            and torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))):
        print(f"rmsnorm -> mxfp8 at {m} x {k}: the producer's copy differs from quantize_mxfp8 of its output: "
              "not timed", file=sys.stderr)
        return True

    def pair():
        mq.quantize_mxfp8(rmsnorm_kernel.rmsnorm_forward(x, w, 1e-5)[0], True, False)

    e = torch.bfloat16
    _time_rows(m, k, rows, copy, (
            ("rmsnorm, then mxfp8 along K", pair,
             rmsnorm_kernel.ideal_bytes(m, k, e) + mq.ideal_bytes(m, k, e, "mxfp8", 1)),
            ("rmsnorm writing mxfp8 (fused)", lambda: f8p.rmsnorm_quantize_mxfp8(x, w, 1e-5),
             f8p.rmsnorm_mxfp8_ideal_bytes(m, k, e))))
    return False


def _mx_swiglu_rows(m: int, k: int, rows: list, copy: float | None) -> bool:
    """Check, then time, SwiGLU + both MXFP8 copies (what down_proj's MXFP8 layer makes of h) as two kernels
    and as the fused producer at [m, k]; append both rows to `rows`. Returns True (and says why) when the
    producer's h or copies differ from the pair's."""
    import fp8_producers_kernel as f8p
    import mx_quant_kernel as mq
    import swiglu_kernel

    gate_up = torch.randn(m, 2 * k, generator=generator(m, 2 * k)).to(DEVICE, torch.bfloat16)
    gate, up = swiglu_kernel.halves(gate_up)
    h = swiglu_kernel.swiglu_forward(gate, up)
    for ours, ref in zip(f8p.swiglu_quantize_mxfp8(gate, up), (h, *mq.quantize_mxfp8(h, True, True))):
        if not torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)):  # correctness before timing
            print(f"swiglu -> mxfp8 at {m} x {k}: the producer differs from the pair: not timed", file=sys.stderr)
            return True
    e = torch.bfloat16
    _time_rows(m, k, rows, copy, (
            ("swiglu, then mxfp8 both copies", lambda: mq.quantize_mxfp8(swiglu_kernel.swiglu_forward(gate, up), True,
                                                                          True),
             3 * m * k * e.itemsize + mq.ideal_bytes(m, k, e, "mxfp8", 2)),
            ("swiglu writing mxfp8 (fused)", lambda: f8p.swiglu_quantize_mxfp8(gate, up),
             f8p.swiglu_mxfp8_ideal_bytes(m, k, e))))
    return False


def _time_rows(m: int, k: int, rows: list, copy: float | None, cases) -> None:
    """Time each (name, run, ideal bytes) of `cases` as CUDA graph replays at [m, k]; append its row to `rows`
    with GB/s and the share of the measured copy bandwidth `copy`."""
    for name, run, nbytes in cases:
        (us, _, _), _ = timed_graph(run)
        gbs = nbytes / us / 1e3
        rows.append(dict(quantizer=name, rows=m, cols=k, us=us, bytes=nbytes, gbs=gbs,
                         pct_copy=100 * gbs / copy if copy else None))
        print(f"  [{len(rows)}] {name} at {m} x {k}: {us:.1f} us, {gbs:.0f} GB/s", flush=True)  # progress


def mx_quant(smoke: bool) -> int:
    """Time the MXFP8 and NVFP4 quantizers (mx_quant_kernel.py) at the 8B step's shapes, as CUDA graph
    replays, each against its reference (bit for bit) first; GB/s counts `mx_quant_kernel.ideal_bytes`
    (each input read once, NVFP4 once more for its tensor maximum, each output written once) and is set
    against the measured device-to-device copy bandwidth (bytes read + written), the goal being 80 % of
    it. The quantizers run on any GPU; the matmuls that read their output need Blackwell (sm_100 and
    newer), which this command does not time. Last, the MXFP8 producers against the pairs they replace:
    RMSNorm then the quantizer at the hidden size, SwiGLU then the quantizer (both copies) at the MLP width,
    each against the one kernel that writes the tensor and its copies (fp8_producers_kernel's
    rmsnorm_quantize_mxfp8 and swiglu_quantize_mxfp8; GB/s from the bytes each must move). Prints the table
    and saves results/mx_quant_<gpu>.json
    (not with `smoke`: its tiny shape's times would replace the file of the 8B shapes' run)."""
    import json

    from tabulate import tabulate

    import mx_quant_kernel as mq

    gpu = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton's interpreter)"
    copy = copy_bandwidth_gbs() if ON_GPU else None
    signs = mq.hadamard_signs(0)
    cases = (  # (name, copies, run(x), reference(x)): the tuples each returns, compared bit for bit
        ("mxfp8, copy along K", 1, "mxfp8", lambda x: mq.quantize_mxfp8(x, True, False),
         lambda x: mq.quantize_mxfp8_ref(x) + (None, None)),
        ("mxfp8, both copies", 2, "mxfp8", lambda x: mq.quantize_mxfp8(x, True, True),
         lambda x: mq.quantize_mxfp8_ref(x) + mq.quantize_mxfp8_t_ref(x)),
        ("nvfp4, copy along K (+ amax)", 1, "nvfp4", lambda x: mq.quantize_nvfp4(x, True, False)[:4],
         lambda x: mq.nvfp4_ref(x)[:2] + (None, None)),
        ("nvfp4, both, SR + Hadamard (+ amax)", 2, "nvfp4",
         lambda x: mq.quantize_nvfp4(x, True, True, stochastic=True, seed=7, hadamard=signs)[:4],
         lambda x: mq.nvfp4_ref(x, True, 7, False, signs)[:4]),
    )
    print(f"{gpu}: " + (f"device-to-device copy {copy:.0f} GB/s (read + written); " if copy else "")
          + "CUDA graph replays, us per call (median)")
    rows = []
    for m, k in (MX_SMOKE_SHAPES if smoke else MX_SHAPES):
        x = torch.randn(m, k, generator=generator(m, k)).to(DEVICE, torch.bfloat16)
        for name, copies, fmt, run, reference in cases:
            for ours, ref in zip(run(x), reference(x)):  # correctness before timing
                if ref is not None and not torch.equal(ours.contiguous().view(torch.uint8),
                                                       ref.contiguous().view(torch.uint8)):
                    print(f"{name} at {m} x {k}: the kernel's bytes differ from the reference: not timed",
                          file=sys.stderr)
                    return 1
            _time_rows(m, k, rows, copy, ((name, lambda: run(x), mq.ideal_bytes(m, k, torch.bfloat16, fmt, copies)),))
    # The MXFP8 producers (fp8_producers_kernel) against the pairs they replace, the kernel that writes the
    # tensor and then the quantizer reading it back: the norm at the hidden size, the SwiGLU at the MLP width
    for (m, k), (m2, k2) in ((MX_SMOKE_SHAPES * 2,) if smoke else (MX_SHAPES,)):
        if _mx_norm_rows(m, k, rows, copy) or _mx_swiglu_rows(m2, k2, rows, copy):
            return 1
    print(tabulate([(r["quantizer"], f"{r['rows']} x {r['cols']}", f"{r['us']:.1f}", f"{r['bytes'] / 1e6:.1f}",
                     f"{r['gbs']:.0f}", f"{r['pct_copy']:.0f}" if r["pct_copy"] else "-") for r in rows],
                   headers=["quantizer", "shape", "us", "MB (ideal)", "GB/s", "% copy"], tablefmt="github"))
    if not ON_GPU:
        print("(CPU: Triton's interpreter ran each quantizer once; the times say nothing about a GPU)")
        return 0
    print("(the block-scaled matmuls that read these copies need Blackwell: not timed here)")
    if smoke:
        print("(--smoke: tiny shapes, which say nothing of the 8B step's; not saved)")
        return 0
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"mx_quant_{gpu.replace(' ', '_')}.json"
    write_atomic(path, json.dumps(dict(gpu=gpu, torch=torch.__version__, copy_gbs=copy, rows=rows), indent=1) + "\n")
    print(f"Saved {path.relative_to(RESULTS.parent)}")
    return 0


# --mx-quant --tune: the launch settings tried, (BLOCK_M, BLOCK_K, num_warps) for MXFP8 (tiles of 4K-16K values)
# and (BLOCK_K, num_warps) for NVFP4 (its BLOCK_M also pads the transposed copy: fixed). One and two warps too:
# with four, a tile's 32 rows span the warps, so each scale of the transposed copy is a maximum across warps
# (through shared memory, between barriers); with one warp it stays in registers and shuffles
MX_TUNE = [(m, k, w) for m in (32, 64, 128) for k in (32, 64, 128, 256) if 4096 <= m * k <= 16384
           for w in (1, 2, 4, 8)]
NV_TUNE = [(k, w) for k in (32, 64, 128, 256) for w in (1, 2, 4, 8)]


def mx_quant_tune(smoke: bool) -> int:
    """Time each quantizer of `mx_quant` under each launch setting of MX_TUNE / NV_TUNE at the 8B step's shapes,
    every setting's bytes checked against the reference first (a setting that differs is reported and not
    timed); print every row as it is timed, then the fastest setting per quantizer and shape with its share of
    the copy bandwidth, and save results/mx_quant_tune_<gpu>.json (not with `smoke`). The settings in force are
    mx_quant_kernel's MX_CONFIG and NV_CONFIG, and fp8_producers_kernel's SWIGLU_MX_CONFIG (the SwiGLU
    producer, timed at the MLP width against the bytes of the pair it replaces)."""
    import json

    import fp8_producers_kernel as f8p
    import mx_quant_kernel as mq
    import swiglu_kernel

    gpu = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton's interpreter)"
    copy = copy_bandwidth_gbs() if ON_GPU else None
    signs = mq.hadamard_signs(0)
    print(f"{gpu}: " + (f"device-to-device copy {copy:.0f} GB/s; " if copy else "")
          + "each setting checked bit for bit, then timed as CUDA graph replays (us, median)", flush=True)
    mx_cases = (("mxfp8, copy along K", (True, False), 1), ("mxfp8, both copies", (True, True), 2))
    nv_cases = (("nvfp4, copy along K (+ amax)", dict(), 1),
                ("nvfp4, both, SR + Hadamard (+ amax)", dict(stochastic=True, seed=7, hadamard=signs), 2))
    saved_mx, saved_nv, saved_swiglu = dict(mq.MX_CONFIG), dict(mq.NV_CONFIG), f8p.SWIGLU_MX_CONFIG
    shapes = MX_SMOKE_SHAPES if smoke else MX_SHAPES
    mx_settings = MX_TUNE[::len(MX_TUNE) - 1] if smoke else MX_TUNE  # the smoke: the first and the last
    nv_settings = NV_TUNE[::len(NV_TUNE) - 1] if smoke else NV_TUNE
    rows, bad = [], 0
    try:  # each setting in force for its own copies only, the others as saved
        for m, k in shapes:
            x = torch.randn(m, k, generator=generator(m, k)).to(DEVICE, torch.bfloat16)
            ref = mq.quantize_mxfp8_ref(x) + mq.quantize_mxfp8_t_ref(x)
            for name, (r, c), copies in mx_cases:
                want = [t for t, keep in zip(ref, (r, r, c, c)) if keep]
                for setting in mx_settings:
                    mq.MX_CONFIG = {**saved_mx, (r, c): setting}
                    bad += _tune_row(rows, name, m, k, setting, copy, lambda: mq.quantize_mxfp8(x, r, c), want,
                                     mq.ideal_bytes(m, k, torch.bfloat16, "mxfp8", copies))
            for name, kw, copies in nv_cases:
                both = copies == 2
                ref = mq.nvfp4_ref(x, kw.get("stochastic", False), kw.get("seed", 0), False, kw.get("hadamard"))
                want = list(ref[:4 if both else 2])
                for setting in nv_settings:
                    mq.NV_CONFIG = {**saved_nv, (True, both): setting}
                    bad += _tune_row(rows, name, m, k, setting, copy,
                                     lambda: mq.quantize_nvfp4(x, True, both, **kw)[:4], want,
                                     mq.ideal_bytes(m, k, torch.bfloat16, "nvfp4", copies))
        # The SwiGLU producer (fp8_producers_kernel.SWIGLU_MX_CONFIG) at the MLP width, against the pair's bytes
        m, k = shapes[-1]
        gate_up = torch.randn(m, 2 * k, generator=generator(m, 2 * k)).to(DEVICE, torch.bfloat16)
        gate, up = swiglu_kernel.halves(gate_up)
        h = swiglu_kernel.swiglu_forward(gate, up)
        want = [h, *mq.quantize_mxfp8_ref(h), *mq.quantize_mxfp8_t_ref(h)]
        for setting in mx_settings:
            f8p.SWIGLU_MX_CONFIG = setting
            bad += _tune_row(rows, "swiglu writing mxfp8 (fused)", m, k, setting, copy,
                             lambda: f8p.swiglu_quantize_mxfp8(gate, up), want,
                             f8p.swiglu_mxfp8_ideal_bytes(m, k, torch.bfloat16))
    finally:
        mq.MX_CONFIG, mq.NV_CONFIG = saved_mx, saved_nv
        f8p.SWIGLU_MX_CONFIG = saved_swiglu
    best = {}
    for row in rows:
        key = (row["quantizer"], row["rows"], row["cols"])
        if row["us"] is not None and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    print("\nFastest setting per quantizer and shape (in force: MX_CONFIG "
          f"{saved_mx}, NV_CONFIG {saved_nv}, SWIGLU_MX_CONFIG {saved_swiglu}):")
    for (name, m, k), row in best.items():
        share = f", {row['pct_copy']:.0f} % of copy" if row["pct_copy"] else ""
        print(f"  {name} at {m} x {k}: {row['setting']} {row['us']:.1f} us, {row['gbs']:.0f} GB/s{share}")
    if bad:
        print(f"{bad} setting(s) wrote other bytes than the reference: not timed", file=sys.stderr)
    if ON_GPU and not smoke:
        path = RESULTS / f"mx_quant_tune_{gpu.replace(' ', '_')}.json"
        RESULTS.mkdir(exist_ok=True)
        write_atomic(path, json.dumps(dict(gpu=gpu, torch=torch.__version__, copy_gbs=copy, rows=rows), indent=1) + "\n")
        print(f"Saved {path.relative_to(RESULTS.parent)}")
    return 1 if bad else 0


def _tune_row(rows: list, name: str, m: int, k: int, setting, copy, run, want, nbytes) -> int:
    """One setting of `mx_quant_tune`: its output against `want` bit for bit, then timed; 1 when it differed."""
    got = [t for t in run() if t is not None]
    same = len(got) == len(want) and all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                                         for a, b in zip(got, want))
    us = gbs = None
    if same:
        (us, _, _), _ = timed_graph(run)
        gbs = nbytes / us / 1e3
    rows.append(dict(quantizer=name, rows=m, cols=k, setting=list(setting), us=us, gbs=gbs,
                     pct_copy=100 * gbs / copy if copy and gbs else None, same_bytes=same))
    print(f"  {name} at {m} x {k}, {setting}: " + (f"{us:.1f} us, {gbs:.0f} GB/s" if same else
                                                   "bytes differ from the reference: not timed"), flush=True)
    return 0 if same else 1


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
    p.add_argument("--mx-quant", action="store_true",
                   help="time the MXFP8 and NVFP4 quantizers at LLaMA 3.1 8B's shapes against copy bandwidth (GPU; "
                        "with --smoke, tiny shapes, checked and run but not saved: in the interpreter on a CPU)")
    args = p.parse_args()
    if args.mx_quant:
        if not ON_GPU and not args.smoke:
            print("--mx-quant times the quantizers at LLaMA 3.1 8B's shapes, which need a CUDA GPU (or add --smoke)",
                  file=sys.stderr)
            return 2
        return mx_quant_tune(args.smoke) if args.tune else mx_quant(args.smoke)
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
    sys.exit(signals.run_main(main, "the kernels measured before it are in results/benchmark_*; the one running "
                                     "was not saved"))
