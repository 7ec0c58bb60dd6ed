"""The registry: every optimization a user can switch on, in one table, by the name every script takes.

    >>> from playbook.startup import start
    >>> start()                                                  # first: Triton's interpreter without a GPU
    >>> from playbook.model import registry
    >>> [o.name for o in registry.OPTIMIZATIONS]
    ['rmsnorm', 'cross_entropy', 'linear_cross_entropy', 'swiglu', 'rope', 'projections', 'fp8', 'adamw',
     'lora', 'distillation']
    >>> report = registry.apply_kernels(model)                   # DEFAULT_KERNELS
    >>> report = registry.apply_kernels(model, "rmsnorm,cross_entropy")

The same names go to `--kernels` in `finetune_optimized.py`, `profile_baseline.py`,
`finetune_trainer.py`, `distill.py` and `benchmark_kernels.py`. Two entries have a switch of their own
(`flag`): the FP8 projections are `--fp8` and the Triton AdamW `--optimizer adamw-triton`; in a script's
`--kernels` their names are deprecated spellings of those flags (one line says so). `--kernels none` is
plain PyTorch, `--kernels liger` Liger-Kernel's own set, a peer to compare with.

Each entry says what it replaces, when it applies, how many replacements to expect, its lesson
(`kernel`, `test`), its benchmark (`benchmark_kernels.py --kernels <name>`), whether a run selects it
(`selected(cfg)`) and what it does to a model (`apply`: the model entries patch it, fp8 converts its
projections; models.prepare_model applies them in registry order). Adding a kernel is its
`<name>_kernel.py` (with `patch_model(model) -> int` and `expected_patches(config) -> int` when it
patches a model), its `<name>_test.py`, one line in `OPTIMIZATIONS` and one row in
docs/optimizations.md; tests/registry_test.py checks all four.

Where an entry acts (`scope`):
    model         apply_kernels patches the Hugging Face model (modules or functions), counts checked
    fp8           the decoder's seven projections as FP8 matmuls (models.prepare_model, after the model kernels)
    optimizer     the optimizer the training loop builds (optim/optimizer.py, make_optimizer)
    lora          the LoRA adapters' forward and backward (lora.lora_from_config, with --lora-r)
    distillation  the distillation losses (distill.py)

Families (model_families.py): llama, mistral, qwen2, qwen3, gemma, gemma2, phi3. A model kernel that
does not apply to a model (an MLP activation the fused MLP does not compute; Gemma 2's final-logit
softcap, which the fused lm_head + loss must then apply itself) is left out with one line,
`apply_kernels: swiglu not applied to this gemma model: ...`, and listed in `report.not_applied`;
the other kernels still apply. A family no kernel knows is refused as a whole.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from core.model_families import final_logit_softcap
from core.process import log
from playbook.sections import RunConfig
from playbook.memory import options


# Each lesson is imported only when its entry is used (importing a kernel file imports Triton): by the
# module name of its `kernel` file (importlib), or by the entry's own `load`.
def _fp8():
    import fp8_linear_kernel

    return fp8_linear_kernel


class NotApplicable(Exception):
    """A model kernel that does not apply to this model (its family's architecture); the message says why."""


def patch(entry: "Optimization", model, cfg: RunConfig | None = None) -> int:
    """A model entry's `apply`: its lesson's patch_model(model), the count checked against expected_patches.
    Raises NotApplicable, before anything is patched, where the kernel does not apply to this model."""
    module = entry.module
    why = not_applicable(entry.name, model)
    if why is not None:
        raise NotApplicable(why)
    try:
        count = module.patch_model(model)
    except NotImplementedError as err:  # raised before the kernel patches anything
        raise NotApplicable(str(err)) from None
    expected = module.expected_patches(model.config)
    if count != expected:
        raise RuntimeError(f"{entry.name}: replaced {count}, expected {expected} for this "
                           f"{model.config.model_type} model of {model.config.num_hidden_layers} layers")
    return count


def convert_fp8(entry: "Optimization", model, cfg: RunConfig) -> int:
    """The fp8 entry's `apply`: apply_fp8 with the run's --fp8-backend, --fp8-recipe and --fp8-layers, the
    producers linked as far as --compile, --mlp-chunk-tokens and --lora-r allow."""
    return apply_fp8(model, cfg.model.fp8_backend, cfg.model.compile, cfg.model.fp8_recipe, cfg.model.fp8_layers,
                     chunked_mlp=options.mlp_tiled(options.values(cfg)), lora=bool(cfg.model.lora_r))


def apply_fp8(model, backend: str = "playbook", compiled: bool = False, recipe: str = "rowwise",
              layers: str = "all", *, chunked_mlp: bool = False, lora: bool = False) -> int:
    """--fp8: the decoder's projections as FP8 matmuls; returns how many. fp8_producers_kernel.apply converts
    them as --fp8-recipe and --fp8-layers say, links the producers (what `compiled`, `chunked_mlp` and `lora`
    allow) and logs it; --fp8-backend torchao: torchao's float8 training (row-wise scales, as ours) on the
    same projections, a peer to compare with."""
    if backend == "torchao":
        import fp8_linear_kernel

        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as err:
            raise SystemExit(f"error: --fp8-backend torchao needs torchao (pip install torchao): {err}") from None
        wanted = {id(getattr(owner, name)) for owner, name in fp8_linear_kernel.projections(model)}
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, fqn: id(module) in wanted)
        converted = sum(type(getattr(owner, name)).__module__.startswith("torchao")
                        for owner, name in fp8_linear_kernel.projections(model))
        log(f"FP8 (torchao, row-wise recipe): {converted} decoder projections converted; lm_head and embeddings stay "
            "bf16" + ("" if compiled else "; torchao's casts are meant to be fused by torch.compile: add --compile"))
        return converted
    import fp8_producers_kernel

    try:
        return fp8_producers_kernel.apply(model, recipe, layers, compiled=compiled, chunked_mlp=chunked_mlp, lora=lora)
    except RuntimeError as err:  # a GPU without the recipe's FP8 matmuls: one line, not a traceback
        raise SystemExit(f"error: --fp8: {err}") from None


