"""What the fine-tuning and profiling scripts share: arguments, models, data, the training loop,
timing, the summary, and `apply_kernels(model)`.

The scripts stay short because everything they have in common lives here, once:

    finetune_baseline.py   = train(args, kernels=none)
    finetune_optimized.py  = train(args, kernels=--kernels)
    profile_baseline.py    = the same loop under torch.profiler

Models: `--model` takes a Hugging Face id, a local directory, or a preset built from its config
with random weights (timing and memory do not depend on the weight values):
    llama-3.1-8b   the exact LLaMA 3.1 8B architecture, built directly on the GPU in bf16
    llama-tiny     a few small layers, for CPUs (kernels then run in Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import kernel_utils  # noqa: F401  (selects Triton's interpreter on machines without a GPU)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"
KERNEL_NAMES = ("rmsnorm", "ce", "flce", "swiglu", "rope", "liger")
# rmsnorm, swiglu, rope: the fused kernels of the same names; ce: the fused cross-entropy on the
# model's logits; flce: the lm_head fused with the loss (no logits at all; replaces ce);
# liger: Liger-Kernel's own set (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy), as a peer.

# ------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------
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

# Dense bf16 tensor-core peak (no sparsity) by device name, for model FLOPs utilisation.
BF16_PEAK_TFLOPS = {
    "H100 80GB HBM3": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0,
    "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "GB200": 2500.0, "B300": 2500.0, "GB300": 2500.0,
    "A100": 312.0,
}


def gpu_bf16_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):  # most specific name first
        if key in name:
            return BF16_PEAK_TFLOPS[key]
    return None


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
def base_parser(description: str, kernels_default: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"Hugging Face id, local directory, or preset ({', '.join(PRESETS)}). "
                        f"Default: {DEFAULT_MODEL} on a GPU, llama-tiny without one")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (per GPU); default 4 on GPU, 2 on CPU")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence; default 2048 on GPU, 64 on CPU")
    p.add_argument("--steps", type=int, default=None, help="timed steps; default 10 on GPU, 20 on CPU")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed first steps (Triton compiles here)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--optimizer", choices=["adamw-fused", "adamw-foreach"], default=None,
                   help="fused AdamW (default on CUDA) or the multi-tensor foreach version")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter's optimizer inside backward, as soon as its gradient is ready, "
                        "so full-model gradients never coexist (saves one bf16 copy of the model)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this global norm")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (after any kernels)")
    p.add_argument("--data", type=Path, default=None, help="a local text file to fine-tune on (default: synthetic tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--tag", default=None, help="name of the JSON summary under results/")
    if kernels_default is not None:
        p.add_argument("--kernels", default=kernels_default,
                       help=f"comma-separated kernels to apply: {', '.join(KERNEL_NAMES)}, or 'none'")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on whether a GPU is present."""
    gpu = torch.cuda.is_available()
    args.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    args.model_explicit = args.model is not None
    if args.model is None:
        args.model = DEFAULT_MODEL if gpu else "llama-tiny"
    args.batch_size = args.batch_size or (4 if gpu else 2)
    args.seq_len = args.seq_len or (2048 if gpu else 64)
    args.steps = args.steps if args.steps is not None else (10 if gpu else 20)
    args.optimizer = args.optimizer or ("adamw-fused" if gpu else "adamw-foreach")
    if args.optimizer_in_backward and args.max_grad_norm is not None:
        raise SystemExit("error: --max-grad-norm needs every gradient before the first update, but "
                         "--optimizer-in-backward updates each parameter as soon as its own gradient exists; "
                         "drop one of the two")
    for name in ("batch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    if not gpu:
        print("No CUDA GPU found: running on the CPU, Triton kernels through the interpreter "
              "(TRITON_INTERPRET=1). Timings are not meaningful; use the llama-tiny preset.")
    return args


def parse_kernels(spec: str) -> dict:
    names = [] if spec.strip().lower() in ("", "none") else [s.strip().lower() for s in spec.split(",")]
    unknown = [n for n in names if n not in KERNEL_NAMES]
    if unknown:
        raise SystemExit(f"error: unknown kernel(s) {unknown}; choose from {', '.join(KERNEL_NAMES)} or 'none'")
    if "ce" in names and "flce" in names:
        raise SystemExit("error: choose one loss kernel: 'ce' (fused cross-entropy on the logits) or 'flce' "
                         "(lm_head fused with the loss)")
    if "liger" in names and len(names) > 1:
        raise SystemExit("error: 'liger' applies Liger-Kernel's own set and cannot be mixed with our kernels")
    return {"rmsnorm": "rmsnorm" in names, "cross_entropy": "ce" in names, "flce": "flce" in names,
            "swiglu": "swiglu" in names, "rope": "rope" in names, "liger": "liger" in names}


# ------------------------------------------------------------------------------------------------
# Distributed (torchrun) set-up
# ------------------------------------------------------------------------------------------------
def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return world()[0] == 0


def log(*a, **k):
    if is_main():
        print(*a, **k, flush=True)


def init_distributed(args) -> None:
    rank, size = world()
    if size == 1:
        return
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
        torch.distributed.init_process_group("nccl", device_id=args.device)
    else:  # CPU processes (gloo): slow, but the same FSDP2 code path, for tests without GPUs
        torch.distributed.init_process_group("gloo")
    log(f"Distributed: {size} processes, one GPU each; the model is sharded with FSDP2 (fully_shard).")


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
def _hub_advice(model_id: str, err: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    # GatedRepoError subclasses RepositoryNotFoundError: test it first.
    if isinstance(err, GatedRepoError):
        what = f"'{model_id}' is a gated model and this machine has no access to it"
    elif isinstance(err, RepositoryNotFoundError):
        what = f"'{model_id}' was not found on the Hugging Face Hub (or is private)"
    elif isinstance(err, LocalEntryNotFoundError) or "offline" in str(err).lower() or "connect" in str(err).lower():
        what = f"'{model_id}' is not in the local cache and the Hub cannot be reached"
    else:
        what = f"'{model_id}' could not be loaded ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    return (
        f"{what}. To use real weights: accept the licence at https://huggingface.co/{model_id}, create a "
        "token at https://huggingface.co/settings/tokens (fine-grained tokens need access to gated repos), "
        "`export HF_TOKEN=...` and check it with `huggingface-cli whoami`; or pass a local directory. "
        "To measure speed and memory without weights, pass --model llama-3.1-8b (the same architecture, "
        "random weights)."
    )


def build_preset(name: str, num_layers: int | None, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(PRESETS[name])
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # identical weights in every run and every process
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly: no 32 GB fp32 copy of 8B params
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model, None


def load_model(args):
    """Returns (model, tokenizer or None, description). Falls back to the 8B preset as documented."""
    dtype = torch.bfloat16
    if args.model in PRESETS:
        model, tok = build_preset(args.model, args.num_layers, args.device, dtype)
        return model, tok, f"preset {args.model} (random weights)"
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
        if args.num_layers:
            model.model.layers = model.model.layers[: args.num_layers]
            model.config.num_hidden_layers = args.num_layers
        model.to(args.device)
        return model, tok, args.model
    except (OSError, ValueError, ImportError) as err:  # hub errors are OSError subclasses
        advice = _hub_advice(args.model, err)
        if args.model_explicit:
            raise SystemExit(f"error: {advice}") from None
        log("\n" + "!" * 100 + f"\nThe default model could not be loaded: {advice}\nContinuing with the "
            "llama-3.1-8b preset: timing and memory are those of the real model; loss values are not "
            "meaningful.\n" + "!" * 100 + "\n")
        args.model = "llama-3.1-8b"
        model, tok = build_preset(args.model, args.num_layers, args.device, dtype)
        return model, tok, f"preset {args.model} (random weights; {DEFAULT_MODEL} unavailable)"


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
class Batches:
    """Token batches [batch, seq] for step i, identical across runs with the same seed and rank.

    Synthetic: uniform random token ids from a fixed generator. With `--data FILE`: the file
    tokenised once (the model's tokenizer, or bytes when the model has none), cut into windows.
    """

    def __init__(self, args, vocab_size: int, tokenizer=None):
        self.B, self.T, self.vocab = args.batch_size, args.seq_len, vocab_size
        rank, _ = world()
        self.seed = args.seed * 1000 + rank  # each rank sees its own data shard
        self.tokens = None
        if args.data is not None:
            if not args.data.is_file():
                raise SystemExit(f"error: --data {args.data} is not a file")
            text = args.data.read_text(encoding="utf-8", errors="replace")
            ids = tokenizer(text)["input_ids"] if tokenizer is not None else list(text.encode("utf-8"))
            ids = torch.tensor(ids, dtype=torch.long) % vocab_size
            if ids.numel() < self.T + 1:
                raise SystemExit(f"error: {args.data} has {ids.numel()} tokens, fewer than --seq-len {self.T}")
            self.tokens = ids
            log(f"Data: {args.data} ({ids.numel():,} tokens, {'model tokenizer' if tokenizer else 'bytes'})")

    def get(self, step: int, device: torch.device) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + step)
        if self.tokens is None:
            batch = torch.randint(0, self.vocab, (self.B, self.T), generator=g)
        else:
            starts = torch.randint(0, self.tokens.numel() - self.T, (self.B,), generator=g)
            batch = torch.stack([self.tokens[s: s + self.T] for s in starts.tolist()])
        return batch.to(device, non_blocking=True)


# ------------------------------------------------------------------------------------------------
# apply_kernels: patch a Hugging Face model in place
# ------------------------------------------------------------------------------------------------
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _family_classes(suffix: str):
    """`<Family><suffix>` classes (RMSNorm, MLP) of the supported families, resolved as classes."""
    classes = []
    for family, prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")):
        try:
            module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=[prefix + suffix])
            classes.append(getattr(module, prefix + suffix))
        except (ImportError, AttributeError):
            pass
    return tuple(classes)


