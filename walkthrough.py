"""The README's steps in one command (`make run`): profile, test, fine-tune, re-profile, then a real model.

    $ python walkthrough.py                       # picks a workload that shows the lesson on this machine
    $ python walkthrough.py --model meta-llama/Llama-3.1-8B --batch-size 2 --seq-len 2048
    $ python walkthrough.py --kernel-tests rmsnorm,rope  # step 2 with these kernel test files only
    $ python walkthrough.py --skip-kernel-tests --seq-len 128 --steps 4 --real-model-steps 2   # CI's short form

The steps carry the README's numbers. Each is a script of this repository that you can also run by
itself; before it runs, the walkthrough says what it shows and what to look at, and after it, the one
number that matters.
  1   profile_baseline.py                     where the time of a training step goes
  2   <kernel>_test.py for the six kernels    the fused kernels are correct (a short report each; the full
      that patch the model                    one in results/walkthrough_tests_<kernel>.txt)
  3   benchmark_kernels.py                    not run here: its command, to run yourself
  4a  finetune_baseline.py                    plain Hugging Face training: tokens/s, memory, loss
  4b  finetune_optimized.py                   the same loop with the Triton kernels
  4c  profile_baseline.py --kernels default   what the kernels changed in the step
  4d  --model smollm2-135m                    a real pretrained model (SmolLM2-135M-Instruct) learns from the
                                              example data: eval loss and answers before and after; then
      export.py                               its checkpoint as one GGUF file, with the Ollama command to run it
  then a summary: 4a and 4b side by side, and what the real model learned.

Without a GPU, steps 1 and 4a-4c run the llama-tiny preset (kernels through Triton's interpreter:
minutes, to see the workflow and the loss falling, not the speed), and step 4d fine-tunes SmolLM2 with
finetune_baseline.py, in PyTorch's own CPU operators: with the kernels, which run in the interpreter there,
a step took minutes (REAL_CPU_KERNEL_STEPS below). With a GPU, steps 1 and 4a-4c run the
LLaMA 3.1 8B architecture (random weights: the timing and memory of the real model) at a size that
fits the card, and step 4d fine-tunes SmolLM2 twice, baseline and kernels, as docs/quality.md does.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import NamedTuple
from pathlib import Path

from playbook.runtime import signals
from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was run", kernels=False)

import torch  # noqa: E402

from playbook.model import registry  # noqa: E402
from playbook.store.files import RESULTS_DIR

HERE = Path(__file__).resolve().parent
RESULTS = RESULTS_DIR  # results/, or the folder PLAYBOOK_RESULTS_DIR names
EXAMPLE_DATA = HERE / "examples" / "chat.jsonl"
PROMPTS = HERE / "examples" / "walkthrough_prompts.txt"
KNOWN_GPUS = ("H100", "H200")  # GPUs with measured results in results/
# The profile categories of the work the default kernels replace (step 4c compares them with step 1).
KERNEL_CATEGORIES = ("RMSNorm", "loss", "SwiGLU", "RoPE", "element-wise")
# Step 2: the kernels apply_kernels patches into the model. The other lessons act outside the model's modules
# (fp8_linear, adamw, lora, distillation): `make test` runs their tests.
OTHER_TESTS = tuple(o.test for o in registry.OPTIMIZATIONS if o.name not in registry.KERNEL_NAMES)

# The learning rate of every GPU run (4a, 4b, 4d, 4e): the Hugging Face Trainer's default, 5e-5, the top of the
# peers' range for a full fine-tune (TRL, torchtune and Axolotl use 2e-5), with one warm-up step (of the 12, about
# 10 %; --warmup-ratio 0.1 would round up to 2, as Hugging Face rounds) and linear decay to 0 (the scripts' default schedule): the walkthrough's runs are a dozen steps, and
# at 2e-5 SmolLM2's eval loss moved 1.7 % in its three epochs where the same run at 5e-5 moved 6.6 %. At 1e-4
# the 8B preset's eval loss rose over the first steps before falling (14.06 after step 3, from 12.47)
# (results/runs/walkthrough_settings_H200/: lr 2e-5, 5e-5 and 1e-4, baseline against the kernels).
GPU_LR = ["--lr", "5e-5", "--lr-warmup-steps", "1"]
# Step 4b changes only the kernels: the optimized script's AdamW rounds each new bf16 weight to nearest, as the
# baseline's (PyTorch's fused AdamW) does. The default rounding keeps the updates that rounding loses: step 4e.
SAME_OPTIMIZER = ["--optimizer-rounding", "nearest"]

# Step 4d, the real model: SmolLM2-135M-Instruct (real weights, offline: playbook/model/pretrained.py).
REAL_MODEL = "smollm2-135m"
REAL_TITLE = "SmolLM2-135M-Instruct"
# On a GPU: 8 x 512 packed rows for three epochs (12 steps; the peers stop at 3), eval every 2 steps, baseline
# and kernels; then step 4e's roundings at the same settings.
REAL_GPU = ["--batch-size", "8", "--seq-len", "512", "--epochs", "3", *GPU_LR, "--eval-every", "2", "--log-every", "2"]
# On a CPU: finetune_baseline.py, in PyTorch's CPU operators (the model loads in float32 on a CPU without bf16
# matmuls). 12 steps of 2 x 256 packed tokens are what a few minutes of a small CPU hold: a third of one pass
# over the file, so the learning rate is high enough (3e-4) for answers to change after one sight of their
# rows. What such a run learned is in README.md (Step 4d) and results/runs/walkthrough_CPU_smollm2.log.
REAL_CPU_STEPS = 12
# A constant rate: the run ends a third of the way through its first epoch, where a decay to 0 would only
# shrink the last steps' updates.
REAL_CPU = ["--packing", "--batch-size", "2", "--seq-len", "256", "--lr", "3e-4", "--lr-schedule", "constant",
            "--log-every", "2", "--timing-warmup-steps", "1"]  # (the lesson is the loss and the answers, not the timing)
# Why step 4d runs no kernel on a CPU: in Triton's interpreter a step of this model takes minutes. The figure
# step 4d prints is the run of finetune_optimized.py --model smollm2-135m --batch-size 2 --seq-len 256 --steps 2
# in results/runs/finetune_CPU_smollm2_kernels.log (results/README.md describes it).
REAL_CPU_KERNEL_STEPS = "5.9 and 14.3 min"
# The end of step 4d: the last real-model run's checkpoint, exported for llama.cpp and Ollama (export.py).
REAL_OUTPUT = "out/walkthrough_smollm2"  # (git-ignored)
REAL_GGUF = REAL_OUTPUT + ".q8_0.gguf"
REAL_OLLAMA_NAME = "smollm2-walkthrough"
OVERWRITE = ["--overwrite"]  # every step writes its results afresh


class Workload(NamedTuple):
    """Steps 1 and 4a-4c on this machine: the scripts' arguments, what they are, the lesson to look for, and the
    profiles' batch where it differs from the runs' (steps 1 and 4c)."""
    args: list[str]
    desc: str
    lesson: str
    profile_batch: int | None = None


def default_workload() -> Workload:
    """Steps 1 and 4a-4c on this machine (Workload)."""
    data = ["--dataset", str(EXAMPLE_DATA.relative_to(HERE)), "--packing"]
    if not torch.cuda.is_available():
        return Workload(data + ["--model", "llama-tiny", "--steps", "12", "--lr", "2e-3", "--batch-size", "2",
                                "--seq-len", "256", "--log-every", "5"],
                "CPU: llama-tiny preset, 2 x 256 tokens, 12 steps (an interpreter run: timings mean nothing)",
                "on a CPU both runs learn the same thing: compare the loss columns, not the speed")
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    big = data + ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--steps", "12", *GPU_LR,
                  "--eval-every", "3"]
    if gib >= 120:
        return Workload(big, f"{gib:.0f} GiB GPU: full 8B fine-tune, 4 x 2048 tokens",
                        "the kernels make each step faster and leaner at the same loss")
    if gib >= 70:
        # The chats read as raw text: no per-example attention mask, whose extra activations would not
        # fit next to the optimized run's ~81 GB on an 80 GB card.
        # Raw text has no held-out examples: no --eval-every (the scripts refuse it without --dataset).
        text = ["--data", str(EXAMPLE_DATA.relative_to(HERE))] + _drop(big[3:], "--eval-every")
        return Workload(text, (f"{gib:.0f} GiB GPU: full 8B fine-tune, 4 x 2048 tokens of the example file as raw "
                               f"text (the profiles of steps 1 and 4c: {PROFILE_BATCH_80GB} x 2048, which the baseline fits)"),
                        "at this size the baseline does not fit this GPU and the optimized run does", PROFILE_BATCH_80GB)
    layers = max(2, int(32 * gib / 100))
    return Workload(data + ["--model", "llama-3.1-8b", "--num-layers", str(layers), "--batch-size", "2", "--seq-len", "2048",
                    "--steps", "12", *GPU_LR, "--eval-every", "3"],
            f"{gib:.0f} GiB GPU: the 8B architecture cut to {layers} layers, 2 x 2048 tokens",
            "a slice of the model, to fit this GPU: the ratios carry over, the absolute figures do not")


REAL_DATA = ["--model", REAL_MODEL, "--dataset", str(EXAMPLE_DATA.relative_to(HERE)),
             "--sample-prompts", str(PROMPTS.relative_to(HERE))]  # every real-model run's model, data and prompts


def real_model_args(steps: int | None = None) -> list[str]:
    """The arguments of every real-model run on a GPU (steps 4d and 4e); `steps`: N steps instead of three epochs."""
    args = REAL_DATA + REAL_GPU
    if steps is not None:
        args = _drop(args, "--epochs") + ["--steps", str(steps)] + (["--timing-warmup-steps", "1"] if steps <= 2 else [])
    return args


def real_model_runs(gpu: bool, steps: int | None = None) -> list[tuple[str, str, list[str]]]:
    """Step 4d: (tag, script, arguments) of each real-model run. `steps`: --real-model-steps, else the default."""
    if gpu:
        args = real_model_args(steps)
        return [("walkthrough_real_baseline", "finetune_baseline.py", args),
                ("walkthrough_real_optimized", "finetune_optimized.py", args + SAME_OPTIMIZER)]
    return [("walkthrough_real_baseline", "finetune_baseline.py",
             REAL_DATA + REAL_CPU + ["--steps", str(steps or REAL_CPU_STEPS)])]


def rounding_runs(steps: int | None = None) -> list[tuple[str, str, list[str]]]:
    """Step 4e, on a GPU: the real model with the optimized script's default rounding, and with fp32 master
    weights, at step 4d's settings (step 4d's kernels' run is the third: rounding to nearest). The default's
    run keeps its best checkpoint, which step 4e exports."""
    args = real_model_args(steps)
    return [("walkthrough_real_default", "finetune_optimized.py",
             args + ["--output-dir", REAL_OUTPUT, "--overwrite-output-dir", "--load-best-model-at-end"]),
            ("walkthrough_real_fp32", "finetune_optimized.py", args + ["--master-weights", "fp32"])]


def _drop(args: list[str], flag: str) -> list[str]:
    """args without flag and its value."""
    if flag not in args:
        return args
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    """args with flag's value replaced, or flag added."""
    if flag in args:
        i = args.index(flag)
        return args[:i + 1] + [value] + args[i + 2:]
    return args + [flag, value]


