"""Bad input to every script, tried as a user would: each case a command line, run as a process.

    $ PYTHONPATH=. python tests/probe_test.py     # the table below as a report, then the counts
    $ pytest tests/probe_test.py

Every case runs a script on the CPU (the tiny preset, a step or two of 32 tokens) and holds it to
what docs/troubleshooting.md promises for bad input:

    an error      exit code 2 for a bad argument (1 for a failure during the run, 130 for Ctrl-C),
                  a message that names the problem, and never a Python traceback
    handled       input that must work (the formats users bring, a flag's promised effect): exit
                  code 0 and the effect checked

Each run is classified: a clean error, handled correctly, a traceback, silent (exit 0 where an error
was due, or the flag's effect missing), unclear (an error with the wrong exit code or a message that
does not name the problem), or a hang. The summary line gives the counts. Cases that only argparse
or the configuration checks see run together in two child processes (the script's `__main__`
through runpy, once per case), so the hundred cases take under two minutes on two cores. `pytest
tests/probe_test.py -k resume` runs the cases whose names match.

The `part` of a case says where its fix lives: "probe" (the scripts, playbook/config/,
runtime/common.py, kernel_utils.py), "runs" (output directories, checkpoints and resume: run/training.py,
store/checkpoint.py), "data" (the formats and files users bring: data/dataset.py), "lora" (adapters:
model/lora.py, model/models.py), "chat" (chat.py, prompts files and the model cache: model/generate.py,
model/pretrained.py). A grouped
case may have a set-up: it runs in the parent, before the group starts.
"""

from __future__ import annotations

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from playbook.store.files import RESULTS_DIR
from testkit import python_path, run_as_script
from robustness_test import interrupt

SKIP = torch.cuda.is_available()  # (conftest.py starts no cases then)
pytestmark = pytest.mark.skipif(SKIP, reason="the cases are the CPU demo's (the tiny preset, "
                                "the CPU allocator, benchmark_kernels.py refusing to time without a GPU)")

HERE = Path(__file__).resolve().parent.parent  # the repository root
BIG = "99999999999999999999"  # overflows a C ssize_t
TAG = "probe_test_"  # results/probe_test_* are this file's and are removed after the run
RUN = ["--steps", "2", "--timing-warmup-steps", "1", "--seq-len", "32"]  # a short fine-tuning run
CHAT = ["--dataset", "examples/chat.jsonl", "--seq-len", "128", "--timing-warmup-steps", "1"]  # the resume fixture's


@dataclass
class Case:
    name: str
    argv: list  # script and arguments; {tmp} is the case's folder, {full} / {lora} the fixtures' output dirs
    mentions: str = ""  # a regular expression (any case) the output must match: the problem named, or the effect
    codes: tuple = (2,)  # exit codes of the right answer; (0,): the input must be handled
    part: str = "probe"  # where the fix lives (module docstring)
    setup: Callable | None = None  # setup(folder): files the case needs, in its own folder
    check: Callable | None = None  # check(result, folder) -> what is wrong, or None
    grouped: bool = False  # refused by argparse or the configuration: runs in a shared child process
    ctrl_c: str | bool = False  # Ctrl-C: True at start-up, or after the first stdout line holding this text
    before_training: bool = False  # an error that must come before the first step (nothing lost)


def _write(name: str, data) -> Callable:
    def setup(folder: Path):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return setup


def _rows(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


CHAT_ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                           {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}]} for i in range(40)]


