"""The one training loop behind every fine-tuning script: `train(cfg)`.

    finetune_baseline.py   = train(config with kernels=())
    finetune_optimized.py  = train(config with --kernels)
    profile_baseline.py    = the same steps under torch.profiler

One optimizer step = `--grad-accum` micro-batches. The loss of the step is the mean over every target
token of all its micro-batches (not the mean of the micro-batch means, which would weigh a short
example like a long one): the number of target tokens in the window is counted first and passed to
the model as `num_items_in_batch`, so each micro-batch's loss is its sum divided by that count.

The run's parts live beside this module: the optimizer and its schedule in playbook/optim/, how each step
is queued (eagerly or replayed from a CUDA graph) in playbook/run/step.py, the checks of a --resume
checkpoint and of the output folders in playbook/run/resume.py, the summary, metrics and loss curve in
playbook/run/report.py.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from tqdm import tqdm

from core.process import is_main, log, world
from playbook.data.rows import IGNORE_INDEX
from playbook.model import generate
from playbook.model.lora import merge_and_save
from playbook.optim.optimizer import OptimizerInBackward, describe_optimizer
from playbook.optim.schedule import (LRSchedule, check_warmup, describe as describe_schedule, divergence_causes,
                                     warmup_steps)
from playbook.run import interpreter, start
from playbook.run.best import BestEval
from playbook.run.report import (MetricsLog, RunResult, answers_after, answers_before, default_tag, emulation, step_line,
                                 write_report)
from playbook.run.resume import (check_output_checkpoints, check_output_folders, check_resumed_run, load, read_resume,
                                 resume_settings)
from playbook.run.start import run_errors, settle
from playbook.run.step import StepRunner
from playbook.runtime import signals
from playbook.runtime.common import describe_gpu, interactive, synchronize, usage_error, versions
from playbook.runtime.time_left import TimeLeft, in_progress, running
from playbook.store import checkpoint, checkpoint_load
from playbook.store.checkpoint import BEST_FILE
from playbook.store.files import RESULTS_DIR, result_path, write_failure
from playbook.sections import RunConfig



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
    """Mean loss over every target token of the held-out batches. A pass that runs long says how far it is and
    what it has left (time_left.running)."""
    if not batches:
        return None
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    n_sum = 0
    with running("eval pass", total=len(batches), unit="batches", unknown="the first batch still running") as at:
        for b in batches:
            n = int(count_targets([b]))  # a sync point, once per eval batch
            if n:
                loss_sum += float(model(**b).loss) * n
                n_sum += n
            at.done += 1
    model.train(was_training)
    return float(loss_sum / max(n_sum, 1))


# ------------------------------------------------------------------------------------------------
# The run's data
# ------------------------------------------------------------------------------------------------
def total_steps(cfg: RunConfig, data) -> int:
    if cfg.training.steps is not None:
        return cfg.training.steps
    per_epoch = data.batches_per_epoch
    steps = max(1, math.ceil(cfg.training.epochs * per_epoch / cfg.training.grad_accum))
    log(f"--epochs {cfg.training.epochs:g}: {per_epoch} micro-batches per epoch / {cfg.training.grad_accum} -> {steps} steps")
    return steps


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def train(cfg: RunConfig) -> dict:
    """The one training loop behind both fine-tuning scripts. Returns the summary dict."""
    check_output_folders(cfg)  # results/ and --output-dir writable: one line, before the memory plan and any model
    cfg = settle(cfg)  # the run's RunConfig from here on: the memory plan checked, the rounding decided
    with run_errors(cfg, "the run stopped before its summary; checkpoints already written under --output-dir are "
                         "complete"):
        return _train(cfg)


def _train(cfg: RunConfig) -> dict:
    """train() less its answers to Ctrl-C and to memory running out: start_run, the steps, end_run."""
    run = start_run(cfg)
    runner = step_runner(run)
    bar = progress_bar(run)
    stopped = None  # the message of a run stopped early (a non-finite loss, a checkpoint not written)
    terminated = None  # the step after which a SIGTERM stopped the run
    def waiting_for() -> str:  # what a deferred SIGTERM waits for, said when the stop takes a while
        where = in_progress()
        return (f"the run stops after the step in progress{f' ({where})' if where else ''} and saves its checkpoint "
                f"to {cfg.output.output_dir}")

    # A scheduler's SIGTERM with --output-dir: the step in progress ends, is saved, and the run stops (without
    # one there is nothing to wait for: the run stops at once, as for Ctrl-C)
    signals.defer_sigterm(cfg.output.output_dir is not None, waiting_for=waiting_for)
    run.left.begin()
    try:
        for step in bar:
            with running(f"step {step + 1} of {run.steps}", expected_s=run.left.step_seconds(),
                         unknown="no step time measured yet"):
                stopped = one_step(run, runner, step, bar)
            if stopped is not None or run.early_stop is not None:
                break
            if step + 1 < run.steps and sigterm_stops(cfg):
                terminated = step + 1
                break
    finally:  # however the loop ends (out of memory in a step: train() turns it into its one-line message)
        signals.defer_sigterm(False)
        bar.close()
        run.metrics.close()
    run.result.cuda_graphs = runner.mode
    ending = end_run(run, runner, stopped, terminated)
    if world()[1] > 1:  # a run that ends as planned leaves the process group (an error leaves with the process)
        torch.distributed.destroy_process_group()
    if isinstance(ending, SystemExit):
        raise ending
    return ending


def step_runner(run: Run) -> StepRunner:
    """The run's StepRunner around training_step (looked up at each step, so that a test may replace it)."""
    cfg = run.cfg

    def step_fn(micro_batches, grad_norm=False, zero_grad=True):
        return training_step(run.model, run.optimizer, micro_batches, cfg.training.max_grad_norm, grad_norm=grad_norm,
                             zero_grad=zero_grad)

    return StepRunner(step_fn, lambda: gradient_norm(run.model), run.optimizer, cfg.run.device, run.blocker,
                      compiled=cfg.model.compile)