def banner(title: str, explain: str, cmd: list[str] | None = None, env: dict | None = None) -> None:
    shown = "" if cmd is None else "$ " + " ".join([f"{k}={v}" for k, v in (env or {}).items()] + ["python"] + cmd[1:]) + "\n"
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}\n{explain}\n{shown}", flush=True)


def step(title: str, explain: str, cmd: list[str], may_fail_with: dict[str, str] | None = None,
         env: dict | None = None) -> bool:
    """Run one script (with `env` added to the environment); True when it succeeded. A failure stops the
    walkthrough unless its error output holds a text of `may_fail_with` ({text: what it means}: the lesson of
    that step, e.g. a run that does not fit)."""
    banner(title, explain, cmd, env)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=HERE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    sys.stderr.write(proc.stderr)
    print(f"[{title.split(':')[0]} took {time.perf_counter() - t0:.0f} s]")
    if proc.returncode == 0:
        return True
    said = [meaning for text, meaning in (may_fail_with or {}).items() if text in proc.stderr]
    if said:
        print(f"-> this step failed as it can at this size ({said[0]}); the walkthrough goes on.")
        return False
    raise failed_exit(cmd, proc.returncode)


def failed_exit(cmd: list[str], code: int) -> SystemExit:
    """What stops the walkthrough when a step's script failed."""
    return SystemExit(f"\nwalkthrough: '{' '.join(cmd[1:])}' failed (exit code {code}); stopping here.")


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


