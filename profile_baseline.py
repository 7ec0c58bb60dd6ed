"""Profile LLaMA 3.1 8B training steps with torch.profiler: where does the GPU time go?

    $ python profile_baseline.py --model llama-3.1-8b --batch-size 4 --seq-len 2048
    $ python profile_baseline.py --model llama-3.1-8b --kernels rmsnorm,cross_entropy
    $ python profile_baseline.py --model llama-3.1-8b --kernels default      # every kernel of the playbook
    $ python profile_baseline.py --steps 5 --timing-warmup-steps 3   # record 5 steps after 3 warm-up steps
    $ python profile_baseline.py            # no GPU: llama-tiny on the CPU (CPU time instead)

It runs the training step of the fine-tuning scripts (same flags, same step): --timing-warmup-steps
first (default 2), outside the recorded window (Triton compiles there, and the CUDA caching allocator
settles), then a short profiler schedule (1 step skipped, 1 step of profiler warm-up, then --steps
recorded, default 3). Options of the fine-tuning scripts that a profile has no use for (checkpoints,
the learning-rate schedule, evaluation, --epochs, logging) are refused, not ignored. It prints a
breakdown by category, then the 20 GPU kernels with the most self time, and saves a Chrome trace
that https://ui.perfetto.dev opens. Without --kernels it profiles the plain Hugging Face model.

How to read the categories: each GPU kernel is assigned by its name. Matrix multiplies (cuBLAS /
CUTLASS), attention (flash / memory-efficient / cuDNN SDPA), the optimizer (fused or multi-tensor
AdamW) and our Triton kernels have telling names. Generic PyTorch kernels do not say which module
launched them, so in the eager baseline only RMSNorm's pow, mean and rsqrt are counted as
RMSNorm, and only softmax / NLL as the loss; their multiplies and the fp32 upcast of the logits
land in "element-wise". The re-profile with the kernels shows how much of that column was theirs.
The attention backend SDPA picked is reported by name (the kernel names say which one ran).

Where the GPU waits: on a GPU the report also reads the saved trace for the gaps between consecutive
kernels of each recorded step and splits them into those where the next kernel was launched only after
the previous one had ended (the host was behind: Python, autograd and launch overhead) and the rest,
with the host operation that was running at each late launch. Many short kernels (FP8's quantizers,
small matmuls) make a step host-bound; fusing kernels or capturing the step in a CUDA graph is then the
fix, not faster kernels.
"""

import bisect
import dataclasses
import json
import re
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass

from playbook.runtime import signals
from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was run")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, schedule  # noqa: E402

from playbook.config import PROFILE, ExtraSection, RunConfig, make_parser, parse_config, refuse_unused
from playbook.model.registry import in_effect
from playbook.run import cuda_graph
from playbook.run.resume import check_output_folders
from playbook.run.start import build, run_errors, settle
from playbook.run.training import training_step
from core.process import log
from playbook.runtime.common import without_stderr_lines
from playbook.store.files import RESULTS_DIR, result_path, write_atomic
from playbook.runtime.time_left import running