@dataclass(frozen=True)
class Optimization:
    name: str  # what --kernels takes
    scope: str  # where it acts: model, fp8, optimizer, lora, distillation (module docstring)
    replaces: str  # what it replaces, printed in reports
    applies: str  # when it applies
    expect: str  # how many replacements to expect (the model kernels check it: expected_patches)
    kernel: str  # its lesson: the kernel file ...
    test: str  # ... and its test file
    benchmarks: tuple  # benchmark_kernels.py entries that time it; () if the training step is its benchmark
    flag: str | None = None  # its own switch on the command line, where it has one (--kernels <name> is then a
    # deprecated spelling of it); None: --kernels selects it
    switch: Callable = field(repr=False, compare=False, default=None)  # switch(cfg): whether a run selects it;
    # None: named in cfg.kernels
    apply: Callable = field(repr=False, compare=False, default=None)  # apply(entry, model, cfg): what it does to a
    # model (models.prepare_model applies the model and fp8 entries in registry order); None: it acts elsewhere
    load: Callable = field(repr=False, compare=False, default=None)  # imports the kernel file; None: by its name
    more: tuple = ()  # further lessons of the entry, (kernel file, test file) each, built on the first

    @property
    def module(self):
        return self.load() if self.load is not None else importlib.import_module(self.kernel.removesuffix(".py"))

    def selected(self, cfg: RunConfig) -> bool:
        """Whether the run `cfg` switches this entry on (by --kernels, or by its own flag)."""
        return self.switch(cfg) if self.switch is not None else self.name in cfg.model.kernels

    def apply_to(self, model, cfg: RunConfig | None = None):
        """Apply this entry to `model` (its `apply`), for the run `cfg`."""
        if self.apply is None:
            raise ValueError(f"{self.name} acts outside the model's modules: {ACTS_ELSEWHERE[self.name]}")
        return self.apply(self, model, cfg)

    @property
    def lessons(self) -> tuple:
        """Every (kernel file, test file) pair of the entry: its own, then `more`."""
        return ((self.kernel, self.test), *self.more)


