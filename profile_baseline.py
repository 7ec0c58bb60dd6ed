"""Profile LLaMA 3.1 8B training steps with torch.profiler: where does the GPU time go?

    $ python profile_baseline.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python profile_baseline.py --model llama-3.1-8b --use-custom-rmsnorm --use-custom-ce
    $ python profile_baseline.py --model llama-3.1-8b --use-custom-rmsnorm --use-custom-flce \
          --use-custom-swiglu --use-custom-rope      # every kernel of the playbook
    $ python profile_baseline.py            # no GPU: llama-tiny on the CPU (CPU time instead)

It runs the training loop of the fine-tuning scripts: warm-up steps first, outside the recorded
window (Triton compiles there, and the CUDA caching allocator settles), then a short profiler
schedule (1 step skipped, 1 step of profiler warm-up, 3 recorded). It prints a breakdown by
category, then the 20 GPU kernels with the most self time, and saves a Chrome trace that
https://ui.perfetto.dev opens.

How to read the categories: each GPU kernel is assigned by its name. Matrix multiplies (cuBLAS /
CUTLASS), attention (flash / memory-efficient SDPA), the optimizer (fused or multi-tensor AdamW)
and our Triton kernels have telling names. Generic PyTorch kernels do not say which module
launched them, so in the eager baseline only RMSNorm's pow, mean and rsqrt are counted as
RMSNorm, and only softmax / NLL as the loss; their multiplies and the fp32 upcast of the logits
land in "element-wise". The re-profile with the kernels shows how much of that column was theirs.
"""

import json
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from common import (RESULTS_DIR, Batches, base_parser, finish_args, is_out_of_memory, log, make_optimizer, oom_message,
                    setup_model, training_step)

CATEGORIES = [  # (category, pattern on the lower-cased GPU kernel or CPU op name); first match wins
    ("RMSNorm", r"_rmsnorm|rsqrt|pow_tensor|meanops|mean_kernel|aten::(pow|mean)\b"),
    ("loss", r"_cross_entropy|_scale_rows|softmax|nll_loss|cross_entropy"),
    ("SwiGLU", r"_swiglu|silu"),
    ("RoPE", r"_rope"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|optimizer"),
    ("attention", r"flash|fmha|attention|sdpa|efficient|cudnn"),
    ("matrix multiply", r"gemm|xmma|nvjet|cutlass|cublas|gemv|splitk|sm\d\d_|_mma|matmul|aten::(mm|bmm|addmm|linear)\b"),
    ("element-wise", r"elementwise|vectorized|unrolled|functor|copy|cat_|fill|silu|index|gather|scatter|embedding"
                     r"|aten::(mul|add|sub|div|neg|cat|lerp|sqrt|sum|zero)"),
]
WAIT, WARMUP, ACTIVE = 1, 1, 3


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def main():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--use-custom-rmsnorm", action="store_true", help="profile with the Triton RMSNorm")
    p.add_argument("--use-custom-ce", action="store_true", help="profile with the fused cross-entropy")
    p.add_argument("--use-custom-swiglu", action="store_true", help="profile with the fused SwiGLU")
    p.add_argument("--use-custom-flce", action="store_true",
                   help="profile with lm_head fused into the loss (instead of --use-custom-ce)")
    p.add_argument("--use-custom-rope", action="store_true", help="profile with the fused RoPE")
    args = p.parse_args()
    if args.steps is None:
        args.steps = WAIT + WARMUP + ACTIVE
    if args.use_custom_ce and args.use_custom_flce:
        raise SystemExit("error: choose one loss kernel: --use-custom-ce or --use-custom-flce")
    args = finish_args(args)
    kernels = {"rmsnorm": args.use_custom_rmsnorm, "cross_entropy": args.use_custom_ce,
               "swiglu": args.use_custom_swiglu, "flce": args.use_custom_flce, "rope": args.use_custom_rope}
    model, tok, desc = setup_model(args, kernels)
    data = Batches(args, model.config.vocab_size, tok)
    optimizer = make_optimizer(model, args)
    gpu = args.device.type == "cuda"

    try:
        log(f"Warm-up: {args.warmup_steps} steps outside the profiler ...")
        for step in range(args.warmup_steps):
            training_step(model, optimizer, data.get(step, args.device))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        log(f"Profiling {ACTIVE} training steps of {args.batch_size} x {args.seq_len} tokens ({desc}) ...")
        t0 = time.perf_counter()
        with profile(activities=activities, schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE)) as prof:
            for step in range(WAIT + WARMUP + ACTIVE):
                training_step(model, optimizer, data.get(args.warmup_steps + step, args.device))
                prof.step()
        if gpu:
            torch.cuda.synchronize()  # a sync point: make sure every kernel has been recorded
    except RuntimeError as err:  # OutOfMemoryError, or cuBLAS failing to allocate
        if not is_out_of_memory(err):
            raise
        raise SystemExit(oom_message(args, err)) from None
    log(f"Recorded in {time.perf_counter() - t0:.1f} s.")
    report(prof, args, kernels, gpu)