def expected_rmsnorm_count(config) -> int:
    per_layer = 4 if config.model_type == "qwen3" else 2  # qwen3 adds q_norm and k_norm
    return per_layer * config.num_hidden_layers + 1


def _shifted_targets(labels, ignore_index, shift_labels=None):
    """HF's causal shift without copying logits or hidden states: targets[t] = labels[t + 1], last ignored."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    return shift_labels


def _hf_reduction(loss_with, num_items_in_batch):
    """HF's causal-LM reduction: the mean over non-ignored tokens, or, under gradient accumulation,
    the sum divided by `num_items_in_batch` (the token count of the whole accumulated batch)."""
    if num_items_in_batch is None:
        return loss_with("mean")
    loss = loss_with("sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fused_causal_lm_loss(inplace_grad: bool):
    """A drop-in for Hugging Face's `ForCausalLMLoss` that calls the fused cross-entropy.

    Same semantics: labels shifted left with `ignore_index` padding (the logits are not shifted,
    so no [tokens, vocab] copy is made), mean over non-ignored tokens, or sum / num_items_in_batch
    under gradient accumulation. Unlike HF it does not upcast the logits to fp32: the kernel reads
    bf16 and computes in fp32.
    """
    from cross_entropy_kernel import cross_entropy

    def loss_fn(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, **kwargs):
        logits2 = logits.view(-1, vocab_size)
        targets = _shifted_targets(labels, ignore_index, shift_labels).reshape(-1).to(logits.device)
        return _hf_reduction(lambda reduction: cross_entropy(logits2, targets, ignore_index, reduction, inplace_grad),
                             num_items_in_batch)

    return loss_fn




def flce_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                           inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """`XxxForCausalLM.forward` with the lm_head fused into the loss whenever labels are given.

    With labels the [batch, seq, vocab] logits are never computed: `outputs.logits` is None and
    `outputs.loss` comes from the fused linear cross-entropy (same shift, ignore_index and mean or
    sum / num_items_in_batch as Hugging Face). Without labels (generation, evaluation of logits)
    it computes the logits exactly as the original forward does.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from linear_cross_entropy_kernel import linear_cross_entropy

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
    hidden = outputs.last_hidden_state
    loss = logits = None
    if labels is not None or shift_labels is not None:
        targets = _shifted_targets(labels, ignore_index, shift_labels).to(hidden.device)
        loss = _hf_reduction(lambda reduction: linear_cross_entropy(hidden, self.lm_head.weight, targets, ignore_index,
                                                                    reduction), num_items_in_batch)
    else:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def apply_liger(model: nn.Module) -> dict:
    """Liger-Kernel's kernels on the same model (a peer for side-by-side runs; needs liger-kernel)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as err:
        raise SystemExit(f"error: --kernels liger needs Liger-Kernel (pip install liger-kernel): {err}") from None
    model_type = model.config.model_type
    fn = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if fn is None:
        raise SystemExit(f"error: Liger-Kernel has no kernels for model type {model_type!r}")
    fn(model=model)  # its defaults: RoPE, RMSNorm, SwiGLU, fused linear cross-entropy
    log(f"apply_liger: Liger-Kernel {getattr(liger, '__version__', '')} applied to {type(model).__name__}")
    return {"liger": True}


def apply_kernels(model: nn.Module, rmsnorm: bool = True, cross_entropy: bool = True, swiglu: bool = False,
                  ce_inplace_grad: bool = True, verbose: bool = True, flce: bool = False, rope: bool = False) -> dict:
    """Patch a Hugging Face causal LM in place with the Triton kernels. Returns what was replaced.

    rmsnorm: every RMSNorm module (found by class) becomes a TritonRMSNorm sharing its weight; the
        count is checked against the architecture (2 per layer + the final norm for LLaMA).
    cross_entropy: the model's loss becomes the fused cross-entropy. With `ce_inplace_grad` the
        gradient overwrites the logits during the forward pass (no [tokens, vocab] gradient
        buffer): after `model(..., labels=...)`, `outputs.logits` holds gradients, not logits.
    swiglu: every MLP (found by class; one per layer, checked) computes silu(gate) * up with the
        fused SwiGLU kernel; only for models whose activation is SiLU.
    flce: the model's forward fuses lm_head with the loss whenever labels are given (the logits
        are never materialised; `outputs.logits` is None then). Replaces `cross_entropy`.
    rope: the family's `apply_rotary_pos_emb` becomes the fused RoPE. It is a module-level function
        in transformers, so this affects every model of that family in the process.
    """
    from rmsnorm_kernel import TritonRMSNorm

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"apply_kernels supports Hugging Face models of type {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"this model is {model_type!r} ({type(model).__name__})"
        )
    if cross_entropy and flce:
        raise ValueError("choose one loss kernel: cross_entropy (on the logits) or flce (lm_head fused with the loss)")
    report = {"rmsnorm": 0, "cross_entropy": False, "swiglu": 0, "flce": False, "rope": False}
    if rmsnorm:
        classes = _family_classes("RMSNorm")
        targets = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
        for name, module in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, TritonRMSNorm.from_llama_rmsnorm(module))
        expected = expected_rmsnorm_count(config)
        if len(targets) != expected:
            raise RuntimeError(f"replaced {len(targets)} RMSNorm modules, expected {expected} for "
                               f"{config.num_hidden_layers} {model_type} layers: the model is not the expected shape")
        report["rmsnorm"] = len(targets)
    if cross_entropy:
        model.loss_function = fused_causal_lm_loss(ce_inplace_grad)
        report["cross_entropy"] = True
    if swiglu:
        import types

        from swiglu_kernel import swiglu_mlp_forward

        if getattr(config, "hidden_act", None) != "silu":
            raise NotImplementedError(f"the fused SwiGLU needs hidden_act='silu', this model uses {config.hidden_act!r}")
        mlps = [m for m in model.modules() if isinstance(m, _family_classes("MLP"))]
        if len(mlps) != config.num_hidden_layers:
            raise RuntimeError(f"found {len(mlps)} MLP modules, expected one per layer ({config.num_hidden_layers})")
        for mlp in mlps:
            mlp.forward = types.MethodType(swiglu_mlp_forward, mlp)
        report["swiglu"] = len(mlps)
    if flce:
        import types

        if getattr(model, "lm_head", None) is None or getattr(model.lm_head, "bias", None) is not None:
            raise NotImplementedError("the fused linear cross-entropy needs a bias-free `lm_head`")
        model.forward = types.MethodType(flce_causal_lm_forward, model)
        report["flce"] = True
    if rope:
        import importlib

        import rope_kernel

        family = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        if not hasattr(family, "apply_rotary_pos_emb"):
            raise NotImplementedError(f"transformers' {model_type} module has no apply_rotary_pos_emb to replace")
        family.apply_rotary_pos_emb = rope_kernel.apply_rotary_pos_emb
        report["rope"] = True
    if verbose:
        loss = ("lm_head + loss -> fused linear cross-entropy" if flce else
                "fused cross-entropy" + (" (gradient written into the logits)" if ce_inplace_grad else "")
                if cross_entropy else "PyTorch (unchanged)")
        log(f"apply_kernels: {report['rmsnorm']} RMSNorm modules -> TritonRMSNorm; loss -> {loss}"
            + (f"; {report['swiglu']} MLPs -> fused SwiGLU" if swiglu else "")
            + (f"; {model_type}'s apply_rotary_pos_emb -> fused RoPE" if rope else ""))
    return report


# ------------------------------------------------------------------------------------------------
# The training loop
# ------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    script: str
    model: str
    kernels: list
    gpu: str
    world_size: int
    batch_size: int
    seq_len: int
    steps: int
    optimizer: str
    params: int
    losses: list = field(default_factory=list)
    step_times_s: list = field(default_factory=list)
    peak_memory_gb: float | None = None
    versions: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.world_size

    def summary(self, bf16_peak: float | None, flops_per_token: float) -> dict:
        t = self.step_times_s
        mean, median = statistics.fmean(t), statistics.median(t)
        tps = self.tokens_per_step / median
        achieved = tps * flops_per_token / 1e12
        return {
            "step time mean (ms)": mean * 1e3,
            "step time median (ms)": median * 1e3,
            "tokens/s (job)": tps,
            "tokens/s per GPU": tps / self.world_size,
            "model TFLOP/s per GPU": achieved / self.world_size,
            "MFU (% of bf16 peak)": 100 * achieved / self.world_size / bf16_peak if bf16_peak else None,
            "peak GPU memory (GB)": self.peak_memory_gb,
            "final loss": self.losses[-1] if self.losses else None,
        }


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters used in matmuls) + attention scores (12 L H T).

    The input embedding is a lookup, not a matmul, so its parameters are left out; causal
    attention does half of the 12 L H T as useful work, but the kernels compute it all (convention
    of the PaLM paper's MFU).
    """
    cfg = model.config
    emb = model.get_input_embeddings().weight.numel()
    n_matmul = count_params(model) - emb
    if getattr(cfg, "tie_word_embeddings", False):
        n_matmul += emb  # the tied lm_head still multiplies by it
    return 6 * n_matmul + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def make_optimizer(model, args):
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adamw-fused" and args.device.type != "cuda":
        raise SystemExit("error: --optimizer adamw-fused needs a CUDA GPU; use adamw-foreach")
    kind = {"fused": True} if args.optimizer == "adamw-fused" else {"foreach": True}
    if getattr(args, "optimizer_in_backward", False):
        if world()[1] > 1:
            raise SystemExit("error: --optimizer-in-backward runs on one GPU; FSDP2 already shards gradients "
                             "and optimizer state across GPUs")
        return OptimizerInBackward(params, lambda group: torch.optim.AdamW(group, lr=args.lr, **kind))
    return torch.optim.AdamW(params, lr=args.lr, **kind)