CATEGORIES = [  # (category, pattern on the lower-cased GPU kernel or CPU op name); first match wins
    ("RMSNorm", r"_rmsnorm|rsqrt|pow_tensor|meanops|mean_kernel|aten::(pow|mean)\b"),
    ("loss", r"_cross_entropy|_scale_rows|softmax|nll_loss|cross_entropy|_jsd|_kl_div|kl_div"),
    ("SwiGLU", r"_swiglu|silu"),
    ("RoPE", r"_rope"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|optimizer"),
    ("FP8 casts", r"_quantize_rows|_quantize_cols|_quantize_tiles|fp8_quantize|nvfp4_quantize|_abs_max_partial|_transpose_bytes"),  # --fp8: the Triton quantizers, MXFP8's and NVFP4's too (and the FP8 base's byte transpose)
    ("attention", r"flash|fmha|attention|sdpa|efficient|cudnn"),
    ("matrix multiply", r"gemm|xmma|nvjet|cutlass|cublas|gemv|splitk|sm\d\d_|_mma|matmul|aten::(mm|bmm|addmm|linear)\b"),
    ("element-wise", r"elementwise|vectorized|unrolled|functor|copy|cat_|fill|silu|index|gather|scatter|embedding"
                     r"|aten::(mul|add|sub|div|neg|cat|lerp|sqrt|sum|zero)"),
]
ATTENTION_BACKENDS = [("cuDNN", r"cudnn"), ("flash", r"flash"), ("memory-efficient", r"fmha|efficient"),
                      ("math (unfused)", r"_scaled_dot_product_attention_math")]
# A faster GPU, by arithmetic: matrix multiplies and attention scale with the tensor-core rate, every
# other category (element-wise, casts, norms, the optimizer, the loss) with the memory bandwidth. A
# GB300-class GPU against the H200: ~2.5x the dense bf16 and FP8 matmul rate, ~1.5x the HBM bandwidth.
COMPUTE_BOUND = ("matrix multiply", "attention")
FASTER_GPU = {"name": "GB300-class", "matmul_x": 2.5, "bandwidth_x": 1.5}


def project(categories_ms: dict, host_ms: float | None, matmul_x: float, bandwidth_x: float) -> dict:
    """GPU ms per step on a GPU `matmul_x` times faster at compute-bound kernels and `bandwidth_x` times at
    the rest, and whether the host (its queue time as measured here) would still keep up with it."""
    gpu = sum(ms / (matmul_x if cat in COMPUTE_BOUND else bandwidth_x) for cat, ms in categories_ms.items())
    out = {"gpu_ms": gpu, "matmul_x": matmul_x, "bandwidth_x": bandwidth_x, "host_queue_ms": host_ms}
    if host_ms is not None:
        out["host_queue_share"] = host_ms / gpu
        out["gpu_bound"] = host_ms < gpu
    return out


WAIT, WARMUP = 1, 1  # profiler schedule: steps skipped, then steps of profiler warm-up, before --steps recorded
RECORDED_STEPS = 3  # --steps when not given

# Shared options a profile has no use for: refused when given, rather than silently ignored.
UNUSED = {
    "epochs": "--steps sets the recorded steps", "eval_fraction": "no evaluation runs", "eval_every": None,
    "lr_schedule": "a few steps are profiled, with no learning-rate schedule", "lr_warmup_steps": None,
    "warmup_ratio": None, "output_dir": "nothing but the summary and the trace is written", "save_every": None,
    "resume": None, "merge_lora": None, "save_total_limit": None, "overwrite_output_dir": None,
    "eval_dataset": None, "log_every": "the profile is printed at the end", "report_to": None,
    "sample_prompts": "a profile measures steps; chat.py answers prompts", "load_best_model_at_end": None,
    "early_stopping_patience": None, "early_stopping_threshold": None,
}


@dataclass(frozen=True)
class ProfileSection(ExtraSection):
    """profile_baseline.py's part of the command line (config.make_parser's `extra`): what --steps and
    --timing-warmup-steps mean here, and the refusal of the shared options a profile does not use."""

    unused = UNUSED  # (config.unused_options)
    recorded_steps: int  # --steps: the steps the profiler records

    @staticmethod
    def add_arguments(parser) -> None:
        for dest, default, help in (
                ("steps", None, f"training steps recorded by the profiler, after {WAIT} skipped and {WARMUP} of "
                                f"profiler warm-up (default {RECORDED_STEPS})"),
                ("warmup_steps", 2, "steps run before the profiler starts (Triton compiles, the allocator settles)")):
            action = next(action for action in parser._actions if action.dest == dest)
            action.default, action.help = default, help

    @classmethod
    def from_args(cls, a, parser) -> "ProfileSection":
        refuse_unused(a, parser, "profile_baseline.py", UNUSED)
        return cls(recorded_steps=a.steps or RECORDED_STEPS)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def make_profile_parser():
    """The shared parser (playbook.config.make_parser) with the profile's section."""
    return make_parser(__doc__.splitlines()[0], kernels_default=(), extra=ProfileSection)


def parse_args(argv=None):
    """The run's RunConfig, every argument checked (one line and exit code 2 for a wrong one)."""
    return parse_config(make_profile_parser(), PROFILE, argv)


def main():
    from playbook.runtime.setup_check import check_or_exit

    check_or_exit()
    cfg = parse_args()  # its own count of steps: --steps are the recorded ones
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                steps=cfg.extra.recorded_steps))  # the summary's config says what ran
    gpu, active = cfg.on_gpu, cfg.training.steps

    graphed = None  # the captured step, once the warm-up has run (playbook/run/cuda_graph.py)

    def step(i):
        batches = [data.batch(i * cfg.training.grad_accum + j, cfg.run.device) for j in range(cfg.training.grad_accum)]

        def eager(mb):
            return training_step(model, optimizer, mb, cfg.training.max_grad_norm)

        with running(f"step {i + 1} of {cfg.training.warmup_steps + WAIT + WARMUP + active}"):  # (a long one says so)
            return graphed.run(batches, eager) if graphed is not None else eager(batches)

    check_output_folders(cfg)  # results/ can be written (where not, one line naming PLAYBOOK_RESULTS_DIR), before
    # any model is built, not after the run
    cfg = settle(cfg)  # the run's RunConfig from here on: the memory plan checked, the rounding decided
    with run_errors(cfg, "nothing was recorded"):
        built = build(cfg)
        model, model_name, desc, data, optimizer = built.model, built.model_name, built.description, built.data, \
            built.optimizer
        kernel_report, blocker = built.kernel_report, built.blocker
        if blocker is None and cfg.training.warmup_steps:
            graphed = cuda_graph.GraphedStep(
                lambda mb: training_step(model, optimizer, mb, cfg.training.max_grad_norm, zero_grad=False),
                [data.batch(j, cfg.run.device) for j in range(cfg.training.grad_accum)], compiled=cfg.model.compile)
        log(f"Warm-up: {cfg.training.warmup_steps} steps outside the profiler ...")
        for i in range(cfg.training.warmup_steps):
            step(i)
        if graphed is not None:
            failed = graphed.capture(optimizer)
            if failed is not None:
                log(f"CUDA graphs: the capture failed ({failed}); the profiled steps are queued eagerly")
                graphed = None
            else:
                log("CUDA graphs: the profiled steps are replays of the captured step (--cuda-graphs off profiles "
                    "the eager steps, where the host's launches show)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        log(f"Profiling {active} training steps of {cfg.training.grad_accum} x {cfg.data.batch_size} x {cfg.data.seq_len} tokens (micro-batches "
            f"x sequences x tokens each; {desc}) ...")
        t0 = time.perf_counter()
        wall, queued = [], []  # seconds per recorded step: until the GPU finished it; until the host had queued it
        # One cycle of the schedule (repeat=1). Left out of the output: Kineto's "USDT: profiler_start /
        # profiler_stop" notices (its other lines pass), and the warning that the profiler "clears events at the
        # end of each cycle", which torch 2.11 gives even for one cycle (fixed after it: pytorch/pytorch#180387).
        with without_stderr_lines("USDT:"), warnings.catch_warnings(), \
                profile(activities=activities, schedule=schedule(wait=WAIT, warmup=WARMUP, active=active, repeat=1)) as prof:
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
            for i in range(WAIT + WARMUP + active):
                start = time.perf_counter()
                step(cfg.training.warmup_steps + i)
                if i >= WAIT + WARMUP:
                    queued.append(time.perf_counter() - start)  # the host's time to queue the step (no sync yet)
                if gpu:
                    # Wait for the step's last kernel before the profiler moves on: without this the
                    # GPU still runs the previous step's backward when a window opens, and a window
                    # of "3 steps" held ~13% more kernels than 3 steps launch.
                    torch.cuda.synchronize()
                if i >= WAIT + WARMUP:
                    wall.append(time.perf_counter() - start)
                prof.step()
    log(f"Recorded in {time.perf_counter() - t0:.1f} s.")
    mode = "CUDA graph replays" if graphed is not None else f"eager ({blocker or 'the capture failed'})"
    report(prof, cfg, model_name, kernel_report, gpu, sorted(wall)[len(wall) // 2] * 1e3,
           sorted(queued)[len(queued) // 2] * 1e3, mode)


def _self_time_us(evt, gpu: bool) -> float:
    if not gpu:
        return evt.self_cpu_time_total
    t = getattr(evt, "self_device_time_total", None)  # torch >= 2.4; older: self_cuda_time_total
    return t if t is not None else evt.self_cuda_time_total


def report(prof, cfg: RunConfig, model_name, kernel_report, gpu, wall_ms: float | None = None,
           host_ms: float | None = None,
           mode: str | None = None):
    from tabulate import tabulate

    # User annotations (ProfilerStep#N, Optimizer.step#AdamW.step, record_function ranges) span
    # the kernels inside them: counting them too would count those kernels twice.
    active = cfg.training.steps  # the recorded steps
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
    per_step = total / active / 1e3
    used = in_effect(kernel_report, cfg.training.optimizer, cfg.model.lora_r)
    label = "+".join(used) or "baseline"
    cpu_note = " -- CPU run: " + ("the kernels' CPU time in Triton's interpreter and PyTorch's CPU operators"
                                  if used else "PyTorch's CPU operators") + ", not GPU time"
    log(f"\nSelf {unit} time per training step: {per_step:.1f} ms ({label}, {model_name}, "
        f"{cfg.training.grad_accum} x {cfg.data.batch_size} x {cfg.data.seq_len} tokens: micro-batches x sequences x tokens each)"
        f"{'' if gpu else cpu_note}")
    if gpu and wall_ms:
        # the profiler slows the host's launches, so this idle time is an upper bound of the real one
        log(f"Wall time per profiled step: {wall_ms:.1f} ms (median of {active}, under the profiler); the GPU "
            f"ran no kernel for {max(0.0, wall_ms - per_step):.1f} ms of it")
        if host_ms:
            log(f"Host queue per profiled step: {host_ms:.1f} ms of the {wall_ms:.1f} ms (median, {mode}; the profiler "
                f"slows the host's launches, so the fine-tuning summary's 'host queue median (ms)' is the figure without it)")

    by_cat = {}
    for e in rows:
        c = category(e.key)
        by_cat[c] = by_cat.get(c, 0.0) + _self_time_us(e, gpu)
    cat_rows = sorted(by_cat.items(), key=lambda kv: -kv[1])
    log(tabulate([(c, f"{t / active / 1e3:.2f}", f"{100 * t / total:.1f}") for c, t in cat_rows],
                 headers=["category", "ms per step", "% of step"], tablefmt="github"))
    backend = attention_backend(rows)
    log(f"Attention backend (from the kernel names): {backend}")
    projection = None
    if gpu:
        projection = project({c: t / active / 1e3 for c, t in cat_rows}, host_ms, FASTER_GPU["matmul_x"],
                             FASTER_GPU["bandwidth_x"])
        verdict = ("" if host_ms is None else
                   f"; host queue {host_ms:.1f} ms = {100 * projection['host_queue_share']:.0f}% of it: "
                   + ("the GPU stays the bottleneck" if projection["gpu_bound"] else "the GPU would wait for the host"))
        log(f"On a {FASTER_GPU['name']} GPU ({FASTER_GPU['matmul_x']}x the matmul rate, {FASTER_GPU['bandwidth_x']}x "
            f"the memory bandwidth), by arithmetic from these categories: {projection['gpu_ms']:.1f} ms of GPU work "
            f"per step{verdict}")

    top = sorted(rows, key=lambda e: -_self_time_us(e, gpu))[:20]
    log(f"\nTop 20 {'GPU kernels' if gpu else 'operations'} by self {unit} time:")
    log(tabulate([(_short(e.key), category(e.key), f"{_self_time_us(e, gpu) / active / 1e3:.3f}",
                   f"{100 * _self_time_us(e, gpu) / total:.1f}", e.count // active)
                  for e in top], headers=["name", "category", "ms per step", "%", "calls per step"], tablefmt="github"))

    tag = cfg.output.tag or f"profile_{label}_{model_name.replace('/', '_')}_b{cfg.data.batch_size}_s{cfg.data.seq_len}"
    out = result_path(tag, ".json", cfg.output.overwrite)
    trace = RESULTS_DIR / "traces" / f"{out.stem}.trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.unlink(missing_ok=True)  # never leave a stale trace under the new name
    try:
        prof.export_chrome_trace(str(trace))
    except OSError as err:  # a full disk: no half-written trace is left, and the error names it
        trace.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(trace)) from err
    log(f"\nChrome trace: {trace} (open it in https://ui.perfetto.dev)")
    gaps = launch_gaps(json.loads(trace.read_text())) if gpu else None
    if gaps:
        log(f"Gaps between kernels per recorded step: {gaps['late_ms']:.1f} ms where the next kernel was launched only "
            f"after the previous one ended (the host was behind), {gaps['other_ms']:.1f} ms other")
        log(tabulate([(op, f"{ms:.2f}", f"{n:.0f}") for op, ms, n in gaps["late_by_op"][:8]],
                     headers=["host op at the late launch", "ms per step", "late launches per step"], tablefmt="github"))
    summary = {"label": label, "model": model_name, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
               "grad_accum": cfg.training.grad_accum, "recorded_steps": active, "unit": unit, "ms_per_step": per_step, "wall_ms_per_step": wall_ms if gpu else None,
               "host_queue_ms_per_step": host_ms if gpu else None, "step_mode": mode,
               "attention_backend": backend, "projection": projection and {**FASTER_GPU, **projection},
               "categories_ms_per_step": {c: t / active / 1e3 for c, t in cat_rows},
               "top": [(e.key[:200], _self_time_us(e, gpu) / active / 1e3, e.count // active) for e in top],
               "launch_gaps": gaps,
               "config": cfg.as_dict()}
    if out.name != f"{tag}.json":
        log(f"results/{tag}.json exists: writing {out.name} instead (--overwrite replaces it)")
    write_atomic(out, json.dumps(summary, indent=1))
    log(f"Summary: {out}")


def launch_gaps(trace: dict) -> dict | None:
    """Gaps between consecutive GPU kernels inside the recorded steps of a Chrome trace (as exported by
    torch.profiler), averaged per step: `late_ms` where the next kernel's launch call ended after the
    previous kernel had finished (the GPU waited for the host), `other_ms` the rest, and `late_by_op`:
    [(outermost host op running at the late launch, ms per step, launches per step)], largest first.
    None when the trace holds no kernel inside a ProfilerStep."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    steps = [e for e in spans if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep")]
    host = defaultdict(list)  # thread -> its outermost host ops, in time order
    for e in sorted((e for e in spans if e.get("cat") in ("cpu_op", "user_annotation")
                     and not e.get("name", "").startswith("ProfilerStep")), key=lambda e: e["ts"]):
        ops = host[e["tid"]]
        if not ops or e["ts"] >= ops[-1]["ts"] + ops[-1]["dur"]:
            ops.append(e)
    starts = {tid: [e["ts"] for e in ops] for tid, ops in host.items()}

    def running(launch) -> str:
        ops = host.get(launch["tid"], [])
        i = bisect.bisect_right(starts.get(launch["tid"], []), launch["ts"]) - 1
        return ops[i]["name"] if i >= 0 and ops[i]["ts"] + ops[i]["dur"] >= launch["ts"] else "(no op)"

    kernel_starts = [k["ts"] for k in kernels]
    late, other, by_ms, by_n, n_steps = 0.0, 0.0, Counter(), Counter(), 0
    for step in steps:  # the kernels that start inside the step: a slice of the time-sorted list
        inside = kernels[bisect.bisect_left(kernel_starts, step["ts"]):
                         bisect.bisect_left(kernel_starts, step["ts"] + step["dur"])]
        n_steps += bool(inside)
        for a, b in zip(inside, inside[1:]):
            end = a["ts"] + a["dur"]
            gap = b["ts"] - end
            if gap <= 0:
                continue
            launch = launches.get(b.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] + launch["dur"] > end:
                late += gap
                op = running(launch)
                by_ms[op] += gap
                by_n[op] += 1
            else:
                other += gap
    if not n_steps:
        return None
    return {"late_ms": late / n_steps / 1e3, "other_ms": other / n_steps / 1e3,
            "late_by_op": [(op, ms / n_steps / 1e3, by_n[op] / n_steps) for op, ms in by_ms.most_common()]}


def attention_backend(rows) -> str:
    """Which SDPA implementation ran, read off the recorded kernel / op names."""
    names = " ".join(e.key.lower() for e in rows)
    found = [name for name, pattern in ATTENTION_BACKENDS if re.search(pattern, names)]
    return found[0] if found else "not identified"


def _is_annotation(evt) -> bool:
    return bool(getattr(evt, "is_user_annotation", False)) or evt.key.startswith("ProfilerStep") or "#" in evt.key


def _short(name: str, width: int = 70) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


if __name__ == "__main__":
    # from here on, Ctrl-C raises KeyboardInterrupt (main's own handling); a full disk is one line
    signals.run_main(main, "the profile's files written before it are complete")
