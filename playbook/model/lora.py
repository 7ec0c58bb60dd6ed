"""LoRA through peft: add low-rank adapters to a (kernel-patched) causal LM, save them, merge them.

    >>> from playbook.model.lora import apply_lora, save_adapter, merge_and_save
    >>> model = apply_lora(model, r=16)                 # all seven linear layers, alpha = 2 r
    trainable parameters: 41,943,040 of 8,072,204,288 (0.52%)
    >>> save_adapter(model, "out/adapter")              # adapter_model.safetensors + adapter_config.json
    >>> merge_and_save(model, "out/merged", tokenizer)  # a plain Hugging Face model, adapters folded in

LoRA replaces the update of a frozen weight W [out, in] by B @ A, with A [r, in] and B [out, r]:
the layer computes W x + (alpha / r) B A x. Only A and B are trained (B starts at zero, so the
model starts exactly where the base model is), which makes optimizer state and gradients tiny:
for LLaMA 3.1 8B at r = 16 on all seven projections, 42 M trainable parameters instead of 8 B.

Order with the kernels: `apply_kernels` runs first, then `apply_lora`, then `lora_kernel.patch_model`.
The kernels replace MLP forwards, RMSNorm modules and the causal LM's forward, never the seven
projection modules, so peft finds and wraps exactly the nn.Linear modules it would find in an
unpatched model. `lora_kernel.patch_model` (the fused path, a lesson of its own) then swaps the computation (not the modules) of every
adapter-wrapped projection for `LoRALinearFunction`, and of every fused SwiGLU MLP with an adapted
down_proj for `SwiGLUDownLoRAFunction` (see below for what each saves); the optimized scripts call
it whenever kernels are on, the baseline keeps peft's own forward.

    >>> model = apply_lora(model, r=16)
    >>> import lora_kernel; lora_kernel.patch_model(model)   # 224 projections of LLaMA 3.1 8B
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# LLaMA's (and Mistral's, Qwen2's) linear layers inside each decoder layer
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
TARGET_SETS = {"all": ALL_TARGETS, "attention": ATTENTION_TARGETS}


def _peft():
    try:
        import peft
    except ImportError:
        raise RuntimeError("LoRA needs the peft package: pip install peft") from None
    return peft


def _log(text: str) -> None:
    log(text)


def parse_targets(targets) -> tuple:
    """'all' -> the seven projections, 'attention' -> q, k, v, o, or a comma list / list of their names."""
    if isinstance(targets, str):
        key = targets.strip().lower()
        if key in TARGET_SETS:
            return TARGET_SETS[key]
        names = [w.strip() for w in targets.split(",") if w.strip()]
    elif isinstance(targets, (list, tuple)):
        names = [str(w).strip() for w in targets]
    else:
        raise ValueError(f"LoRA targets must be 'all', 'attention', a comma list or a list, got {type(targets).__name__}")
    if not names:
        raise ValueError("LoRA targets are empty: name at least one of " + ", ".join(ALL_TARGETS))
    unknown = [n for n in names if n not in ALL_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {', '.join(unknown)}; valid: {', '.join(ALL_TARGETS)}, "
                         f"or 'all' / 'attention'")
    if len(set(names)) != len(names):
        raise ValueError(f"a LoRA target is named twice in {targets!r}")
    return tuple(names)


from core.process import is_peft_model  # noqa: E402  (the LoRA glue's own question)

from core.process import log
from playbook.store.checkpoint import BASE_NOTE_KEY, add_base_model_note, atomic_directory
from playbook.sections import RunConfig


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters that require grad, all parameters), counted in elements."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def apply_lora(model: nn.Module, r: int, alpha: float | None = None, dropout: float = 0.0,
               targets: str | list = "all") -> nn.Module:
    """Wrap `model` in a peft LoRA model: adapters of rank r on `targets`, everything else frozen.

    alpha: the scale numerator (the update is scaled by alpha / r); default 2 r.
    dropout: dropout on the adapters' input, in [0, 1).
    Returns the peft model (a PeftModelForCausalLM); `model` itself is modified in place (its
    projections are wrapped), so use the returned model from here on.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be an integer >= 1, got {r!r}")
    if alpha is None:
        alpha = 2 * r
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or alpha == float("inf"):
        raise ValueError(f"LoRA alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    names = parse_targets(targets)
    peft = _peft()
    if is_peft_model(model):
        raise ValueError("the model already has LoRA adapters (it is a peft model): apply_lora once")
    found = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"this {type(model).__name__} has no nn.Linear module named {', '.join(missing)}; "
                         f"its linear layers are {', '.join(sorted(found)) or 'none'}")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=list(names),
                             bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)  # freezes every base parameter
    trainable, total = trainable_parameters(model)
    _log(f"LoRA r={r} alpha={alpha:g} dropout={dropout:g} on {', '.join(names)}: trainable parameters "
         f"{trainable:,} of {total:,} ({100 * trainable / total:.2f}%)")
    return model


def _require_peft_model(model, what: str) -> None:
    if not is_peft_model(model):
        raise ValueError(f"{what} needs a LoRA model (the result of apply_lora), got {type(model).__name__}")


def _refuse_sharded(model, what: str) -> None:
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise RuntimeError(f"{what}: the parameters are sharded (FSDP2); save the adapter with save_checkpoint "
                           "and merge it on one process (load the base model, load_adapter, merge_and_save)")


