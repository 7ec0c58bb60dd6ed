"""A training run's report: its result (RunResult) and summary table, the metrics of each logged step,
the JSON of the whole run beside its loss curve, and the answers to --sample-prompts before and after.

Files, under results/ (the tag: --tag, or default_tag): <tag>.json (every step's loss and time, the
summary, the configuration), <tag>.png (the loss curve), <tag>.metrics.jsonl (one line per logged step).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from tabulate import tabulate

from core.process import is_main, world
from playbook.model import generate, models
from playbook.optim.optimizer import weight_rounding
from playbook.runtime import output
from playbook.runtime.common import gpu_bf16_peak_tflops
from playbook.store.files import write_atomic
from playbook.sections import RunConfig


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
    best_eval: dict | None = None  # with --eval-every: {"step", "eval loss", "checkpoint"} of the lowest eval loss
    early_stop: str | None = None  # the line of a run that --early-stopping-patience ended
    ended_with: str | None = None  # with periodic evals: whose weights the model ended with
    ended_at: int | None = None  # the step whose weights the model ended with, where not the last (the best step's)

    def _final_eval(self) -> float | None:
        """The eval loss of the weights the model ends with: the last eval after a step, or, where the run ends
        with an earlier step's weights (--load-best-model-at-end), that step's eval."""
        if self.ended_at is not None:
            return next((loss for step, loss in self.eval_losses if step == self.ended_at), None)
        return self.eval_losses[-1][1] if self.eval_losses and self.eval_losses[-1][0] > 0 else None

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
            # the eval loss of the model as the run ends: the best step's, where it ends with its weights
            "final eval loss": self._final_eval(),
            **({} if self.ended_at is None or not self.eval_losses else {
                "last step's eval loss": self.eval_losses[-1][1]}),
            **({} if self.best_eval is None else {
                "best eval loss": self.best_eval["eval loss"], "best eval step": self.best_eval["step"]}),
            **({} if self.early_stop is None else {"stopped early at step": len(self.losses)}),
            **({} if self.ended_with is None else {"model at the end": self.ended_with}),
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
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if "loss" in key:
        return f"{v:.4f}"
    if "tokens/s" in key:
        return f"{v:,.0f}"
    return f"{v:,.1f}"


def default_tag(cfg: RunConfig, model_name: str) -> str:
    size = world()[1]
    gpus = f"_{size}gpu" if size > 1 else ""
    lora = f"_lora{cfg.model.lora_r}" if cfg.model.lora_r else ""
    rounding = weight_rounding(cfg.training)
    rounding = f"_{rounding}" if rounding != "nearest" else ""  # the runs that compare them get one file each
    return f"{cfg.run.script}_{model_name.replace('/', '_')}_b{cfg.data.batch_size}_s{cfg.data.seq_len}{lora}{gpus}{rounding}"


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
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as err:  # a full disk: the error names the file
            raise OSError(err.errno, err.strerror, str(self.path)) from err
        if self.writer is not None:
            for k, v in row.items():
                if k != "step":
                    self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if is_main():
            try:
                self.file.close()
            except OSError as err:  # what was buffered, on a full disk
                raise OSError(err.errno, err.strerror, str(self.path)) from err
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


def emulation(cfg: RunConfig) -> str | None:
    """The emulated FP8/FP4 recipe a run trains with (`--fp8-emulate`), or None: its times are of the
    emulation (dequantized bf16 matmuls), never a speed of the format, and every line that prints one says so."""
    from core.fp8_support import RECIPES

    recipe = cfg.model.fp8_recipe
    return recipe if cfg.model.fp8 and recipe in RECIPES and RECIPES[recipe].emulated else None


def step_line(step: int, steps: int, loss: float, eval_loss: float | None, rate: str, norm, seconds: float,
              text_tokens: int, tokens: int, time_left: str, emulated: str | None = None) -> str:
    """A logged step's line: "step    10/100  loss 2.3456  lr 1.00e-04  grad norm 0.812  512.3 ms  ...";
    `rate`: the schedule's part (LRSchedule.text); `emulated` (the recipe, `emulation`): the time and throughput
    are marked as the emulation's."""
    timing = f"  {seconds * 1e3:8.1f} ms  {throughput(text_tokens, tokens, seconds)}"
    if emulated:
        timing += f" [{emulated}: emulated, not a speed]"
    return (f"step {step:5d}/{steps}  loss {loss:.4f}"
            + (f"  eval {eval_loss:.4f}" if eval_loss is not None else "")
            + f"  {rate}" + (f"  grad norm {float(norm):.3f}" if norm is not None else "")
            + timing + time_left)