OPTIMIZATIONS = (
    Optimization("rmsnorm", "model", "every RMSNorm module -> TritonRMSNorm (fused forward, one-pass backward)",
                 "every family", "2 per decoder layer + the final norm (Gemma 2: 4 per layer + 1)",
                 "rmsnorm_kernel.py", "rmsnorm_test.py", ("rmsnorm",), apply=patch),
    Optimization("cross_entropy", "model", "the loss on the logits -> fused cross-entropy (gradient written into the logits)",
                 "every family; instead of linear_cross_entropy", "1 (the causal LM's loss)",
                 "cross_entropy_kernel.py", "cross_entropy_test.py", ("cross_entropy",), apply=patch),
    Optimization("linear_cross_entropy", "model", "lm_head + loss -> fused linear cross-entropy (the logits are never built)",
                 "every family (Gemma 2 with its final-logit softcap)", "1 (the causal LM's forward)",
                 "linear_cross_entropy_kernel.py", "linear_cross_entropy_test.py", ("linear_cross_entropy",),
                 apply=patch),
    Optimization("swiglu", "model", "every MLP -> act(gate) * up fused (SwiGLU, or GeGLU for Gemma), recomputed in backward",
                 "families with a gated MLP", "1 per decoder layer",
                 "swiglu_kernel.py", "swiglu_test.py", ("swiglu",), apply=patch),
    Optimization("rope", "model", "the family's apply_rotary_pos_emb -> fused RoPE (forward and backward in one kernel)",
                 "every family (partial rotary too)", "1 (the family module's function)",
                 "rope_kernel.py", "rope_test.py", ("rope",), apply=patch),
    Optimization("projections", "model", "q/k/v and gate/up -> one matmul each (weights placed side by side; same Parameters)",
                 "one process (not under FSDP2)", "2 per decoder layer",
                 "projections_kernel.py", "projections_test.py", ("projections",), apply=patch),
    Optimization("fp8", "fp8", "q/k/v/o and gate/up/down projections -> FP8 matmuls as --fp8-recipe says",
                 "GPUs of compute capability 8.9+ (and the CPU, for tests)", "7 per decoder layer",
                 "fp8_linear_kernel.py", "fp8_linear_test.py", (),
                 flag="--fp8", switch=lambda cfg: cfg.model.fp8, apply=convert_fp8, load=_fp8,
                 more=(("fp8_recipes_kernel.py", "fp8_recipes_test.py"),
                       ("fp8_producers_kernel.py", "fp8_producers_test.py"), ("fp8_lora_kernel.py", "fp8_lora_test.py"),
                       ("mx_quant_kernel.py", "mx_quant_test.py"))),
    Optimization("adamw", "optimizer", "torch's AdamW -> one Triton launch per parameter group",
                 "a GPU, the scripts' own loop, one process or FSDP2 (elsewhere, in the default set, PyTorch's AdamW)",
                 "1 optimizer",
                 "adamw_kernel.py", "adamw_test.py", ("adamw",),
                 flag="--optimizer adamw-triton", switch=lambda cfg: cfg.training.optimizer == "adamw-triton"),
    Optimization("lora", "lora", "peft's LoRA forward -> base and adapter in one autograd node, bf16 saved inputs",
                 "with --lora-r (peft adapters on the projections)", "1 per adapted projection",
                 "lora_kernel.py", "lora_test.py", (),
                 switch=lambda cfg: "lora" in cfg.model.kernels and bool(cfg.model.lora_r)),
    Optimization("distillation", "distillation", "teacher/student logits + JSD -> fused linear JSD (no logits built)",
                 "distill.py --mode fused", "the distillation loss",
                 "distillation_kernel.py", "distillation_test.py", ("jsd", "linear_jsd"),
                 switch=lambda cfg: cfg.extra is not None and cfg.extra.mode != "baseline"),
)
BY_NAME = {o.name: o for o in OPTIMIZATIONS}
NAMES = tuple(BY_NAME)
KERNEL_NAMES = tuple(o.name for o in OPTIMIZATIONS if o.scope == "model")  # what apply_kernels patches
KERNELS = {o.name: o.replaces for o in OPTIMIZATIONS}
FLAGS = {o.name: o.flag for o in OPTIMIZATIONS if o.flag}  # names whose own switch is a flag (--kernels fp8: --fp8)
DEFAULT_KERNELS = ("rmsnorm", "linear_cross_entropy", "swiglu", "rope", "projections", "adamw", "lora")  # the fastest measured set
PEERS = ("liger",)  # other kernel libraries, applied to the same model for side-by-side runs
EXCLUSIVE = (("cross_entropy", "linear_cross_entropy"),)  # two losses cannot both own the loss