def progress_bar(run: Run):
    """The steps still to run, as a tqdm bar on an interactive terminal of the main process (else silent)."""
    return tqdm(range(run.start, run.steps), desc=run.cfg.run.script, unit="step",
                disable=not (is_main() and interactive()), dynamic_ncols=True)


@dataclass
class Run:
    """A training run from its first step to its report: what start_run built, and how far the loop is."""

    cfg: object  # the run's RunConfig, as start.settle returned it
    model: nn.Module
    tokenizer: object
    data: object  # playbook.data.dataset's TrainData
    steps: int
    optimizer: object
    schedule: LRSchedule
    result: RunResult
    metrics: MetricsLog
    summary_path: Path
    settings: dict  # resume_settings, stored in every checkpoint
    blocker: str | None  # why the step cannot be one CUDA graph (cuda_graph.graph_blocker), or None
    kernels: tuple  # the kernels in effect (registry.in_effect)
    start: int = 0  # the steps done before this run started (a resumed checkpoint's)
    last_good: tuple | None = None  # (step, directory) of the newest checkpoint with finite weights
    last_saved: Path | None = None  # the newest complete checkpoint
    left: TimeLeft | None = None
    prompts: list | None = None  # --sample-prompts
    best: BestEval | None = None  # the lowest eval loss after a step: --load-best-model-at-end, early stopping
    early_stop: str | None = None  # the line of a run that early stopping ended

    @property
    def timed_from(self) -> int:
        """The first timed step (0-based): the ones before it warm up (--timing-warmup-steps)."""
        return self.start + self.cfg.training.warmup_steps


