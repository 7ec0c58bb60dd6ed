"""Fine-tune with the Hugging Face Trainer, the playbook's kernels on: for users whose code already uses it.

    $ python finetune_trainer.py --model meta-llama/Llama-3.1-8B --dataset examples/chat.jsonl --steps 200
    $ python finetune_trainer.py --dataset examples/chat.jsonl --steps 30 --lr 1e-3     # CPU: llama-tiny
    $ python finetune_trainer.py --kernels none ...                                    # the Trainer alone

The whole integration is one call before the Trainer is built, the same preparation every script
of the playbook makes (kernels, FP8, gradient checkpointing, LoRA, compile; see models.prepare_model):

    model, name, desc, report = prepare_model(cfg, shard=False)   # the Trainer runs the processes

The Trainer passes `labels` (and, under gradient accumulation, `num_items_in_batch`) to the model,
so its loss goes through the fused linear cross-entropy: the [tokens, vocab] logits are never built.
The same works for TRL's SFTTrainer, which calls the model the same way. Multi-GPU: launch this
script with `accelerate launch` or `torchrun`; the Trainer sets up the processes.
"""

from __future__ import annotations

import math
from pathlib import Path

from playbook.runtime import signals
from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was run")

import torch  # noqa: E402


from playbook.run.best import BestEval
from playbook.model.registry import DEFAULT_KERNELS
from core.process import log
from playbook.runtime.common import usage_error
from playbook.config import TRAINER, RunConfig, make_parser, parse_config, refuse_unused


class RowsDataset(torch.utils.data.Dataset):
    """Encoded examples, one per row, padded to the run's sequence length (labels -100 on padding)."""

    def __init__(self, rows: dict):
        self.rows = rows

    def __len__(self):
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.rows.items()}


def build_datasets(cfg: RunConfig, tokenizer, vocab_size: int):
    """(training set, eval set or None) from --dataset, with --eval-dataset or --eval-fraction for the eval
    set; the same encoding, truncation, id checks and counts line as the scripts' own loop (data/dataset.py)."""
    from playbook.data.dataset import bad_data_exit, encode_dataset, pad_examples

    try:
        train, held, pad, report = encode_dataset(
            cfg.data.dataset, tokenizer, cfg.data.seq_len, vocab_size, cfg.run.seed, cfg.data.train_on_prompt, cfg.data.eval_fraction,
            cfg.data.drop_long, cfg.data.eval_dataset, min_train=2)  # the Trainer needs at least 2 training rows
    except (ValueError, OSError, ImportError) as err:  # bad input: the row counts, one line, exit code 2
        raise bad_data_exit(err) from None
    log(f"Data: dataset {report}")  # rows kept whole, truncated and dropped, by reason, and the split
    log(f"Split: {len(train)} training and {len(held)} eval examples, one per row of {cfg.data.seq_len} tokens")
    return (RowsDataset(pad_examples(train, cfg.data.seq_len, pad)),
            RowsDataset(pad_examples(held, cfg.data.seq_len, pad)) if held else None)


def progress_callback():
    """The Trainer's steps and eval passes as passes in progress (playbook/runtime/time_left.py): one that runs long says
    how far it is, as in the scripts' own loop (the Trainer's own progress bar is off: disable_tqdm)."""
    import contextlib
    import statistics
    import time

    from transformers import TrainerCallback

    from playbook.runtime.time_left import running

    class Progress(TrainerCallback):
        def __init__(self):
            self.step, self.evals = contextlib.ExitStack(), contextlib.ExitStack()
            self.times, self.began, self.batches = [], 0.0, None

        def on_step_begin(self, args, state, control, **kwargs):
            recent = self.times[-20:]
            self.step.enter_context(running(f"step {state.global_step + 1} of {state.max_steps}",
                                            expected_s=statistics.median(recent) if recent else None,
                                            unknown="no step time measured yet"))
            self.began = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.monotonic() - self.began)
            self.step.close()

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            if self.batches is None:  # (the first batch is done: the pass is counted from here)
                total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
                self.batches = self.evals.enter_context(running("eval pass", total=total, unit="batches"))
            self.batches.done += 1

        def on_evaluate(self, args, state, control, **kwargs):
            self.evals.close()
            self.batches = None

    return Progress()