class OptimizerInBackward:
    """Each parameter's optimizer step runs inside backward, as soon as its gradient is accumulated.

    Ordinarily every parameter's gradient is kept until `optimizer.step()` after backward: for an 8B
    model in bf16 that is 16 GB alive at the end of backward, on top of the activations. Here a
    `register_post_accumulate_grad_hook` on every parameter steps a one-parameter AdamW the moment
    that parameter's gradient is complete, then drops the gradient, so at most a few gradients
    exist at a time. The arithmetic is the same AdamW, parameter by parameter.

    What it cannot do: global gradient clipping (it needs the norm of *all* gradients before the
    first update: `--max-grad-norm` is refused with it) and gradient accumulation over several
    backward passes (each backward would update the weights): `clip_grad_norm_` and a second
    backward without `step()` raise instead of silently doing the wrong thing.
    `step()` and `zero_grad()` exist so that the training loop needs no special case.
    """

    def __init__(self, params, make):
        self.optimizers = {p: make([p]) for p in params}
        self._stepped = set()  # parameters updated since the last step()
        for p in self.optimizers:
            p.register_post_accumulate_grad_hook(self._step_param)

    def _step_param(self, p):
        if id(p) in self._stepped:
            raise RuntimeError("--optimizer-in-backward: a second backward before optimizer.step() would update the "
                               "weights twice; gradient accumulation over several backward passes is not possible "
                               "with the optimizer step inside backward")
        self._stepped.add(id(p))
        self.optimizers[p].step()
        p.grad = None  # frees the gradient right away

    def step(self):
        self._stepped.clear()  # the updates already happened during backward

    def zero_grad(self, set_to_none: bool = True):
        pass  # gradients are dropped as soon as they are used

    @property
    def param_groups(self):  # one group per parameter, e.g. for a learning-rate schedule
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def clip_grad_norm_(self, *args, **kwargs):
        raise RuntimeError("gradient clipping needs all gradients before any update; the optimizer-in-backward "
                           "step has already applied them")


