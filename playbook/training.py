"""The one training loop behind every fine-tuning script, with its optimizer, schedule and summary.

    finetune_baseline.py   = train(config with kernels=())
    finetune_optimized.py  = train(config with --kernels)
    profile_baseline.py    = the same steps under torch.profiler

One optimizer step = `--grad-accum` micro-batches. The loss of the step is the mean over every target
token of all its micro-batches (not the mean of the micro-batch means, which would weigh a short
example like a long one): the number of target tokens in the window is counted first and passed to
the model as `num_items_in_batch`, so each micro-batch's loss is its sum divided by that count.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from playbook.common import (RESULTS_DIR, describe_gpu, gpu_bf16_peak_tflops, interactive, is_main, is_out_of_memory, log,
                    oom_message, result_path, synchronize, versions, world, write_atomic)
from playbook.models import PRESETS, count_params, flops_per_token, prepare_model
from playbook import memory_plan, signals
from playbook.registry import in_effect

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# ------------------------------------------------------------------------------------------------
def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices get weight decay; norms and biases (1-D) do not. Frozen parameters are left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SystemExit("error: the model has no trainable parameters")
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def weight_rounding(cfg) -> str:
    """How the optimizer rounds each new bf16 weight: TritonAdamW's `rounding` (adamw_kernel.ROUNDINGS),
    from --optimizer-rounding and --master-weights. "auto" (none given) is chosen as a run starts
    (memory_plan.start); an optimizer made from a RunConfig that no run start settled rounds to nearest."""
    if getattr(cfg, "master_weights", "none") == "fp32":
        return "fp32-master"
    rounding = getattr(cfg, "optimizer_rounding", "nearest")
    return "nearest" if rounding == "auto" else rounding


def describe_optimizer(cfg) -> str:
    """--optimizer and what changes it, as the log and the summary name it: "adamw-triton, stochastic rounding"."""
    rounding = weight_rounding(cfg)
    extra = {"nearest": "", "stochastic": ", stochastic rounding", "kahan": ", Kahan-compensated",
             "fp32-master": ", fp32 master weights"}[rounding]
    return cfg.optimizer + extra + (" in backward" if cfg.optimizer_in_backward else "")


def make_optimizer(model: nn.Module, cfg, capturable: bool = False):
    """AdamW as --optimizer names it. capturable: for a CUDA graph (cuda_graph.py), its step count and
    learning rate live on the GPU (one rate tensor for every group, which LRSchedule fills in place).
    --optimizer-rounding and --master-weights: the Triton AdamW's `rounding`, its random bits seeded by --seed."""
    kind = {"fused": True} if cfg.optimizer == "adamw-fused" else {"foreach": True}
    adamw = torch.optim.AdamW
    rounding = weight_rounding(cfg)
    if cfg.optimizer == "adamw-triton":  # one multi-tensor Triton launch per param group
        from adamw_kernel import TritonAdamW as adamw

        kind = {} if rounding == "nearest" else {"rounding": rounding, "seed": cfg.seed}
    elif rounding != "nearest":
        raise ValueError(f"rounding {rounding!r} is TritonAdamW's (--optimizer adamw-triton), not {cfg.optimizer}'s")
    lr = cfg.lr
    if capturable:
        lr = torch.tensor(float(cfg.lr), dtype=torch.float32, device=cfg.device)
        kind["capturable"] = True
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer_in_backward:
        if "seed" in kind:  # one optimizer per parameter: each its own seed, so that no two draw the same bits
            places = itertools.count(1)
            return OptimizerInBackward(groups, lambda group: adamw([group], lr=lr, **{
                **kind, "seed": cfg.seed + (next(places) << 32)}))
        return OptimizerInBackward(groups, lambda group: adamw([group], lr=lr, **kind))
    return adamw(groups, lr=lr, **kind)


class OptimizerInBackward:
    """Each parameter's optimizer step runs inside backward, as soon as its gradient is accumulated.

    Ordinarily every parameter's gradient is kept until `optimizer.step()` after backward: for an 8B
    model in bf16 that is 16 GB alive at the end of backward, on top of the activations. Here a
    `register_post_accumulate_grad_hook` on every parameter steps a one-parameter AdamW the moment
    that parameter's gradient is complete, then drops the gradient, so at most a few gradients
    exist at a time. The arithmetic is the same AdamW, parameter by parameter.

    What it cannot do: global gradient clipping (it needs the norm of *all* gradients before the
    first update) and gradient accumulation over several backward passes (each backward would update
    the weights); the command line refuses both, and a second backward before `step()` raises.
    """

    def __init__(self, groups, make):
        self.optimizers = {}
        for g in groups:
            for p in g["params"]:
                self.optimizers[p] = make({"params": [p], "weight_decay": g["weight_decay"]})
        self._stepped = set()  # parameters updated since the last step()
        for p in self.optimizers:
            p.register_post_accumulate_grad_hook(self._step_param)

    def _step_param(self, p):
        if id(p) in self._stepped:
            raise RuntimeError("--optimizer-in-backward: a second backward before optimizer.step() would update the "
                               "weights twice; gradient accumulation is not possible with the optimizer inside backward")
        self._stepped.add(id(p))
        self.optimizers[p].step()
        p.grad = None  # frees the gradient right away

    def step(self):
        self._stepped.clear()  # the updates already happened during backward

    def zero_grad(self, set_to_none: bool = True):
        pass  # gradients are dropped as soon as they are used

    @property
    def param_groups(self):  # one group per parameter, for the learning-rate schedule
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def state_dict(self) -> dict:
        return {"per_parameter": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers.values(), state["per_parameter"], strict=True):
            opt.load_state_dict(s)


