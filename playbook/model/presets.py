"""The model presets (configs of random-weight models) and the dtype a model trains in: data both the model
builder (playbook/model/models.py) and the memory plan (playbook/plan/) read, with no model code."""

from __future__ import annotations

from pathlib import Path

import torch

from playbook.sections import RunConfig

# The model a GPU run trains when --model is not given (a CPU run takes llama-tiny).
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"

PRESETS = {
    # meta-llama/Llama-3.1-8B's config.json, field for field (weights are random)
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    # Small enough for a CPU and Triton's interpreter; same family, same code paths.
    "llama-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2,
    ),
}


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 matrix instructions (AVX512-BF16, AMX). Elsewhere PyTorch emulates bf16
    matmuls: on a 2-core AMD EPYC without them, 0.3 GFLOP/s against 17 in float32 ([1024, 576] x [576, 1536])."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))


def weights_dtype(cfg: RunConfig, requested: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype a model is trained in: bf16 on a GPU. On a CPU without native bf16 matmuls, a real model
    (not a preset) loads in float32: in bf16 one SmolLM2-135M step took minutes there (cpu_has_native_bf16)."""
    if requested != torch.bfloat16 or torch.device(cfg.run.device).type == "cuda" or cfg.model.model in PRESETS:
        return requested
    return requested if cpu_has_native_bf16() else torch.float32
