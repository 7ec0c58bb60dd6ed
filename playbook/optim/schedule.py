"""The learning-rate schedule: warm-up, then constant, linear or cosine decay (--lr-schedule)."""

from __future__ import annotations

import math

import torch

from playbook.runtime.common import usage_error
from playbook.sections import TrainingSection


def warmup_steps(lr_warmup_steps: int, warmup_ratio: float, total: int, saved: dict | None = None) -> int:
    """The warm-up's length in steps: --lr-warmup-steps, or --warmup-ratio of the run's `total` steps rounded up
    to a whole step, as the Hugging Face Trainer counts it (0.05 of 10 steps is 1 warm-up step, not 0). The
    product is rounded to 9 decimals first: 0.1 * 30 is 3.0000000000000004 in binary floating point, 3 steps
    as the user means it, not 4. Resumed (`saved`: the checkpoint's schedule, LRSchedule.state_dict), a
    --warmup-ratio is a share of the saved run's length: the warm-up already done."""
    if saved and not lr_warmup_steps and warmup_ratio:
        return saved["warmup"]
    if lr_warmup_steps:
        return lr_warmup_steps
    return math.ceil(round(warmup_ratio * total, 9))


def check_warmup(lr_warmup_steps: int, steps: int, counted: str = "") -> None:
    """A learning-rate warm-up longer than the run never reaches --lr: --lr-warmup-steps 100 with --steps 3 trains
    at 1 % to 3 % of it. Refused (exit code 2), before the model is built where the run's length is known;
    `counted`: how the length was counted, where --epochs gave it."""
    if lr_warmup_steps > steps:
        raise usage_error(f"--lr-warmup-steps {lr_warmup_steps} is longer than the run's {steps} step"
                          f"{'s' if steps > 1 else ''}{counted}: the learning rate would end at "
                          f"{100 * steps / lr_warmup_steps:.3g} % of --lr, never reaching it; give --lr-warmup-steps "
                          f"{steps} or fewer, --warmup-ratio (a share of the run), or a longer run")


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


def length_change(saved: dict, start: int, steps: int, training: TrainingSection) -> str:
    """What a run resumed at step `start` with another length (`steps`) than the checkpoint's schedule (`saved`,
    LRSchedule.state_dict) does to the rate of `training` (its peak, --lr), in one line: a decay is rebuilt for
    the new length."""
    lr = training.lr
    kind = saved["kind"]
    if kind == "constant":
        return (f"The run's length changes from {saved['total']} to {steps} steps (constant learning rate: "
                "the remaining steps' rate is unchanged)")
    before = schedule_factor(start, saved["total"], saved["warmup"], kind)
    after = schedule_factor(start, steps, saved["warmup"], kind)
    return (f"The schedule's length changes from {saved['total']} to {steps} steps: the {kind} decay is rebuilt "
            f"for {steps} steps, so the remaining steps' learning rate follows the new length (step {start + 1}: "
            f"{lr * after:.3g} instead of {lr * max(before, 0.0):.3g})")


def describe(training: TrainingSection, warmup: int) -> str:
    """The schedule as the run's start line gives it: "lr 1e-05 cosine after 3 warm-up steps"."""
    return f"lr {training.lr:g} {training.lr_schedule}" + (f" after {warmup} warm-up steps" if warmup else "")


def divergence_causes(training: TrainingSection) -> str:
    """The learning rate's part of what a run whose loss became NaN or inf may try."""
    return (f"the learning rate (--lr {training.lr:g}: try a lower one, a warm-up with --lr-warmup-steps, or "
            "--max-grad-norm 1.0)")


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

    @property
    def rate(self) -> float:
        """The rate of the last step applied (`apply`; a resumed schedule's saved position)."""
        return self.base[0] * self.factor(self.last_step)

    def metrics(self) -> dict:
        """The applied rate as the metrics row (results/<tag>.metrics.jsonl) records it."""
        return {"lr": self.rate}

    def text(self) -> str:
        """The applied rate as a step's log line gives it: "lr 1.00e-04"."""
        return f"lr {self.rate:.2e}"

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