def _copy_checkpoint(src: str, damage: Callable | None = None) -> Callable:
    """A copy of the full fixture's output dir under {tmp}/ckpt, damaged by `damage(checkpoint dir)`."""
    def setup(folder: Path):
        shutil.copytree(FIXTURES[src], folder / "ckpt")
        if damage is not None:
            damage(folder / "ckpt" / "checkpoint-2")
    return setup


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _rename_a_key(ckpt: Path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    key = next(k for k in tensors if "layers.0" in k)
    tensors[key.replace("layers.0", "layers.0.renamed")] = tensors.pop(key)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def _other_model(folder: Path):
    """A local Hugging Face model of another width, with the fixture's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = FIXTURES["full"] / "checkpoint-2"
    saved = json.loads((ckpt / "config.json").read_text())
    cfg = LlamaConfig(**{**saved, "hidden_size": 32, "intermediate_size": 64})
    LlamaForCausalLM(cfg).save_pretrained(folder / "other")
    for f in ckpt.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / "other" / f.name)


def _checkpoints(folder: Path) -> list:
    return sorted(p.name for p in (folder / "out").glob("checkpoint-*"))


def _profiled_steps(result, folder) -> str | None:
    tag = result["argv"][result["argv"].index("--tag") + 1]
    trace = RESULTS_DIR / "traces" / f"{tag}.trace.json"
    if not trace.is_file():
        return f"no trace at {trace}"
    steps = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name", "").startswith("ProfilerStep")}
    if len(steps) != 2:
        return f"the trace holds {len(steps)} profiled steps, not 2"
    notices = [line for line in result["text"].splitlines()  # Kineto's, at start / stop; torch 2.11's warning
               if line.startswith("USDT:") or "clears events at the end of each cycle" in line]
    return f"the profiler's notices are in the output: {notices}" if notices else None


def _no_progress_bars(result, folder) -> str | None:
    """Output to a pipe (a log) holds no progress bar: a bar's every redraw would be a line of it."""
    bars = [line for line in result["text"].splitlines() if "it/s]" in line or "s/it]" in line]
    return f"progress bars in a piped output: {bars[:2]}" if bars else None


def _gpt2(folder: Path):
    """A local Hugging Face model of a family the kernels do not know (GPT-2), 1 layer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=300, bos_token_id=1,
                               eos_token_id=2)).save_pretrained(folder / "gpt2")


def _adapter_names_its_base(result, folder) -> str | None:
    saved = json.loads((FIXTURES["lora"] / "checkpoint-2" / "adapter_config.json").read_text())
    return None if saved.get("base_model_name_or_path") else \
        f"adapter_config.json has base_model_name_or_path {saved.get('base_model_name_or_path')!r}"


def _one_line(result, folder) -> str | None:
    """After Ctrl-C, stderr holds one line (and nothing else)."""
    lines = [line for line in result["text"].splitlines() if line.strip()]
    return None if len(lines) == 1 else f"{len(lines)} lines on stderr after Ctrl-C: {' | '.join(lines)[-300:]}"


def _copy_model(damage: Callable | None = None) -> Callable:
    """A copy of the full fixture's last checkpoint (a llama-tiny model with its tokenizer) at {tmp}/m,
    damaged by `damage(folder)`: chat.py's stand-in for a model with weights."""
    def setup(folder: Path):
        shutil.copytree(FIXTURES["full"] / "checkpoint-2", folder / "m")
        if damage is not None:
            damage(folder / "m")
    return setup


def _adapter(base: str = "", text: str | None = None) -> Callable:
    """A copy of the LoRA fixture's adapter at {tmp}/ad whose adapter_config.json names `base` ({tmp} and
    {full} filled in; {tmp}/other is built: another width), or holds `text`."""
    def setup(folder: Path):
        shutil.copytree(FIXTURES["lora"] / "checkpoint-2", folder / "ad")
        config = folder / "ad" / "adapter_config.json"
        if text is not None:
            config.write_text(text)
            return
        saved = json.loads(config.read_text())
        saved["base_model_name_or_path"] = base.replace("{tmp}", str(folder)).replace("{full}", str(FIXTURES["full"]))
        config.write_text(json.dumps(saved))
        if base == "{tmp}/other":
            _other_model(folder)
    return setup


def _chat_into(stdout: str) -> Callable:
    """{tmp}/run.py: chat.py with its stdout a pipe whose reader is gone ("pipe") or a full disk ("full")."""
    def setup(folder: Path):
        opened = ("r, w = os.pipe()\nos.close(r)\nsys.stdout = os.fdopen(w, 'w')\n" if stdout == "pipe"
                  else "sys.stdout = open('/dev/full', 'w')\n")
        (folder / "run.py").write_text(
            "import os, runpy, sys\n" + opened
            + f"sys.argv = ['chat.py', '--model', {str(FIXTURES['full'] / 'checkpoint-2')!r}, '--max-new-tokens', '2', "
              "'--prompt', 'Hi', '--prompt', 'Bye']\n"
            "runpy.run_path('chat.py', run_name='__main__')\n")
    return setup


def _answered(*prompts) -> Callable:
    """chat.py's output holds an answer to each of `prompts`, and no prompt that is a JSON bracket."""
    def check(result, folder) -> str | None:
        asked = re.findall(r"^> (.*)$", result["text"], re.MULTILINE)
        return None if asked == list(prompts) else f"the prompts answered were {asked}, not {list(prompts)}"
    return check


def _quiet(result, folder) -> str | None:
    return "an error line for a reader that went away" if "error" in result["text"].lower() else None


SHELL_INTERRUPT = "interrupted"
# The README's order of the kernel API, after `import triton` (transformers and peft import it too): the
# start-up, the registry, a model built by transformers, apply_kernels, a training step; on a CPU, in Triton's
# interpreter.
ANY_IMPORT_ORDER = ("import torch, triton\n"
                    "from playbook.startup import start\n"
                    "start()\n"
                    "from playbook.model import registry\n"
                    "from transformers import LlamaConfig, LlamaForCausalLM\n"
                    "model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, "
                    "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16))\n"
                    "report = registry.apply_kernels(model)\n"
                    "ids = torch.randint(0, 128, (2, 16))\n"
                    "model(input_ids=ids, labels=ids).loss.backward()\n"
                    "print('kernels applied:', report.describe())\n")
# a -c child's last lines: run the script named after -c's code with the arguments after it, as python would
THEN_THE_SCRIPT = "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
OOM_AT_BUILD = ("import runpy, sys\n"
                "import playbook.model.models as m\n"
                "def build(*a, **k):\n"
                "    raise RuntimeError('[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can\\'t allocate "
                "memory: you tried to allocate 64000000000 bytes')\n"
                "m.build_preset = build\n" + THEN_THE_SCRIPT)

# torch 2.11's profiler warns that it "clears events at the end of each cycle" when a schedule records one cycle
# (pytorch/pytorch#180387); this torch may not: the child warns as 2.11 does, and the profile must not pass it on
PROFILER_WARNS_AS_2_11 = ("import runpy, sys, warnings\n"
                          "from torch.profiler import profiler as p\n"
                          "prepare = p.profile.prepare_trace\n"
                          "def warned(self):\n"
                          "    warnings.warn('Warning: Profiler clears events at the end of each cycle.Only events from "
                          "the current cycle will be reported.To keep events across cycles, set acc_events=True.')\n"
                          "    prepare(self)\n"
                          "p.profile.prepare_trace = warned\n" + THEN_THE_SCRIPT)

FT = ("finetune_baseline.py", "finetune_optimized.py")
ASK = ["chat.py", "--max-new-tokens", "2"]  # chat.py, answers of two tokens (the stand-in model has nothing to say)
CASES = [
    # ---- numbers, paths and combinations refused by argparse or the configuration (grouped) ----
    *[Case(f"{s} --steps {BIG}", [s, "--steps", BIG], "too large", grouped=True)
      for s in (*FT, "profile_baseline.py", "distill.py", "finetune_trainer.py")],
    Case("--batch-size 2**31", ["finetune_baseline.py", "--batch-size", str(2**31)], "too large", grouped=True),
    Case("--num-layers huge", ["finetune_optimized.py", "--num-layers", BIG], "too large", grouped=True),
    Case("--grad-accum huge", ["finetune_baseline.py", "--grad-accum", BIG], "too large", grouped=True),
    Case("--batch-size -1", ["finetune_baseline.py", "--batch-size", "-1"], "--batch-size", grouped=True),
    Case("--batch-size 1.5", ["finetune_baseline.py", "--batch-size", "1.5"], "not an integer", grouped=True),
    Case("--batch-size abc", ["finetune_optimized.py", "--batch-size", "abc"], "not an integer", grouped=True),
    Case("--lr inf", ["finetune_baseline.py", "--lr", "1e400"], "finite", grouped=True),
    Case("--lr -1", ["finetune_baseline.py", "--lr", "-1"], "--lr", grouped=True),
    Case("--seed -1", ["finetune_baseline.py", "--seed", "-1"], "--seed", grouped=True),
    Case("--epochs 0", ["finetune_baseline.py", "--epochs", "0", "--dataset", "examples/chat.jsonl"], "--epochs",
         grouped=True),
    Case("--steps and --epochs", ["finetune_baseline.py", "--steps", "3", "--epochs", "1", "--dataset",
                                  "examples/chat.jsonl"], "choose one", grouped=True),
    Case("--eval-fraction without --dataset", ["finetune_baseline.py", "--eval-fraction", "0.5"], "--dataset",
         grouped=True),
    Case("--data is a folder", ["finetune_baseline.py", "--data", "examples"], "no such file", grouped=True),
    Case("--data and --dataset", ["finetune_baseline.py", "--data", "README.md", "--dataset", "examples/chat.jsonl"],
         "choose one", grouped=True),
    Case("--output-dir is a file", ["finetune_baseline.py", "--output-dir", "README.md"], "is a file", grouped=True),
    Case("--resume is a file", ["finetune_baseline.py", "--resume", "README.md"], "no such checkpoint", grouped=True),
    Case("--tag with a space", ["finetune_baseline.py", "--tag", "my run"], "--tag", grouped=True),
    Case("--kernels ''", ["finetune_optimized.py", "--kernels", ""], "--kernels", grouped=True),
    Case("--kernels liger,rmsnorm", ["finetune_optimized.py", "--kernels", "liger,rmsnorm"], "--kernels",
         grouped=True),
    Case("--kernels rmsnorm,,swiglu", ["finetune_optimized.py", "--kernels", "rmsnorm,,swiglu"], "empty kernel name",
         grouped=True),
    Case("--fp8-backend without --fp8", ["finetune_optimized.py", "--fp8-backend", "torchao"], "--fp8", grouped=True),
    Case("--offload-layers sometimes", ["finetune_optimized.py", "--offload-layers", "sometimes"], "--offload-layers",
         grouped=True),
    Case("--recompute-norms with --compile", ["finetune_optimized.py", "--recompute-norms", "--compile"],
         "not with --compile", grouped=True),
    Case("--offload-layers on a checkpointed layer", ["finetune_optimized.py", *RUN, "--checkpoint-layers", "0",
                                                      "--offload-layers", "all"], "both checkpointed"),
    Case("--lr-schedule bogus", ["finetune_baseline.py", "--lr-schedule", "exponential"], "invalid choice",
         grouped=True),
    Case("--timing-warmup-steps >= --steps", ["finetune_baseline.py", "--steps", "2", "--timing-warmup-steps", "2"],
         "no timed step", grouped=True),
    *[Case(f"{s} --lora-targets foo_proj", [s, "--lora-r", "4", "--lora-targets", "foo_proj"],
           "foo_proj.*q_proj", grouped=True) for s in FT],
    Case("--lora-targets empty", ["finetune_baseline.py", "--lora-r", "4", "--lora-targets", ","], "q_proj",
         grouped=True),
    *[Case(f"{s} --kernels liger, not installed", [s, "--kernels", "liger"], "pip install liger-kernel", grouped=True)
      for s in ("finetune_optimized.py", "profile_baseline.py", "distill.py")],
    Case("profile --save-every --output-dir", ["profile_baseline.py", "--save-every", "1", "--output-dir", "{tmp}/d"],
         "does not use --output-dir, --save-every", grouped=True),
    Case("profile --lr-schedule", ["profile_baseline.py", "--lr-schedule", "cosine"], "does not use --lr-schedule",
         grouped=True),
    Case("profile --log-every", ["profile_baseline.py", "--log-every", "1"], "does not use --log-every", grouped=True),
    Case("profile --resume", ["profile_baseline.py", "--resume", "examples"], "does not use --resume", grouped=True),
    Case("profile --epochs", ["profile_baseline.py", "--epochs", "1", "--dataset", "examples/chat.jsonl"],
         "does not use --epochs", grouped=True),
    Case("distill --dataset", ["distill.py", "--dataset", "examples/chat.jsonl"], "does not use --dataset",
         grouped=True),
    Case("distill --alpha 2", ["distill.py", "--alpha", "2"], "--alpha", grouped=True),
    Case("distill --temperature 0", ["distill.py", "--temperature", "0"], "--temperature", grouped=True),
    Case("benchmark --smoke --sizes", ["benchmark_kernels.py", "--smoke", "--sizes", "64"], "--sizes", grouped=True),
    Case("benchmark --tune --kernels", ["benchmark_kernels.py", "--tune", "--kernels", "rmsnorm"], "--kernels",
         grouped=True),
    Case("benchmark --sizes 0", ["benchmark_kernels.py", "--smoke", "--sizes", "0"], "--sizes", grouped=True),
    Case("benchmark --kernels bogus", ["benchmark_kernels.py", "--smoke", "--kernels", "bogus"], "bogus",
         grouped=True),
    Case("benchmark --dtype float64", ["benchmark_kernels.py", "--smoke", "--dtype", "float64"], "invalid choice",
         grouped=True),
    Case("benchmark without --smoke on a CPU", ["benchmark_kernels.py"], "--smoke", grouped=True),
    Case("trainer --optimizer adamw-triton", ["finetune_trainer.py", "--dataset", "examples/chat.jsonl",
                                              "--optimizer", "adamw-triton"], "adamw-triton", grouped=True),
    Case("trainer --cuda-graphs off", ["finetune_trainer.py", "--dataset", "examples/chat.jsonl",
                                       "--cuda-graphs", "off"], "--cuda-graphs", grouped=True),
    Case("trainer --optimizer-in-backward", ["finetune_trainer.py", "--dataset", "examples/chat.jsonl",
                                             "--optimizer-in-backward"],
         "does not use --optimizer-in-backward.*finetune_optimized.py takes it",
         grouped=True),
    Case("trainer --resume of the scripts' own checkpoint", ["finetune_trainer.py", *CHAT, "--resume", "{full}"],
         "not of the Trainer", grouped=True),
    Case("trainer --resume of a folder with no Trainer checkpoint",
         ["finetune_trainer.py", *CHAT, "--resume", "{tmp}/final"], "no Trainer checkpoint",
         setup=_write("final/model.safetensors", b"saved weights, no trainer state"), before_training=True),
    Case("trainer without --dataset", ["finetune_trainer.py"], "--dataset", grouped=True,
         part="data"),  # finetune_trainer.py, which the data part edits: usage_error, not SystemExit(text)
    Case("selfcheck --bogus", ["selfcheck.py", "--bogus"], "bogus", grouped=True),
    Case("a lesson's test file with an unknown argument", ["rmsnorm_test.py", "--bogus"],
         "unrecognized arguments: --bogus", grouped=True),
    # ---- values once accepted and then ignored, or refused without saying what to do ----
    Case("--eval-every without --dataset", ["finetune_baseline.py", "--eval-every", "1"], "--eval-every.*--dataset",
         grouped=True),
    Case("--model ''", ["finetune_baseline.py", "--model", ""], "--model ''", grouped=True),
    Case("--output-dir ''", ["finetune_baseline.py", "--output-dir", ""], "--output-dir: an empty path",
         grouped=True),
    Case("--kernels lora without --lora-r", ["finetune_optimized.py", "--kernels", "lora"], "--kernels lora.*--lora-r",
         grouped=True),
    Case("--lr-warmup-steps and --warmup-ratio", ["finetune_baseline.py", "--lr-warmup-steps", "1", "--warmup-ratio",
                                                  "0.9"], "choose one of --lr-warmup-steps", grouped=True),
    *[Case(f"{flag} {value}: a value that starts with '-'", ["finetune_baseline.py", flag, value],
           re.escape(f"{flag}={value}"), grouped=True) for flag, value in (("--lr", "-inf"), ("--tag", "-x"))],
    *[Case(f"--kernels {spec}", ["finetune_optimized.py", "--kernels", spec], "'none' alone", grouped=True)
      for spec in ("none,rmsnorm", "default,none")],
    Case("--data /dev/null", ["finetune_baseline.py", "--data", "/dev/null"], "not a regular file", grouped=True),
    Case("--epochs too few for a timed step", ["finetune_baseline.py", *CHAT, "--epochs", "1e-9"],
         r"--epochs 1e-09 is 1 step.*--timing-warmup-steps 0", grouped=True),
    *[Case(f"distill {flag} 99", ["distill.py", flag, "99"], f"{flag} 99: llama-tiny.* has only", grouped=True)
      for flag in ("--student-layers", "--teacher-layers")],
    *[Case(f"{argv[0]}: --eval-fraction with one usable row", [*argv, "--seq-len", "64", "--dataset",
                                                                 "examples/alpaca.jsonl"],
           r"1 of its 30 rows usable.*too long for seq_len 64.*--seq-len", part="data", grouped=True)
      for argv in (["finetune_optimized.py", "--epochs", "0.05"], ["finetune_trainer.py", "--lora-r", "4"])],
    Case("--dataset /dev/null", ["finetune_baseline.py", *RUN, "--dataset", "/dev/null"], "not a regular file",
         part="data", grouped=True),
    *[Case(f"--model {name}", ["finetune_baseline.py", *RUN, "--model", name], mentions, part="model", grouped=True)
      for name, mentions in (("llama-TINY", "spelled --model llama-tiny"),
                             ("examples/chat.jsonl", "is a file, not a model.*--dataset"))],
    Case("--model: a family the kernels do not know (GPT-2)", ["finetune_optimized.py", *RUN, "--model", "{tmp}/gpt2"],
         "this model is 'gpt2'.*--kernels none", part="model", setup=_gpt2, before_training=True),

    # ---- flags that must do what they say (probe) ----
    Case("profile --steps 2 records 2 steps", ["-c", PROFILER_WARNS_AS_2_11, "profile_baseline.py", "--steps", "2",
                                               "--seq-len", "32"],
         "Profiling 2 training steps", codes=(0,), check=_profiled_steps),
    Case("--warmup-steps: deprecated alias", ["finetune_baseline.py", "--steps", "2", "--warmup-steps", "1",
                                              "--seq-len", "32"], "deprecated.*--timing-warmup-steps.*--lr-warmup-steps",
         codes=(0,)),
    # ---- memory runs out (probe; at model build in the fine-tuning scripts: training.train, runs) ----
    # (found by the memory plan before the model is built: one line naming --batch-size, and a size that fits)
    *[Case(f"{s}: a batch far too large", [s, "--batch-size", "2000000000", *RUN], "plan needs.*--batch-size \\d+ \\(",
           codes=(2,)) for s in FT],
    Case("profile: a batch far too large", ["profile_baseline.py", "--batch-size", "2000000000", "--seq-len", "32",
                                            "--steps", "1"], "plan needs.*--batch-size \\d+ \\(", codes=(2,)),
    Case("profile: memory runs out building the model", ["-c", OOM_AT_BUILD, "profile_baseline.py", "--steps", "1"],
         "out of memory", codes=(1,)),
    Case("finetune: memory runs out building the model", ["-c", OOM_AT_BUILD, "finetune_baseline.py", *RUN],
         "out of memory", codes=(1,), part="runs"),
    # ---- Ctrl-C: one line, exit 130 (probe; the fine-tuning loop's: training.train, runs) ----
    # (mid-step: after a step's own log line, "/100000"; the memory plan printed before names "the optimizer step")
    Case("Ctrl-C: distill mid-step", ["distill.py", "--steps", "100000"], SHELL_INTERRUPT, codes=(130,), ctrl_c="/100000",
         check=_one_line),
    Case("Ctrl-C: distill at start-up", ["distill.py"], SHELL_INTERRUPT, codes=(130,), ctrl_c=True, check=_one_line),
    Case("Ctrl-C: benchmark mid-run", ["benchmark_kernels.py", "--smoke"], SHELL_INTERRUPT, codes=(130,),
         ctrl_c=" done", check=_one_line),
    Case("Ctrl-C: benchmark at start-up", ["benchmark_kernels.py", "--smoke"], SHELL_INTERRUPT, codes=(130,),
         ctrl_c=True),
    Case("Ctrl-C: profile mid-step", ["profile_baseline.py", "--steps", "100000"], SHELL_INTERRUPT, codes=(130,),
         ctrl_c="Warm-up", check=_one_line),
    Case("Ctrl-C: finetune mid-step", ["finetune_baseline.py", "--steps", "100000", "--log-every", "1"],
         SHELL_INTERRUPT, codes=(130,), ctrl_c="/100000", part="runs", check=_one_line),
    # ---- the kernel API ----
    Case("kernel API: triton imported first, then the README's order", ["-c", ANY_IMPORT_ORDER],
         r"kernels applied: rmsnorm x3, linear_cross_entropy x1, swiglu x1, rope x1", codes=(0,)),

    # ---- output directories: nothing lost (runs) ----
    Case("--output-dir under a file", ["finetune_baseline.py", *RUN, "--output-dir", "{tmp}/file/out"],
         "--output-dir", part="runs", setup=_write("file", "a file"), before_training=True),
    Case("--output-dir read-only", ["finetune_baseline.py", *RUN, "--output-dir", "/sys/probe_test_out"],
         "--output-dir", part="runs", before_training=True),
    Case("--output-dir holds another run's checkpoints", ["finetune_baseline.py", *CHAT, "--steps", "3",
                                                          "--output-dir", "{tmp}/ckpt"],
         "--resume|--overwrite-output-dir", part="runs", setup=_copy_checkpoint("full"), before_training=True),
    Case("--save-total-limit 1 keeps one checkpoint", ["finetune_baseline.py", *RUN, "--steps", "3", "--save-every",
                                                       "1", "--save-total-limit", "1", "--output-dir", "{tmp}/out"],
         "", codes=(0,), part="runs",
         check=lambda r, f: (None if _checkpoints(f) == ["checkpoint-3"] else f"checkpoints left: {_checkpoints(f)}")
         or _no_progress_bars(r, f)),
    Case("a NaN loss names the last good checkpoint", ["finetune_baseline.py", *RUN, "--steps", "6", "--lr", "1e30",
                                                       "--save-every", "1", "--output-dir", "{tmp}/out"],
         "loss.*checkpoint", codes=(1,), part="runs"),
    # ---- resume: the run that was saved, or what differs (runs) ----
    # five settings changed at once, in one run: each must be named (a line each, tests/runs_test.py)
    Case("resume with another --batch-size, --grad-accum, --no-packing, --train-on-prompt and --seq-len",
         ["finetune_baseline.py", *CHAT, "--steps", "3", "--resume", "{full}", "--batch-size", "1", "--grad-accum", "2",
          "--no-packing", "--train-on-prompt", "--seq-len", "64"],
         "--batch-size", part="runs", before_training=True,
         check=lambda r, f: next((f"{flag} is not named" for flag in
                                  ("--grad-accum", "--packing", "--train-on-prompt", "--seq-len")
                                  if flag not in r["text"]), None)),
    Case("resume with another dataset file", ["finetune_baseline.py", *CHAT, "--steps", "3", "--resume", "{full}",
                                              "--dataset", "examples/alpaca.jsonl"], "dataset", part="runs",
         before_training=True),
    Case("resume with more --steps", ["finetune_baseline.py", *CHAT, "--steps", "3", "--resume", "{full}"],
         "Resumed from", codes=(0,), part="runs"),
    *[Case(f"--resume {what}", ["finetune_baseline.py", *CHAT, "--steps", "3", "--resume", resume, *more],
           mentions, codes=(2,), part="runs", setup=setup, before_training=True)
      for what, resume, more, mentions, setup in (
          ("an empty directory", "{tmp}/empty", [], "checkpoint", lambda f: (f / "empty").mkdir()),
          ("a directory that is not a checkpoint", "{tmp}/notes", [], "checkpoint", _write("notes/notes.txt", "hi")),
          ("with model.safetensors truncated", "{tmp}/ckpt", [], "model.safetensors",
           _copy_checkpoint("full", lambda c: _truncate(c / "model.safetensors"))),
          ("with model.safetensors missing", "{tmp}/ckpt", [], "model.safetensors",
           _copy_checkpoint("full", lambda c: (c / "model.safetensors").unlink())),
          ("with trainer_state.pt missing", "{tmp}/ckpt", [], "trainer_state.pt",
           _copy_checkpoint("full", lambda c: (c / "trainer_state.pt").unlink())),
          ("with trainer_state.pt garbage", "{tmp}/ckpt", [], "trainer_state.pt",
           _copy_checkpoint("full", lambda c: (c / "trainer_state.pt").write_bytes(b"\x00garbage" * 100))),
          ("whose latest names a missing checkpoint", "{tmp}/ckpt", [], "checkpoint-9",
           _copy_checkpoint("full", lambda c: (c.parent / "latest").write_text("checkpoint-9\n"))),
          ("of a LoRA run into a full fine-tune", "{lora}", [], "lora", None),
          ("of a full fine-tune into a LoRA run", "{full}", ["--lora-r", "4"], "lora", None),
          ("with another --num-layers", "{full}", ["--num-layers", "1"], "layer", None),
          ("with a renamed tensor", "{tmp}/ckpt", [], "layers.0", _copy_checkpoint("full", _rename_a_key)),
          ("of another model", "{full}", ["--model", "{tmp}/other"], "model", _other_model),
      )],

    # ---- the data users bring (data) ----
    Case("--data with bytes that are not UTF-8", ["finetune_baseline.py", *RUN, "--data", "{tmp}/latin1.txt"],
         "UTF-8", codes=(2,), part="data", setup=_write("latin1.txt", "caf\xe9 cr\xe8me ".encode("latin-1") * 200)),
    Case("distill --data with bytes that are not UTF-8", ["distill.py", "--steps", "2", "--seq-len", "32", "--data",
                                                          "{tmp}/latin1.txt"],
         "UTF-8", codes=(2,), part="data", setup=_write("latin1.txt", "caf\xe9 cr\xe8me ".encode("latin-1") * 200)),
    Case("--dataset with bytes that are not UTF-8", ["finetune_baseline.py", *RUN, "--dataset", "{tmp}/rows.jsonl"],
         "UTF-8", codes=(2,), part="data",
         setup=_write("rows.jsonl", _rows(*CHAT_ROWS).encode() + b'{"text": "caf\xe9"}\n')),
    Case("a chat role 'wizard'", ["finetune_baseline.py", *RUN, "--seq-len", "64", "--dataset", "{tmp}/rows.jsonl"],
         "wizard", codes=(0, 2), part="data",
         setup=_write("rows.jsonl", _rows(*CHAT_ROWS, {"messages": [{"role": "wizard", "content": "Cast a spell."},
                                                                    {"role": "assistant", "content": "Done."}]}))),
    Case("ShareGPT conversations (from/value)", ["finetune_baseline.py", *RUN, "--seq-len", "128", "--dataset",
                                                 "examples/sharegpt.jsonl", "--eval-fraction", "0"],
         "", codes=(0,), part="data"),
    Case("examples longer than --seq-len are cut, and counted", ["finetune_baseline.py", *RUN, "--seq-len", "64",
                                                                 "--dataset", "examples/chat.jsonl"],
         r"\d+ (cut|truncated)|(cut|truncated)\D{0,20}\d+", codes=(0,), part="data"),
    Case("every example dropped: the count said", ["finetune_baseline.py", *RUN, "--seq-len", "16", "--drop-long",
                                                   "--dataset", "examples/chat.jsonl"],
         r"\d+.{0,40}(longer|dropped)", codes=(2,), part="data"),
    Case("--eval-dataset", ["finetune_baseline.py", *RUN, "--seq-len", "128", "--dataset", "examples/chat.jsonl",
                            "--eval-dataset", "examples/alpaca.jsonl"], r"eval \d", codes=(0,), part="data"),
    Case("a .parquet dataset without pyarrow", ["finetune_baseline.py", *RUN, "--dataset", "{tmp}/rows.parquet"],
         "pip install pyarrow", codes=(2,), part="data", setup=_write("rows.parquet", b"PAR1 not really")),
    *[Case(f"{s}: a hub dataset id without `datasets`", [s, *RUN, "--dataset", "someone/rows"],
           "pip install datasets", codes=(2,), part="data") for s in ("finetune_baseline.py", "profile_baseline.py")],
    Case("--dataset: no such file", ["finetune_baseline.py", *RUN, "--dataset", "{tmp}/missing.jsonl"],
         "missing.jsonl", codes=(2,), part="data"),
    Case("--dataset: a line that is not JSON", ["finetune_baseline.py", *RUN, "--dataset", "{tmp}/rows.jsonl"],
         "line 41", codes=(2,), part="data", setup=_write("rows.jsonl", _rows(*CHAT_ROWS) + "{oops\n")),
    Case("--data: an empty file", ["finetune_baseline.py", *RUN, "--data", "{tmp}/empty.txt"], "tokens",
         codes=(2,), part="data", setup=_write("empty.txt", "")),
    Case("--model: a directory whose config.json transformers refuses",
         ["finetune_baseline.py", *RUN, "--model", "{tmp}/model"], "could not load this directory", codes=(1,),
         part="model", setup=_write("model/config.json", '{"model_type": "llama", "hidden_size": "wide"}')),
    Case("--model: a directory without weights", ["finetune_baseline.py", *RUN, "--model", "{tmp}/model"],
         "could not load this directory", codes=(1,), part="model",
         setup=_write("model/config.json", '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                      '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}')),
    Case("distill --teacher: no such directory", ["distill.py", "--teacher", "{tmp}/none", "--steps", "2"],
         r"--teacher .*no such local directory", codes=(1,), part="model"),
    # ---- adapters (lora) ----
    Case("a LoRA adapter directory as --model", ["finetune_baseline.py", *RUN, "--model", "{lora}/checkpoint-2"],
         "adapter", codes=(2,), part="lora"),
    Case("a saved adapter names its base model", ["-c", "pass"], "", codes=(0,), part="lora",
         check=_adapter_names_its_base),
    # ---- chat.py and the prompts files (chat): one line, exit code 2, the flag the user typed ----
    *[Case(f"chat --model {what}", [*ASK, "--model", model, "Hi"], mentions, part="chat", grouped=True, setup=setup)
      for what, model, mentions, setup in (
          ("a folder without a model", "examples", "no model in this directory", None),
          ("README.md", "README.md", "not a directory or a .gguf file", None),
          ("llama-tiny", "llama-tiny", "random-weight preset.*nothing to say", None),
          ("with model.safetensors truncated", "{tmp}/m", "model.safetensors is truncated",
           _copy_model(lambda m: _truncate(m / "model.safetensors"))),
          ("an adapter whose adapter_config.json is not JSON", "{tmp}/ad", "adapter_config.json.*JSON",
           _adapter(text="{oops")),
          ("an adapter whose base was deleted", "{tmp}/ad", "base model .*/gone.* no longer exists",
           _adapter("{tmp}/gone")),
          ("an adapter whose base has other shapes", "{tmp}/ad", "does not fit its base model",
           _adapter("{tmp}/other")),
      )],
    Case("chat: an adapter on its base", [*ASK, "--model", "{tmp}/ad", "Hi"], "LoRA adapter on", codes=(0,),
         part="chat", grouped=True, setup=_adapter("{full}/checkpoint-2"), check=_answered("Hi")),
    *[Case(f"chat: {what}", [*ASK, "--model", "{full}/checkpoint-2", *args], mentions, part="chat", grouped=True,
           setup=setup)
      for what, args, mentions, setup in (
          ("an empty question", [""], "the question is empty", None),
          ("a blank --prompt", ["--prompt", "  \t"], "--prompt is empty", None),
          ("a question that is not UTF-8", ["caf\udce9"], "not UTF-8.*0xe9", None),
          ("a question that is not UTF-8, --json", ["--json", "caf\udce9"], "not UTF-8.*0xe9", None),
          ("a question longer than the context", ["word " * 2100], r"[\d,]+ tokens .*at most 2,048 positions", None),
          ("a prompts file that is not UTF-8", ["--prompts-file", "{tmp}/p.txt"], "--prompts-file .*line 2.*UTF-8",
           _write("p.txt", "Hello?\ncaf\xe9?\n".encode("latin-1"))),
          ("a prompts file with a bad JSON line", ["--prompts-file", "{tmp}/p.jsonl"], "--prompts-file .*line 1",
           _write("p.jsonl", "{oops\n")),
          ("an empty prompt in a JSON array", ["--prompts-file", "{tmp}/p.json"], "--prompts-file .*item 2.*empty",
           _write("p.json", '["Hi?", " "]')),
      )],
    *[Case(f"chat: a prompts file, {what}",
           [*ASK, "--model", "{full}/checkpoint-2", "--prompts-file", f"{{tmp}}/{name}"],
           r"answered 1 of 2 prompts, about \d+ s left", codes=(0,), part="chat", grouped=True,
           setup=_write(name, text), check=_answered("First?", "Second?"))
      for what, name, text in (("a JSON array", "p.json", '[\n "First?",\n "Second?"\n]\n'),
                               ("a JSON array without a suffix", "prompts", '["First?", "Second?"]'),
                               (".JSONL in capitals", "p.JSONL", '{"prompt": "First?"}\n{"prompt": "Second?"}\n'),
                               ("text", "p.txt", "# two questions\nFirst?\n\nSecond?\n"))],
    Case("chat: a reader that goes away (| head)", ["{tmp}/run.py"], "", codes=(141,), part="chat", grouped=True,
         setup=_chat_into("pipe"), check=_quiet),
    Case("chat: stdout on a full disk", ["{tmp}/run.py"], "writing the answers .*failed.*No space left", codes=(1,),
         part="chat", grouped=True, setup=_chat_into("full")),
    *[Case(f"{s} --sample-prompts", [s, *more, "--sample-prompts", "examples/prompts.txt"],
           "does not use --sample-prompts|--sample-prompts belongs", part="chat", grouped=True)
      for s, more in (("distill.py", []), ("profile_baseline.py", []),
                      ("finetune_trainer.py", ["--dataset", "examples/chat.jsonl"]))],
    *[Case(f"--sample-prompts {what}", ["finetune_baseline.py", "--sample-prompts", f"{{tmp}}/{name}"], mentions,
           part="chat", grouped=True, setup=_write(name, text))
      for what, name, text, mentions in (
          ("a JSON object", "p.json", '{"prompt": "Hi?"}', "--sample-prompts .*not an array"),
          (".JSONL in capitals with a bad line", "p.JSONL", '{"prompt": "Hi?"}\n[1]\n', "line 2: needs a \"prompt\""),
          ("not UTF-8", "p.txt", "caf\xe9?\n".encode("latin-1"), "--sample-prompts .*line 1.*UTF-8"),
      )],
    Case("distill --teacher: a truncated .gguf", ["distill.py", "--teacher", "{tmp}/t.gguf", "--steps", "2"],
         r"--teacher .*t\.gguf: transformers could not read", codes=(1,), part="chat", grouped=True,
         setup=_write("t.gguf", b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)),
]

# The fixtures: two short runs whose checkpoints the resume cases start from (a --dataset run and a LoRA run).
FIXTURE_RUNS = {
    "full": ["finetune_baseline.py", *CHAT, "--steps", "2", "--save-every", "1"],
    "lora": ["finetune_baseline.py", *RUN, "--lora-r", "4", "--save-every", "2"],
}
FIXTURES: dict = {}


# ------------------------------------------------------------------------------------------------
# Running the cases
# ------------------------------------------------------------------------------------------------
# One child process runs the grouped cases, each as `python <script> <args>` would (runpy, run_name
# '__main__'), and writes [exit code, stdout + stderr] per case; an exception that escapes is written
# as the traceback Python would print.
_GROUP_RUNNER = """
import contextlib, io, json, runpy, signal, sys, traceback
cases_file, out_file = sys.argv[1:3]
cases = json.load(open(cases_file))
out = []
def too_long(*_):
    raise TimeoutError('probe: the case ran past 60 s')
signal.signal(signal.SIGALRM, too_long)
for argv in cases:
    if argv is None:  # its set-up failed
        out.append([None, ''])
        continue
    text = io.StringIO()
    sys.argv = list(argv)
    signal.alarm(60)
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_path(argv[0], run_name='__main__')
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            code = 1
            print('Traceback (most recent call last):', traceback.format_exc(), file=sys.stderr)
    signal.alarm(0)
    out.append([code, text.getvalue()])
json.dump(out, open(out_file, 'w'))
"""


def _env():
    """A user's environment: without the TRITON_INTERPRET=1 that conftest.py's start-up sets in this test
    process (the scripts set it themselves; the kernel-API case must not find it set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path(HERE)}


def _argv(case: Case, folder: Path, index: int) -> list:
    places = {"{tmp}": str(folder), **{f"{{{name}}}": str(path) for name, path in FIXTURES.items()}}
    argv = [re.sub(r"\{(tmp|full|lora)\}", lambda m: places[m.group(0)], a) for a in case.argv]
    script = argv[0] if argv[0] != "-c" else argv[2] if len(argv) > 2 else ""
    if script.startswith(("finetune", "profile", "distill")) and "--tag" not in argv:
        argv += ["--tag", f"{TAG}{index}", "--overwrite"]
    return argv


def _run(case: Case, folder: Path, index: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    argv = _argv(case, folder, index)
    start = time.perf_counter()
    try:
        if case.setup is not None:
            case.setup(folder)
        if case.ctrl_c:
            code, text = interrupt(*argv, ready=None if case.ctrl_c is True else case.ctrl_c)
            text = text.split("\n", 1)[1] if text.startswith("inherited") else text  # the test's own line
        else:
            out = subprocess.run([sys.executable, *argv], cwd=HERE, capture_output=True, text=True, timeout=240,
                                 env=_env())
            code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired:
        code, text = None, "(no exit after 240 s)"
    except BaseException as err:  # noqa: BLE001 (a failed set-up or Ctrl-C helper: reported as the case's)
        code, text = None, f"probe: {type(err).__name__}: {err}"
    return {"argv": argv, "code": code, "text": text, "seconds": time.perf_counter() - start}


def _run_group(cases: list, folder: Path) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    argvs = [_argv(c, folder / f"g{i}", i) for i, c in enumerate(cases)]
    failed = {}  # a case whose set-up failed: reported as its outcome, not run
    for i, c in enumerate(cases):
        if c.setup is not None:
            (folder / f"g{i}").mkdir(parents=True, exist_ok=True)
            try:
                c.setup(folder / f"g{i}")
            except Exception as err:  # noqa: BLE001
                failed[i] = f"probe: the set-up failed: {type(err).__name__}: {err}"
                argvs[i] = None  # the runner skips it
    (folder / "cases.json").write_text(json.dumps(argvs))
    out = subprocess.run([sys.executable, "-c", _GROUP_RUNNER, str(folder / "cases.json"), str(folder / "out.json")],
                         cwd=HERE, capture_output=True, text=True, timeout=600, env=_env())
    if out.returncode != 0 or not (folder / "out.json").is_file():
        return [{"argv": a, "code": None, "text": f"the group runner failed: {out.stderr[-2000:]}", "seconds": 0}
                for a in argvs]
    argvs = [a or [] for a in argvs]
    return [{"argv": a, "code": None if i in failed else code, "text": failed.get(i, text), "seconds": 0}
            for i, (a, (code, text)) in enumerate(zip(argvs, json.loads((folder / "out.json").read_text())))]


def classify(case: Case, result: dict, folder: Path) -> tuple[str, str]:
    """(outcome, why): clean error, handled, traceback, silent, unclear or hang."""
    code, text = result["code"], result["text"]
    if code is None:
        return "hang", text[-300:]
    if "Traceback (most recent call last)" in text:
        return "traceback", _last_lines(text)
    named = re.search(case.mentions, text, re.IGNORECASE | re.DOTALL) is not None if case.mentions else True
    if code == 0:
        if 0 not in case.codes:
            return "silent", f"exit 0 where an error was due ({case.codes}); {_last_lines(text)}"
        wrong = (None if named else f"the output does not match {case.mentions!r}") or \
            (case.check(result, folder) if case.check else None)
        return ("silent", f"{wrong}; {_last_lines(text)}") if wrong else ("handled", "")
    if code not in case.codes:
        return "unclear", f"exit {code}, expected {case.codes}; {_last_lines(text)}"
    if not named:
        return "unclear", f"the message does not match {case.mentions!r}: {_last_lines(text)}"
    if case.before_training and re.search(r"^Training: ", text, re.MULTILINE):
        return "unclear", f"the error came after training started: {_last_lines(text)}"
    wrong = case.check(result, folder) if case.check else None
    return ("unclear", wrong) if wrong else ("clean error", "")


def _last_lines(text: str, n: int = 3) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-500:]


def _selected(items) -> set | None:
    """The names of the selected cases; None (every case) when test_summary is selected."""
    if any(item.name == "test_summary" for item in items):
        return None
    specs = [getattr(item, "callspec", None) for item in items]
    return {spec.params["case"].name for spec in specs if spec is not None and "case" in spec.params}


def start_in_background(items, tmp: Path):
    """Start the selected cases (`items`: the session's tests of this file) in one child process, which
    runs them as `outcomes` would and writes the outcomes to a file: (process, that file, its log).
    conftest.py calls this when the session starts; `outcomes` collects them.

    Why: the cases are ~50 processes that each start Python and torch, four minutes of two cores' work,
    while the rest of the suite mostly keeps one core busy. The child runs at a lower priority (its
    cases inherit it), so it takes the time the other tests leave idle, in its own process: the
    environment it passes on is the session's as it started (not one a test has just monkeypatched),
    and the models some cases build draw from its own random generator, not the tests'."""
    names = _selected(items)
    (tmp / "names.json").write_text(json.dumps(None if names is None else sorted(names)))
    log = tmp / "probe.log"
    with open(log, "w") as log_file:  # a file, not a pipe: a full pipe would stall the child
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--background", str(tmp)], cwd=HERE,
                                stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": python_path(HERE, HERE / "tests")})
    with contextlib.suppress(OSError, AttributeError):  # a lower priority (AttributeError: no os.setpriority)
        os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
    return proc, tmp / "outcomes.json", log


def _background(tmp: Path) -> int:
    """The child process of `start_in_background`."""
    names = json.loads((tmp / "names.json").read_text())
    out = _run_all(tmp / "cases", None if names is None else set(names))
    (tmp / "outcomes.json").write_text(json.dumps(out))
    return 0


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, probe_runs_in_background) -> dict:
    """The selected cases run, two at a time (every case when test_summary is selected): {case name:
    (outcome, why, seconds)}. `pytest tests/probe_test.py -k resume` runs the resume cases alone.
    They were started with the session (conftest.py, `start_in_background`); without that, here."""
    if probe_runs_in_background is None:
        return _run_all(tmp_path_factory.mktemp("probe"), _selected(request.session.items))
    proc, out, log = probe_runs_in_background
    try:
        proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"the probe cases' child process failed (exit code {proc.returncode}): "
                    f"{log.read_text()[-3000:]}")
    return {name: tuple(o) for name, o in json.loads(out.read_text()).items()}


def _run_all(root: Path, names: set | None = None) -> dict:
    cases = [c for c in CASES if names is None or c.name in names]
    fixture_out = {name: root / name / "out" for name in FIXTURE_RUNS}
    FIXTURES.update(fixture_out)
    with ThreadPoolExecutor(2) as pool:
        setups = [pool.submit(_run, Case(name, [*argv, "--output-dir", str(fixture_out[name])]), root / name, 900 + i)
                  for i, (name, argv) in enumerate(FIXTURE_RUNS.items())]
        for name, future in zip(FIXTURE_RUNS, setups):
            r = future.result()
            if r["code"] != 0:
                print(f"probe: the fixture run {name} failed: {_last_lines(r['text'])}", file=sys.stderr)
        grouped = [c for c in cases if c.grouped]
        halves = [grouped[0::2], grouped[1::2]]
        group_futures = [pool.submit(_run_group, half, root / f"group{k}") if half else None
                         for k, half in enumerate(halves)]
        single = [(CASES.index(c), c) for c in cases if not c.grouped]
        # the longest first: Ctrl-C and profiling runs, then the rest
        single.sort(key=lambda ic: (not ic[1].ctrl_c, "profile" not in ic[1].name))
        futures = {c.name: pool.submit(_run, c, root / f"case{i}", i) for i, c in single}
        results = {}
        for half, future in zip(halves, group_futures):
            for c, r in zip(half, future.result() if future else []):
                results[c.name] = r
        for name, future in futures.items():
            results[name] = future.result()
    out = {}
    for c in cases:
        outcome, why = classify(c, results[c.name], root / f"case{CASES.index(c)}")
        out[c.name] = (outcome, why, results[c.name]["seconds"])
    _clean_results()
    return out


def _clean_results():
    for path in [*RESULTS_DIR.glob(f"{TAG}*"), *(RESULTS_DIR / "traces").glob(f"{TAG}*")]:
        path.unlink(missing_ok=True)


def summary(outcomes: dict) -> str:
    counts = {k: sum(o == k for o, _, _ in outcomes.values())
              for k in ("clean error", "handled", "traceback", "silent", "unclear", "hang")}
    return (f"probe: {len(outcomes)} cases: {counts['clean error']} clean errors, {counts['handled']} handled "
            f"correctly, {counts['traceback']} tracebacks, {counts['silent']} silent, {counts['unclear']} unclear "
            f"(wrong exit code or message), {counts['hang']} hangs")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case, outcomes):
    outcome, why, _ = outcomes[case.name]
    assert outcome in ("clean error", "handled"), f"{outcome} (part: {case.part}): {why}"


def test_summary(outcomes, capsys):
    line = summary(outcomes)
    failing = [f"  {outcomes[c.name][0]:<11} [{c.part}] {c.name}: {outcomes[c.name][1][:300]}"
               for c in CASES if outcomes[c.name][0] not in ("clean error", "handled")]
    with capsys.disabled():
        print("\n" + "\n".join([line, *failing]))
    assert len(CASES) == len({c.name for c in CASES}), "case names must be unique"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--background"]:  # start_in_background's child
        sys.exit(_background(Path(sys.argv[2])))
    sys.exit(run_as_script(__name__, "Bad input to every script, as a user gives it: probe report"))
