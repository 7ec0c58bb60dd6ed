"""The Hugging Face model families the kernels know, resolved as classes and modules (never by name string).

Every kernel file's `patch_model(model)` asks this module where a family keeps its RMSNorm and MLP
classes and its module-level `apply_rotary_pos_emb`, so the family list lives in one place:

    >>> family_module(model)              # transformers.models.llama.modeling_llama
    >>> family_classes("RMSNorm")         # (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)
"""

from __future__ import annotations

import importlib
from types import ModuleType

# model_type -> the class-name prefix transformers uses for it
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def model_type(model) -> str:
    """The model's `config.model_type`, refused with a clear error when no kernel knows the family."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise NotImplementedError(
            f"the kernels support Hugging Face models of type {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"this model is {kind!r} ({type(model).__name__})")
    return kind


def family_module(model_or_type) -> ModuleType:
    """`transformers.models.<family>.modeling_<family>` for a model or a model_type string."""
    kind = model_or_type if isinstance(model_or_type, str) else model_type(model_or_type)
    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")


def family_classes(suffix: str) -> tuple[type, ...]:
    """`<Family><suffix>` classes (for example every `...RMSNorm`) of the supported families."""
    classes = []
    for kind, prefix in FAMILIES.items():
        try:
            classes.append(getattr(family_module(kind), prefix + suffix))
        except (ImportError, AttributeError):  # an older transformers without this family
            pass
    return tuple(classes)


def norms_per_layer(config) -> int:
    """RMSNorm modules per decoder layer: input and post-attention norms, plus q/k norms in Qwen3."""
    return 4 if config.model_type == "qwen3" else 2