def kernel_test(name: str, py: str, letter: str = "") -> tuple[str, str, list[str], dict]:
    """Step 2 for one kernel, as step() takes it: its test file as a script. The full report (every check) goes
    to results/walkthrough_tests_<name>.txt; the screen gets testkit's short one (TESTKIT_REPORT)."""
    report = shown(RESULTS / f"walkthrough_tests_{name}.txt")
    return (f"Step 2{letter} ({name}): test the fused {name} kernel",
            f"{registry.KERNELS[name]}.\nEach check compares the kernel with PyTorch and a float64 reference on the "
            "same inputs: 'max err'\nmust stay under 'tol' (at most 2x PyTorch's own error). Shown here: the counts, "
            "any failure with its\nfirst error line, and the check closest to its tolerance.\nEvery check is in "
            f"{report}.",
            [py, registry.BY_NAME[name].test], {"TESTKIT_REPORT": str(report)})


def shown(path: Path) -> Path:
    """A path as the reader finds it: relative to the repository where it is inside it."""
    return path.relative_to(HERE) if path.is_relative_to(HERE) else path


def steps_together(calls: list[tuple[str, str, list[str], dict]]) -> None:
    """step() for several scripts at once, each started at once and shown in order when it ends (its banner, its
    output, its time): on a GPU the kernel test files spend most of their time compiling Triton kernels on
    the host, one core each, and the tests marked big_gpu_memory take the GPU in turn (conftest.py). The first
    that fails stops the walkthrough, as step() does, once the others have ended."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env}) for _, _, cmd, env in calls]
    failed = None
    for (title, explain, cmd, env), proc in zip(calls, procs):
        out, err = proc.communicate()
        banner(title, explain, cmd, env)
        sys.stdout.write(out)
        sys.stderr.write(err)
        print(f"[{title.split(':')[0]} ended {time.perf_counter() - t0:.0f} s after the {len(calls)} started together]",
              flush=True)
        if proc.returncode != 0 and failed is None:
            failed = (cmd, proc.returncode)
    if failed is not None:
        raise failed_exit(*failed)


def category_changes(before_tag: str, after_tag: str) -> str:
    """The two profiles' categories side by side (ms per step), and what the kernels' rows did in total."""
    before, after = load(before_tag), load(after_tag)
    if before is None or after is None:
        return "no profile to compare"
    b, a = before["categories_ms_per_step"], after["categories_ms_per_step"]
    cats = sorted(set(b) | set(a), key=lambda c: -max(b.get(c, 0.0), a.get(c, 0.0)))
    lines = [f"   {'category':<16} {'step 1 (ms)':>12} {'step 4c (ms)':>12}"]
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

    cpu = "CPU" in opt["gpu"]
    keys = (("step time median (ms)", "lower"), ("host queue median (ms)", "lower"), ("tokens/s (job)", "higher"),
            ("MFU (% of bf16 peak)", "higher"), ("peak GPU memory (GB)", "lower"),
            ("first loss", None), ("final loss", None), ("final eval loss", None))
    rows = []
    for key, better in keys:
        if cpu and key in ("host queue median (ms)", "MFU (% of bf16 peak)", "peak GPU memory (GB)"):
            continue  # a GPU's figures: the CPU run has none
        b = base["summary"].get(key) if base else None
        o = opt["summary"].get(key)
        change = "-" if b in (None, 0) or o is None or better is None else f"{o / b:.2f}x"
        fmt = (lambda v: "n/a" if v is None else (f"{v:.4f}" if "loss" in key else f"{v:,.1f}"))
        rows.append((key, fmt(b) if base else "did not fit", fmt(o), change))
    print(f"\nSteps 4a and 4b, baseline vs optimized ({opt['model']}, {opt['batch_size']} x {opt['seq_len']} tokens, "
          f"{opt['gpu']}):")
    kernels = " + ".join(opt.get("kernels", [])) or "no kernels"
    print(tabulate(rows, headers=["", "baseline", f"optimized ({kernels})", "optimized / baseline"],
                   tablefmt="github"))
    if cpu:
        print("(CPU run: the optimized run's kernels ran in Triton's interpreter, so the timings compare nothing "
              "real; the loss rows show that both runs learn the same thing from the same text.)")


# ------------------------------------------------------------------------------------------------
# Step 4d: what the real model learned
# ------------------------------------------------------------------------------------------------
def taught_answers(path: Path = EXAMPLE_DATA) -> dict[str, str]:
    """question -> the example data's answer, for every one-question conversation of a chat file."""
    answers = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        turns = [m for m in json.loads(line).get("messages", []) if m.get("role") != "system"]
        if len(turns) == 2 and turns[0].get("role") == "user" and isinstance(turns[1].get("content"), str):
            answers[turns[0]["content"].strip()] = turns[1]["content"]
    return answers