def start_run(cfg: RunConfig) -> Run:
    """Everything before the first step, for a RunConfig that start.settle returned (train() has checked the output
    folders): the --resume check, the model, the data and the optimizer (start.build), the schedule, the run's outputs, the resumed
    checkpoint, and what before_first_step does."""
    info = read_resume(cfg) if cfg.output.resume is not None else None
    built = start.build(cfg)
    model, model_name, data, optimizer, blocker = built.model, built.model_name, built.data, built.optimizer, built.blocker
    data_line = data.describe()
    log(f"Data: {data_line}")
    steps = total_steps(cfg, data)
    if steps <= cfg.training.warmup_steps:  # (--epochs: the count of steps is known only now, from the data)
        raise usage_error(f"--epochs {cfg.training.epochs:g} is {steps} step(s) of this data, and --timing-warmup-steps "
                          f"{cfg.training.warmup_steps} leaves none of them timed: give more --epochs, or --timing-warmup-steps "
                          f"{steps - 1}")
    if cfg.training.steps is None:  # (--steps: checked with the arguments)
        check_warmup(cfg.training.lr_warmup_steps, steps,
                     counted=f" (--epochs {cfg.training.epochs:g} of this data)")
    settings = resume_settings(cfg, model_name)
    if info is not None:
        check_resumed_run(cfg, info, settings, steps)
    check_output_checkpoints(cfg, info, steps)
    forget_best(cfg)
    warmup = warmup_steps(cfg.training.lr_warmup_steps, cfg.training.warmup_ratio, steps, info["scheduler"] if info
                          else None)
    schedule = LRSchedule(optimizer, steps, warmup, cfg.training.lr_schedule)
    summary_path, metrics = open_outputs(cfg, model_name)
    result = RunResult(script=cfg.run.script, model=model_name, kernels=list(built.kernels) + (["torch.compile"]
                                                                                               if cfg.model.compile
                                                                                           else []),
                       gpu=describe_gpu(cfg.run.device), world_size=world()[1], batch_size=cfg.data.batch_size,
                       seq_len=cfg.data.seq_len, grad_accum=cfg.training.grad_accum, steps=steps, optimizer=describe_optimizer(cfg.training),
                       params=built.params[0], trainable_params=built.params[1], data=data_line, versions=versions(),
                       config=cfg.as_dict())
    run = Run(cfg, model, built.tokenizer, data, steps, optimizer, schedule, result, metrics, summary_path, settings,
              blocker, built.kernels, best=BestEval(cfg.output.early_stopping_patience,
                                                    cfg.output.early_stopping_threshold))
    if info is not None:
        run.start = load(cfg, info, model, optimizer, schedule, result, steps, capturable=blocker is None)
        run.last_good, run.last_saved = (run.start, info["path"]), info["path"]
        if cfg.data.eval_every:  # the resumed run's evals are candidates too (their checkpoints: where one is on disk)
            for done, loss in result.eval_losses:
                if done > 0 and judge_eval(run, done, loss, quiet=True):
                    kept = cfg.output.output_dir / f"checkpoint-{done}" if cfg.output.output_dir else None
                    run.best.checkpoint = kept if kept is not None and kept.is_dir() else None
            line = patience_left(run)
            if line:
                log(line)
    before_first_step(run)
    return run