def name_base_model(model: nn.Module, name_or_path: str, note: str | None = None) -> None:
    """Record the base model in the adapter's config, so that a saved adapter_config.json names it
    (`base_model_name_or_path`, which peft's AutoPeftModelForCausalLM.from_pretrained loads first).

    name_or_path: a Hugging Face id, or a local directory (stored as its absolute path). note: for a
    base that AutoPeft cannot fetch (a preset): a line saved beside it as `base_model_note`; both are
    then written into the saved file only (peft would look the name up on the Hub at every save).
    """
    _require_peft_model(model, "name_base_model")
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        name_or_path = str(local.resolve())

    if note is None:
        model.peft_config[model.active_adapter].base_model_name_or_path = name_or_path
        setattr(model, BASE_NOTE_KEY, None)
    else:
        setattr(model, BASE_NOTE_KEY, {"base_model_name_or_path": name_or_path, "base_model_note": note})


def save_adapter(model: nn.Module, directory) -> Path:
    """Write the adapter (adapter_model.safetensors + adapter_config.json) into `directory`, atomically."""
    _require_peft_model(model, "save_adapter")
    _refuse_sharded(model, "save_adapter")

    with atomic_directory(directory) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        add_base_model_note(tmp, model)
    return Path(directory)


def load_adapter(model: nn.Module, directory, trainable: bool = False) -> nn.Module:
    """A base model plus the adapter saved in `directory` (by save_adapter or save_checkpoint)."""
    peft = _peft()
    directory = Path(directory)
    if not (directory / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{directory}: no adapter_config.json (not an adapter directory)")
    if is_peft_model(model):
        raise ValueError("load_adapter takes the base model; this one already has adapters")
    return peft.PeftModel.from_pretrained(model, str(directory), is_trainable=trainable)


def merge_and_save(model: nn.Module, directory, tokenizer=None) -> Path:
    """Fold the adapters into the base weights (W + alpha / r * B A) and save a plain Hugging Face
    model (safetensors) that `AutoModelForCausalLM.from_pretrained(directory)` loads without peft.

    The merge happens in place: afterwards `model` has no adapters (call this last). The merged
    weights keep the base weights' dtype. Returns the directory. A base whose frozen weights are kept
    in FP8 (--lora-r with --fp8) is refused (RuntimeError): load the bf16 base and the adapter instead.
    """
    _require_peft_model(model, "merge_and_save")
    _refuse_sharded(model, "merge_and_save")
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        raise RuntimeError("merge_and_save: the frozen base weights of this model are kept in FP8 (--lora-r with "
                           "--fp8), and the adapters folded into them would carry FP8's rounding of every base weight "
                           "(up to 2^-4 of it); save the adapter (save_adapter), then merge it into the original bf16 "
                           "model: merge_and_save(load_adapter(bf16_base, adapter_directory), directory)")

    with torch.no_grad():
        merged = model.merge_and_unload()
    with atomic_directory(directory) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(directory)


# ------------------------------------------------------------------------------------------------
# QLoRA: the frozen base projections in 4 bits (NF4, bitsandbytes)
# ------------------------------------------------------------------------------------------------
def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError:
        raise RuntimeError("--load-in-4bit needs the bitsandbytes package: pip install bitsandbytes") from None
    return bitsandbytes


def quantize_4bit(model: nn.Module, targets: str | list = "all") -> int:
    """Replace the decoder's target projections (nn.Linear) by bitsandbytes NF4 `Linear4bit` layers
    with the model's dtype as compute dtype; return how many. Call before `apply_lora`.

    The weights are quantized where they are: on a GPU at once; on a CPU bitsandbytes' own CPU path
    is used (tests). 8.03 B bf16 parameters take 16 GB; their seven projections in NF4 take ~3.5 GB
    (0.5 byte per weight plus one scale per 64 weights). Embeddings, norms and lm_head stay as they are.
    """
    bnb = _bitsandbytes()
    names = parse_targets(targets)
    todo = [(parent, attr, child) for parent in model.modules() for attr, child in parent.named_children()
            if attr in names and type(child) is nn.Linear]
    if not todo:
        raise ValueError(f"{type(model).__name__} has no nn.Linear projection named {', '.join(names)} to quantize")
    for parent, attr, child in todo:
        dtype = child.weight.dtype
        q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                              compute_dtype=dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu") if child.weight.device.type == "cpu"
                                     else child.weight.data, requires_grad=False, quant_type="nf4")
        if child.bias is not None:
            q.bias = nn.Parameter(child.bias.data, requires_grad=False)
        q = q.to(child.weight.device)  # Params4bit quantizes when it is moved to its device
        setattr(parent, attr, q)
    return len(todo)


def lora_from_config(model: nn.Module, cfg: RunConfig, fuse: bool) -> nn.Module:
    """What the scripts do with --lora-r / --load-in-4bit: quantize (QLoRA), add the adapters, and
    with fuse=True (the registry's `lora` entry, lora_kernel.py) route them through the fused path."""
    if cfg.model.load_in_4bit:
        _log(f"QLoRA: {quantize_4bit(model, cfg.model.lora_targets)} projections quantized to NF4 (bitsandbytes)")
    model = apply_lora(model, r=cfg.model.lora_r, alpha=cfg.model.lora_alpha, dropout=cfg.model.lora_dropout,
                       targets=cfg.model.lora_targets)
    if fuse:
        import lora_kernel  # the registry's lora entry

        _log(f"LoRA layers on the fused path (adapter matmuls in the model's dtype, no fp32 input copies): "
             f"{lora_kernel.patch_model(model)}")
    return model