def trainer_checkpoint(path: Path) -> str:
    """--resume for the Trainer: one of its checkpoint-N folders, or the --output-dir that holds them
    (then the newest). Anything else is one clear line before the model is built."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    from playbook.store.checkpoint import STATE_FILE

    if (path / TRAINER_STATE_NAME).is_file():
        return str(path)
    last = get_last_checkpoint(str(path))  # the newest checkpoint-N folder, by its name only
    if last is not None and (Path(last) / TRAINER_STATE_NAME).is_file():
        return last
    if (path / STATE_FILE).is_file() or (last is not None and (Path(last) / STATE_FILE).is_file()):
        raise usage_error(f"--resume {path}: a checkpoint of finetune_baseline.py / finetune_optimized.py, not of the "
                          "Trainer: continue it with the script that wrote it")
    raise usage_error(f"--resume {path}: no Trainer checkpoint there (a checkpoint-N folder with trainer_state.json); "
                      "finetune_trainer.py writes them into --output-dir with --save-every N")


# Beside each Trainer checkpoint (checkpoint-N/): the run's settings that decide the data order and the learning-rate
# schedule (playbook/run/resume.py's RESUME_SETTINGS), as the scripts' own loop stores them in its checkpoints. The
# Trainer restores its schedule's rates from the checkpoint (scheduler.pt), whatever --lr and --lr-schedule say now,
# so a resume with other values is refused, as the own loop refuses it.
SETTINGS_FILE = "playbook_settings.json"


def run_settings(cfg: RunConfig) -> dict:
    """This run's RESUME_SETTINGS values, as a Trainer checkpoint stores them (the model as --model names it)."""
    from playbook.run.resume import resume_settings

    return resume_settings(cfg, cfg.model.model)