def patience_left(run: Run) -> str | None:
    """For a resumed run with --early-stopping-patience whose last evals did not beat the best: what the patience
    still allows, said before the first step (an early-stopped run resumed with the same flags stops again at
    its next eval). None where there is nothing to say."""
    cfg, best = run.cfg, run.best
    if not cfg.output.early_stopping_patience or best.step is None or not best.evals_since or not cfg.data.eval_every:
        return None
    left = max(0, cfg.output.early_stopping_patience - best.evals_since)
    next_eval = (run.start // cfg.data.eval_every + 1) * cfg.data.eval_every
    stop = min(run.steps, next_eval + (max(left, 1) - 1) * cfg.data.eval_every)
    return (f"Resumed after {best.evals_since} eval{'s' if best.evals_since > 1 else ''} in a row without a new best "
            f"(the best, {best.loss:.4f}, at step {best.step}): --early-stopping-patience "
            f"{cfg.output.early_stopping_patience} allows {left} more, so the run stops after step {stop} unless an eval by "
            f"then is below {best.loss - best.threshold:.4f}"
            + ("; it stopped early there before: a higher --early-stopping-patience trains on" if not left else ""))


def forget_best(cfg: RunConfig) -> None:
    """A run in an --output-dir without --load-best-model-at-end ends with its last step's weights: the `best`
    pointer an earlier run there left (checkpoint.mark_best) would send export.py and chat.py to another
    checkpoint, so it goes."""
    pointer = cfg.output.output_dir / BEST_FILE if cfg.output.output_dir is not None else None
    if pointer is not None and not cfg.output.load_best_model_at_end and pointer.is_file() and is_main():
        pointer.unlink()
        log(f"{pointer} removed: this run ends with its last step's weights (no --load-best-model-at-end), which "
            "export.py and chat.py then take for the run folder")


def open_outputs(cfg: RunConfig, model_name: str) -> tuple[Path, MetricsLog]:
    """results/<tag>.json's path (another free name unless --overwrite) and the metrics log beside it."""
    tag = cfg.output.tag or default_tag(cfg, model_name)
    summary_path = result_path(tag, ".json", cfg.output.overwrite)
    stem = summary_path.stem
    if stem != tag:
        log(f"results/{tag}.json exists: this run writes results/{stem}.* (--overwrite replaces it)")
    tb_dir = ((cfg.output.output_dir
               or RESULTS_DIR / "tensorboard") / stem) if cfg.output.report_to == "tensorboard" else None
    return summary_path, MetricsLog(RESULTS_DIR / f"{stem}.metrics.jsonl", tb_dir)


def before_first_step(run: Run) -> None:
    """The interpreter's estimate of the run, the held-out loss before any update (the baseline of the run's
    gain), the answers to --sample-prompts before training, and the line that says what the loop runs."""
    cfg, result = run.cfg, run.result
    interpreter.before_training(cfg, run.model, run.kernels, run.data, run.start + 1, run.steps)
    run.left = TimeLeft(run.steps, run.start, cfg.data.eval_every, cfg.output.save_every,
                        cfg.output.output_dir is not None,
                        answers=cfg.output.sample_prompts is not None)
    if run.start == 0:
        with run.left.measure("eval"):
            eval_before = evaluate(run.model, run.data.eval_batches(cfg.run.device))
        if eval_before is not None:
            result.eval_losses.insert(0, (0, eval_before))
            log(f"eval loss before training: {eval_before:.4f} (mean over the held-out target tokens)")
    if cfg.output.sample_prompts is not None:
        run.prompts = generate.read_prompts(cfg.output.sample_prompts)
        with run.left.measure("answers"):
            result.samples = answers_before(run.model, run.tokenizer, run.prompts, cfg.run.device)
    size = world()[1]
    log(f"Training: steps {run.start + 1}-{run.steps} ({cfg.training.warmup_steps} untimed warm-up), {cfg.training.grad_accum} x "
        f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens per step{' per GPU' if size > 1 else ''} (micro-batches x sequences x "
        f"tokens each), {result.optimizer}, {describe_schedule(cfg.training, run.schedule.warmup)}")


def one_step(run: Run, runner: StepRunner, step: int, bar) -> str | None:
    """Optimizer step `step` (0-based) and what follows it: the eval, the metrics and the log line, the
    checkpoint, the capture of the CUDA graph. Returns the message that stops the run, or None."""
    cfg, result = run.cfg, run.result
    if step == run.timed_from and cfg.on_gpu:
        synchronize(cfg.run.device)
        torch.cuda.reset_peak_memory_stats(cfg.run.device)  # peak counted after warm-up
    run.schedule.apply(step)
    batches = [run.data.batch(step * cfg.training.grad_accum + i, cfg.run.device)
               for i in range(cfg.training.grad_accum)]
    n_text = sum(run.data.text_tokens(step * cfg.training.grad_accum + i)
                 for i in range(cfg.training.grad_accum))  # on the host
    log_now = (step + 1) % cfg.output.log_every == 0 or step == run.steps - 1
    loss, norm, queued, dt = runner.run(step, batches, log_now)
    loss_value = loss.float().item()  # a sync point (the runner synchronised already)
    if not math.isfinite(loss_value):
        return nonfinite_message(cfg, loss_value, step + 1, run.steps, run.last_good)
    result.losses.append(loss_value)
    if step >= run.timed_from:
        result.step_times_s.append(dt)
        result.host_queue_s.append(queued)
        result.text_tokens.append(n_text)
    eval_loss = eval_when_due(run, step + 1)
    mem = runner.peak_bytes() / 1e9 if cfg.on_gpu else None
    run.metrics.write(step + 1, loss=loss_value, eval_loss=eval_loss, **run.schedule.metrics(),
                      grad_norm=float(norm) if norm is not None else None, tokens_per_s=n_text / dt,
                      padded_tokens_per_s=result.tokens_per_step / dt,
                      step_ms=dt * 1e3, host_queue_ms=queued * 1e3, peak_memory_gb=mem)
    bar.set_postfix(loss=f"{loss_value:.4f}", ms=f"{dt * 1e3:.0f}")
    run.left.step_done(step + 1)
    if log_now or eval_loss is not None:
        line = step_line(step + 1, run.steps, loss_value, eval_loss, run.schedule.text(), norm, dt, n_text,
                         result.tokens_per_step, run.left.text(step + 1), emulation(run.cfg))
        if bar.disable:
            log(line)
        else:
            bar.write(line)
    improved = judge_eval(run, step + 1, eval_loss) if eval_loss is not None else False
    best_due = improved and cfg.output.load_best_model_at_end
    # early stopping is judged at an eval, as the Trainer's EarlyStoppingCallback judges it: a resumed run whose
    # patience is spent trains on to its next eval (patience_left said so), rather than stopping after one step
    stopping = eval_loss is not None and run.best.should_stop
    stop = save_when_due(run, step + 1, force=best_due or stopping)
    if improved and run.last_saved is not None and Path(run.last_saved).name == f"checkpoint-{step + 1}":
        run.best.checkpoint = run.last_saved
        if cfg.output.load_best_model_at_end:  # the run ends with it: export.py and chat.py take it for the run folder
            checkpoint.mark_best(cfg.output.output_dir, run.last_saved)
    if stop is None and stopping:
        run.early_stop = run.best.stop_line(step + 1)
        log(run.early_stop)
    if stop is None:
        runner.after(step, run.steps)
    return stop


def judge_eval(run: Run, done: int, eval_loss: float, quiet: bool = False) -> bool:
    """A periodic eval (--eval-every) against the best so far: returns whether it is a new best; says once when
    the run starts to memorize (the eval loss above its best while the training loss fell)."""
    cfg, best = run.cfg, run.best
    if not cfg.data.eval_every:  # one eval after the last step: nothing to compare it with
        return False
    last = best.history[-1][0] if best.history else 0  # the step of the last eval judged
    window = run.result.losses[last:done]  # the training losses since then (a resumed run's begin at step 1 too)
    if not quiet and not best.warned and best.memorizing(eval_loss, window):
        best.warned = True
        log(best.memorizing_line(done, eval_loss, window, best_kept(run)))
    return best.update(done, eval_loss, window)


def best_kept(run: Run) -> str:
    """Where the best step's weights are, or how to keep them next time."""
    cfg, best = run.cfg, run.best
    on_disk = best.checkpoint or (cfg.output.output_dir / f"checkpoint-{best.step}" if cfg.output.output_dir else None)
    if on_disk is not None and Path(on_disk).is_dir():
        return (f"The best step's checkpoint: {on_disk}"
                + ("; the run ends with its weights (--load-best-model-at-end)." if cfg.output.load_best_model_at_end
                   else "."))
    advice = "--load-best-model-at-end" + ("" if cfg.output.output_dir else " with --output-dir")
    return (f"Step {best.step}'s weights are not kept: {advice} keeps the best checkpoint"
            + ("" if cfg.output.early_stopping_patience
               else ", and --early-stopping-patience N stops such a run") + ".")


def eval_when_due(run: Run, done: int) -> float | None:
    """The held-out loss after `done` steps, every --eval-every steps and after the last (kept in the result);
    None when no eval is due or there is no held-out data."""
    cfg = run.cfg
    if not ((cfg.data.eval_every and done % cfg.data.eval_every == 0) or done == run.steps):
        return None
    with run.left.measure("eval"):
        eval_loss = evaluate(run.model, run.data.eval_batches(cfg.run.device))
    if eval_loss is not None:
        run.result.eval_losses.append((done, eval_loss))
    return eval_loss


def save_when_due(run: Run, done: int, force: bool = False) -> str | None:
    """The checkpoint after `done` steps, when --output-dir is given and --save-every, the last step or `force`
    (a new best eval with --load-best-model-at-end, an early stop) asks for one. Returns the message that stops
    the run when it cannot be written, else None."""
    cfg = run.cfg
    if cfg.output.output_dir is None or not (force or (cfg.output.save_every and done % cfg.output.save_every == 0)
                                             or done == run.steps):
        return None
    if run.last_saved is not None and Path(run.last_saved).name == f"checkpoint-{done}":
        return None  # (written already: a step that is both a save step and a new best)
    try:
        with run.left.measure("save"):
            path = save(cfg, done, run.model, run.tokenizer, run.optimizer, run.schedule, run.result, run.settings,
                        keep=run.best.checkpoint if cfg.output.load_best_model_at_end else None)
    except (OSError, RuntimeError, SafetensorError) as err:  # a full disk, a file size limit,
        # permissions (safetensors' own error for a failed write): the summary is still written
        return (f"error: the checkpoint of step {done} could not be written to {cfg.output.output_dir} "
                f"({write_failure(err)})"
                + (f"; the last complete checkpoint is {run.last_saved}" if run.last_saved else
                   "; no checkpoint of this run is complete"))
    run.last_saved = path
    if weights_finite(run.model):
        run.last_good = (done, path)
    return None


def end_run(run: Run, runner: StepRunner, stopped: str | None, terminated: int | None) -> dict | SystemExit:
    """After the loop: for a SIGTERM, the checkpoint of the last step done; otherwise the answers after
    training, the report, and the merged LoRA weights of a run that finished. Returns the report's dict, or
    the SystemExit that ends a stopped or terminated run (raised once the processes have left their group)."""
    cfg, result = run.cfg, run.result
    if terminated is not None:
        kept = stop_after_sigterm(cfg, terminated, run.steps, run.last_saved, lambda: save(
            cfg, terminated, run.model, run.tokenizer, run.optimizer, run.schedule, result, run.settings))
        return signals.interrupted_exit(kept, "SIGTERM")
    if cfg.on_gpu:
        result.peak_memory_gb = runner.peak_bytes() / 1e9  # the captured step's footprint included
    if stopped is None:
        end_with_best(run)
    if run.prompts is not None and stopped is None:
        answers_after(result.samples, run.model, run.tokenizer, run.prompts, cfg.run.device, len(result.losses))
    payload = write_report(cfg, result, run.model, run.left.summary(), stopped, run.summary_path, run.metrics.path,
                           interpreted=bool(run.kernels))
    if stopped is not None:
        return SystemExit(f"{stopped}\nThe summary of the {len(result.losses)} steps done is in {run.summary_path}")
    if cfg.model.lora_r and cfg.model.merge_lora and is_main():
        merge_lora(cfg, run.model, run.tokenizer)
    return payload


def end_with_best(run: Run) -> None:
    """After the last step (or an early stop): the best eval named, and with --load-best-model-at-end its weights
    loaded into the model, so that what follows (answers, report, merged LoRA weights) is the best step's."""
    cfg, best, result = run.cfg, run.best, run.result
    result.best_eval = best.as_dict()
    result.early_stop = run.early_stop
    if best.step is None:
        return
    done = len(result.losses)  # (a resumed run's include the steps before it)
    result.ended_with = f"the last step's weights (step {done})"  # (unless the best step's are loaded below)
    log(f"best eval loss: {best.loss:.4f} at step {best.step} of {done}"
        + (f" (checkpoint {best.checkpoint})" if best.checkpoint is not None else ""))
    if cfg.output.load_best_model_at_end and best.checkpoint is not None and best.step != done:
        checkpoint_load.load_checkpoint(best.checkpoint, run.model)
        result.ended_with, result.ended_at = f"step {best.step}'s weights ({best.checkpoint})", best.step
        log(f"--load-best-model-at-end: the model ends with step {best.step}'s weights, from {best.checkpoint}; the "
            f"last checkpoint, {run.last_saved}, holds step {done}'s")


def merge_lora(cfg: RunConfig, model, tokenizer) -> None:
    """--merge-lora: the adapters folded into the base weights, saved under --output-dir/merged."""
    merged = cfg.output.output_dir / "merged"
    merge_and_save(model, merged, tokenizer)
    print(f"Merged LoRA weights: {merged}")


def sigterm_stops(cfg: RunConfig) -> bool:
    """Whether a SIGTERM came during the loop (signals.defer_sigterm) to any process: every process then
    stops after the same step, the one whose checkpoint they write together."""
    pending = signals.sigterm_pending()
    if world()[1] > 1:
        flag = torch.tensor(int(pending), device=cfg.run.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # a sync point, once per step
        pending = bool(flag)
    return pending


def stop_after_sigterm(cfg: RunConfig, step: int, steps: int, last_saved, save_now) -> str:
    """What a SIGTERM (a scheduler's pre-emption) keeps: with --output-dir the checkpoint of `step`, the last
    step done (`save_now()` writes it unless it was just written), so that the job resumes from it."""
    kept = f"stopped after step {step} of {steps}, before its summary"
    if cfg.output.output_dir is None:
        return kept + "; no checkpoint (no --output-dir)"
    try:
        path = last_saved if last_saved is not None and Path(last_saved).name == f"checkpoint-{step}" else save_now()
    except (OSError, RuntimeError, SafetensorError) as err:
        return (kept + f"; the checkpoint of step {step} could not be written ({write_failure(err)})"
                + (f"; the last complete checkpoint is {last_saved}" if last_saved else ""))
    return kept + f"; saved {path}: resume with --resume {shlex.quote(str(cfg.output.output_dir))}"  # (quoted: copied to a shell)


def save(cfg: RunConfig, step, model, tokenizer, optimizer, schedule, result, settings=None, keep=None):
    """Write checkpoint-<step> (keeping the newest --save-total-limit, and `keep`, the best checkpoint);
    `settings`: resume_settings."""
    extra = {"step": step, "micro_batch": step * cfg.training.grad_accum, "losses": result.losses,
             "eval_losses": result.eval_losses, "config": cfg.as_dict(), "world_size": world()[1],
             "settings": settings}
    path = checkpoint.save_checkpoint(cfg.output.output_dir, step, model, tokenizer, optimizer, schedule, extra,
                                      keep_last=cfg.output.save_total_limit, keep=keep)
    if path is not None:
        log(f"checkpoint: {path}")
    return path


def weights_finite(model) -> bool:
    """Whether every trainable parameter is finite (a sync point; all processes agree)."""
    with torch.no_grad():
        flags = [torch.isfinite(p.to_local() if type(p).__name__ == "DTensor" else p).all()
                 for p in model.parameters() if p.requires_grad]
        ok = torch.stack(flags).all().to(torch.int32) if flags else torch.ones((), dtype=torch.int32)
        if world()[1] > 1:
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        return bool(ok)


def nonfinite_message(cfg: RunConfig, loss: float, step: int, steps: int, last_good) -> str:
    """What stops a run whose loss is NaN or inf: the step, the likely causes, the last good checkpoint."""
    if last_good is not None:
        where = f"The last good checkpoint (finite weights): {last_good[1]} (step {last_good[0]})."
    elif cfg.output.output_dir is None:
        where = "No checkpoint was written (no --output-dir)."
    else:
        where = "No checkpoint with finite weights was written before it."
    return (f"error: the loss is {loss} at step {step} of {steps}. Likely causes: {divergence_causes(cfg.training)}; the "
            "data (an example of this step with broken tokens or labels); or overflow in reduced precision (fp16 / bf16 / --fp8 "
            f"activations out of range: compare with --kernels none, without --fp8). {where}")
