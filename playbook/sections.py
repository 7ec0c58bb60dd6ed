"""The RunConfig and its sections: what a run is, as frozen dataclasses (no parsing here; playbook/config/
builds them from the command line).

The RunConfig holds one small frozen dataclass per section, in the order of the command line's argument
groups: `cfg.run` (RunSection: which script, on what device), `cfg.model` (ModelSection), `cfg.memory`
(MemorySection: the memory options), `cfg.data` (DataSection), `cfg.training` (TrainingSection) and
`cfg.output` (OutputSection), then `cfg.extra`, a script's own section (distill.py's). A field a resumed run
must keep is marked `resumable(flag, place)`: the settings every checkpoint stores (playbook/run/resume.py)
are those fields (`resumable_settings()`), by their own names, as are the summaries' `config`
(`RunConfig.as_dict()`, flat, as before the sections were nested).

What differs between the scripts is data, not a test of the script's name: each script passes its
`ScriptDefaults` (BASELINE, OPTIMIZED, TRAINER, PROFILE, DISTILL below) to `config.parse_config`. This module
sits below every other part of playbook/, so that each can name the types it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import torch


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
    (lora_r = 0: a full fine-tune, and the other LoRA fields are unused). The memory options: MemorySection."""

    model: str = resumable("--model", 1)
    model_explicit: bool  # False: the default model, which may fall back to the 8B preset
    num_layers: int | None = resumable("--num-layers", 2)
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
class MemorySection:
    """The memory options: which activations are kept, recomputed or moved to host memory
    (playbook/memory/activations.py), and the MLP in chunks. None is resumable: they change no result."""

    gradient_checkpointing: bool  # some decoder layers are recomputed in backward (checkpoint_layers says which)
    checkpoint_layers: str | None  # the --checkpoint-layers SPEC (activations.parse_layers); "all" for
    # --gradient-checkpointing
    offload_activations: bool  # the checkpointed layers' inputs kept in pinned host memory
    # (playbook/memory/activations.py)
    keep_attention: bool  # checkpointed layers keep attention's forward outputs instead of recomputing them
    recompute_norms: bool  # plain layers keep each norm's input, not its output, and run the norm again in backward
    offload_layers: str | None  # the --offload-layers SPEC: plain layers whose saved tensors wait in host memory
    mlp_chunk_tokens: int  # each MLP computed over chunks of this many tokens; 0: in one piece


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


SECTIONS = {"run": RunSection, "model": ModelSection, "memory": MemorySection, "data": DataSection,
            "training": TrainingSection, "output": OutputSection}
# Each section's field -> the section that holds it: the names a checkpoint's settings, a summary's config and the
# memory plan's offers use (every field name is one section's only)
FIELD_SECTIONS = {f.name: name for name, kind in SECTIONS.items() for f in fields(kind)}
# The flat form (as_dict) keeps the order of the summaries written while RunConfig held every field itself: the
# memory options where ModelSection held them, after num_layers
_FLAT_AFTER = {"num_layers": "memory"}


class ExtraSection:
    """A script's own section of the command line (make_parser's `extra`; `RunConfig.extra`): what the library
    asks of one, answered as for a script with nothing of its own. distill.py's DistillConfig and
    profile_baseline.py's ProfileSection subclass it, and their fields of the same names override these."""

    unused: dict = {}  # the shared options the script refuses: option dest -> why (or None); flags.refuse_unused
    refused_options: frozenset = frozenset()  # the shared options the memory plan must not offer
    mode: str = "baseline"  # the loss computation (distill.py --mode); "baseline": the model's own
    dtype: str = "bfloat16"  # the trained weights' dtype (distill.py --dtype)
    student: str | None = None  # the model trained, where --model does not name it (distill.py --student)

    def plan_models(self) -> list | None:
        """The models the memory plan counts, where they are not --model's: None."""
        return None


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run, fully described: what the scripts, the loop and the summary read (never mutated).

    One field per section, in the sections' order (run, model, memory, data, training, output), then `extra`:
    a script's own section (distill.py's `DistillConfig`), None for the scripts without one.
    """

    run: RunSection
    model: ModelSection
    memory: MemorySection
    data: DataSection
    training: TrainingSection
    output: OutputSection
    extra: ExtraSection | None = None

    @property
    def on_gpu(self) -> bool:
        return self.run.device.type == "cuda"

    def value(self, name: str):
        """A field's value by its own name, whichever section holds it (FIELD_SECTIONS): the names of a
        checkpoint's settings and of a summary's config."""
        return getattr(getattr(self, FIELD_SECTIONS[name]), name)

    def changed(self, **values) -> "RunConfig":
        """This RunConfig with fields changed, each named by its own name (FIELD_SECTIONS), as a summary's config
        and the memory plan's offers name them; `extra` by its own."""
        by_section: dict = {}
        for name, v in values.items():
            if name != "extra":
                by_section.setdefault(FIELD_SECTIONS[name], {})[name] = v
        sections = {name: replace(getattr(self, name), **changes) for name, changes in by_section.items()}
        return replace(self, **sections, **({"extra": values["extra"]} if "extra" in values else {}))

    def as_dict(self) -> dict:
        """Every field as JSON can hold it (paths and devices as text, `extra` as a nested dict), flat: each
        section's fields under their own names, in the order summaries and checkpoints have always held them
        (_FLAT_AFTER); the script's defaults are left out (`script` names them)."""
        out: dict = {}
        for name in SECTIONS:
            if name in _FLAT_AFTER.values():
                continue
            for key, v in _as_dict(getattr(self, name)).items():
                out[key] = v
                if key in _FLAT_AFTER:
                    out.update(_as_dict(getattr(self, _FLAT_AFTER[key])))
        out["extra"] = _as_dict(self.extra) if is_dataclass(self.extra) else self.extra
        return out


def resumable_settings() -> dict:
    """Every field marked `resumable`, name -> flag, in the order of their places."""
    marked = sorted((f for kind in SECTIONS.values() for f in fields(kind) if "resume" in f.metadata),
                    key=lambda f: f.metadata["resume_place"])
    places = [f.metadata["resume_place"] for f in marked]
    if len(set(places)) != len(places):
        raise ValueError(f"two resumable fields share a place: {places}")
    return {f.name: f.metadata["resume"] for f in marked}


def _as_dict(section) -> dict:
    return {f.name: (_as_dict(v) if is_dataclass(v) else str(v) if isinstance(v, (Path, torch.device)) else v)
            for f in fields(section) if f.name != "defaults" for v in [getattr(section, f.name)]}