def _self_time_us(evt, gpu: bool) -> float:
    if not gpu:
        return evt.self_cpu_time_total
    t = getattr(evt, "self_device_time_total", None)  # torch >= 2.4; older: self_cuda_time_total
    return t if t is not None else evt.self_cuda_time_total


def report(prof, args, kernels, gpu):
    from tabulate import tabulate

    # User annotations (ProfilerStep#N, Optimizer.step#AdamW.step, record_function ranges) span
    # the kernels inside them: counting them too would count those kernels twice.
    events = [e for e in prof.key_averages() if not _is_annotation(e)]
    if gpu:  # kernel rows only: an aten op's self device time is its kernels' time (no double count)
        rows = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA") and _self_time_us(e, True) > 0]
    else:
        rows = [e for e in events if _self_time_us(e, False) > 0]
    total = sum(_self_time_us(e, gpu) for e in rows)
    if total <= 0:
        raise SystemExit("error: the profiler recorded no GPU kernel time. Is CUDA profiling (CUPTI) available "
                         "in this environment, and did the steps run on the GPU?")
    unit = "GPU" if gpu else "CPU"
    per_step = total / ACTIVE / 1e3
    label = "+".join(k for k, v in kernels.items() if v) or "baseline"
    log(f"\nSelf {unit} time per training step: {per_step:.1f} ms ({label}, {args.model}, "
        f"{args.batch_size} x {args.seq_len} tokens){'' if gpu else ' -- CPU run: CPU time, not GPU time'}")

    by_cat = {}
    for e in rows:
        c = category(e.key)
        by_cat[c] = by_cat.get(c, 0.0) + _self_time_us(e, gpu)
    cat_rows = sorted(by_cat.items(), key=lambda kv: -kv[1])
    log(tabulate([(c, f"{t / ACTIVE / 1e3:.2f}", f"{100 * t / total:.1f}") for c, t in cat_rows],
                 headers=["category", "ms per step", "% of step"], tablefmt="github"))

    top = sorted(rows, key=lambda e: -_self_time_us(e, gpu))[:20]
    log(f"\nTop 20 {'GPU kernels' if gpu else 'operations'} by self {unit} time:")
    log(tabulate([(_short(e.key), category(e.key), f"{_self_time_us(e, gpu) / ACTIVE / 1e3:.3f}",
                   f"{100 * _self_time_us(e, gpu) / total:.1f}", e.count // ACTIVE)
                  for e in top], headers=["name", "category", "ms per step", "%", "calls per step"], tablefmt="github"))

    traces = RESULTS_DIR / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    path = traces / f"profile_{label}_{args.model.replace('/', '_')}_b{args.batch_size}_s{args.seq_len}.json"
    path.unlink(missing_ok=True)  # never leave a stale trace under the new name
    prof.export_chrome_trace(str(path))
    log(f"\nChrome trace: {path} (open it in https://ui.perfetto.dev)")
    summary = {"label": label, "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "unit": unit, "ms_per_step": per_step,
               "categories_ms_per_step": {c: t / ACTIVE / 1e3 for c, t in cat_rows},
               "top": [(e.key[:200], _self_time_us(e, gpu) / ACTIVE / 1e3, e.count // ACTIVE) for e in top]}
    out = RESULTS_DIR / f"profile_{label}_{args.model.replace('/', '_')}_b{args.batch_size}_s{args.seq_len}.json"
    out.write_text(json.dumps(summary, indent=1))
    log(f"Summary: {out}")


def _is_annotation(evt) -> bool:
    return bool(getattr(evt, "is_user_annotation", False)) or evt.key.startswith("ProfilerStep") or "#" in evt.key


def _short(name: str, width: int = 70) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


if __name__ == "__main__":
    main()
