"""The start of every run, in one order, for every script that trains: finetune_baseline.py and
finetune_optimized.py (through training.train), profile_baseline.py and distill.py.

    settle(cfg)      before any model: the data files checked, the processes connected (torchrun), the memory
                     plan printed and checked, and the optimizer's rounding decided, the same on every process.
                     The RunConfig it returns is the run's from then on: nothing rewrites it later.
    build(cfg)       the model with its kernels (said in one line), the tokenizer, the data built whole (its
                     attention chosen first), whether the step can be one CUDA graph, and the optimizer.
    run_errors(...)  Ctrl-C, memory running out and a full disk, each as one line and its exit code.

distill.py builds its teacher and its students itself (they are not one model of the config): it calls settle.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from core.process import log, world
from playbook.data.dataset import BatchAttention, bad_data_exit, check_source, make_data
from playbook.model import packed_attention, pretrained
from playbook.model.lora import name_base_model
from playbook.model.models import count_params, init_distributed, prepare_model
from playbook.model.presets import PRESETS
from playbook.model.registry import in_effect
from playbook.model.tokenizer import make_tokenizer
from playbook.optim.optimizer import make_optimizer
from playbook.plan import check
from playbook.plan.oom import oom_message
from playbook.run import cuda_graph
from playbook.runtime import output, signals
from playbook.runtime.common import describe_gpu, is_out_of_memory
from playbook.sections import RunConfig


def settle(cfg: RunConfig, connect: bool = True):
    """Everything a run decides before it builds a model. Returns the RunConfig the run goes on with.
    connect: under torchrun, start the process group here (False where something else runs the processes)."""
    check_run_data(cfg)  # data that leaves nothing to train on: one line, before anything is built
    if connect:
        init_distributed(torch.device(cfg.run.device))  # (one process: nothing) so that the plan's choice is agreed
    return check.start(cfg)


@dataclass
class Built:
    """What build() made for a run."""

    model: nn.Module
    model_name: str
    description: str  # the model as the log names it
    kernel_report: dict  # registry.apply_kernels' report (profile_baseline.py prints it)
    kernels: tuple  # the kernels in effect (registry.in_effect)
    params: tuple  # (parameters, trainable parameters)
    tokenizer: object
    data: object  # playbook.data.dataset's TrainData
    blocker: str | None  # why the step cannot be one CUDA graph (cuda_graph.graph_blocker), or None
    optimizer: object


def build(cfg: RunConfig) -> Built:
    """The model, its data and its optimizer, for a RunConfig that settle() returned."""
    model, model_name, desc, kernel_report = prepare_model(cfg)
    if cfg.model.lora_r:
        name_lora_base(model, model_name)
    kernels = in_effect(kernel_report, cfg.training.optimizer, cfg.model.lora_r)
    n_params, n_train = count_params(model), count_params(model, trainable_only=True)
    count = f"{n_params / 1e9:.2f} B" if n_params >= 1e9 else f"{n_params / 1e6:.2f} M"
    dtype = str(next(model.parameters()).dtype).replace('torch.', '').replace('bfloat16', 'bf16')
    size = world()[1]
    log(f"Model: {desc}, {count} parameters ({100 * n_train / n_params:.2f}% trainable), {dtype}, on "
        f"{describe_gpu(cfg.run.device)}" + (f" x {size} processes" if size > 1 else "")
        + (" (the kernels in Triton's interpreter)" if not cfg.on_gpu and kernels else ""))
    tokenizer = run_tokenizer(cfg, model_name)
    data = make_run_data(cfg, model, tokenizer)
    blocker = cuda_graph.graph_blocker(cfg, data)
    if cfg.on_gpu:
        cuda_graph.announce(blocker)
    optimizer = make_optimizer(model, cfg.training, cfg.run, capturable=blocker is None)
    return Built(model, model_name, desc, kernel_report, kernels, (n_params, n_train), tokenizer, data, blocker,
                 optimizer)


@contextlib.contextmanager
def run_errors(cfg: RunConfig, kept: str):
    """The run's answers to what ends it early: Ctrl-C (exit code 130; SIGTERM 143) and a full disk say what is
    `kept`; memory running out (building the model, the data, a step) names the options that need less."""
    signals.started(kept)  # Ctrl-C from here on: the line below
    try:
        yield
    except (KeyboardInterrupt, Exception) as err:
        if signals.is_ctrl_c(err):  # (a Ctrl-C may reach here as another error)
            raise signals.interrupted_exit(kept) from None
        if isinstance(err, RuntimeError) and is_out_of_memory(err):
            raise SystemExit(oom_message(cfg, err)) from None
        if output.is_disk_full(err):  # results/: the metrics, the summary, its plot
            raise output.disk_full_exit(err, kept) from None
        raise


# ------------------------------------------------------------------------------------------------
# The run's data
# ------------------------------------------------------------------------------------------------
def data_source(cfg: RunConfig) -> tuple[str | None, str]:
    """(the file or hub id the run trains on, its kind: "dataset", "text" or "synthetic")."""
    if cfg.data.dataset:
        return str(cfg.data.dataset), "dataset"
    return (str(cfg.data.data), "text") if cfg.data.data else (None, "synthetic")


def check_run_data(cfg: RunConfig) -> None:
    """The data files before the model is built (data.check_source): a file that leaves nothing to train on is
    one line naming it and what it holds, exit code 2."""
    try:
        check_source(*data_source(cfg), cfg.data.eval_dataset, cfg.data.train_on_prompt)
    except (ValueError, OSError, ImportError) as err:
        raise bad_data_exit(err) from None


def make_run_data(cfg: RunConfig, model, tokenizer=None):
    """The run's TrainData, built whole: its attention (batch_attention) is chosen before its batches."""
    source, kind = data_source(cfg)
    rank, size = world()
    attention = batch_attention(cfg, model)
    try:
        return make_data(source, kind, tokenizer,
                         model.config.vocab_size, cfg.data.batch_size, cfg.data.seq_len, cfg.run.seed, rank=rank, world_size=size,
                         packing=cfg.data.packing, train_on_prompt=cfg.data.train_on_prompt, eval_fraction=cfg.data.eval_fraction,
                         drop_long=cfg.data.drop_long, eval_source=cfg.data.eval_dataset, repeat_batches=cfg.data.repeat_batches,
                         attention=attention)
    except (ValueError, OSError, ImportError) as err:  # bad input: the row counts, one line, exit code 2
        raise bad_data_exit(err) from None


