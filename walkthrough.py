"""The whole playbook in one command (`make run`): profile, test, fine-tune, re-profile, compare.

    $ python walkthrough.py                       # picks a workload that shows the lesson on this machine
    $ python walkthrough.py --model meta-llama/Llama-3.1-8B --batch-size 2 --seq-len 2048
    $ python walkthrough.py --kernel-tests rmsnorm,rope  # step 2 with these kernel test files only

Each step is a script of this repository that you can also run by itself; before it runs, the
walkthrough says what it shows and what to look at, and after it, the one number that matters.
  1. profile_baseline.py                   where the time of a training step goes
  2. <kernel>_test.py for every kernel     the fused kernels are correct (a short report per kernel; the
                                           full one in results/walkthrough_tests_<kernel>.txt)
  3. finetune_baseline.py                  plain Hugging Face training on real text: tokens/s, memory, loss
  4. finetune_optimized.py                 the same loop with the Triton kernels
  5. profile_baseline.py --kernels default what changed in the step
  6. a side-by-side table of steps 3 and 4, and the loss curves (PNG)

Without a GPU everything runs on the CPU with the llama-tiny preset (kernels through Triton's
interpreter): a few minutes, to see the workflow and the loss falling, not the speed. With a GPU
the LLaMA 3.1 8B architecture is used (random weights: the timing and memory of the real model)
at a size that shows what the kernels change: 4 x 2048 tokens where ~140 GB are free; on an 80 GB
card the same 4 x 2048, where the baseline runs out of memory and the optimized run fits.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import playbook  # imports no torch: the handler below is set before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    playbook.exit_on_ctrl_c_while_starting()

import torch  # noqa: E402

from playbook import registry  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
EXAMPLE_DATA = HERE / "examples" / "chat.jsonl"
KNOWN_GPUS = ("H100", "H200")  # GPUs with measured results in results/
# The profile categories of the work the default kernels replace (step 5 compares them with step 1).
KERNEL_CATEGORIES = ("RMSNorm", "loss", "SwiGLU", "RoPE", "element-wise")


def default_workload():
    """(arguments, description, lesson) for this machine."""
    data = ["--dataset", str(EXAMPLE_DATA.relative_to(HERE)), "--packing"]
    if not torch.cuda.is_available():
        return (data + ["--model", "llama-tiny", "--steps", "12", "--lr", "2e-3", "--batch-size", "2", "--seq-len", "256",
                        "--log-every", "5"],
                "CPU: llama-tiny preset, 2 x 256 tokens, 12 steps (an interpreter run: timings mean nothing)",
                "on a CPU both runs learn the same thing: compare the loss columns, not the speed")
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    big = data + ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--steps", "12", "--lr", "1e-4"]
    if gib >= 120:
        return big, f"{gib:.0f} GiB GPU: full 8B fine-tune, 4 x 2048 tokens", \
            "the kernels make each step faster and leaner at the same loss"
    if gib >= 70:
        # The chats read as raw text: no per-example attention mask, whose extra activations would not
        # fit next to the optimized run's ~81 GB on an 80 GB card.
        text = ["--data", str(EXAMPLE_DATA.relative_to(HERE))] + big[3:]
        return text, f"{gib:.0f} GiB GPU: full 8B fine-tune, 4 x 2048 tokens of the example file as raw text", \
            "at this size the baseline does not fit this GPU and the optimized run does"
    layers = max(2, int(32 * gib / 100))
    return (data + ["--model", "llama-3.1-8b", "--num-layers", str(layers), "--batch-size", "2", "--seq-len", "2048",
                    "--steps", "12", "--lr", "1e-4"],
            f"{gib:.0f} GiB GPU: the 8B architecture cut to {layers} layers, 2 x 2048 tokens",
            "a slice of the model, to fit this GPU: the ratios carry over, the absolute figures do not")


def banner(title: str, explain: str, cmd: list[str], env: dict | None = None) -> None:
    shown = [f"{k}={v}" for k, v in (env or {}).items()] + ["python"] + cmd[1:]
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}\n{explain}\n$ {' '.join(shown)}\n", flush=True)


def step(title: str, explain: str, cmd: list[str], may_fail_with: str | None = None, env: dict | None = None) -> bool:
    """Run one script (with `env` added to the environment); True when it succeeded. A failure stops the
    walkthrough unless its output holds `may_fail_with` (the lesson of that step, e.g. running out of memory)."""
    banner(title, explain, cmd, env)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=HERE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    sys.stderr.write(proc.stderr)
    print(f"[{title.split(':')[0]} took {time.perf_counter() - t0:.0f} s]")
    if proc.returncode == 0:
        return True
    if may_fail_with and may_fail_with in proc.stderr:
        print(f"-> this step failed as it can at this size ({may_fail_with}); the walkthrough goes on.")
        return False
    raise SystemExit(f"\nwalkthrough: '{' '.join(cmd[1:])}' failed (exit code {proc.returncode}); stopping here.")


def load(tag: str) -> dict | None:
    path = RESULTS / f"{tag}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def profile_line(tag: str) -> str:
    p = load(tag)
    if p is None:
        return "no profile"
    cats = sorted(p["categories_ms_per_step"].items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{c} {ms:.1f} ms" for c, ms in cats[:3])
    return f"{p['ms_per_step']:.1f} ms of {p['unit']} time per step ({top})"


def kernel_test(name: str, py: str) -> None:
    """Step 2 for one kernel: its test file as a script. The full report (every check) goes to
    results/walkthrough_tests_<name>.txt; the screen gets testkit's short one (TESTKIT_REPORT)."""
    report = (RESULTS / f"walkthrough_tests_{name}.txt").relative_to(HERE)
    step(f"Step 2 ({name}): test the fused {name} kernel",
         f"{registry.KERNELS[name]}.\nEach check compares the kernel with PyTorch and a float64 reference on the "
         "same inputs: 'max err'\nmust stay under 'tol' (at most 2x PyTorch's own error). Shown here: the counts, "
         "any failure with its\nfirst error line, and the check closest to its tolerance.\nEvery check is in "
         f"{report}.",
         [py, f"{name}_test.py"], env={"TESTKIT_REPORT": str(report)})


