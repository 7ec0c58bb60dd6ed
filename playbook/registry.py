"""The one place that knows the kernels: their names, the default set, and how they patch a model.

    >>> import apply_kernels as ak
    >>> ak.KERNEL_NAMES
    ('rmsnorm', 'cross_entropy', 'linear_cross_entropy', 'swiglu', 'rope', 'projections')
    >>> report = ak.apply_kernels(model)                    # DEFAULT_KERNELS
    >>> report = ak.apply_kernels(model, "rmsnorm,cross_entropy")

A kernel's name is the stem of its files: `<name>_kernel.py` holds the kernel, its launcher, its
`autograd.Function`, its Hugging Face drop-in and `patch_model(model) -> int` (how many modules or
functions it replaced) with `expected_patches(config) -> int`; `<name>_test.py` tests it. Adding a
kernel is those two files and one line in `KERNELS` below. The same names are what
`--kernels` takes in `profile_baseline.py`, `finetune_optimized.py` and `benchmark_kernels.py`.

Families (model_families.py): llama, mistral, qwen2, qwen3, gemma, gemma2, phi3. A kernel that does
not apply to a model (an MLP activation the fused MLP does not compute; Gemma 2's final-logit
softcap, which the fused lm_head + loss must then apply itself) is left out, and said so in one
line, `apply_kernels: swiglu not applied to this gemma model: ...`, and in `report.not_applied`;
the other kernels still apply. A family no kernel knows is refused as a whole.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

# name -> what it replaces in a Hugging Face causal LM (printed in reports and the README's table)
KERNELS = {
    "rmsnorm": "every RMSNorm module -> TritonRMSNorm (fused forward, one-pass backward)",
    "cross_entropy": "the loss on the logits -> fused cross-entropy (gradient written into the logits)",
    "linear_cross_entropy": "lm_head + loss -> fused linear cross-entropy (the logits are never built)",
    "swiglu": "every MLP -> act(gate) * up fused (SwiGLU, or GeGLU for Gemma), recomputed in backward",
    "rope": "the family's apply_rotary_pos_emb -> fused RoPE (forward and backward in one kernel)",
    "projections": "q/k/v and gate/up -> one matmul each (weights placed side by side; same Parameters)",
}
KERNEL_NAMES = tuple(KERNELS)
DEFAULT_KERNELS = ("rmsnorm", "linear_cross_entropy", "swiglu", "rope", "projections")  # the fastest measured set
PEERS = ("liger",)  # other kernel libraries, applied to the same model for side-by-side runs
EXCLUSIVE = (("cross_entropy", "linear_cross_entropy"),)  # two losses cannot both own the loss


@dataclass(frozen=True)
class KernelReport:
    """What `apply_kernels` did: for each kernel, how many modules or functions it replaced."""

    replaced: dict  # name -> count
    peer: str | None = None
    not_applied: dict = field(default_factory=dict)  # name -> why the kernel does not apply to this model

    @property
    def names(self) -> tuple:
        return (self.peer,) if self.peer else tuple(self.replaced)

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
    if isinstance(spec, str):
        words = [w.strip().lower() for w in spec.split(",") if w.strip()]
    else:
        words = [str(w).strip().lower() for w in spec]
    if words in ([], ["none"]):
        return ()
    if words in (["all"], ["default"]):
        return DEFAULT_KERNELS
    unknown = [w for w in words if w not in KERNELS and w not in PEERS]
    if unknown:
        raise ValueError(f"unknown kernel name(s) {', '.join(unknown)}; choose from {', '.join(KERNEL_NAMES)}, "
                         f"a peer ({', '.join(PEERS)}), 'default' or 'none'")
    if len(set(words)) != len(words):
        raise ValueError(f"a kernel is named twice in {spec!r}")
    if any(w in PEERS for w in words) and len(words) > 1:
        raise ValueError(f"a peer library ({', '.join(PEERS)}) applies its own set and cannot be mixed with other kernels")
    for group in EXCLUSIVE:
        if all(name in words for name in group):
            raise ValueError(f"choose one of {' / '.join(group)}: both replace the loss")
    return tuple(sorted(words, key=lambda w: KERNEL_NAMES.index(w) if w in KERNELS else -1))


def kernel_module(name: str):
    """The module `<name>_kernel` (imported on first use)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose from {', '.join(KERNEL_NAMES)}")
    return importlib.import_module(f"{name}_kernel")