def words(text: str) -> set[str]:
    """The words that carry an answer's content: lower-cased, 4 letters or more."""
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) >= 4}


def overlap(answer: str, taught: str) -> tuple[int, int]:
    """(how many of the taught answer's words the answer has, how many it has in all)."""
    want = words(taught)
    return len(want & words(answer)), len(want)


def most_changed(samples: list[dict], taught: dict[str, str]) -> dict | None:
    """Of the sample answers whose question the data answers, the one that moved most toward the data's answer
    (most taught words gained), with "taught", "before_words", "after_words", "of_words" added; None if none."""
    best = None
    for s in samples:
        if s.get("prompt") not in taught or "after" not in s:
            continue
        before, of = overlap(s["before"], taught[s["prompt"]])
        after, _ = overlap(s["after"], taught[s["prompt"]])
        row = {**s, "taught": taught[s["prompt"]], "before_words": before, "after_words": after, "of_words": of}
        if best is None or after - before > best["after_words"] - best["before_words"]:
            best = row
    return best


def real_model_report(runs: list[tuple[str, dict | None]], taught: dict[str, str], where: str = "") -> str:
    """The summary's lines for step 4d: each run's eval loss before -> after, then the answer that changed most
    toward the data's, before and after, beside the data's answer. `where`: the file with every answer."""
    done = [(label, r) for label, r in runs if r is not None]
    if not done:
        return "Step 4d: no real-model run finished."
    first = done[0][1]
    lines = [f"\nStep 4d, a real model learns ({REAL_TITLE}, pretrained; {first['batch_size']} x {first['seq_len']} "
             f"tokens, {first['steps']} steps, {first['gpu']}):"]
    for label, r in done:
        s = r["summary"]
        before, after = s.get("eval loss before"), s.get("final eval loss")
        shown = "n/a" if before is None or after is None else f"{before:.4f} -> {after:.4f}"
        if s.get("best eval step") is not None:
            shown += f" (best {s['best eval loss']:.4f} at step {s['best eval step']})"
        speed = "" if "CPU" in r["gpu"] or not s.get("tokens/s (job)") else f", {s['tokens/s (job)']:,.0f} tokens/s"
        lines.append(f"   {label:<34} eval loss {shown}{speed}   (held-out conversations of {EXAMPLE_DATA.name})")
    last_label, last = done[-1]  # (the run exported at the end of step 4d)
    pick = most_changed(last.get("samples") or [], taught)
    if pick is None:
        lines.append("   (no sample answer to a question the data teaches)")
        return "\n".join(lines)
    lines.append(f"   Q: {pick['prompt']}")
    lines.append(f"     before training: {pick['before']}")
    for label, r in done:
        after = next((s.get("after") for s in r.get("samples") or [] if s.get("prompt") == pick["prompt"]), None)
        lines.append(f"     after, {label}: {after}")
    lines.append(f"     the data's answer: {pick['taught']}")
    whose = "" if len(done) == 1 else f" of the {last_label} run"
    lines.append(f"   The answer{whose} now has {pick['after_words']} of the {pick['of_words']} words of the data's "
                 f"answer (before training: {pick['before_words']})"
                 + (f"; every prompt's answers: {where}." if where else "."))
    return "\n".join(lines)