def category_changes(before_tag: str, after_tag: str) -> str:
    """The two profiles' categories side by side (ms per step), and what the kernels' rows did in total."""
    before, after = load(before_tag), load(after_tag)
    if before is None or after is None:
        return "no profile to compare"
    b, a = before["categories_ms_per_step"], after["categories_ms_per_step"]
    cats = sorted(set(b) | set(a), key=lambda c: -max(b.get(c, 0.0), a.get(c, 0.0)))
    lines = [f"   {'category':<16} {'step 1 (ms)':>12} {'step 5 (ms)':>12}"]
    lines += [f"   {c:<16} {b.get(c, 0.0):>12.1f} {a.get(c, 0.0):>12.1f}" for c in cats]
    kb = sum(b.get(c, 0.0) for c in KERNEL_CATEGORIES)
    ka = sum(a.get(c, 0.0) for c in KERNEL_CATEGORIES)
    verdict = "shrank" if ka < kb else "grew"
    lines.append(f"   the rows the kernels replace ({', '.join(KERNEL_CATEGORIES)}) {verdict}: {kb:.1f} -> {ka:.1f} ms "
                 f"per step" + ("" if ka < kb or torch.cuda.is_available() else
                                "\n   (on a CPU the kernels run in Triton's interpreter, far slower than PyTorch's CPU code)"))
    return "\n".join(lines)