@dataclass(frozen=True)
class KernelReport:
    """What `apply_kernels` did: for each kernel, how many modules or functions it replaced."""

    replaced: dict  # name -> count (the model kernels)
    peer: str | None = None
    not_applied: dict = field(default_factory=dict)  # name -> why the kernel does not apply to this model
    selected: tuple = ()  # every name asked for, in registry order (fp8, adamw, lora act outside apply_kernels)

    @property
    def names(self) -> tuple:
        """What is on: the peer, or the model kernels that applied plus the entries that act elsewhere."""
        if self.peer:
            return (self.peer,)
        return tuple(n for n in self.selected if n in self.replaced or BY_NAME[n].scope != "model")

    def describe(self) -> str:
        if self.peer:
            return f"{self.peer} (peer library)"
        parts = [f"{name} x{count}" for name, count in self.replaced.items()]
        parts += [f"{name} not applied" for name in self.not_applied]
        if not self.replaced:
            parts.insert(0, "none (plain PyTorch)")
        return ", ".join(parts)


def parse_kernels(spec) -> tuple:
    """'rmsnorm,linear_cross_entropy' -> ('rmsnorm', 'linear_cross_entropy'), checked.

    Also takes 'none' (nothing), 'all' / 'default' (DEFAULT_KERNELS), a peer ('liger'), or a
    sequence of names. Raises ValueError with the valid names for anything else.
    """
    if spec is None:  # neither 'none' nor 'default' can be guessed from it
        raise TypeError("kernels=None: pass 'none' (or ()) for plain PyTorch, 'default' for the default set, or "
                        "the names, as a comma-separated string or a sequence")
    if isinstance(spec, str):
        words = [w.strip().lower() for w in spec.split(",")]
        if "" in words and any(words):  # 'rmsnorm,,swiglu': a name left out (an unset shell variable?)
            raise ValueError(f"an empty kernel name in {spec!r} (two commas in a row, or a comma at an end); "
                             "name each kernel once, separated by single commas")
        words = [w for w in words if w]
    else:
        words = [str(w).strip().lower() for w in spec]
    if words in ([], ["none"]):
        return ()
    if "none" in words:
        raise ValueError(f"'none' means no kernel at all, and {spec if isinstance(spec, str) else ','.join(words)!r} "
                         "names others too: give 'none' alone, or the names without it")
    words = ["default" if w == "all" else w for w in words]  # 'all': an older spelling of 'default'
    if "default" in words:  # 'default' plus more names: the default set and those
        at = words.index("default")
        words = words[:at] + [w for w in DEFAULT_KERNELS if w not in words] + words[at + 1:]
    unknown = [w for w in words if w not in BY_NAME and w not in PEERS]
    if unknown:
        raise ValueError(f"unknown kernel name(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}, "
                         f"a peer ({', '.join(PEERS)}), 'default' or 'none'")
    if len(set(words)) != len(words):
        raise ValueError(f"a kernel is named twice in {spec!r}")
    if any(w in PEERS for w in words) and len(words) > 1:
        raise ValueError(f"a peer library ({', '.join(PEERS)}) applies its own set and cannot be mixed with other kernels")
    for group in EXCLUSIVE:
        if all(name in words for name in group):
            raise ValueError(f"choose one of {' / '.join(group)}: both replace the loss")
    return tuple(sorted(words, key=lambda w: NAMES.index(w) if w in BY_NAME else -1))


def kernel_module(name: str):
    """The kernel file of entry `name` (imported on first use)."""
    if name not in BY_NAME:
        raise ValueError(f"unknown kernel {name!r}; choose from {', '.join(NAMES)}")
    return BY_NAME[name].module


def not_applicable(name: str, model) -> str | None:
    """Why kernel `name` cannot run on this model although its family is supported, or None.

    Decided before patching, from the family's architecture: Gemma 2 caps its final logits,
    `cap * tanh(logits / cap)`, between the lm_head and the loss. The cross-entropy kernel replaces
    only the loss and receives capped logits; the fused lm_head + loss never builds the logits, so
    it applies only in a version that takes the cap (a `softcap` argument).
    """
    cap = final_logit_softcap(model.config)
    if name == "linear_cross_entropy" and cap is not None:
        fused = getattr(kernel_module(name), "linear_cross_entropy", None)
        if fused is None or "softcap" not in inspect.signature(fused).parameters:
            return (f"this model caps its logits before the loss (final_logit_softcapping={cap}), which this fused "
                    f"lm_head + loss does not do; use cross_entropy, which receives the capped logits")
    return None