def shard_model(model):
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, lm_head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a sync point: the host waits for the GPU to finish


def training_step(model, optimizer, input_ids, max_grad_norm: float | None = None):
    # Keep only the loss: holding the whole output would keep the [batch, seq, vocab] logits
    # (2.1 GB at 4 x 2048 tokens in bf16) alive through the backward pass for nothing.
    loss = model(input_ids=input_ids, labels=input_ids).loss  # HF shifts the labels inside the loss
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def versions() -> dict:
    import transformers
    import triton

    v = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
         "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
    return v


def describe_gpu(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU (Triton interpreter)"
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"


def setup_model(args, kernels: dict):
    """Load the model, apply the kernels, shard under torchrun. Returns (model, tokenizer, description)."""
    init_distributed(args)
    model, tok, desc = load_model(args)
    model.config.use_cache = False
    model.train()
    if kernels.get("liger"):
        apply_liger(model)
    elif any(kernels.values()):
        apply_kernels(model, rmsnorm=kernels.get("rmsnorm", False), cross_entropy=kernels.get("cross_entropy", False),
                      swiglu=kernels.get("swiglu", False), flce=kernels.get("flce", False),
                      rope=kernels.get("rope", False))
    if getattr(args, "compile", False):
        model.compile()  # compiles the forward on its first call (the warm-up steps)
        log("torch.compile: the model's forward is compiled on the first (warm-up) step")
    if world()[1] > 1:
        shard_model(model)
    return model, tok, desc


def is_out_of_memory(err: BaseException) -> bool:
    """True for PyTorch's OutOfMemoryError and for libraries that report running out of GPU memory
    through a plain RuntimeError (cuBLAS cannot create its handle or workspace when memory is full:
    CUBLAS_STATUS_ALLOC_FAILED)."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in ("CUBLAS_STATUS_ALLOC_FAILED", "out of memory")))


def oom_message(args, err: Exception) -> str:
    peak = torch.cuda.max_memory_allocated(args.device) / 1e9 if args.device.type == "cuda" else float("nan")
    total = torch.cuda.get_device_properties(args.device).total_memory / 1e9 if args.device.type == "cuda" else float("nan")
    return (
        f"\nOut of GPU memory at batch {args.batch_size} x {args.seq_len} tokens "
        f"(peak allocated {peak:.1f} GB of {total:.1f} GB on {describe_gpu(args.device)}).\n"
        "Try: a smaller --batch-size or --seq-len; fewer layers with --num-layers to measure a slice "
        "of the model; the optimized script (its kernels save activation memory); or several GPUs with "
        "torchrun (FSDP2 shards parameters, gradients and optimizer state).\n"
        f"PyTorch said: {str(err).splitlines()[0][:300]}"
    )


def train(args, kernels: dict, script: str) -> dict:
    """The one training loop behind both fine-tuning scripts. Returns the summary dict."""
    from tabulate import tabulate
    from tqdm import tqdm

    model, tok, desc = setup_model(args, kernels)
    rank, size = world()
    n_params = count_params(model)  # a sharded (DTensor) parameter reports its global size
    count = f"{n_params / 1e9:.2f} B" if n_params >= 1e9 else f"{n_params / 1e6:.2f} M"
    log(f"Model: {desc}, {count} parameters, bf16, on {describe_gpu(args.device)}"
        + (f" x {size} processes" if size > 1 else ""))
    data = Batches(args, model.config.vocab_size, tok)
    optimizer = make_optimizer(model, args)
    result = RunResult(script=script, model=args.model,
                       kernels=[k for k, v in kernels.items() if v] + (["torch.compile"] if getattr(args, "compile", False) else []),
                       gpu=describe_gpu(args.device), world_size=size, batch_size=args.batch_size,
                       seq_len=args.seq_len, steps=args.steps, optimizer=args.optimizer + (" in backward" if args.optimizer_in_backward else ""),
                       params=n_params,
                       versions=versions())
    total = args.warmup_steps + args.steps
    log(f"Training: {args.warmup_steps} warm-up + {args.steps} timed steps of {args.batch_size} x "
        f"{args.seq_len} tokens{' per GPU' if size > 1 else ''}, {result.optimizer}, lr {args.lr:g}")
    try:
        bar = tqdm(range(total), desc=script, unit="step", disable=not is_main(), dynamic_ncols=True)
        for step in bar:
            if step == args.warmup_steps and args.device.type == "cuda":
                synchronize(args.device)
                torch.cuda.reset_peak_memory_stats(args.device)  # peak counted after warm-up
            batch = data.get(step, args.device)
            synchronize(args.device)
            t0 = time.perf_counter()
            loss = training_step(model, optimizer, batch, args.max_grad_norm)
            synchronize(args.device)
            dt = time.perf_counter() - t0
            loss_value = loss.float().item()  # a sync point (already synchronised above)
            result.losses.append(loss_value)
            if step >= args.warmup_steps:
                result.step_times_s.append(dt)
            bar.set_postfix(loss=f"{loss_value:.4f}", ms=f"{dt * 1e3:.0f}")
            if is_main() and ((step + 1) % args.log_every == 0 or step == total - 1):
                bar.write(f"step {step + 1:4d}/{total}  loss {loss_value:.4f}  {dt * 1e3:8.1f} ms")
    except RuntimeError as err:  # OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
        raise SystemExit(oom_message(args, err)) from None
    if args.device.type == "cuda":
        result.peak_memory_gb = torch.cuda.max_memory_allocated(args.device) / 1e9
    summary = result.summary(gpu_bf16_peak_tflops(args.device), flops_per_token(model, args.seq_len))
    if is_main():
        rows = [(k, format_value(k, v)) for k, v in summary.items()]
        unit = "GPUs" if args.device.type == "cuda" else "processes"
        print(tabulate(rows, headers=[f"{script}: {args.model}, {args.batch_size}x{args.seq_len}"
                                      + (f" x {size} {unit}" if size > 1 else ""), ""], tablefmt="github"))
        if size > 1:
            print("(tokens/s counts every process's tokens; the loss is rank 0's, on its own data shard)")
        path = save_json(args.tag or default_tag(script, args, size), {**asdict(result), "summary": summary})
        print(f"Saved {path}")
    if size > 1:
        torch.distributed.destroy_process_group()
    return {**asdict(result), "summary": summary}


def format_value(key: str, v) -> str:
    if v is None:
        return "n/a"
    if "loss" in key:
        return f"{v:.4f}"
    if "tokens/s" in key:
        return f"{v:,.0f}"
    return f"{v:,.1f}"


def default_tag(script: str, args, size: int) -> str:
    gpus = f"_{size}gpu" if size > 1 else ""
    return f"{Path(script).stem}_{args.model.replace('/', '_')}_b{args.batch_size}_s{args.seq_len}{gpus}"


def save_json(tag: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{tag}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