def answers_before(model, tokenizer, prompts: list, device) -> list[dict]:
    """The model's answers to --sample-prompts before training: RunResult.samples, "after" still to come."""
    return [{"prompt": p, "before": a} for p, a in
            zip(prompts, generate.answers(model, tokenizer, prompts, device, "before training"))]


def answers_after(samples: list[dict], model, tokenizer, prompts: list, device, steps_done: int) -> None:
    """Fill in each sample's answer after training, and print the samples side by side."""
    for sample, after in zip(samples, generate.answers(model, tokenizer, prompts, device, f"after {steps_done} steps")):
        sample["after"] = after
    if is_main():
        print(generate.format_samples(samples))


def write_report(cfg: RunConfig, result: RunResult, model, time_left: dict, stopped: str | None, summary_path,
                 metrics_path,
                 interpreted: bool) -> dict:
    """The run's summary (RunResult.summary with time_left's estimate beside it) as a table on the console,
    and with every step in results/<tag>.json beside its loss curve (main process). Returns the JSON's dict.
    stopped: the message of a run stopped early; interpreted: the kernels ran in Triton's interpreter."""
    size = world()[1]
    summary = result.summary(gpu_bf16_peak_tflops(cfg.run.device),
                             models.flops_per_token(model, cfg.data.seq_len, lora=bool(cfg.model.lora_r)))
    summary.update(time_left)  # the end estimated at step 10, against the real one
    payload = {**asdict(result), "summary": summary, "stopped": stopped}
    if not is_main():
        return payload

    rows = table_rows(summary, cfg.on_gpu)
    unit = "GPUs" if cfg.on_gpu else "processes"
    emulated = emulation(cfg)
    if emulated:  # every timing row names the emulation: none of them is the format's speed
        rows = [(k + " [emulated]" if ("ms" in k or "/s" in k or "MFU" in k) else k, v) for k, v in rows]
    print(tabulate(rows, headers=[f"{cfg.run.script}: {result.model}, {cfg.data.batch_size}x{cfg.data.seq_len}"
                                  + (f"x{cfg.training.grad_accum}" if cfg.training.grad_accum > 1 else "")
                                  + (f" x {size} {unit}" if size > 1 else "")
                                  + (f", {emulated}" if emulated else ""), ""], tablefmt="github"))
    if emulated:
        print(f"(--fp8-emulate: recipe {emulated} quantizes as the format does and multiplies dequantized bf16 "
              "operands; its losses are the format's, its times and throughputs are the emulation's, not comparable)")
    if size > 1:
        print("(tokens/s counts every process's tokens; the loss is the job's mean over its target tokens)")
    if summary["padding (% of tokens)"]:
        print("(tokens/s, TFLOP/s and MFU count the tokens that are not padding; 'with padding' counts them all)")
    if not cfg.on_gpu:
        print("(CPU run: " + ("the kernels ran in Triton's interpreter; " if interpreted else "")
              + "the timings say nothing about a GPU)")
    write_atomic(summary_path, json.dumps(payload, indent=2, default=str))
    try:
        plot_curve(result, summary_path.with_suffix(".png"))
    except OSError as err:  # a full disk: one line naming the plot; the summary before it is whole
        if not output.is_disk_full(err):
            raise
        err.filename = err.filename or str(summary_path.with_suffix(".png"))
        raise output.disk_full_exit(err, f"{summary_path} and {metrics_path} are complete, and so are the "
                                         "checkpoints written under --output-dir") from None
    print(f"Saved {summary_path}, its loss curve {summary_path.with_suffix('.png').name} and {metrics_path.name}")
    return payload