def schedule_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """The share of the peak rate at optimizer step `step` (0-based) of a `total`-step schedule."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


class LRSchedule:
    """Linear warm-up to the peak rate, then constant, linear or cosine decay to 0 at the last step."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int, kind: str):
        self.optimizer, self.total, self.warmup, self.kind = optimizer, total_steps, warmup_steps, kind
        self.base = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_step = -1

    def factor(self, step: int) -> float:
        return schedule_factor(step, self.total, self.warmup, self.kind)

    def apply(self, step: int) -> float:
        """Set the rate for optimizer step `step` (0-based); returns it."""
        f = self.factor(step)
        for g, base in zip(self.optimizer.param_groups, self.base):
            if isinstance(g["lr"], torch.Tensor):  # a capturable optimizer's rate: the graph reads this tensor
                g["lr"].fill_(base * f)
            else:
                g["lr"] = base * f
        self.last_step = step
        return self.base[0] * f

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "total": self.total, "warmup": self.warmup, "kind": self.kind}

    def load_state_dict(self, state: dict) -> None:
        """The saved position. The kind and the warm-up must be the saved ones; the length may differ (a
        resumed run given more or fewer --steps): the schedule then follows this run's length from
        here on, which for a decaying kind changes the rate of every remaining step."""
        if (state["warmup"], state["kind"]) != (self.warmup, self.kind):
            raise ValueError(f"the checkpoint's schedule ({state['kind']}, {state['warmup']} warm-up steps) differs "
                             f"from this run's ({self.kind}, {self.warmup}); resume with the same --lr-schedule, "
                             "--lr-warmup-steps and --warmup-ratio")
        self.last_step = state["last_step"]


# ------------------------------------------------------------------------------------------------
# One step
# ------------------------------------------------------------------------------------------------
def count_targets(micro_batches) -> torch.Tensor:
    """Target tokens of a window (labels are shifted inside the loss: position 0 is never a target)."""
    return sum((b["labels"][..., 1:] != IGNORE_INDEX).sum() for b in micro_batches)


def gradient_norm(model) -> torch.Tensor | None:
    """The global L2 norm of the parameters' gradients, on the device (no host sync)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else None


def training_step(model, optimizer, micro_batches, max_grad_norm: float | None = None, grad_norm: bool = False,
                  zero_grad: bool = True):
    """Forward and backward over the micro-batches, then one optimizer step.

    Returns (loss, grad norm or None) as 0-d tensors on the device (no host sync here). The loss is
    the mean over all target tokens of the window. zero_grad=False keeps this step's gradients after
    the update (a CUDA graph's step: they are overwritten by the next replay's first backward).
    """
    _, size = world()
    extra = {}
    if len(micro_batches) > 1 or size > 1:
        # One micro-batch on one process: the model's own mean is already the token mean (and keeps
        # the loss's upstream gradient at 1, which the fused losses skip rescaling for).
        n_items = count_targets(micro_batches).clamp_min(1)
        if size > 1:  # every rank divides by the count of the whole job; FSDP2 averages gradients over ranks
            torch.distributed.all_reduce(n_items)
        extra["num_items_in_batch"] = n_items
    total = None
    for batch in micro_batches:
        # Keep only the loss: holding the whole output would keep the [batch, seq, vocab] logits
        # (2.1 GB at 4 x 2048 tokens in bf16) alive through the backward pass for nothing.
        loss = model(**batch, **extra).loss
        (loss * size if size > 1 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    norm = None
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    elif grad_norm and not isinstance(optimizer, OptimizerInBackward):
        norm = gradient_norm(model)
    optimizer.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    if size > 1:
        torch.distributed.all_reduce(total)
    return total, norm


@torch.no_grad()
def evaluate(model, batches) -> float | None:
    """Mean loss over every target token of the held-out batches."""
    if not batches:
        return None
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    n_sum = 0
    for b in batches:
        n = int(count_targets([b]))  # a sync point, once per eval batch
        if n:
            loss_sum += float(model(**b).loss) * n
            n_sum += n
    model.train(was_training)
    return float(loss_sum / max(n_sum, 1))


# ------------------------------------------------------------------------------------------------
# The run and its summary
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
    grad_accum: int
    steps: int
    optimizer: str
    params: int
    trainable_params: int
    data: str = ""
    losses: list = field(default_factory=list)
    eval_losses: list = field(default_factory=list)  # (step, loss)
    step_times_s: list = field(default_factory=list)
    # from the step's start until training_step returns, before the synchronisation that ends the
    # step: how long the host needs to queue the step's work. Close to the step time on a GPU means
    # host-bound: a faster GPU would wait for the host (docs/troubleshooting.md).
    host_queue_s: list = field(default_factory=list)
    # the job's tokens that are not padding in each timed step (TrainData.text_tokens), beside step_times_s
    text_tokens: list = field(default_factory=list)
    samples: list = field(default_factory=list)  # --sample-prompts: {"prompt", "before", "after"} each
    cuda_graphs: str = ""  # how the steps were queued: "replayed from step N" (and when that ended), or "off (why)"
    peak_memory_gb: float | None = None
    versions: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        """The job's tokens per step, padding included."""
        return self.batch_size * self.seq_len * self.grad_accum * self.world_size

    def summary(self, bf16_peak: float | None, flops_per_token: float) -> dict:
        """tokens/s, TFLOP/s and MFU count the tokens that are not padding: the mean text tokens of a
        timed step over the median step time. "tokens/s with padding (job)" counts every token."""
        t = self.step_times_s
        median = statistics.median(t) if t else None
        padded = self.tokens_per_step / median if median else None
        text_share = (statistics.fmean(self.text_tokens) / self.tokens_per_step if self.text_tokens
                      else 1.0)  # a result without the counts (no timed step): nothing to scale
        tps = padded * text_share if padded else None
        achieved = tps * flops_per_token / 1e12 if tps else None
        return {
            "step time mean (ms)": statistics.fmean(t) * 1e3 if t else None,
            "step time median (ms)": median * 1e3 if median else None,
            "host queue median (ms)": statistics.median(self.host_queue_s) * 1e3 if self.host_queue_s else None,
            # below ~100% the GPU is the bottleneck; a GPU k times faster stays busy while this is under 100/k %
            "host queue (% of step)": (100 * statistics.median(self.host_queue_s) / median
                                       if self.host_queue_s and median else None),
            "step mode": self.cuda_graphs or None,
            "tokens/s (job)": tps,
            "tokens/s with padding (job)": padded,
            "padding (% of tokens)": 100 * (1 - text_share),
            "tokens/s per GPU": tps / self.world_size if tps else None,
            "model TFLOP/s per GPU": achieved / self.world_size if achieved else None,
            "MFU (% of bf16 peak)": 100 * achieved / self.world_size / bf16_peak if achieved and bf16_peak else None,
            "peak GPU memory (GB)": self.peak_memory_gb,
            "first loss": self.losses[0] if self.losses else None,
            "final loss": self.losses[-1] if self.losses else None,
            "eval loss before": self.eval_losses[0][1] if self.eval_losses and self.eval_losses[0][0] == 0 else None,
            "final eval loss": self.eval_losses[-1][1] if self.eval_losses and self.eval_losses[-1][0] > 0 else None,
        }


