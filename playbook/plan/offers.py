"""The options that would fit: where a run's plan does not fit the free memory, each option that brings its peak
under, planned as the run it makes will start.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace

from core import gpu_arch
from core.process import world
from playbook.memory import options
from playbook.model.registry import parse_kernels
from playbook.plan.estimate import combine
from playbook.plan.inputs import Setup, Shape
from playbook.plan.rounding import rounding_for
from playbook.plan.runs import run_plans
from playbook.sections import RunConfig

LORA_DEFAULT_RANK = 16
MAX_INT = 2**31 - 1  # the largest count or size an option takes (config.MAX_INT): an offer never goes past it
MEMORY_OPTIONS = "memory"  # an Offer's kind: it trains the same model the same way, in less memory
OTHER_TRAINING = "other"  # trains something else: adapters instead of the weights, a quantized base, other kernels
SIZE = "size"  # fewer tokens per micro-batch


@dataclass(frozen=True)
class Offer:
    """An option the plan offers where a run does not fit, and the run it makes.

    text     as the error line names it
    add      the command-line words it gives; drop: the flags it takes out (with their values)
    script   another script to run it with (the baseline's way to this project's kernels); None: the same one
    changes  the RunConfig's fields as the command line, so changed, makes them
    variants further changes that command line may make as well (an --optimizer default that the flags dropped
             had set): each is planned, and the offer's peak is the largest
    kind     MEMORY_OPTIONS, OTHER_TRAINING or SIZE
    peak     the peak the run it makes plans, as it starts (a rounding left open chosen as start() chooses it)"""

    text: str
    add: tuple = ()
    drop: tuple = ()
    script: str | None = None
    changes: dict = field(default_factory=dict)
    variants: tuple = ()
    kind: str = MEMORY_OPTIONS
    peak: float = math.inf


def offers(cfg: RunConfig, free: float, where: str = "") -> list[Offer]:
    """The options that bring this run's peak under `free`, each planned as the run it makes will start (its
    config changed as its command line would change it, every model the run holds, the rounding start() would
    choose), closest to this run first: each option alone, the memory options together where none alone fits,
    the largest batch that fits (its --grad-accum keeping the tokens of a step), else the longest sequence.
    None is a command the script refuses, and none proposes a --seq-len past the positions the model was
    trained on. `cfg`: the run as its command line gave it (optimizer_rounding "auto" where left open)."""
    plans = run_plans(cfg)
    if not plans:
        return []
    single = [planned(cfg, o, free, where) for o in _options(cfg, plans[-1][1], plans[-1][2])]
    fits = [o for o in single if o.peak <= free]
    if not [o for o in fits if o.kind == MEMORY_OPTIONS]:
        together = _together([o for o in single if o.kind == MEMORY_OPTIONS])
        if together is not None:
            together = planned(cfg, together, free, where)
            if together.peak <= free:
                fits.append(together)
    size = _smaller_run(cfg, plans[-1][1], free, where)
    if size is not None:
        fits.append(size)
    return sorted(fits, key=lambda o: -o.peak)  # the closest to this run first


def planned(cfg: RunConfig, offer: Offer, free: float, where: str) -> Offer:
    """The offer with its peak: the largest of the runs its command line may make."""
    peaks = [peak_as_run(cfg.changed(**{**offer.changes, **variant}), free, where)
             for variant in ({}, *offer.variants)]
    return replace(offer, peak=max(peaks))


def peak_as_run(cfg: RunConfig, free: float, where: str) -> float:
    """The peak of the plan the run of `cfg` will print as it starts: a rounding left open ("auto") chosen as
    start() chooses it, for the free memory `free` (`where`: where that figure comes from)."""
    if cfg.training.optimizer_rounding == "auto":
        cfg = replace(cfg, training=replace(cfg.training, optimizer_rounding=rounding_for(cfg, free, where)[0]))
    plans = run_plans(cfg)
    return combine(plans).peak if plans else math.inf


def _refuses(cfg: RunConfig, dest: str) -> bool:
    """Whether the script refuses the shared option `dest` (distill.py refuses --grad-accum, for one): its own
    section of the RunConfig lists those it refuses as `refused_options`."""
    return cfg.extra is not None and dest in cfg.extra.refused_options


def _explicit_rounding(cfg: RunConfig) -> list[str]:
    """The flags of the command line that set how the Triton AdamW rounds (a rounding start() chose is not one)."""
    flags = []
    if cfg.training.optimizer_rounding in ("stochastic", "kahan"):
        flags.append(f"--optimizer-rounding {cfg.training.optimizer_rounding}")
    if cfg.training.master_weights == "fp32":
        flags.append("--master-weights fp32")
    return flags


def _default_optimizer(cfg: RunConfig, kernels) -> str:
    """--optimizer as config.parse_config chooses it where the command line names none and no rounding flag
    implies the Triton AdamW."""
    if not cfg.on_gpu:
        return "adamw-foreach"
    own = cfg.run.defaults is None or cfg.run.defaults.own_optimizer
    return "adamw-triton" if "adamw" in kernels and own else "adamw-fused"


def _options(cfg: RunConfig, shape: Shape, s: Setup) -> list[Offer]:
    """Each option alone that needs less memory than this run, as the command line takes it (config.py's
    refusals: an option that clashes with one already given is offered with that one dropped, or not at all)."""
    found = []
    plain = "plain" in (s.layer_kinds or ("plain",))
    # The roundings that keep small updates in less memory than the run's (start() chooses kahan only where
    # it fits, so a run that stops was given its rounding)
    if cfg.training.master_weights == "fp32":
        for rounding in ("kahan", "stochastic"):
            found.append(Offer(f"--optimizer-rounding {rounding} instead of --master-weights fp32",
                               add=("--optimizer-rounding", rounding), drop=("--master-weights",),
                               changes=dict(master_weights="none", optimizer_rounding=rounding)))
    if cfg.training.optimizer_rounding == "kahan":
        found.append(Offer("--optimizer-rounding stochastic instead of kahan",
                           add=("--optimizer-rounding", "stochastic"), drop=("--optimizer-rounding",),
                           changes=dict(optimizer_rounding="stochastic")))
    ctx = options.Context(on_gpu=cfg.on_gpu, compile=cfg.model.compile, seq_len=cfg.data.seq_len, tokens=s.tokens,
                          plain=plain,
                          own_kernels=s.kernels == "playbook")
    found += [Offer(**suggestion._asdict()) for suggestion in options.offers(options.values(cfg), ctx)]
    if (not cfg.model.lora_r and not cfg.training.optimizer_in_backward and cfg.training.grad_accum == 1
        and cfg.training.max_grad_norm is None
            and world()[1] == 1 and (cfg.run.defaults is None or cfg.run.defaults.own_optimizer)
            and not _refuses(cfg, "optimizer_in_backward")):
        found.append(Offer("--optimizer-in-backward", add=("--optimizer-in-backward",),
                           changes=dict(optimizer_in_backward=True)))
    if not cfg.model.lora_r:
        given = _explicit_rounding(cfg)  # LoRA's fp32 adapters lose nothing to rounding: refused with them
        default = _default_optimizer(cfg, cfg.model.kernels)
        found.append(Offer(f"--lora-r {LORA_DEFAULT_RANK}" + (f" without {' and '.join(given)}" if given else ""),
                           add=("--lora-r", str(LORA_DEFAULT_RANK)),
                           drop=tuple(flag.split()[0] for flag in given),
                           changes=dict(lora_r=LORA_DEFAULT_RANK, optimizer_rounding="nearest", master_weights="none"),
                           variants=({"optimizer": default},) if given and default != cfg.training.optimizer else (),
                           kind=OTHER_TRAINING))
    elif not cfg.model.load_in_4bit and not cfg.model.fp8 and not cfg.model.merge_lora:  # (--merge-lora: a quantized base is refused)
        if not cfg.on_gpu or _capability(cfg.run.device) >= (8, 9):
            found.append(Offer("--fp8 (the frozen projections in FP8)", add=("--fp8",), changes=dict(fp8=True),
                               kind=OTHER_TRAINING))
        if importlib.util.find_spec("bitsandbytes") is not None:
            found.append(Offer("--load-in-4bit", add=("--load-in-4bit",), changes=dict(load_in_4bit=True),
                               kind=OTHER_TRAINING))
    if (s.kernels != "playbook" or s.loss != "fused") and cfg.extra is None:  # (distill.py's losses: --mode)
        kernels = tuple(parse_kernels("default"))
        baseline = cfg.run.defaults is not None and cfg.run.defaults.huggingface_attention  # (it has no --kernels)
        default = _default_optimizer(cfg, kernels)
        variants = ()
        if default == "adamw-triton" and cfg.training.optimizer != default:  # its default where --optimizer is not given
            variants = ({"optimizer": default, "optimizer_rounding": "auto" if not cfg.model.lora_r and
                         cfg.training.master_weights == "none" else cfg.training.optimizer_rounding},)
        found.append(Offer("finetune_optimized.py (this project's kernels)" if baseline
                           else "--kernels default (this project's kernels)",
                           add=("--kernels", "default"), drop=("--kernels",),
                           script="finetune_optimized" if baseline else None, changes=dict(kernels=kernels),
                           variants=variants, kind=OTHER_TRAINING))
    return found


def _capability(device) -> tuple:
    return tuple(gpu_arch.device_capability(device))


def _together(memory: list[Offer]) -> Offer | None:
    """The memory options together, where none alone fits (the rounding that needs none rather than kahan,
    no --recompute-norms once every layer is checkpointed)."""
    names, add, drop, changes = [], [], [], {}
    for o in memory:
        if o.text.startswith("--optimizer-rounding kahan") or (
                o.text == "--recompute-norms" and any(n.startswith("--gradient-checkpointing") for n in names)):
            continue
        names.append(o.text)
        add += o.add
        drop += [f for f in o.drop if f not in drop]
        changes.update(o.changes)
    if len(names) < 2:
        return None
    return Offer("together: " + ", ".join(names), add=tuple(add), drop=tuple(drop), changes=changes)


def _smaller_run(cfg: RunConfig, shape: Shape, free: float, where: str) -> Offer | None:
    """The run with fewer tokens per micro-batch that fits, closest to this one: the model's positions where
    --seq-len goes past them; else the largest --batch-size (with --grad-accum keeping the tokens of a step,
    where the batch divides and the script takes it); else at --batch-size 1 the longest --seq-len, never past
    the model's positions."""
    positions = shape.positions
    if positions and cfg.data.seq_len > positions:
        text = f"--seq-len {positions} (the {positions:,} positions {trained_model(cfg)} was trained on)"
        o = planned(cfg, Offer(text, add=("--seq-len", str(positions)), drop=("--seq-len",),
                               changes=dict(seq_len=positions), kind=SIZE), free, where)
        if o.peak <= free:
            return o
    for batch in _halves(cfg.data.batch_size):
        accum = cfg.training.grad_accum * cfg.data.batch_size // batch
        keep = (cfg.data.batch_size % batch == 0 and accum <= MAX_INT and not cfg.training.optimizer_in_backward
                and not _refuses(cfg, "grad_accum"))
        words = ("--batch-size", str(batch)) + (("--grad-accum", str(accum)) if keep else ())
        o = planned(cfg, Offer(" ".join(words), add=words, drop=("--batch-size", "--grad-accum") if keep
                               else ("--batch-size",), changes=dict(batch_size=batch, **({"grad_accum": accum} if keep
                                                                                         else {})), kind=SIZE),
                    free, where)
        if o.peak <= free:
            return o
    for seq in _shorter(cfg.data.seq_len, positions):
        words = (("--batch-size", "1") if cfg.data.batch_size > 1 else ()) + ("--seq-len", str(seq))
        o = planned(cfg, Offer(" ".join(words), add=words, drop=tuple(w for w in words if w.startswith("--")),
                               changes=dict(batch_size=1, seq_len=seq), kind=SIZE), free, where)
        if o.peak <= free:
            return o
    return None


def trained_model(cfg: RunConfig) -> str:
    """The model a run trains: --model, or distill.py's student."""
    return (cfg.extra is not None and cfg.extra.student) or cfg.model.model


def _halves(n: int):
    while n > 1:
        n //= 2
        yield n


def _shorter(seq: int, positions: int | None):
    """Sequence lengths below `seq`, longest first: the model's positions where `seq` is past them, then the
    powers of two below both."""
    top = seq - 1
    if positions and top >= positions:
        yield positions
        top = positions - 1
    power = 1 << (top.bit_length() - 1) if top >= 1 else 0
    while power >= 1:
        yield power
        power //= 2
