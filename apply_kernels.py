"""The one place that knows the kernels: their names, the default set, and how they patch a model.

    >>> import apply_kernels as ak
    >>> ak.KERNEL_NAMES
    ('rmsnorm', 'cross_entropy', 'linear_cross_entropy', 'swiglu', 'rope')
    >>> report = ak.apply_kernels(model)                    # DEFAULT_KERNELS
    >>> report = ak.apply_kernels(model, "rmsnorm,cross_entropy")

A kernel's name is the stem of its files: `<name>_kernel.py` holds the kernel, its launcher, its
`autograd.Function`, its Hugging Face drop-in and `patch_model(model) -> int` (how many modules or
functions it replaced) with `expected_patches(config) -> int`; `<name>_test.py` tests it. Adding a
kernel is those two files and one line in `KERNELS` below. The same names are what
`--kernels` takes in `profile_baseline.py`, `finetune_optimized.py` and `benchmark_kernels.py`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# name -> what it replaces in a Hugging Face causal LM (printed in reports and the README's table)
KERNELS = {
    "rmsnorm": "every RMSNorm module -> TritonRMSNorm (fused forward, one-pass backward)",
    "cross_entropy": "the loss on the logits -> fused cross-entropy (gradient written into the logits)",
    "linear_cross_entropy": "lm_head + loss -> fused linear cross-entropy (the logits are never built)",
    "swiglu": "every MLP -> silu(gate) * up fused, recomputed in backward",
    "rope": "the family's apply_rotary_pos_emb -> fused RoPE (forward and backward in one kernel)",
}
KERNEL_NAMES = tuple(KERNELS)
DEFAULT_KERNELS = ("rmsnorm", "linear_cross_entropy", "swiglu", "rope")  # the fastest measured set
PEERS = ("liger",)  # other kernel libraries, applied to the same model for side-by-side runs
EXCLUSIVE = (("cross_entropy", "linear_cross_entropy"),)  # two losses cannot both own the loss


@dataclass(frozen=True)
class KernelReport:
    """What `apply_kernels` did: for each kernel, how many modules or functions it replaced."""

    replaced: dict  # name -> count
    peer: str | None = None

    @property
    def names(self) -> tuple:
        return (self.peer,) if self.peer else tuple(self.replaced)

    def describe(self) -> str:
        if self.peer:
            return f"{self.peer} (peer library)"
        if not self.replaced:
            return "none (plain PyTorch)"
        return ", ".join(f"{name} x{count}" for name, count in self.replaced.items())


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


def apply_kernels(model, kernels=DEFAULT_KERNELS, verbose: bool = False) -> KernelReport:
    """Patch a Hugging Face causal LM in place with the named kernels; return what was replaced.

    Each replacement count is checked against the architecture (for example 2 RMSNorms per layer
    plus the final one for LLaMA): a model of an unexpected shape raises instead of training with
    half its modules unpatched.
    """
    names = parse_kernels(kernels)
    if names and names[0] in PEERS:
        report = KernelReport(replaced={}, peer=apply_peer(model, names[0]))
    else:
        from model_families import model_type

        if names:
            model_type(model)  # a clear error for an unsupported family before anything is patched
        replaced = {}
        for name in names:
            module = kernel_module(name)
            count, expected = module.patch_model(model), module.expected_patches(model.config)
            if count != expected:
                raise RuntimeError(f"{name}: replaced {count}, expected {expected} for this "
                                   f"{model.config.model_type} model of {model.config.num_hidden_layers} layers")
            replaced[name] = count
        report = KernelReport(replaced=replaced)
    if verbose:
        from common import log

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
