"""The whole playbook in one command (`make run`): profile, test, fine-tune, re-profile, compare.

    $ python walkthrough.py                       # picks the largest preset this machine fits
    $ python walkthrough.py --model meta-llama/Llama-3.1-8B --batch-size 1 --seq-len 512

Steps, each one a script of this repository that you can also run by itself:
  1. profile_baseline.py                  where the GPU time of a training step goes
  2. rmsnorm_test.py, cross_entropy_test.py, swiglu_test.py, linear_cross_entropy_test.py,
     rope_test.py                         the fused kernels are correct
  3. finetune_baseline.py                 plain Hugging Face training: tokens/s, peak memory
  4. finetune_optimized.py                the same loop with the Triton kernels
  5. profile_baseline.py --use-custom-rmsnorm --use-custom-flce --use-custom-swiglu --use-custom-rope
                                          what changed
  6. a side-by-side table of steps 3 and 4

Without a GPU everything runs on the CPU with the llama-tiny preset (kernels through Triton's
interpreter): a few minutes, to see the workflow, not the speed. With a GPU the LLaMA 3.1 8B preset
is used (random weights: the timing and memory of the real model), at batch 4 x 2048 where ~120 GB
are free and at 1 x 512 on an 80 GB card; smaller cards get fewer layers.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def default_workload():
    """(model args, description) for the largest preset this machine fits."""
    if not torch.cuda.is_available():
        return ["--model", "llama-tiny", "--steps", "20"], "CPU: llama-tiny preset, 2 x 64 tokens"
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    if gib >= 120:
        return ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048"], f"{gib:.0f} GiB GPU: full 8B, 4 x 2048"
    if gib >= 70:
        return ["--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "512"], f"{gib:.0f} GiB GPU: full 8B, 1 x 512"
    layers = max(2, int(32 * gib / 80))
    return (["--model", "llama-3.1-8b", "--num-layers", str(layers), "--batch-size", "1", "--seq-len", "512"],
            f"{gib:.0f} GiB GPU: 8B preset cut to {layers} layers, 1 x 512")


def step(title: str, cmd: list[str]) -> None:
    print(f"\n{'=' * 100}\n{title}\n$ {' '.join(['python'] + cmd[1:])}\n{'=' * 100}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=HERE).returncode
    if rc != 0:
        raise SystemExit(f"\nwalkthrough: '{' '.join(cmd[1:])}' failed (exit code {rc}); stopping here.")
    print(f"[{title.split(':')[0]} took {time.perf_counter() - t0:.0f} s]")


def side_by_side(base_tag: str, opt_tag: str) -> None:
    from tabulate import tabulate

    base = json.loads((RESULTS / f"{base_tag}.json").read_text())
    opt = json.loads((RESULTS / f"{opt_tag}.json").read_text())
    rows = []
    for key, better in (("step time median (ms)", "lower"), ("tokens/s (job)", "higher"),
                        ("MFU (% of bf16 peak)", "higher"), ("peak GPU memory (GB)", "lower"),
                        ("final loss", None)):
        b, o = base["summary"].get(key), opt["summary"].get(key)
        change = "-" if b in (None, 0) or o is None or better is None else f"{o / b:.2f}x"
        fmt = (lambda v: "n/a" if v is None else (f"{v:.4f}" if "loss" in key else f"{v:,.1f}"))
        rows.append((key, fmt(b), fmt(o), change))
    print(f"\nBaseline vs optimized ({base['model']}, {base['batch_size']} x {base['seq_len']} tokens, {base['gpu']}):")
    if "CPU" in base["gpu"]:
        print("(CPU run: the kernels ran in Triton's interpreter, so the timings compare nothing real; "
              "the final loss row shows that both runs learn the same thing.)")
    kernels = " + ".join(opt.get("kernels", [])) or "no kernels"
    print(tabulate(rows, headers=["", "baseline", f"optimized ({kernels})", "optimized / baseline"],
                   tablefmt="github"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", default=None)
    p.add_argument("--seq-len", default=None)
    p.add_argument("--num-layers", default=None)
    args = p.parse_args()
    workload, desc = default_workload()
    for flag in ("model", "batch_size", "seq_len", "num_layers"):  # the user's choices win
        value = getattr(args, flag)
        if value is not None:
            opt = "--" + flag.replace("_", "-")
            if opt in workload:
                i = workload.index(opt)
                del workload[i:i + 2]
            workload += [opt, str(value)]
            desc = "as given on the command line"
    print(f"Walkthrough workload: {desc}")
    py = sys.executable
    prof = [py, "profile_baseline.py"] + workload
    if "--steps" in prof:  # the profiler runs its own fixed schedule of steps
        i = prof.index("--steps")
        del prof[i:i + 2]
    step("Step 1: profile the baseline", prof)
    step("Step 2a: test the fused RMSNorm", [py, "rmsnorm_test.py"])
    step("Step 2b: test the fused cross-entropy", [py, "cross_entropy_test.py"])
    step("Step 2c: test the fused SwiGLU", [py, "swiglu_test.py"])
    step("Step 2d: test the fused linear cross-entropy", [py, "linear_cross_entropy_test.py"])
    step("Step 2e: test the fused RoPE", [py, "rope_test.py"])
    step("Step 3: fine-tune, baseline", [py, "finetune_baseline.py", *workload, "--tag", "walkthrough_baseline"])
    step("Step 4: fine-tune, optimized", [py, "finetune_optimized.py", *workload, "--tag", "walkthrough_optimized"])
    step("Step 5: profile again with the kernels",
         prof + ["--use-custom-rmsnorm", "--use-custom-flce", "--use-custom-swiglu", "--use-custom-rope"])
    side_by_side("walkthrough_baseline", "walkthrough_optimized")


if __name__ == "__main__":
    main()