def batch_attention(cfg: RunConfig, model) -> BatchAttention:
    """How the batches carry attention. Right-padded rows without their padding mask (data/dataset.py,
    `causal_padding`) are the optimized scripts' default; the baseline passes Hugging Face the mask, as plain
    Hugging Face training does. Packed rows: the optimized scripts give the model model/packed_attention.py's
    function and the batches their examples' boundaries; the baseline keeps SDPA with a dense [B, 1, T, T] mask.
    Says which, in one line, for packed rows."""
    causal = not cfg.run.defaults.huggingface_attention
    if not cfg.data.packing:
        return BatchAttention(causal_padding=causal)
    config = model.config
    why = "the baseline: Hugging Face's SDPA" if cfg.run.defaults.huggingface_attention else \
        packed_attention.unsupported(config)
    if why:
        log(f"attention on packed rows: SDPA with a dense [batch, 1, seq, seq] mask ({why})")
        return BatchAttention(causal_padding=causal)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = model.get_input_embeddings().weight.dtype
    device = torch.device(cfg.run.device)
    packed_attention.install(model)
    log(packed_attention.describe(device, dtype, head_dim))
    return BatchAttention(causal_padding=causal, packed="boundaries",
                          packed_kernel=packed_attention.kernel(device, dtype, head_dim))


def needs_tokenizer(cfg: RunConfig) -> bool:
    return bool(cfg.data.dataset or cfg.data.data or cfg.output.output_dir or cfg.output.sample_prompts)


def run_tokenizer(cfg: RunConfig, model_name: str):
    if not needs_tokenizer(cfg):
        return None
    return make_tokenizer(model_name, preset=model_name in PRESETS)


def name_lora_base(model, model_name: str) -> None:
    """The base model the adapters belong to, as their saved adapter_config.json names it (lora.name_base_model)."""
    base = str(pretrained.local_directory(model_name)) if pretrained.is_pretrained_name(model_name) else model_name
    name_base_model(model, base, f"{model_name} is a preset of this project (its architecture with random "
                                 "weights, built by playbook.model.models.build_preset): not on the Hugging Face "
                                 "Hub, so AutoPeftModelForCausalLM cannot fetch it; build the preset, then "
                                 "playbook.model.lora.load_adapter" if model_name in PRESETS else None)