# Summary rows that only a GPU fills: the CPU's table leaves them out (the JSON keeps every key).
GPU_ONLY_ROWS = ("host queue median (ms)", "host queue (% of step)", "tokens/s per GPU", "model TFLOP/s per GPU",
                 "MFU (% of bf16 peak)", "peak GPU memory (GB)")
PADDING_ROWS = ("tokens/s with padding (job)", "padding (% of tokens)")  # left out of the table without padding


def table_rows(summary: dict, on_gpu: bool) -> list:
    """The summary's rows as printed: a CPU leaves out GPU_ONLY_ROWS, batches without padding PADDING_ROWS."""
    padded = bool(summary.get("padding (% of tokens)"))
    return [(k, format_value(k, v)) for k, v in summary.items()
            if (on_gpu or k not in GPU_ONLY_ROWS) and (padded or k not in PADDING_ROWS)]


def throughput(text_tokens: int, tokens: int, seconds: float) -> str:
    """'47,012 tokens/s (text), 314,385 with padding'; one figure when nothing is padding."""
    said = f"{text_tokens / seconds:,.0f} tokens/s"
    return said + (f" (text), {tokens / seconds:,.0f} with padding" if text_tokens < tokens else "")


def format_value(key: str, v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if "loss" in key:
        return f"{v:.4f}"
    if "tokens/s" in key:
        return f"{v:,.0f}"
    return f"{v:,.1f}"


def default_tag(cfg, model_name: str) -> str:
    size = world()[1]
    gpus = f"_{size}gpu" if size > 1 else ""
    lora = f"_lora{cfg.lora_r}" if cfg.lora_r else ""
    rounding = weight_rounding(cfg)
    rounding = f"_{rounding}" if rounding != "nearest" else ""  # the runs that compare them get one file each
    return f"{cfg.script}_{model_name.replace('/', '_')}_b{cfg.batch_size}_s{cfg.seq_len}{lora}{gpus}{rounding}"


class MetricsLog:
    """One JSON line per logged step (results/<tag>.metrics.jsonl), and TensorBoard when asked for."""

    def __init__(self, path, tensorboard_dir=None):
        self.path = path
        self.writer = None
        if is_main():
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w")
            if tensorboard_dir is not None:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, step: int, **values) -> None:
        if not is_main():
            return
        row = {"step": step, **{k: v for k, v in values.items() if v is not None}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in row.items():
                if k != "step":
                    self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if is_main():
            self.file.close()
            if self.writer is not None:
                self.writer.close()


def plot_curve(result: RunResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(result.losses) + 1), result.losses, label="train loss")
    if result.eval_losses:
        ax.plot(*zip(*result.eval_losses), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per target token)")
    ax.set_title(f"{result.script}: {result.model}, {result.batch_size}x{result.seq_len}x{result.grad_accum}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def causal_padding(cfg) -> bool:
    """Right-padded batches without their padding mask (playbook/data.py, `causal_padding`): the optimized
    scripts' default. The baseline passes Hugging Face the mask, as plain Hugging Face training does."""
    return not cfg.defaults.huggingface_attention


def make_run_data(cfg, model, tokenizer=None):
    from playbook.data import bad_data_exit, make_data

    kind = "dataset" if cfg.dataset else "text" if cfg.data else "synthetic"
    rank, size = world()
    try:
        data = make_data(str(cfg.dataset or cfg.data) if kind != "synthetic" else None, kind, tokenizer,
                         model.config.vocab_size, cfg.batch_size, cfg.seq_len, cfg.seed, rank=rank, world_size=size,
                         packing=cfg.packing, train_on_prompt=cfg.train_on_prompt, eval_fraction=cfg.eval_fraction,
                         drop_long=cfg.drop_long, eval_source=cfg.eval_dataset, repeat_batches=cfg.repeat_batches)
    except (ValueError, OSError, ImportError) as err:  # bad input: the row counts, one line, exit code 2
        raise bad_data_exit(err) from None
    data.causal_padding = causal_padding(cfg)
    if data.packing:
        use_packed_attention(cfg, model, data)
    return data


def use_packed_attention(cfg, model, data) -> None:
    """Packed rows' attention: the optimized scripts give the model playbook/packed_attention.py's function and
    the batches their examples' boundaries; the baseline keeps SDPA with a dense [B, 1, T, T] mask, as plain
    Hugging Face training does. Says which, in one line."""
    from playbook import packed_attention

    config = model.config
    why = "the baseline: Hugging Face's SDPA" if cfg.defaults.huggingface_attention else \
        packed_attention.unsupported(config)
    if why:
        log(f"attention on packed rows: SDPA with a dense [batch, 1, seq, seq] mask ({why})")
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = model.get_input_embeddings().weight.dtype
    packed_attention.install(model)
    data.packed_attention = "boundaries"
    data.packed_kernel = packed_attention.kernel(torch.device(cfg.device), dtype, head_dim)
    log(packed_attention.describe(torch.device(cfg.device), dtype, head_dim))


def needs_tokenizer(cfg) -> bool:
    return bool(cfg.dataset or cfg.data or cfg.output_dir or cfg.sample_prompts)


def run_tokenizer(cfg, model_name: str):
    if not needs_tokenizer(cfg):
        return None
    from playbook.data import make_tokenizer

    return make_tokenizer(model_name, preset=model_name in PRESETS)


def total_steps(cfg, data) -> int:
    if cfg.steps is not None:
        return cfg.steps
    per_epoch = data.batches_per_epoch
    steps = max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    log(f"--epochs {cfg.epochs:g}: {per_epoch} micro-batches per epoch / {cfg.grad_accum} -> {steps} steps")
    return steps


# ------------------------------------------------------------------------------------------------
# Outputs and resuming: checked before the first step
# ------------------------------------------------------------------------------------------------
# The settings that decide a run's data order and learning-rate schedule: name in the checkpoint ->
# the flag that sets it. A resumed run must have the same values (the kernels, the optimizer's
# implementation, logging and the number of steps may change).
RESUME_SETTINGS = {
    "model": "--model", "num_layers": "--num-layers", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha",
    "lora_dropout": "--lora-dropout", "lora_targets": "--lora-targets", "load_in_4bit": "--load-in-4bit",
    "data": "--data / --dataset", "batch_size": "--batch-size", "grad_accum": "--grad-accum", "seq_len": "--seq-len",
    "packing": "--packing", "train_on_prompt": "--train-on-prompt", "drop_long": "--drop-long",
    "eval_fraction": "--eval-fraction", "seed": "--seed", "lr": "--lr", "lr_schedule": "--lr-schedule",
    "lr_warmup_steps": "--lr-warmup-steps", "warmup_ratio": "--warmup-ratio", "weight_decay": "--weight-decay",
    "repeat_batches": "--repeat-batches",
}


def data_identity(cfg) -> dict | str:
    """The training data, as a checkpoint records it: a file's path, size and SHA-256 (a moved file with
    the same bytes is the same data), a hub dataset's id, or "synthetic"."""
    source = cfg.data if cfg.data is not None else cfg.dataset
    if source is None:
        return "synthetic"
    path = Path(source).expanduser()
    if not path.is_file():
        return {"hub": str(source)}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def resume_settings(cfg, model_name: str) -> dict:
    """This run's values of RESUME_SETTINGS, as stored in every checkpoint it writes."""
    from playbook.lora import parse_targets

    local = Path(model_name).expanduser()
    lora = bool(cfg.lora_r)
    return {
        "model": str(local.resolve()) if local.is_dir() else model_name, "num_layers": cfg.num_layers,
        "lora_r": cfg.lora_r, "lora_alpha": (cfg.lora_alpha or 2 * cfg.lora_r) if lora else None,
        "lora_dropout": cfg.lora_dropout if lora else None,
        "lora_targets": list(parse_targets(cfg.lora_targets)) if lora else None, "load_in_4bit": cfg.load_in_4bit,
        "data": data_identity(cfg), "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
        "seq_len": cfg.seq_len, "packing": cfg.packing, "train_on_prompt": cfg.train_on_prompt,
        "drop_long": cfg.drop_long, "eval_fraction": cfg.eval_fraction, "seed": cfg.seed, "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule, "lr_warmup_steps": cfg.lr_warmup_steps, "warmup_ratio": cfg.warmup_ratio,
        "weight_decay": cfg.weight_decay, "repeat_batches": cfg.repeat_batches,
    }


def _show_setting(key: str, value) -> str:
    if key == "data" and isinstance(value, dict):
        if "hub" in value:
            return f"hub dataset {value['hub']}"
        return f"{value['path']} ({value['bytes']:,} bytes, sha256 {value['sha256'][:12]})"
    if key == "num_layers" and value is None:
        return "all layers"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def settings_differences(saved: dict, ours: dict) -> list[str]:
    """One line per setting that differs: "--batch-size: checkpoint 4, this run 8"."""
    lines = []
    for key, flag in RESUME_SETTINGS.items():
        a, b = saved.get(key), ours.get(key)
        if key == "data" and isinstance(a, dict) and isinstance(b, dict) and "sha256" in a and "sha256" in b:
            same = (a["bytes"], a["sha256"]) == (b["bytes"], b["sha256"])  # the same bytes, wherever they are
        else:
            same = a == b
        if not same:
            lines.append(f"{flag}: checkpoint {_show_setting(key, a)}, this run {_show_setting(key, b)}")
    return lines


def _probe_folder(folder, what: str) -> None:
    """Refuse (exit code 2) a folder that is a file, lies under a file, or cannot be created or written."""
    from playbook.config import usage_error

    for p in (folder, *folder.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == folder else f"lies under {p}, which is a file"
            raise usage_error(f"{what} {folder} {where}, not a directory: choose another {what}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise usage_error(f"{what} {folder} cannot be written ({err.strerror or err}): choose a writable "
                          "directory") from None


def check_output_folders(cfg) -> None:
    """results/ and --output-dir are directories this run can write, checked before the model is built."""
    _probe_folder(RESULTS_DIR, "the results folder")
    if cfg.output_dir is not None:
        _probe_folder(cfg.output_dir, "--output-dir")


def resume_error(cfg, err) -> SystemExit:
    """A checkpoint that cannot be resumed: one line naming it and what is wrong, exit code 2."""
    from playbook.config import usage_error

    return usage_error(f"--resume {cfg.resume}: {str(err).strip()}")


def read_resume(cfg) -> dict:
    """read_checkpoint_info of --resume, its errors as resume_error."""
    from playbook.checkpoint import read_checkpoint_info

    try:
        return read_checkpoint_info(cfg.resume)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:
        raise resume_error(cfg, err) from None


def check_resume(cfg, info: dict, settings: dict, steps: int) -> None:
    """Stop (exit code 2) when this run's settings differ from the checkpoint's, one line each; warn when
    the checkpoint predates stored settings; say how the schedule changes when the length does."""
    saved = info["extra"].get("settings")
    if saved is None:
        log(f"warning: {info['path']} stores no run settings (an older checkpoint): whether this run's batch size, "
            "data, sequence length and schedule are the saved run's cannot be checked")
    else:
        lines = settings_differences(saved, settings)
        if lines:
            print(f"error: --resume {cfg.resume}: this run's settings differ from the checkpoint's; they decide the "
                  "data order and the learning-rate schedule:", file=sys.stderr)
            for line in lines:
                print(f"  {line}", file=sys.stderr)
            print("Resume with the checkpoint's values, or start a new run (another --output-dir).", file=sys.stderr)
            raise SystemExit(2)
    schedule = info["scheduler"]
    if schedule and schedule["total"] != steps and info["step"] < steps:
        start, kind = info["step"], schedule["kind"]
        if kind == "constant":
            log(f"The run's length changes from {schedule['total']} to {steps} steps (constant learning rate: "
                "the remaining steps' rate is unchanged)")
        else:
            before = schedule_factor(start, schedule["total"], schedule["warmup"], kind)
            after = schedule_factor(start, steps, schedule["warmup"], kind)
            log(f"The schedule's length changes from {schedule['total']} to {steps} steps: the {kind} decay is rebuilt "
                f"for {steps} steps, so the remaining steps' learning rate follows the new length (step {start + 1}: "
                f"{cfg.lr * after:.3g} instead of {cfg.lr * max(before, 0.0):.3g})")


def check_output_checkpoints(cfg, info: dict | None, steps: int) -> None:
    """--output-dir must not hold another run's checkpoints: this run's would be mixed with them.

    Allowed: no checkpoints; resuming from a checkpoint of this folder, the later ones (if any)
    belonging to the same run (same length: with the same settings they are what this run computes
    again, and it replaces them as it reaches them). Otherwise stop, unless --overwrite-output-dir,
    which deletes those checkpoints (all of them, or the ones after the resumed one) first."""
    from playbook.checkpoint import LATEST_FILE, list_checkpoints
    from playbook.config import usage_error

    out = cfg.output_dir
    if out is None:
        return
    found = list_checkpoints(out)
    if not found:
        return
    inside = info is not None and info["path"].resolve().parent == out.resolve()
    if inside:
        others = [p for s, p in found if s > info["step"]]
        schedule = info["scheduler"] or {}
        if not others or schedule.get("total") == steps:
            return
        what = (f"{', '.join(p.name for p in others)}, later than the resumed {info['path'].name} and from a run of "
                f"{schedule.get('total')} steps (this one has {steps})")
    else:
        others = [p for _, p in found]
        what = f"another run's checkpoints ({', '.join(p.name for p in others)})"
    if not cfg.overwrite_output_dir:
        raise usage_error(f"--output-dir {out} holds {what}: this run's checkpoints would be mixed with them. Choose "
                          "another --output-dir, resume that run (--resume), or add --overwrite-output-dir to delete "
                          "them before training")
    if is_main():
        for p in others:
            shutil.rmtree(p)
        latest = out / LATEST_FILE
        if latest.is_file() and not (out / latest.read_text().strip()).is_dir():
            latest.unlink()
    log(f"--overwrite-output-dir: deleted {', '.join(p.name for p in others)} from {out} before training")


def weights_finite(model) -> bool:
    """Whether every trainable parameter is finite (a sync point; all processes agree)."""
    with torch.no_grad():
        flags = [torch.isfinite(p.to_local() if type(p).__name__ == "DTensor" else p).all()
                 for p in model.parameters() if p.requires_grad]
        ok = torch.stack(flags).all().to(torch.int32) if flags else torch.ones((), dtype=torch.int32)
        if world()[1] > 1:
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        return bool(ok)


def nonfinite_message(cfg, loss: float, step: int, steps: int, last_good) -> str:
    """What stops a run whose loss is NaN or inf: the step, the likely causes, the last good checkpoint."""
    if last_good is not None:
        where = f"The last good checkpoint (finite weights): {last_good[1]} (step {last_good[0]})."
    elif cfg.output_dir is None:
        where = "No checkpoint was written (no --output-dir)."
    else:
        where = "No checkpoint with finite weights was written before it."
    return (f"error: the loss is {loss} at step {step} of {steps}. Likely causes: the learning rate (--lr {cfg.lr:g}: "
            "try a lower one, a warm-up with --lr-warmup-steps, or --max-grad-norm 1.0); the data (an example of "
            "this step with broken tokens or labels); or overflow in reduced precision (fp16 / bf16 / --fp8 "
            f"activations out of range: compare with --kernels none, without --fp8). {where}")


def train(cfg) -> dict:
    """The one training loop behind both fine-tuning scripts. Returns the summary dict."""
    signals.started()  # Ctrl-C from here on: the line below, exit code 130 (SIGTERM: 143)
    started = [cfg]  # the RunConfig as the run goes on with it (memory_plan.start chooses a default rounding)
    try:
        return _train(cfg, started)
    except (KeyboardInterrupt, Exception) as err:
        if not signals.is_ctrl_c(err):  # (a Ctrl-C may reach here as another error)
            if isinstance(err, RuntimeError) and is_out_of_memory(err):  # (building the model, the data, a step)
                raise SystemExit(oom_message(started[-1], err)) from None
            raise
    raise signals.interrupted_exit("the run stopped before its summary; checkpoints already written under "
                                   "--output-dir are complete") from None


def _train(cfg, started: list | None = None) -> dict:
    from tabulate import tabulate

    check_output_folders(cfg)
    info = read_resume(cfg) if cfg.resume is not None else None
    auto = cfg.optimizer_rounding == "auto"
    cfg = memory_plan.start(cfg)  # the peak it needs against the free memory, before the model is built
    if started is not None:
        started.append(cfg)
    model, model_name, desc, kernel_report = prepare_model(cfg)
    if auto:  # torchrun: every process the same rounding (each chose from its own GPU's free memory)
        cfg = memory_plan.agree_on_rounding(cfg)
    if cfg.lora_r:
        from playbook.lora import name_base_model

        from playbook import pretrained

        base = str(pretrained.local_directory(model_name)) if pretrained.is_pretrained_name(model_name) else model_name
        name_base_model(model, base, f"{model_name} is a preset of this project (its architecture with random "
                                           "weights, built by playbook.models.build_preset): not on the Hugging Face "
                                           "Hub, so AutoPeftModelForCausalLM cannot fetch it; build the preset, then "
                                           "playbook.lora.load_adapter" if model_name in PRESETS else None)
    _, size = world()
    n_params, n_train = count_params(model), count_params(model, trainable_only=True)
    count = f"{n_params / 1e9:.2f} B" if n_params >= 1e9 else f"{n_params / 1e6:.2f} M"
    log(f"Model: {desc}, {count} parameters ({100 * n_train / n_params:.2f}% trainable), {str(next(model.parameters()).dtype).replace('torch.', '').replace('bfloat16', 'bf16')}, on "
        f"{describe_gpu(cfg.device)}" + (f" x {size} processes" if size > 1 else "")
        + (" (the kernels in Triton's interpreter)" if not cfg.on_gpu and in_effect(kernel_report, cfg.optimizer,
                                                                                       cfg.lora_r) else ""))
    tokenizer = run_tokenizer(cfg, model_name)
    data = make_run_data(cfg, model, tokenizer)
    data_line = data.describe()
    log(f"Data: {data_line}")
    steps = total_steps(cfg, data)
    if steps <= cfg.warmup_steps:  # (--epochs: the count of steps is known only now, from the data)
        from playbook.config import usage_error

        raise usage_error(f"--epochs {cfg.epochs:g} is {steps} step(s) of this data, and --timing-warmup-steps "
                          f"{cfg.warmup_steps} leaves none of them timed: give more --epochs, or --timing-warmup-steps "
                          f"{steps - 1}")
    settings = resume_settings(cfg, model_name)
    if info is not None:
        saved_size = int(info["extra"].get("world_size", 1))
        if saved_size != size and cfg.dataset:
            raise resume_error(cfg, f"the checkpoint was written by {saved_size} process(es), this run has {size}: a "
                                    "--dataset epoch is dealt out among the processes, so at another count the step "
                                    f"no longer says which rows were seen; resume with {saved_size} process(es)")
        check_resume(cfg, info, settings, steps)
        saved = info["extra"].get("config") or {}
        saved_rounding = ("fp32-master" if saved.get("master_weights") == "fp32"
                          else saved.get("optimizer_rounding", "nearest"))
        if saved_rounding != weight_rounding(cfg):  # allowed, as a change of --optimizer is
            log(f"The checkpoint's run rounded its weights with {saved_rounding!r}, this one with "
                f"{weight_rounding(cfg)!r}: a Kahan compensation or fp32 master weight the checkpoint lacks starts "
                "from the bf16 weights, one this run does not use is dropped")
    check_output_checkpoints(cfg, info, steps)
    from playbook import cuda_graph

    blocker = cuda_graph.graph_blocker(cfg, data)
    if cfg.on_gpu:
        cuda_graph.announce(blocker)
    optimizer = make_optimizer(model, cfg, capturable=blocker is None)
    lr_warmup = cfg.lr_warmup_steps or int(cfg.warmup_ratio * steps)
    if info is not None and info["scheduler"] and not cfg.lr_warmup_steps and cfg.warmup_ratio:
        lr_warmup = info["scheduler"]["warmup"]  # a share of the saved run's length: the warm-up already done
    schedule = LRSchedule(optimizer, steps, lr_warmup, cfg.lr_schedule)
    tag = cfg.tag or default_tag(cfg, model_name)
    summary_path = result_path(tag, ".json", cfg.overwrite)
    stem = summary_path.stem
    if stem != tag:
        log(f"results/{tag}.json exists: this run writes results/{stem}.* (--overwrite replaces it)")
    tb_dir = ((cfg.output_dir or RESULTS_DIR / "tensorboard") / stem) if cfg.report_to == "tensorboard" else None
    metrics = MetricsLog(RESULTS_DIR / f"{stem}.metrics.jsonl", tb_dir)
    result = RunResult(script=cfg.script, model=model_name, kernels=list(in_effect(kernel_report, cfg.optimizer, cfg.lora_r)) + (["torch.compile"] if cfg.compile else []),
                       gpu=describe_gpu(cfg.device), world_size=size, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       grad_accum=cfg.grad_accum, steps=steps,
                       optimizer=describe_optimizer(cfg),
                       params=n_params, trainable_params=n_train, data=data_line, versions=versions(),
                       config=cfg.as_dict())
    start = 0
    last_good = None  # (step, directory) of the newest checkpoint with finite weights
    last_saved = None  # the newest complete checkpoint
    if info is not None:
        from playbook.checkpoint import load_checkpoint

        try:
            state = load_checkpoint(info["path"], model, optimizer, schedule)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:
            raise resume_error(cfg, err) from None
        start = int(state["step"])
        last_good, last_saved = (start, info["path"]), info["path"]
        if blocker is None:
            cuda_graph.make_capturable(optimizer, cfg.device)
        saved_size = int(state.get("world_size", 1))
        if saved_size != size:
            log(f"The checkpoint was written by {saved_size} process(es), this run has {size}: the weights, optimizer "
                "and schedule carry over; the batches and random numbers from here on are this run's own")
        result.losses = list(state.get("losses", []))[:start]
        result.eval_losses = [tuple(e) for e in state.get("eval_losses", []) if e[0] <= start]
        log(f"Resumed from {info['path']} at step {start} of {steps}")
        if start >= steps:
            raise resume_error(cfg, f"the checkpoint is at step {start}, and this run has only {steps} steps; give "
                                    f"more --steps (or --epochs) to continue it")
    from playbook import interpreter  # the checkpoints' disk; a CPU running the kernels on a real model: estimate, heartbeat

    interpreter.before_training(cfg, model, in_effect(kernel_report, cfg.optimizer, cfg.lora_r), data, start + 1,
                                steps)
    from playbook.time_left import TimeLeft

    left = TimeLeft(steps, start, cfg.eval_every, cfg.save_every, cfg.output_dir is not None,
                    answers=cfg.sample_prompts is not None)
    if start == 0:  # held-out loss before any update, the baseline of the run's gain
        with left.measure("eval"):
            eval_before = evaluate(model, data.eval_batches(cfg.device))
        if eval_before is not None:
            result.eval_losses.insert(0, (0, eval_before))
            log(f"eval loss before training: {eval_before:.4f} (mean over the held-out target tokens)")
    prompts = None
    if cfg.sample_prompts is not None:
        from playbook import generate

        prompts = generate.read_prompts(cfg.sample_prompts)
        with left.measure("answers"):
            result.samples = [{"prompt": p, "before": a} for p, a in
                              zip(prompts, generate.answers(model, tokenizer, prompts, cfg.device, "before training"))]
    timed_from = start + cfg.warmup_steps
    result.cuda_graphs = "" if blocker is None else f"off ({blocker})"
    log(f"Training: steps {start + 1}-{steps} ({cfg.warmup_steps} untimed warm-up), {cfg.grad_accum} x "
        f"{cfg.batch_size} x {cfg.seq_len} tokens per step{' per GPU' if size > 1 else ''} (micro-batches x sequences x "
        f"tokens each), {result.optimizer}, "
        f"lr {cfg.lr:g} {cfg.lr_schedule}" + (f" after {lr_warmup} warm-up steps" if lr_warmup else ""))
    from tqdm import tqdm

    bar = tqdm(range(start, steps), desc=cfg.script, unit="step", disable=not (is_main() and interactive()),
               dynamic_ncols=True)
    stopped = None  # the message of a run stopped early (a non-finite loss, a checkpoint not written)
    terminated = None  # the step after which a SIGTERM stopped the run
    graphed = None  # the step to capture (cuda_graph.GraphedStep); captured after the first step of the run
    signals.defer_sigterm(True)  # a scheduler's SIGTERM: the step in progress ends, is saved, and the run stops
    left.begin()
    try:
        for step in bar:
            if step == timed_from and cfg.on_gpu:
                synchronize(cfg.device)
                torch.cuda.reset_peak_memory_stats(cfg.device)  # peak counted after warm-up
            lr = schedule.apply(step)
            batches = [data.batch(step * cfg.grad_accum + i, cfg.device) for i in range(cfg.grad_accum)]
            n_text = sum(data.text_tokens(step * cfg.grad_accum + i) for i in range(cfg.grad_accum))  # on the host
            log_now = (step + 1) % cfg.log_every == 0 or step == steps - 1
            if blocker is None and graphed is None:
                graphed = cuda_graph.GraphedStep(
                    lambda mb: training_step(model, optimizer, mb, cfg.max_grad_norm, zero_grad=False), batches,
                    compiled=cfg.compile)
            if graphed is not None and graphed.graph is not None and not graphed.matches(batches):
                log(f"CUDA graphs: step {step + 1}'s batches differ in shape from the captured ones; the rest "
                    "of the run is queued eagerly")
                result.cuda_graphs += f", eager from step {step + 1} (the batches changed shape)"
                graphed, blocker = None, "the batches changed shape"
                optimizer.zero_grad(set_to_none=True)  # the graph's gradients are not this step's to add to

            def eager(mb, log_now=log_now):
                return training_step(model, optimizer, mb, cfg.max_grad_norm, grad_norm=log_now)

            synchronize(cfg.device)
            t0 = time.perf_counter()
            loss, norm = graphed.run(batches, eager) if graphed is not None else eager(batches)
            queued = time.perf_counter() - t0  # the host's time to queue the step (no sync inside it)
            synchronize(cfg.device)
            dt = time.perf_counter() - t0
            if log_now and norm is None and graphed is not None and graphed.graph is not None:
                norm = gradient_norm(model)  # the replay left this step's gradients; outside the timing
            loss_value = loss.float().item()  # a sync point (already synchronised above)
            if not math.isfinite(loss_value):
                stopped = nonfinite_message(cfg, loss_value, step + 1, steps, last_good)
                break
            result.losses.append(loss_value)
            if step >= timed_from:
                result.step_times_s.append(dt)
                result.host_queue_s.append(queued)
                result.text_tokens.append(n_text)
            eval_loss = None
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step == steps - 1:
                with left.measure("eval"):
                    eval_loss = evaluate(model, data.eval_batches(cfg.device))
                if eval_loss is not None:
                    result.eval_losses.append((step + 1, eval_loss))
            mem = cuda_graph.peak_bytes(graphed) / 1e9 if cfg.on_gpu else None
            metrics.write(step + 1, loss=loss_value, eval_loss=eval_loss, lr=lr,
                          grad_norm=float(norm) if norm is not None else None, tokens_per_s=n_text / dt,
                          padded_tokens_per_s=result.tokens_per_step / dt,
                          step_ms=dt * 1e3, host_queue_ms=queued * 1e3, peak_memory_gb=mem)
            bar.set_postfix(loss=f"{loss_value:.4f}", ms=f"{dt * 1e3:.0f}")
            left.step_done(step + 1)
            if log_now or eval_loss is not None:
                line = (f"step {step + 1:5d}/{steps}  loss {loss_value:.4f}"
                        + (f"  eval {eval_loss:.4f}" if eval_loss is not None else "")
                        + f"  lr {lr:.2e}" + (f"  grad norm {float(norm):.3f}" if norm is not None else "")
                        + f"  {dt * 1e3:8.1f} ms  {throughput(n_text, result.tokens_per_step, dt)}" + left.text(step + 1))
                if bar.disable:
                    log(line)
                else:
                    bar.write(line)
            if cfg.output_dir is not None and ((cfg.save_every and (step + 1) % cfg.save_every == 0) or step == steps - 1):
                try:
                    with left.measure("save"):
                        path = save(cfg, step + 1, model, tokenizer, optimizer, schedule, result, settings)
                except (OSError, RuntimeError, SafetensorError) as err:  # a full disk, a file size limit,
                    # permissions (safetensors' own error for a failed write): the summary is still written
                    stopped = (f"error: the checkpoint of step {step + 1} could not be written to {cfg.output_dir} "
                               f"({str(err).splitlines()[0][:300]})"
                               + (f"; the last complete checkpoint is {last_saved}" if last_saved else
                                  "; no checkpoint of this run is complete"))
                    break
                last_saved = path
                if weights_finite(model):
                    last_good = (step + 1, path)
            if graphed is not None and graphed.graph is None and step + 1 < steps:
                failed = graphed.capture(optimizer)
                if failed is not None:
                    log(f"CUDA graphs: the capture failed ({failed}); each step is queued eagerly")
                    graphed, blocker = None, failed
                    result.cuda_graphs = f"off ({failed})"
                else:
                    result.cuda_graphs = f"replayed from step {step + 2}"
            if step + 1 < steps and sigterm_stops(cfg):
                terminated = step + 1
                break
    finally:  # out of memory in a step: train() turns it into its one-line message
        signals.defer_sigterm(False)
        bar.close()
        metrics.close()
    if terminated is not None:
        kept = stop_after_sigterm(
            cfg, terminated, steps, last_saved,
            lambda: save(cfg, terminated, model, tokenizer, optimizer, schedule, result, settings))
        if size > 1:
            torch.distributed.destroy_process_group()
        raise signals.interrupted_exit(kept, "SIGTERM")
    if cfg.on_gpu:
        result.peak_memory_gb = cuda_graph.peak_bytes(graphed) / 1e9  # the captured step's footprint included
    if prompts is not None and stopped is None:
        from playbook import generate

        for sample, after in zip(result.samples, generate.answers(model, tokenizer, prompts, cfg.device,
                                                                  f"after {len(result.losses)} steps")):
            sample["after"] = after
        if is_main():
            print(generate.format_samples(result.samples))
    summary = result.summary(gpu_bf16_peak_tflops(cfg.device), flops_per_token(model, cfg.seq_len, lora=bool(cfg.lora_r)))
    summary.update(left.summary())  # the end estimated at step 10, against the real one
    payload = {**asdict(result), "summary": summary, "stopped": stopped}
    if is_main():
        rows = table_rows(summary, cfg.on_gpu)
        unit = "GPUs" if cfg.on_gpu else "processes"
        print(tabulate(rows, headers=[f"{cfg.script}: {model_name}, {cfg.batch_size}x{cfg.seq_len}"
                                      + (f"x{cfg.grad_accum}" if cfg.grad_accum > 1 else "")
                                      + (f" x {size} {unit}" if size > 1 else ""), ""], tablefmt="github"))
        if size > 1:
            print("(tokens/s counts every process's tokens; the loss is the job's mean over its target tokens)")
        if summary["padding (% of tokens)"]:
            print("(tokens/s, TFLOP/s and MFU count the tokens that are not padding; 'with padding' counts them all)")
        if not cfg.on_gpu:
            print("(CPU run: " + ("the kernels ran in Triton's interpreter; " if in_effect(kernel_report, cfg.optimizer,
                                                                                          cfg.lora_r) else "")
                  + "the timings say nothing about a GPU)")
        write_atomic(summary_path, json.dumps(payload, indent=2, default=str))
        plot_curve(result, summary_path.with_suffix(".png"))
        print(f"Saved {summary_path}, its loss curve {summary_path.with_suffix('.png').name} and "
              f"{metrics.path.name}")
    if stopped is not None:
        if size > 1:
            torch.distributed.destroy_process_group()
        raise SystemExit(f"{stopped}\nThe summary of the {len(result.losses)} steps done is in {summary_path}")
    if cfg.lora_r and cfg.merge_lora and is_main():
        from playbook.lora import merge_and_save

        merged = cfg.output_dir / "merged"
        merge_and_save(model, merged, tokenizer)
        print(f"Merged LoRA weights: {merged}")
    if size > 1:
        torch.distributed.destroy_process_group()
    return payload


def sigterm_stops(cfg) -> bool:
    """Whether a SIGTERM came during the loop (signals.defer_sigterm) to any process: every process then
    stops after the same step, the one whose checkpoint they write together."""
    pending = signals.sigterm_pending()
    if world()[1] > 1:
        flag = torch.tensor(int(pending), device=cfg.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # a sync point, once per step
        pending = bool(flag)
    return pending


def stop_after_sigterm(cfg, step: int, steps: int, last_saved, save_now) -> str:
    """What a SIGTERM (a scheduler's pre-emption) keeps: with --output-dir the checkpoint of `step`, the last
    step done (`save_now()` writes it unless it was just written), so that the job resumes from it."""
    kept = f"stopped after step {step} of {steps}, before its summary"
    if cfg.output_dir is None:
        return kept + "; no checkpoint (no --output-dir)"
    try:
        path = last_saved if last_saved is not None and Path(last_saved).name == f"checkpoint-{step}" else save_now()
    except (OSError, RuntimeError, SafetensorError) as err:
        return (kept + f"; the checkpoint of step {step} could not be written ({str(err).splitlines()[0][:200]})"
                + (f"; the last complete checkpoint is {last_saved}" if last_saved else ""))
    return kept + f"; saved {path}: resume with --resume {cfg.output_dir}"


def save(cfg, step, model, tokenizer, optimizer, schedule, result, settings=None):
    """Write checkpoint-<step> (keeping the newest --save-total-limit); `settings`: resume_settings."""
    from playbook.checkpoint import save_checkpoint

    extra = {"step": step, "micro_batch": step * cfg.grad_accum, "losses": result.losses,
             "eval_losses": result.eval_losses, "config": cfg.as_dict(), "world_size": world()[1],
             "settings": settings}
    path = save_checkpoint(cfg.output_dir, step, model, tokenizer, optimizer, schedule, extra,
                           keep_last=cfg.save_total_limit)
    if path is not None:
        log(f"checkpoint: {path}")
    return path