def _arguments() -> tuple[argparse.Namespace, list[str]]:
    """The command line, checked: (args, the kernels whose test files step 2 runs)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="steps 1 and 4a-4c: the model (default: chosen for this machine)")
    p.add_argument("--batch-size", default=None)
    p.add_argument("--seq-len", default=None)
    p.add_argument("--num-layers", default=None)
    p.add_argument("--steps", default=None, help="steps 4a and 4b: optimizer steps (default 12)")
    p.add_argument("--skip-kernel-tests", action="store_true",
                   help="leave out step 2 (the kernel test files), e.g. right after `make test` ran them")
    p.add_argument("--kernel-tests", default=",".join(registry.KERNEL_NAMES), metavar="NAMES",
                   help="the kernels whose test files step 2 runs, comma-separated (default: the six that patch the "
                        "model: %(default)s)")
    p.add_argument("--real-model-steps", type=int, default=None, metavar="N",
                   help=f"steps 4d and 4e: fine-tune {REAL_TITLE} for N steps (default: {REAL_CPU_STEPS} on a CPU, "
                        f"{REAL_GPU[REAL_GPU.index('--epochs') + 1]} epochs on a GPU); 0 leaves them out")
    args = p.parse_args()
    kernel_tests = [k for k in args.kernel_tests.split(",") if k]
    unknown = [k for k in kernel_tests if k not in registry.KERNEL_NAMES]
    if unknown:
        p.error(f"--kernel-tests: unknown {', '.join(unknown)} (known: {', '.join(registry.KERNEL_NAMES)})")
    if args.real_model_steps is not None and (args.real_model_steps < 0 or args.real_model_steps == 1):
        p.error(f"--real-model-steps {args.real_model_steps}: give 0 (leave step 4d out) or 2 or more (one step is "
                "not timed)")
    return args, kernel_tests


def _workload(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The arguments of steps 4a-4b and of the profiles (steps 1 and 4c): this machine's default, with the user's
    choices over it (then the profiles run the runs' batch)."""
    workload, desc, lesson, profile_batch = default_workload()
    for flag in ("model", "batch_size", "seq_len", "num_layers", "steps"):  # the user's choices win
        value = getattr(args, flag)
        if value is not None:
            workload = _replace(workload, "--" + flag.replace("_", "-"), str(value))
            desc, profile_batch = "as given on the command line", None
    profile = profile_arguments(workload, profile_batch)
    check_workload(workload, torch.cuda.is_available(), profile)  # every argument, before anything is said or run
    print(f"Walkthrough workload of steps 1 and 4a-4c: {desc}.\nThe lesson to look for: {lesson}.")
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if not any(k in name for k in KNOWN_GPUS):
            print(f"Note: results/ holds no figures from a {name} yet: what you see here will be the first.")
    return workload, profile


# What a run that does not fit says on stderr: the memory plan's refusal before the model is built
# (plan/check.py, too_big), or running out of memory anyway (plan/oom.py)
DOES_NOT_FIT = {"the plan needs": "its memory plan does not fit this GPU", "out of GPU memory": "out of GPU memory"}
# Steps 1 and 4c on an 80 GB GPU: the baseline's step at 4 x 2048 needs ~116 GB (the memory plan), at 1 x 2048 ~81 GB
PROFILE_BATCH_80GB = 1
TRAINING_ONLY = ("--steps", "--lr", "--lr-warmup-steps", "--warmup-ratio", "--eval-every")  # flags of 4a/4b that a profile refuses


def profile_arguments(workload: list[str], batch: int | None = None) -> list[str]:
    """Steps 1 and 4c: the workload without the flags of a training run (each with its value), at `batch` rows
    where given (a 70-120 GiB GPU's default: one the baseline fits, so step 1 has a profile to show)."""
    for flag in TRAINING_ONLY:
        workload = _drop(workload, flag)
    return workload if batch is None else _replace(workload, "--batch-size", str(batch))


def _profile_baseline(prof: list[str], gpu: bool) -> None:
    step("Step 1: profile the baseline",
         ("One training step of plain Hugging Face under torch.profiler, GPU time by category. Look at the\n"
          "category table: matrix multiplies lead (they are the model's real work), then attention and the\n"
          "optimizer; RMSNorm, the loss and the element-wise rows are the memory-bound glue that fused kernels\n"
          "can shrink." if gpu else
          "One training step of plain Hugging Face under torch.profiler, CPU time by category (no GPU here).\n"
          "Look at the category table: matrix multiplies, attention, the optimizer, and the RMSNorm, loss,\n"
          "SwiGLU and element-wise rows that fused kernels replace. The baseline runs no Triton kernel: these are\n"
          "PyTorch's CPU operators, so the categories are those of a GPU profile but their shares are the CPU's."),
         prof + ["--tag", "walkthrough_profile_baseline"])
    print(f"-> the number: {profile_line('walkthrough_profile_baseline')}")


def _kernel_tests(skip: bool, kernel_tests: list[str], py: str) -> None:
    """Step 2: each named kernel's test file, or a banner saying it was left out."""
    others = ", ".join(OTHER_TESTS)
    if skip:
        banner("Step 2: the kernel tests: skipped (--skip-kernel-tests); `make test` runs them",
               f"The test files of all ten kernel lessons are part of `make test` ({others} included).")
    else:
        banner("Step 2: the kernels and their tests",
               f"The test files of the kernels that patch the model, "
               f"{'all started at once (a GPU)' if torch.cuda.is_available() else 'one after another'}:\n"
               f"{', '.join(kernel_tests)}.\n"
               f"The other lessons act outside the model's modules: {others}.\n"
               "`make test` runs them, and each runs as a script too, e.g. `python adamw_test.py`.")
    calls = [kernel_test(name, py, letter=chr(ord("a") + i)) for i, name in enumerate(() if skip else kernel_tests)]
    if torch.cuda.is_available() and len(calls) > 1:
        steps_together(calls)  # (a CPU has too few cores to gain: the interpreter keeps each one busy)
    else:
        for title, explain, cmd, env in calls:
            step(title, explain, cmd, env=env)