# Where the entries that are not model patches act, for a caller of apply_kernels who names one of them.
ACTS_ELSEWHERE = {
    "fp8": "playbook.model.registry.apply_fp8(model) converts the projections (the scripts: --fp8)",
    "adamw": "adamw_kernel.TritonAdamW is the optimizer (the scripts: --optimizer adamw-triton)",
    "lora": "playbook.model.lora.apply_lora(model, r) adds the adapters, then lora_kernel.patch_model(peft_model) fuses "
            "them (the scripts: --lora-r)",
    "distillation": "distillation_kernel.linear_jsd is the distillation loss (distill.py --mode fused)",
}


def conversions(cfg: RunConfig) -> tuple:
    """The entries beyond the model kernels that have an `apply` and that the run `cfg` selects, in registry
    order (fp8, with --fp8): models.prepare_model applies them right after apply_kernels."""
    return tuple(o for o in OPTIMIZATIONS if o.scope != "model" and o.apply is not None and o.selected(cfg))


def apply_kernels(model, kernels=DEFAULT_KERNELS, verbose: bool = False, others_applied: bool = False) -> KernelReport:
    """Patch a Hugging Face causal LM in place with the named kernels; return what was replaced.

    Each replacement count is checked against the architecture (for example 2 RMSNorms per layer
    plus the final one for LLaMA): a model of an unexpected shape raises instead of training with
    half its modules unpatched. A kernel that does not apply to this model's family (see
    `not_applicable`, or a kernel's own NotImplementedError, raised before it patches anything) is
    left out with a one-line message and listed in `report.not_applied`.

    The entries that act outside the model's modules (fp8, adamw, lora, distillation: ACTS_ELSEWHERE)
    are the caller's to apply, as `models.prepare_model` and the training loop do (`others_applied`).
    Named alone, with `others_applied` False, they are refused: nothing here would apply them.
    """
    names = parse_kernels(kernels)
    if names and not others_applied and all(BY_NAME.get(n) is not None and BY_NAME[n].scope != "model"
                                            for n in names):
        raise ValueError(f"apply_kernels patches the model's modules, and {', '.join(names)} act elsewhere: "
                         + "; ".join(f"{n}: {ACTS_ELSEWHERE[n]}" for n in names))
    if names and names[0] in PEERS:
        report = KernelReport(replaced={}, peer=apply_peer(model, names[0]))
    else:
        from core.model_families import model_type

        # a clear error for an unsupported family, before anything is patched
        kind = model_type(model) if names else None
        replaced, not_applied = {}, {}
        for entry in (BY_NAME[n] for n in names if BY_NAME[n].scope == "model"):  # the others act elsewhere (docstring)
            try:
                replaced[entry.name] = entry.apply_to(model)
            except NotApplicable as err:
                not_applied[entry.name] = str(err)
                log(f"apply_kernels: {entry.name} not applied to this {kind} model: {err}")
        report = KernelReport(replaced=replaced, not_applied=not_applied, selected=names)
    if verbose:
        log(f"apply_kernels: {report.describe()}")
        for name in report.replaced:
            log(f"  {name:<21} {KERNELS[name]}")
        for name in (n for n in names if n in BY_NAME and BY_NAME[n].scope != "model"):
            log(f"  {name:<21} {KERNELS[name]} (applies: {BY_NAME[name].applies})")
    return report


def in_effect(report: KernelReport, optimizer: str, lora_r: int | None) -> tuple:
    """`report.names` as a run uses them, for its labels: adamw only when the optimizer is the Triton AdamW
    (the default set leaves PyTorch's AdamW on a CPU and in the Trainer), lora only with
    adapters (--lora-r)."""
    return tuple(n for n in report.names if (n != "adamw" or optimizer == "adamw-triton") and (n != "lora" or lora_r))


def apply_peer(model, peer: str) -> str:
    """Liger-Kernel's own set (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) on the same model."""
    if peer != "liger":
        raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    try:
        import liger_kernel.transformers as liger
    except ImportError as err:  # the scripts refuse --kernels liger before this (config.parse_config)
        raise ImportError(f"the peer 'liger' needs Liger-Kernel: pip install liger-kernel ({err})") from None
    fn = getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}", None)
    if fn is None:
        raise RuntimeError(f"Liger-Kernel has no kernels for model type {model.config.model_type!r}")
    fn(model=model)
    return f"liger {getattr(liger, '__version__', '')}".strip()