def settings_callback(settings: dict):
    """Write SETTINGS_FILE into each checkpoint the Trainer saves (the main process only; after the Trainer's own
    files, so a checkpoint without it is one written before this file existed, or cut short)."""
    import json

    from transformers import TrainerCallback

    from playbook.store.files import write_atomic

    class Settings(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if state.is_world_process_zero and folder.is_dir():
                write_atomic(folder / SETTINGS_FILE, json.dumps(settings, indent=2))

    return Settings()


def run_pointers_callback(load_best: bool, tokenizer):
    """The run folder's pointers, as the scripts' own loop writes them (playbook/store/checkpoint.py), so that
    export.py and chat.py take the --output-dir for a run: `latest` names each checkpoint-N the Trainer saves,
    and with --load-best-model-at-end `best` names the Trainer's best checkpoint so far (the one it ends with).
    Each checkpoint gets the run's tokenizer first (the Trainer saves none: it is not handed one, since with one
    it would collate the padded rows with the tokenizer's padding collator), so that it loads alone, as the own
    loop's do. The main process writes them,
    after the Trainer's own files; the pointers atomically."""
    from transformers import TrainerCallback

    from playbook.store.checkpoint import BEST_FILE, LATEST_FILE
    from playbook.store.files import write_atomic

    class Pointers(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            out = Path(args.output_dir)
            folder = out / f"checkpoint-{state.global_step}"
            if not state.is_world_process_zero or not folder.is_dir():
                return
            if tokenizer is not None:
                tokenizer.save_pretrained(str(folder))
            write_atomic(out / LATEST_FILE, folder.name + "\n")
            best = Path(state.best_model_checkpoint) if state.best_model_checkpoint else None
            if load_best and best is not None and best.is_dir():
                write_atomic(out / BEST_FILE, best.name + "\n")

    return Pointers()


def check_trainer_resume(cfg: RunConfig, checkpoint: str, settings: dict) -> None:
    """A resume that changes a setting the run depends on is refused before the model is built, in the own
    loop's words (resume.refuse_differences). A checkpoint without SETTINGS_FILE: its schedule's peak rate (in
    scheduler.pt) is still compared with --lr, and the rest is said to be unchecked."""
    import json

    from playbook.run.resume import refuse_differences, settings_differences

    folder = Path(checkpoint)
    try:
        saved = json.loads((folder / SETTINGS_FILE).read_text())
    except FileNotFoundError:
        saved = None
    except (OSError, ValueError) as err:
        raise usage_error(f"--resume {cfg.output.resume}: {folder / SETTINGS_FILE} cannot be read ({err})") from None
    if saved is not None:
        refuse_differences(cfg, settings_differences(saved, settings))
        return
    lines = []
    try:
        rates = torch.load(folder / "scheduler.pt", weights_only=True).get("base_lrs") or []
    except (OSError, RuntimeError, AttributeError, ValueError):
        rates = []
    if rates and not math.isclose(float(rates[0]), cfg.training.lr,
                                  rel_tol=1e-6):  # (the rate as saved, a float's rounding)
        lines.append(f"--lr: checkpoint {float(rates[0]):g}, this run {cfg.training.lr:g}")
    refuse_differences(cfg, lines)
    log(f"warning: {folder} stores no run settings (a checkpoint written before finetune_trainer.py stored them): "
        "whether this run's --lr-schedule, warm-up, batch size and data are the saved run's cannot be checked")


def best_eval_callback(cfg: RunConfig):
    """The Trainer's evals (--eval-every) against the best so far, as the scripts' own loop says them
    (playbook/run/best.py): the line when the run starts to memorize, and the best step at the end (said_at_end)."""
    from transformers import TrainerCallback

    class Words(TrainerCallback):
        def __init__(self):
            self.best, self.window, self.cfg = BestEval(), [], cfg

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and "eval_loss" not in logs:
                self.window.append(float(logs["loss"]))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            loss = (metrics or {}).get("eval_loss")
            if loss is None:
                return
            window, self.window = self.window, []
            if not self.best.warned and self.best.memorizing(loss, window):
                self.best.warned = True
                keeps = (f"The best checkpoint so far: {state.best_model_checkpoint}; the run ends with its weights "
                         "(--load-best-model-at-end)." if self.cfg.output.load_best_model_at_end and
                         state.best_model_checkpoint else "--load-best-model-at-end with --output-dir keeps the "
                         "best checkpoint, and --early-stopping-patience N stops such a run.")
                log(self.best.memorizing_line(state.global_step, loss, window, keeps))
            self.best.update(state.global_step, loss, window)

        def said_at_end(self, state):
            if self.best.step is not None:
                log(f"best eval loss: {self.best.loss:.4f} at step {self.best.step} of {state.global_step}"
                    + (f" (checkpoint {state.best_model_checkpoint}; the model ends with its weights)"
                       if self.cfg.output.load_best_model_at_end and state.best_model_checkpoint else ""))

    return Words()


# The shared options the Trainer has no use for: refused when given, in the words distill.py's refusals use.
UNUSED = {
    "overwrite_output_dir": "the Trainer keeps its checkpoints in --output-dir itself; give a new --output-dir, or "
                            "--resume its checkpoint",
    "cuda_graphs": "the Trainer runs its steps eagerly",
    "optimizer_in_backward": "the Trainer steps its optimizer after backward; finetune_optimized.py takes it",
    "sample_prompts": "the Trainer answers no prompts; chat.py --prompts-file answers them from the saved checkpoint",
}


class TrainerOptions:
    """finetune_trainer.py's part of the command line (config.make_parser's `extra`): no options of its own, the
    refusal of the shared ones the Trainer does not use, and the Trainer's own rules for the best checkpoint."""

    unused = UNUSED  # (config.unused_options)

    @staticmethod
    def add_arguments(parser) -> None:
        pass

    @classmethod
    def from_args(cls, a, parser) -> None:
        refuse_unused(a, parser, "finetune_trainer.py", UNUSED)
        if a.early_stopping_patience and a.eval_every and not a.load_best_model_at_end:
            raise usage_error("--early-stopping-patience: the Trainer's EarlyStoppingCallback needs "
                              "--load-best-model-at-end (and --output-dir) too; the scripts' own loop does not")
        if a.load_best_model_at_end and a.save_every and a.eval_every and a.save_every % a.eval_every:
            raise usage_error(f"--load-best-model-at-end: the Trainer keeps the best of its saved checkpoints, so "
                              f"--save-every ({a.save_every}) must be a multiple of --eval-every ({a.eval_every})")
        return None


def make_trainer_parser():
    """The shared parser (playbook.config.make_parser) with the Trainer's refusals (TrainerOptions)."""
    return make_parser(__doc__.splitlines()[0], kernels_default=DEFAULT_KERNELS, extra=TrainerOptions)


def parse_args(argv=None):
    """The run's RunConfig, every argument checked (one line and exit code 2 for a wrong one) before anything is
    loaded: the shared rules (playbook/config/), the options the Trainer does not use, --dataset."""
    cfg = parse_config(make_trainer_parser(), TRAINER, argv)  # its own optimizer, one example per row
    if cfg.data.dataset is None:
        raise usage_error("finetune_trainer.py needs --dataset (a .jsonl / .json / .parquet file or a hub id)")
    return cfg


def trainer_class(cfg: RunConfig):
    """The Trainer, its learning-rate warm-up counted as the own loop counts it (schedule.warmup_steps): a
    --warmup-ratio of the run's steps rounded up to a whole step, with --steps or --epochs (the Trainer knows the
    count of an --epochs run only when it builds its schedule, which is when this is counted); a warm-up longer
    than the run refused before the first step."""
    from transformers import Trainer

    from playbook.optim.schedule import check_warmup, warmup_steps

    class PlaybookTrainer(Trainer):
        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                counted = f" (--epochs {cfg.training.epochs:g} of this data)" if cfg.training.steps is None else ""
                check_warmup(cfg.training.lr_warmup_steps, num_training_steps, counted)
                warmup = warmup_steps(cfg.training.lr_warmup_steps, cfg.training.warmup_ratio, num_training_steps)
                self.args.warmup_steps = warmup  # (a whole number: the Trainer takes it as steps)
                if warmup:
                    log(f"Learning-rate warm-up: {warmup} of {num_training_steps} steps"
                        + (f" (--warmup-ratio {cfg.training.warmup_ratio:g}, rounded up to a whole step)"
                           if cfg.training.warmup_ratio else ""))
            return super().create_scheduler(num_training_steps, optimizer)

    return PlaybookTrainer


FINAL = "final"  # the folder of the weights the run ends with, beside the Trainer's checkpoint-N folders


def save_final(trainer, tokenizer, cfg: RunConfig) -> None:
    """The weights the run ends with in output_dir/final, with the step they are from (FINAL_STEP_FILE, which
    export.py and chat.py name). Without --load-best-model-at-end they are the last step's, so `latest` names
    them and the two scripts take the --output-dir for them; with it they are the best checkpoint's, which
    `best` already names (without it, a `best` an earlier run there left goes, as in the own loop). (No
    trainer_state.json there: final/ is not a checkpoint --resume could continue.)"""
    import json

    from playbook.run.training import forget_best
    from playbook.store.checkpoint import FINAL_STEP_FILE, LATEST_FILE
    from playbook.store.files import write_atomic

    final = cfg.output.output_dir / FINAL
    trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        if tokenizer is not None:
            tokenizer.save_pretrained(str(final))
        write_atomic(final / FINAL_STEP_FILE, json.dumps({"step": trainer.state.global_step}) + "\n")
        if not cfg.output.load_best_model_at_end:
            forget_best(cfg)
            write_atomic(cfg.output.output_dir / LATEST_FILE, FINAL + "\n")
    log(f"Saved {final} (safetensors; AutoModelForCausalLM.from_pretrained loads it)")


def main(argv=None):
    from transformers import TrainingArguments

    from playbook.model.models import prepare_model
    from playbook.run.start import run_tokenizer, settle

    cfg = parse_args(argv)
    resume = trainer_checkpoint(cfg.output.resume) if cfg.output.resume else None  # before the model is built
    settings = run_settings(cfg)
    if resume is not None:
        check_trainer_resume(cfg, resume, settings)
    cfg = settle(cfg, connect=False)  # the data files and the memory plan, before the model is built (the
    # Trainer sets up and wraps the processes itself)
    model, name, desc, report = prepare_model(cfg, shard=False)  # the Trainer sets up and wraps the processes
    tokenizer = run_tokenizer(cfg, name)
    train_set, eval_set = build_datasets(cfg, tokenizer, model.config.vocab_size)
    out = cfg.output.output_dir or "out/trainer"  # the Trainer needs a folder; out/ is not committed
    args = TrainingArguments(
        output_dir=str(out), max_steps=cfg.training.steps or -1, num_train_epochs=cfg.training.epochs or 1,
        per_device_train_batch_size=cfg.data.batch_size, per_device_eval_batch_size=cfg.data.batch_size,
        gradient_accumulation_steps=cfg.training.grad_accum, learning_rate=cfg.training.lr, weight_decay=cfg.training.weight_decay,
        lr_scheduler_type=cfg.training.lr_schedule if cfg.training.lr_schedule != "constant" else "constant_with_warmup",
        warmup_steps=0, max_grad_norm=cfg.training.max_grad_norm or 0.0, logging_steps=cfg.output.log_every,
        save_strategy="steps" if cfg.output.save_every or cfg.output.load_best_model_at_end else "no",
        save_steps=cfg.output.save_every or (cfg.data.eval_every if cfg.output.load_best_model_at_end else 500),
        load_best_model_at_end=cfg.output.load_best_model_at_end, metric_for_best_model="eval_loss", greater_is_better=False,
        save_total_limit=cfg.output.save_total_limit,
        eval_strategy="steps" if eval_set is not None and cfg.data.eval_every else "no", eval_steps=cfg.data.eval_every or None,
        bf16=cfg.on_gpu, use_cpu=not cfg.on_gpu, report_to=[] if cfg.output.report_to == "none" else [cfg.output.report_to],
        # every trainable parameter gets a gradient in every step (frozen LoRA bases need none), so
        # DDP's search for unused parameters (the Trainer's default) would only add a graph walk
        ddp_find_unused_parameters=False,
        seed=cfg.run.seed, disable_tqdm=True, optim="adamw_torch_fused" if cfg.training.optimizer == "adamw-fused" else "adamw_torch",
    )
    words = best_eval_callback(cfg) if eval_set is not None and cfg.data.eval_every else None
    callbacks = [progress_callback()] + ([words] if words is not None else [])
    if cfg.output.output_dir is not None:
        callbacks += [settings_callback(settings), run_pointers_callback(cfg.output.load_best_model_at_end, tokenizer)]
    if cfg.output.early_stopping_patience:
        from transformers import EarlyStoppingCallback

        callbacks.append(EarlyStoppingCallback(early_stopping_patience=cfg.output.early_stopping_patience,
                                               early_stopping_threshold=cfg.output.early_stopping_threshold))
    trainer = trainer_class(cfg)(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                                 callbacks=callbacks)
    log(f"Trainer: {desc}, kernels {report.describe()}, {len(train_set)} training rows, "
        f"{args.world_size} process{'es' if args.world_size > 1 else ''}")
    if resume is not None:
        log(f"Resuming from {resume}")
    result = trainer.train(resume_from_checkpoint=resume)
    if words is not None:
        trainer.remove_callback(words)  # (the eval below is of the model as it ends, not one of the run's)
        words.said_at_end(trainer.state)
    metrics = dict(result.metrics)
    if eval_set is not None:
        metrics.update(trainer.evaluate())
    log("Trainer metrics: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in metrics.items()))
    if cfg.output.output_dir is not None:
        save_final(trainer, tokenizer, cfg)
    return trainer, metrics


if __name__ == "__main__":
    from playbook.runtime.setup_check import check_or_exit

    check_or_exit()
    signals.run_main(main, "the run stopped before its metrics; the Trainer's checkpoints already written "
                           "under --output-dir (--save-every) are complete")