def _fine_tune_both(workload: list[str], py: str, gpu: bool) -> tuple[dict | None, dict]:
    """Steps 4a and 4b: the baseline, then the default kernels, on the same loop, seed and data."""
    base_ok = step("Step 4a: fine-tune, baseline",
                   "Plain Hugging Face + PyTorch on real text (examples/chat.jsonl, prompts masked from the loss).\n"
                   + ("Look at the loss falling from line to line, then at tokens/s and peak memory in the summary."
                      if gpu else "Look at the loss falling from line to line (tokens/s are the CPU's; there is "
                      "no GPU memory to measure)."),
                   [py, "finetune_baseline.py", *workload, "--tag", "walkthrough_baseline", *OVERWRITE],
                   may_fail_with=DOES_NOT_FIT)
    base = load("walkthrough_baseline") if base_ok else None
    if base:
        s = base["summary"]
        print(f"-> the number: {s['tokens/s (job)']:,.0f} tokens/s, loss {s['first loss']:.3f} -> {s['final loss']:.3f}"
              + (f", peak {s['peak GPU memory (GB)']:.1f} GB" if s.get("peak GPU memory (GB)") else ""))

    model_kernels = [k for k in registry.DEFAULT_KERNELS if k in registry.KERNEL_NAMES]
    step("Step 4b: fine-tune, optimized",
         ("The same loop, seed and data with the default kernels: "
          + (f"{', '.join(model_kernels)}\nand the Triton AdamW (adamw), told to round each new bf16 weight to "
             "nearest as the baseline's\nPyTorch AdamW does (--optimizer-rounding nearest): one change, the kernels. "
             "The default rounding\nkeeps the updates that rounding loses: step 4e.\n" if gpu else
             f"{', '.join(model_kernels)}\n(the Triton AdamW of the default set runs on a GPU only: PyTorch's AdamW "
             "here, as in the baseline; lora joins with --lora-r).\n"))
         + ("Look at the same three numbers: the loss must follow the baseline's; tokens/s up, peak memory down."
            if gpu and base_ok else
            "The baseline did not fit at this size: look at this run's loss falling, its tokens/s and its peak\n"
            "memory, under this GPU's." if gpu else
            "The loss must follow the baseline's. The kernels run in Triton's interpreter here, so tokens/s\n"
            "fall far below the baseline's: on a CPU the loss is the result, not the speed."),
         [py, "finetune_optimized.py", *workload, *(SAME_OPTIMIZER if gpu else []), "--tag", "walkthrough_optimized",
          *OVERWRITE])
    opt = load("walkthrough_optimized")
    s = opt["summary"]
    if base:
        print(curves_agree(base, opt))
    if not gpu:  # interpreter speed says nothing: the loss is the number here
        print(f"-> the number: loss {s['first loss']:.3f} -> {s['final loss']:.3f}"
              + (f" (baseline: -> {base['summary']['final loss']:.3f})" if base else "")
              + "; tokens/s on a CPU are the Triton interpreter's, not a speed")
    else:
        print(f"-> the number: {s['tokens/s (job)']:,.0f} tokens/s"
              + (f" ({s['tokens/s (job)'] / base['summary']['tokens/s (job)']:.2f}x the baseline)" if base else
                 " (the baseline did not fit)")
              + (f", peak {s['peak GPU memory (GB)']:.1f} GB" if s.get("peak GPU memory (GB)") else ""))
    return base, opt


def curves_agree(base: dict, opt: dict) -> str:
    """How close two runs of the same data, seed and optimizer arithmetic stayed: their training losses step by
    step and their eval losses, as relative differences."""
    steps = [abs(o - b) / abs(b) for b, o in zip(base["losses"], opt["losses"]) if b]
    evals = [(d, abs(o - b) / abs(b)) for (d, b), (_, o) in zip(base["eval_losses"], opt["eval_losses"]) if b]
    line = (f"   the two loss curves: {len(steps)} steps, training losses within {100 * max(steps):.2f} % of each other "
            f"(mean {100 * sum(steps) / len(steps):.2f} %)" if steps else "   no training losses to compare")
    if evals:
        worst = max(evals, key=lambda e: e[1])
        line += f"; eval losses within {100 * worst[1]:.2f} % (after step {worst[0]})"
    return line


def _profile_again(prof: list[str], gpu: bool) -> None:
    step("Step 4c: profile again with the kernels",
         "The same profile with every kernel; the table after it sets each category beside step 1's. On a GPU\n"
         "the RMSNorm, loss, SwiGLU and element-wise rows shrink (the logits are never built), leaving mostly\n"
         "matrix multiplies, attention and the optimizer, where the next gains must come from."
         + ("" if gpu else "\nOn a CPU the kernels run in Triton's interpreter, so expect those rows to grow."),
         prof + ["--kernels", "default", "--tag", "walkthrough_profile_optimized"])
    print(f"-> the number: {profile_line('walkthrough_profile_optimized')}\n   (step 1: "
          f"{profile_line('walkthrough_profile_baseline')})")
    print(category_changes("walkthrough_profile_baseline", "walkthrough_profile_optimized"))


def _real_model_explained(gpu: bool, kernels: bool) -> str:
    """What step 4d's run does, on a GPU (baseline and kernels) or on a CPU (baseline only)."""
    prompts = PROMPTS.relative_to(HERE)
    if gpu:
        return ("Real pretrained weights (Apache-2.0, dequantized from a 4-bit GGUF: docs/data.md), fine-tuned on\n"
                "examples/chat.jsonl for three epochs (12 steps), lr 5e-5 with warm-up and linear decay, the eval loss\n"
                f"every 2 steps; the model's answers to {prompts} before and after.\n"
                + ("The same run with the kernels, its AdamW rounding to nearest as the baseline's: the same losses\n"
                   "within bf16's noise, more tokens/s." if kernels else
                   "First plain Hugging Face; then the same run with the kernels."))
    return (
        "Real pretrained weights (Apache-2.0, dequantized from a 4-bit GGUF: docs/data.md; converted once,\n"
        "on first use). The run prints the held-out eval loss before the first step and after the last,\n"
        f"and the model's answers to {prompts} before and after training.\n"
        "A few minutes on a CPU hold a third of a pass over the file, at a learning rate (3e-4) high\n"
        "enough for an answer to change after one sight of its row. finetune_baseline.py runs it in\n"
        "PyTorch's CPU operators, all 30 layers. The kernels are not run on this model here:\n"
        f"in Triton's interpreter two steps of 2 x 256 tokens took {REAL_CPU_KERNEL_STEPS} on a 2-core AMD "
        "EPYC shared with\nother jobs (finetune_optimized.py --model smollm2-135m --batch-size 2 --seq-len 256; "
        "that script estimates\nits step itself before the first). Steps 4a-4c compare the kernels with the "
        "baseline on llama-tiny\ninstead; a GPU runs both on SmolLM2.")


