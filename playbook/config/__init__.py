"""Command-line arguments of the fine-tuning, profiling and distillation scripts, checked once into a frozen `RunConfig`.

Every script builds its parser with `make_parser()` (playbook/config/flags.py), so `--model`, `--batch-size`,
`--kernels` and the rest mean the same thing everywhere. `parse_config()` checks every value before any model
is built (a bad argument exits with code 2 and one line saying what is wrong) and fills the defaults that
depend on the machine (a GPU gets the 8B architecture at 4 x 2048 tokens, a CPU the tiny preset).

The RunConfig (playbook/sections.py) is made of sections, one small frozen dataclass each, in the order of the
command line's argument groups: `cfg.run`, `cfg.model`, `cfg.memory`, `cfg.data`, `cfg.training` and
`cfg.output`. Each section is checked and built by its own function here. The names the scripts import from
this module (make_parser, the ScriptDefaults, RunConfig, ...) stay importable from it.

What differs between the scripts is data, not a test of the script's name: each script passes its
`ScriptDefaults` (BASELINE, OPTIMIZED, TRAINER, PROFILE, DISTILL) to `parse_config`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import replace

import torch

from core.fp8_support import EMULATED, emulated_name
from playbook.config.flags import (FP8_DEFAULT_RECIPE, FP8_RECIPES, FULL_LR, LORA_LR, MAX_INT,
                                   TAG_PATTERN,  # noqa: F401
                            TIMING_WARMUP, _Kernels, deprecated, fraction, make_parser, nonnegative_float,
                            nonnegative_int, positive_float, positive_int, refuse_unused, unused_options)
from playbook.memory import options
from playbook.model.presets import DEFAULT_MODEL
from playbook.model.registry import parse_kernels
from playbook.optim import schedule
from playbook.plan import check
from playbook.runtime import environment
from playbook.runtime.common import usage_error
from playbook.sections import (BASELINE, DISTILL, OPTIMIZED, PROFILE, SCRIPTS, SECTIONS, TRAINER,  # noqa: F401
                               DataSection, ExtraSection, MemorySection, ModelSection, OutputSection, RunConfig,
                               RunSection, ScriptDefaults, TrainingSection, resumable, resumable_settings,
                               script_defaults)


def default_rounding(optimizer: str, master_weights: str, lora_r: int, extra: ExtraSection | None = None) -> str:
    """--optimizer-rounding where the command line gives none: "auto" (rounding.choose_rounding picks kahan
    or stochastic as the run starts) where the Triton AdamW updates bf16 weights of a full fine-tune without
    --master-weights; "nearest" elsewhere (PyTorch's AdamW, LoRA's fp32 adapters, distill.py --dtype float32),
    where there is nothing to choose."""
    if (optimizer != "adamw-triton" or master_weights != "none" or lora_r
            or (extra or ExtraSection()).dtype != "bfloat16"):
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
    model, memory = _model_section(a, defaults, gpu, sharded)
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
                    or (extra or ExtraSection()).mode != "baseline"):
        from core.kernel_utils import interpreting

        if os.environ.get("TRITON_INTERPRET") is not None and not interpreting():  # =0, false, off: kept as set
            raise usage_error(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} on a machine without a CUDA "
                              "GPU: Triton then compiles for a GPU, and the kernels cannot run here; unset "
                              "TRITON_INTERPRET (on a CPU the kernels run in Triton's interpreter), or run without "
                              "them (--kernels none)")
    run = RunSection(script=defaults.name, device=device, seed=a.seed, defaults=defaults)
    cfg = RunConfig(run=run, model=model, memory=memory, data=data, training=training, output=output, extra=extra)
    _check_timed_steps(cfg, defaults)
    return cfg


def _check_timed_steps(cfg: RunConfig, defaults: ScriptDefaults) -> None:
    """--steps must leave a timed step after --timing-warmup-steps: checked last, once the whole run is known, so
    that a run too large for the memory says that first (plan/check.problem), in the same line."""
    steps, warmup = cfg.training.steps, cfg.training.warmup_steps
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


def _model_section(a: argparse.Namespace, defaults: ScriptDefaults, gpu: bool,
                   sharded: bool) -> tuple[ModelSection, MemorySection]:
    """The model section and the memory section, checked together (in the order of the flags' rules)."""
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
    memory = options.from_flags(a)
    needs_lora = [flag for flag, given in (("--lora-alpha", a.lora_alpha is not None), ("--lora-dropout",
                                                                                        a.lora_dropout),
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
    model = ModelSection(
        model=a.model or (DEFAULT_MODEL if gpu else "llama-tiny"), model_explicit=a.model is not None,
        num_layers=a.num_layers, kernels=tuple(kernels), fp8=a.fp8, fp8_backend=a.fp8_backend,
        fp8_recipe=fp8_recipe,
        fp8_layers=a.fp8_layers or "auto", compile=a.compile, lora_r=a.lora_r, lora_alpha=a.lora_alpha,
        lora_dropout=a.lora_dropout, lora_targets=a.lora_targets, merge_lora=a.merge_lora,
        load_in_4bit=a.load_in_4bit)
    return model, memory


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
        schedule.check_warmup(a.lr_warmup_steps, steps)
    warmup_steps = a.warmup_steps
    if warmup_steps is TIMING_WARMUP:  # not given: 2, fewer where --steps leaves none timed (--steps 2: 1); the
        # profile's --steps are the recorded ones, after its warm-up: 2 there
        warmup_steps = min(2, steps - 1) if steps is not None and defaults.timed_steps else 2
    elif warmup_steps is None:  # a script's parser may leave it open: 2 on a GPU, 1 on a CPU, one step still timed
        warmup_steps = min(2 if gpu else 1, steps - 1) if steps is not None else (2 if gpu else 1)
    optimizer = _optimizer(a, defaults, gpu, model)
    if a.optimizer_in_backward:
        clash = [flag for flag, on in (("--max-grad-norm", a.max_grad_norm is not None), ("--grad-accum",
                                                                                          a.grad_accum > 1),
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