def side_by_side(base: dict | None, opt: dict) -> None:
    from tabulate import tabulate

    rows = []
    for key, better in (("step time median (ms)", "lower"), ("host queue median (ms)", "lower"), ("tokens/s (job)", "higher"),
                        ("MFU (% of bf16 peak)", "higher"), ("peak GPU memory (GB)", "lower"),
                        ("first loss", None), ("final loss", None), ("final eval loss", None)):
        b = base["summary"].get(key) if base else None
        o = opt["summary"].get(key)
        change = "-" if b in (None, 0) or o is None or better is None else f"{o / b:.2f}x"
        fmt = (lambda v: "n/a" if v is None else (f"{v:.4f}" if "loss" in key else f"{v:,.1f}"))
        rows.append((key, fmt(b) if base else "out of memory", fmt(o), change))
    print(f"\nBaseline vs optimized ({opt['model']}, {opt['batch_size']} x {opt['seq_len']} tokens, {opt['gpu']}):")
    kernels = " + ".join(opt.get("kernels", [])) or "no kernels"
    print(tabulate(rows, headers=["", "baseline", f"optimized ({kernels})", "optimized / baseline"],
                   tablefmt="github"))
    if "CPU" in opt["gpu"]:
        print("(CPU run: the kernels ran in Triton's interpreter, so the timings compare nothing real; the loss "
              "rows show that both runs learn the same thing from the same text.)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", default=None)
    p.add_argument("--seq-len", default=None)
    p.add_argument("--num-layers", default=None)
    p.add_argument("--skip-kernel-tests", action="store_true",
                   help="leave out step 2 (the kernel test files), e.g. right after `make test` ran them")
    p.add_argument("--kernel-tests", default=",".join(registry.KERNEL_NAMES), metavar="NAMES",
                   help="the kernels whose test files step 2 runs, comma-separated (default: all: %(default)s)")
    args = p.parse_args()
    kernel_tests = [k for k in args.kernel_tests.split(",") if k]
    unknown = [k for k in kernel_tests if k not in registry.KERNEL_NAMES]
    if unknown:
        p.error(f"--kernel-tests: unknown {', '.join(unknown)} (known: {', '.join(registry.KERNEL_NAMES)})")
    workload, desc, lesson = default_workload()
    for flag in ("model", "batch_size", "seq_len", "num_layers"):  # the user's choices win
        value = getattr(args, flag)
        if value is not None:
            opt = "--" + flag.replace("_", "-")
            if opt in workload:
                i = workload.index(opt)
                del workload[i:i + 2]
            workload += [opt, str(value)]
            desc = "as given on the command line"
    print(f"Walkthrough workload: {desc}.\nThe lesson to look for: {lesson}.")
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if not any(k in name for k in KNOWN_GPUS):
            print(f"Note: results/ holds no figures from a {name} yet: what you see here will be the first.")
    py = sys.executable
    gpu = torch.cuda.is_available()
    overwrite = ["--overwrite"]
    prof = [py, "profile_baseline.py", *[w for i, w in enumerate(workload) if w != "--steps" and
                                         (i == 0 or workload[i - 1] != "--steps")], *overwrite]

    step("Step 1: profile the baseline",
         ("One training step of plain Hugging Face under torch.profiler, GPU time by category. Look at the\n"
          "category table: matrix multiplies lead (they are the model's real work), then attention and the\n"
          "optimizer; RMSNorm, the loss and the element-wise rows are the memory-bound glue that fused kernels\n"
          "can shrink." if gpu else
          "One training step of plain Hugging Face under torch.profiler, CPU time by category (no GPU here).\n"
          "Look at the category table: matrix multiplies, attention, the optimizer, and the RMSNorm, loss and\n"
          "element-wise rows that fused kernels replace. The baseline runs no Triton kernel: these are PyTorch's\n"
          "CPU operators, so the categories are those of a GPU profile but their shares are the CPU's."),
         prof + ["--tag", "walkthrough_profile_baseline"])
    print(f"-> the number: {profile_line('walkthrough_profile_baseline')}")

    if args.skip_kernel_tests:
        print(f"\n{'=' * 100}\nStep 2: the kernel tests: skipped (--skip-kernel-tests); `make test` runs them\n{'=' * 100}")
    RESULTS.mkdir(exist_ok=True)
    for name in () if args.skip_kernel_tests else kernel_tests:
        kernel_test(name, py)

    base_ok = step("Step 3: fine-tune, baseline",
                   "Plain Hugging Face + PyTorch on real text (examples/chat.jsonl, prompts masked from the loss).\n"
                   + ("Look at the loss falling from line to line, then at tokens/s and peak memory in the summary."
                      if gpu else "Look at the loss falling from line to line (tokens/s are the CPU's; there is "
                      "no GPU memory to measure)."),
                   [py, "finetune_baseline.py", *workload, "--tag", "walkthrough_baseline", *overwrite],
                   may_fail_with="out of GPU memory")
    base = load("walkthrough_baseline") if base_ok else None
    if base:
        s = base["summary"]
        print(f"-> the number: {s['tokens/s (job)']:,.0f} tokens/s, loss {s['first loss']:.3f} -> {s['final loss']:.3f}"
              + (f", peak {s['peak GPU memory (GB)']:.1f} GB" if s["peak GPU memory (GB)"] else ""))

    step("Step 4: fine-tune, optimized",
         f"The same loop, seed and data with the default kernels ({','.join(registry.DEFAULT_KERNELS)}).\n"
         + ("Look at the same three numbers: the loss must follow the baseline's; tokens/s up, peak memory down."
            if gpu else "The loss must follow the baseline's. The kernels run in Triton's interpreter here, so tokens/s\n"
            "fall far below the baseline's: on a CPU the loss is the result, not the speed."),
         [py, "finetune_optimized.py", *workload, "--tag", "walkthrough_optimized", *overwrite])
    opt = load("walkthrough_optimized")
    s = opt["summary"]
    if not gpu:  # interpreter speed says nothing: the loss is the number here
        print(f"-> the number: loss {s['first loss']:.3f} -> {s['final loss']:.3f}"
              + (f" (baseline: -> {base['summary']['final loss']:.3f})" if base else "")
              + "; tokens/s on a CPU are the Triton interpreter's, not a speed")
    else:
        print(f"-> the number: {s['tokens/s (job)']:,.0f} tokens/s"
              + (f" ({s['tokens/s (job)'] / base['summary']['tokens/s (job)']:.2f}x the baseline)" if base else
                 " (the baseline did not fit)")
              + (f", peak {s['peak GPU memory (GB)']:.1f} GB" if s["peak GPU memory (GB)"] else ""))

    step("Step 5: profile again with the kernels",
         "The same profile with every kernel; the table after it sets each category beside step 1's. On a GPU\n"
         "the RMSNorm, loss, SwiGLU and element-wise rows shrink (the logits are never built), leaving mostly\n"
         "matrix multiplies, attention and the optimizer, where the next gains must come from."
         + ("" if gpu else "\nOn a CPU the kernels run in Triton's interpreter, so expect those rows to grow."),
         prof + ["--kernels", "default", "--tag", "walkthrough_profile_optimized"])
    print(f"-> the number: {profile_line('walkthrough_profile_optimized')}\n   (step 1: "
          f"{profile_line('walkthrough_profile_baseline')})")
    print(category_changes("walkthrough_profile_baseline", "walkthrough_profile_optimized"))

    banner("Step 6: summary", "Steps 3 and 4 side by side, and where their loss curves are.", [py, "walkthrough.py"])
    side_by_side(base, opt)
    curves = [RESULTS / f"walkthrough_{t}.png" for t in ("baseline", "optimized") if (RESULTS / f"walkthrough_{t}.png").is_file()]
    print("Loss curves: " + ", ".join(str(c.relative_to(HERE)) for c in curves))


if __name__ == "__main__":
    # Ctrl-C reaches the running step too, which stops in its own way first
    playbook.run_main(main, "the walkthrough stopped; the steps that finished saved their results under results/")
