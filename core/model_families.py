"""The Hugging Face model families the kernels know, resolved as classes and modules (never by name string).

Every kernel file's `patch_model(model)` asks this module where a family keeps its RMSNorm and MLP
classes and its module-level `apply_rotary_pos_emb`, and how those compute, so the family list
lives in one place:

    >>> family_module(model)              # transformers.models.llama.modeling_llama
    >>> family_classes("RMSNorm")         # (LlamaRMSNorm, MistralRMSNorm, ..., Phi3RMSNorm)
    >>> family(model).norms_per_layer     # 2 (4 for Qwen3 and Gemma 2)

What differs between the families, and what each kernel does about it:

    family   RMSNorm                          MLP                           RoPE
    llama    w * x_hat, 2 per layer           silu(gate) * up               full head_dim
    mistral  as llama                         as llama                      as llama
    qwen2    as llama                         as llama                      as llama
    qwen3    as llama, + q/k norms: 4         as llama                      as llama
    gemma    (1 + w) * x_hat in fp32          gelu_tanh(gate) * up          as llama
    gemma2   as gemma, + pre/post FF norms: 4 as gemma (`hidden_activation`) as llama
    phi3     as llama                         one gate_up_proj, split       first cos.shape[-1] dims

Gemma 2 also caps its attention logits (inside attention, untouched by these kernels) and its
final logits (`config.final_logit_softcapping`, applied before the loss: see apply_kernels).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Family:
    """What the kernels need to know about one Hugging Face model family."""

    prefix: str  # the class-name prefix transformers uses: LlamaRMSNorm, LlamaMLP, ...
    norms_per_layer: int = 2  # RMSNorm modules per decoder layer
    norm_offset: float = 0.0  # the norm applies its weight as (offset + weight)
    norm_casting: str = "llama"  # where the norm rounds (rmsnorm_kernel's casting_mode)
    activation_key: str = "hidden_act"  # the config attribute that names the MLP's activation
    residual_norms: tuple = ()  # norms whose output is added to the residual stream (never in place)


FAMILIES = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", norms_per_layer=4),  # + q_norm and k_norm over each head
    "gemma": Family("Gemma", norm_offset=1.0, norm_casting="gemma"),
    "gemma2": Family("Gemma2", norms_per_layer=4, norm_offset=1.0, norm_casting="gemma",
                     activation_key="hidden_activation",
                     residual_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    "phi3": Family("Phi3"),
}


def _available(kind: str) -> bool:
    try:
        return importlib.util.find_spec(f"transformers.models.{kind}.modeling_{kind}") is not None
    except ImportError:
        return False


# The families of the table that this transformers release has (all of them since 4.42).
SUPPORTED_MODEL_TYPES = tuple(kind for kind in FAMILIES if _available(kind))


def _checked(kind, what: str) -> str:
    if kind not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"the kernels support Hugging Face models of type {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"this model is {kind!r} ({what})")
    return kind


def model_type(model) -> str:
    """The model's `config.model_type`, refused with a clear error when no kernel knows the family."""
    return _checked(getattr(getattr(model, "config", None), "model_type", None), type(model).__name__)


def family(model_or_config) -> Family:
    """The family record of a model or of its config (refused clearly for an unknown family)."""
    config = getattr(model_or_config, "config", model_or_config)
    return FAMILIES[_checked(getattr(config, "model_type", None), type(model_or_config).__name__)]


def family_module(model_or_type) -> ModuleType:
    """`transformers.models.<family>.modeling_<family>` for a model or a model_type string."""
    kind = model_or_type if isinstance(model_or_type, str) else model_type(model_or_type)
    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")


def family_classes(suffix: str, kind: str | None = None) -> tuple[type, ...]:
    """`<Family><suffix>` classes (for example every `...RMSNorm`) of the supported families, or of
    the family `kind` alone."""
    classes = []
    for k in (kind,) if kind else SUPPORTED_MODEL_TYPES:
        try:
            classes.append(getattr(family_module(k), FAMILIES[k].prefix + suffix))
        except (ImportError, AttributeError):  # a release without this class
            pass
    return tuple(classes)


def norms_per_layer(config) -> int:
    """RMSNorm modules per decoder layer: input and post-attention norms, plus q/k norms in Qwen3
    and pre/post feed-forward norms in Gemma 2."""
    return family(config).norms_per_layer


def mlp_activation(config) -> str | None:
    """The name of the MLP's activation as the config gives it ("silu", "gelu_pytorch_tanh", ...)."""
    return getattr(config, family(config).activation_key, None)


def final_logit_softcap(config) -> float | None:
    """Gemma 2's cap on the final logits, `cap * tanh(logits / cap)`, applied before the loss; None
    for families without one."""
    return getattr(config, "final_logit_softcapping", None)
