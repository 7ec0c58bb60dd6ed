"""The run's best eval loss: the best checkpoint, early stopping, and the word when a run memorizes.

What the Hugging Face Trainer offers with `load_best_model_at_end`, `metric_for_best_model="loss"` and
`EarlyStoppingCallback`, for the scripts' own loop (training.py), by the same names:

    --eval-every N (--eval-steps N)   the held-out loss every N steps; the evals after step 0 are the candidates
    --load-best-model-at-end          a checkpoint at every new best (kept whatever --save-total-limit says);
                                      the run ends with the best step's weights
    --early-stopping-patience N       stop after N evals in a row without a new best
    --early-stopping-threshold X      a new best must be lower than the old one by more than X

Whatever the flags, a run with periodic evals names its best step, and says once when it starts to
memorize: the eval loss has risen above its best while the training loss kept falling.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path


# How far above its best an eval loss must rise before the run is said to memorize: 1 %. The evals of a small
# held-out split wander by about that much between neighbouring evals with no trend (llama-tiny on 3 rows of
# examples/chat.jsonl at lr 1e-2: 3.2045, 3.2377, 3.1809), and a run that memorizes leaves it far behind.
MEMORIZING_MARGIN = 0.01


@dataclass
class BestEval:
    """The lowest eval loss after a training step, and how many evals since have not beaten it."""

    patience: int = 0  # --early-stopping-patience (0: never stop)
    threshold: float = 0.0  # --early-stopping-threshold
    step: int | None = None  # the best eval's step
    loss: float | None = None
    train_at_best: float | None = None  # the mean training loss of the steps that led to the best eval
    checkpoint: Path | None = None  # its checkpoint, where one was written at that step
    evals_since: int = 0  # evals since the best that did not beat it
    warned: bool = False  # the memorizing line was printed
    history: list = field(default_factory=list)  # (step, eval loss) of every candidate

    def update(self, step: int, eval_loss: float, train_losses: list[float]) -> bool:
        """Record the eval after `step`; `train_losses`: the training losses of the steps since the previous
        eval. Returns whether it is a new best."""
        self.history.append((step, eval_loss))
        train = statistics.fmean(train_losses) if train_losses else None
        if self.loss is None or eval_loss < self.loss - self.threshold:
            self.step, self.loss, self.train_at_best, self.checkpoint = step, eval_loss, train, None
            self.evals_since = 0
            return True
        self.evals_since += 1
        return False

    def memorizing(self, eval_loss: float, train_losses: list[float]) -> bool:
        """Whether this eval (not a new best) is above the best while the training loss fell below what it was
        at the best: the model fits the training rows better and the held-out rows worse."""
        if (self.loss is None or eval_loss <= self.loss * (1 + MEMORIZING_MARGIN) or self.train_at_best is None
                or not train_losses):
            return False
        return statistics.fmean(train_losses) < self.train_at_best

    def memorizing_line(self, step: int, eval_loss: float, train_losses: list[float], keeps: str) -> str:
        """The one line said the first time the run memorizes. keeps: what the run does about it (where the best
        checkpoint is, or the flag that would keep it)."""
        now = statistics.fmean(train_losses)
        return (f"eval loss {eval_loss:.4f} at step {step} is above its best, {self.loss:.4f} at step {self.step}, "
                f"while the training loss fell ({self.train_at_best:.4f} -> {now:.4f} on average): the model is "
                f"memorizing its training rows. {keeps}")

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.evals_since >= self.patience

    def stop_line(self, step: int) -> str:
        return (f"early stopping after step {step}: {self.evals_since} evals in a row without an eval loss below the "
                f"best, {self.loss:.4f} at step {self.step} (--early-stopping-patience {self.patience}"
                + (f", --early-stopping-threshold {self.threshold:g}" if self.threshold else "") + ")")

    def as_dict(self) -> dict | None:
        if self.step is None:
            return None
        return {"step": self.step, "eval loss": self.loss,
                "checkpoint": str(self.checkpoint) if self.checkpoint is not None else None}