def eval_line(r: dict, gpu: bool) -> str:
    """A real-model run's number: its eval loss before -> after, its best, and its speed on a GPU."""
    s = r["summary"]
    before, after = s.get("eval loss before"), s.get("final eval loss")
    line = f"eval loss {before or float('nan'):.4f} -> {after or float('nan'):.4f}"
    if s.get("best eval step") is not None:
        line += f" (best {s['best eval loss']:.4f} at step {s['best eval step']})"
    return line + (f", {s['tokens/s (job)']:,.0f} tokens/s" if gpu and s.get("tokens/s (job)") else "")


def _real_model(steps: int | None, py: str, gpu: bool) -> list[tuple[str, str, list[str]]]:
    """Step 4d: the real model fine-tuned (baseline, and with the kernels on a GPU); step 4e on a GPU: the
    optimizer's roundings; then the last run's checkpoint exported. Returns the runs made, as real_model_runs and
    rounding_runs list them."""
    real = [] if steps == 0 else real_model_runs(gpu, steps)
    if not real:
        banner("Step 4d: a real model learns: skipped (--real-model-steps 0)", "")
    for i, (tag, script, real_args) in enumerate(real):
        kernels = script == "finetune_optimized.py"
        title = (f"Step 4d{'' if len(real) == 1 else ' (kernels)' if kernels else ' (baseline)'}: a real model learns: "
                 f"{REAL_TITLE}" + (", with the kernels" if kernels else ""))
        saved = ["--output-dir", REAL_OUTPUT, "--overwrite-output-dir"] if not gpu else []  # (exported below)
        step(title, _real_model_explained(gpu, kernels), [py, script, *real_args, "--tag", tag, *OVERWRITE, *saved])
        r = load(tag)
        if r is not None:
            print(f"-> the number: {eval_line(r, gpu)}")
    if len(real) == 2 and load(real[0][0]) and load(real[1][0]):
        print(curves_agree(load(real[0][0]), load(real[1][0])))
    real += _roundings(steps, py, gpu) if real else []
    if real:
        checkpoint = REAL_OUTPUT
        best = (load(real[-1][0]) or {}).get("best_eval") or {}
        if gpu and best.get("checkpoint"):
            checkpoint = best["checkpoint"]
        step("Step 4d, exported: the fine-tuned model for llama.cpp and Ollama",
             f"The {'best checkpoint of the default run above' if gpu else 'checkpoint of the run above'} as one GGUF "
             "file (q8_0: 8 bits a weight), with its tokenizer, chat\n"
             "template and end-of-turn token, and an Ollama Modelfile beside it. Nothing here runs Ollama or llama.cpp;\n"
             "the command to do so follows (docs/export.md). tests/export_test.py reads such files back through\n"
             "transformers' own GGUF reader and checks that they answer as the checkpoint does.",
             [py, "export.py", checkpoint, "--output", REAL_GGUF, "--name", REAL_OLLAMA_NAME])
        modelfile = REAL_GGUF.removesuffix(".gguf") + ".Modelfile"
        print(f"-> the file: {REAL_GGUF}; to run it:\n   ollama create {REAL_OLLAMA_NAME} -f {modelfile}  &&  "
              f"ollama run {REAL_OLLAMA_NAME}")
    return real


def _roundings(steps: int | None, py: str, gpu: bool) -> list[tuple[str, str, list[str]]]:
    """Step 4e: what the optimizer keeps of each update. On a GPU, the real model again with the optimized
    script's default rounding and with fp32 master weights, beside step 4d's rounding to nearest; on a CPU the
    real model's weights are float32, which round nothing away: the step says so and runs nothing."""
    title = "Step 4e: what the optimizer keeps of an update: rounding to nearest, the default, fp32 master weights"
    if not gpu:
        banner(title + " (a GPU's lesson)",
               "A bf16 weight cannot hold an update smaller than half its last bit: rounding to nearest drops it.\n"
               "The optimized script's default keeps what rounding drops (Kahan-compensated where its buffer fits\n"
               "in memory, else stochastic rounding); fp32 master weights are the reference. On this CPU the real\n"
               "model's weights are float32, which drop nothing, so there is nothing to compare here: on a GPU this\n"
               "step runs SmolLM2 three ways (docs/quality.md has the figures).")
        return []
    runs = rounding_runs(steps)
    for tag, script, run_args in runs:
        fp32 = "--master-weights" in run_args
        step(f"Step 4e{' (fp32 master weights)' if fp32 else ' (the default rounding)'}: what the optimizer keeps "
             "of an update",
             ("The same run as step 4d's with the kernels, with fp32 master weights (--master-weights fp32): the\n"
              "Triton AdamW updates an fp32 copy of every weight (4 bytes each) and rounds it into the bf16 weight:\n"
              "the reference for what an update should do." if fp32 else
              "A bf16 weight cannot hold an update smaller than half its last bit: step 4d's runs round to nearest,\n"
              "which drops it. The optimized script's default keeps it: Kahan compensation (a bf16 buffer of 2 bytes\n"
              "per weight holding what rounding dropped) where it fits in memory, else stochastic rounding. This\n"
              "run keeps its best checkpoint (--load-best-model-at-end), which is exported below."),
             [py, script, *run_args, "--tag", tag, *OVERWRITE])
        r = load(tag)
        if r is not None:
            print(f"-> the number: {eval_line(r, gpu)}")
    print(rounding_table([("nearest (step 4d)", load("walkthrough_real_optimized")),
                          ("the default", load(runs[0][0])), ("fp32 master weights", load(runs[1][0]))]))
    return runs