def not_applicable(name: str, model) -> str | None:
    """Why kernel `name` cannot run on this model although its family is supported, or None.

    Decided before patching, from the family's architecture: Gemma 2 caps its final logits,
    `cap * tanh(logits / cap)`, between the lm_head and the loss. The cross-entropy kernel replaces
    only the loss and receives capped logits; the fused lm_head + loss never builds the logits, so
    it applies only in a version that takes the cap (a `softcap` argument).
    """
    from playbook.model_families import final_logit_softcap

    cap = final_logit_softcap(model.config)
    if name == "linear_cross_entropy" and cap is not None:
        fused = getattr(kernel_module(name), "linear_cross_entropy", None)
        if fused is None or "softcap" not in inspect.signature(fused).parameters:
            return (f"this model caps its logits before the loss (final_logit_softcapping={cap}), which this fused "
                    f"lm_head + loss does not do; use cross_entropy, which receives the capped logits")
    return None


def apply_kernels(model, kernels=DEFAULT_KERNELS, verbose: bool = False) -> KernelReport:
    """Patch a Hugging Face causal LM in place with the named kernels; return what was replaced.

    Each replacement count is checked against the architecture (for example 2 RMSNorms per layer
    plus the final one for LLaMA): a model of an unexpected shape raises instead of training with
    half its modules unpatched. A kernel that does not apply to this model's family (see
    `not_applicable`, or a kernel's own NotImplementedError, raised before it patches anything) is
    left out with a one-line message and listed in `report.not_applied`.
    """
    from playbook.common import log

    names = parse_kernels(kernels)
    if names and names[0] in PEERS:
        report = KernelReport(replaced={}, peer=apply_peer(model, names[0]))
    else:
        from playbook.model_families import model_type

        # a clear error for an unsupported family, before anything is patched
        kind = model_type(model) if names else None
        replaced, not_applied = {}, {}
        for name in names:
            module = kernel_module(name)
            why = not_applicable(name, model)
            if why is None:
                try:
                    count = module.patch_model(model)
                except NotImplementedError as err:
                    why = str(err)
            if why is not None:
                not_applied[name] = why
                log(f"apply_kernels: {name} not applied to this {kind} model: {why}")
                continue
            expected = module.expected_patches(model.config)
            if count != expected:
                raise RuntimeError(f"{name}: replaced {count}, expected {expected} for this "
                                   f"{model.config.model_type} model of {model.config.num_hidden_layers} layers")
            replaced[name] = count
        report = KernelReport(replaced=replaced, not_applied=not_applied)
    if verbose:
        log(f"apply_kernels: {report.describe()}")
        for name in report.replaced:
            log(f"  {name:<21} {KERNELS[name]}")
    return report


def apply_peer(model, peer: str) -> str:
    """Liger-Kernel's own set (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) on the same model."""
    if peer != "liger":
        raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    try:
        import liger_kernel.transformers as liger
    except ImportError as err:
        raise RuntimeError(f"--kernels liger needs Liger-Kernel (pip install liger-kernel): {err}") from None
    fn = getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}", None)
    if fn is None:
        raise RuntimeError(f"Liger-Kernel has no kernels for model type {model.config.model_type!r}")
    fn(model=model)
    return f"liger {getattr(liger, '__version__', '')}".strip()


if __name__ == "__main__":
    print("kernels:", ", ".join(KERNEL_NAMES))
    print("default:", ",".join(DEFAULT_KERNELS))
    for n, what in KERNELS.items():
        print(f"  {n:<21} {what}")