# The memory each rounding adds to AdamW's bf16 moments, per trainable weight (adamw_kernel.py, "Updates that stick")
EXTRA_BYTES = {"nearest": 0, "stochastic": 0, "kahan": 2, "fp32-master": 4}


def rounding_table(runs: list[tuple[str, dict | None]]) -> str:
    """Step 4e's table: each rounding's eval loss, the memory it adds and the run's peak."""
    from tabulate import tabulate

    rows = []
    for label, r in runs:
        if r is None:
            continue
        s, rounding = r["summary"], r["config"].get("optimizer_rounding", "nearest")
        if r["config"].get("master_weights") == "fp32":
            rounding = "fp32-master"
        extra = EXTRA_BYTES.get(rounding, 0) * r["trainable_params"] / 1e9
        before, after = s.get("eval loss before"), s.get("final eval loss")
        gain = "n/a" if not before or after is None else f"{100 * (before - after) / before:.1f} %"
        rows.append((f"{label}: {rounding}", f"{before:.4f}" if before else "n/a",
                     f"{after:.4f}" if after is not None else "n/a", gain, f"{extra:.2f}",
                     f"{s['peak GPU memory (GB)']:.2f}" if s.get("peak GPU memory (GB)") else "n/a"))
    return ("\nStep 4e, the optimizer's rounding (SmolLM2, the same data, seed and learning rate):\n"
            + tabulate(rows, headers=["rounding", "eval before", "eval after", "fall", "added memory (GB)",
                                      "peak GPU memory (GB)"], tablefmt="github"))


RUN_LABELS = {"walkthrough_real_baseline": "baseline (finetune_baseline.py)",
              "walkthrough_real_optimized": "kernels, rounding to nearest",
              "walkthrough_real_default": "kernels, the default rounding",
              "walkthrough_real_fp32": "kernels, fp32 master weights"}


def _summary(base: dict | None, opt: dict, real: list) -> None:
    banner("Summary", "Steps 4a and 4b side by side, what the real model learned in step 4d, and where the loss "
                      "curves are.")
    side_by_side(base, opt)
    if real:
        print(real_model_report([(RUN_LABELS[tag], load(tag)) for tag, _, _ in real], taught_answers(),
                                where=str(shown(RESULTS / f"{real[-1][0]}.json"))))
    tags = ["baseline", "optimized"] + [t.removeprefix("walkthrough_") for t, _, _ in real]
    curves = [RESULTS / f"walkthrough_{t}.png" for t in tags if (RESULTS / f"walkthrough_{t}.png").is_file()]
    print("Loss curves: " + ", ".join(str(shown(c)) for c in curves))


def check_workload(workload: list[str], gpu: bool, profile: list[str] | None = None) -> None:
    """Every argument of steps 1 and 4a-4c checked by the scripts that take it, before Step 1: a bad one (--steps
    abc, --batch-size 0) is the script's one line and exit code 2 now, not a failure inside step 4a after the
    kernel tests ran."""
    import profile_baseline
    from playbook.config import BASELINE, OPTIMIZED, PROFILE, make_parser, parse_config

    def quiet(parser):  # one line, without the scripts' usage (the walkthrough's own flags are not theirs)
        parser.print_usage = lambda file=None: None
        return parser

    parse_config(quiet(make_parser("finetune_baseline.py")), BASELINE, workload)
    parse_config(quiet(make_parser("finetune_optimized.py", kernels_default=registry.DEFAULT_KERNELS)), OPTIMIZED,
                 [*workload, *(SAME_OPTIMIZER if gpu else [])])
    parse_config(quiet(profile_baseline.make_profile_parser()), PROFILE,
                 profile_arguments(workload) if profile is None else profile)


def main():
    args, kernel_tests = _arguments()
    workload, profile = _workload(args)
    py = sys.executable
    gpu = torch.cuda.is_available()
    prof = [py, "profile_baseline.py", *profile, *OVERWRITE]
    _profile_baseline(prof, gpu)
    RESULTS.mkdir(parents=True, exist_ok=True)
    _kernel_tests(args.skip_kernel_tests, kernel_tests, py)
    banner("Step 3: how close to the hardware? (not run by the walkthrough)",
           "benchmark_kernels.py times each kernel against eager PyTorch, torch.compile and Liger-Kernel at the 8B\n"
           "shapes, with the floor of this GPU; a few minutes per kernel on a GPU, and on a CPU its timings would be\n"
           "the interpreter's. Run it yourself (README, Step 3):\n"
           "$ python benchmark_kernels.py                 # every kernel, on a GPU\n"
           "$ python benchmark_kernels.py --smoke         # tiny sizes, also on a CPU: checks, not timings")
    base, opt = _fine_tune_both(workload, py, gpu)
    _profile_again(prof, gpu)
    real = _real_model(args.real_model_steps, py, gpu)
    _summary(base, opt, real)


if __name__ == "__main__":
    # Ctrl-C reaches the running step too, which stops in its own way first
    signals.run_main(main, "the walkthrough stopped; the steps that finished saved their results under results/")
