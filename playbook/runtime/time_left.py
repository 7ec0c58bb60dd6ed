"""The time a run has left: the steps still to come at the recent step time, plus the evals, checkpoint
saves and sample answers still to come at the time each took last.

    >>> left = TimeLeft(steps=100, start=0, eval_every=20, save_every=50, saving=True)
    >>> with left.measure("eval"):                  # the eval before training, and each one after
    ...     evaluate(model, batches)
    >>> left.begin()                                # just before the first step
    >>> left.step_done(1); left.text(1)             # after each step (and its eval), before its save
    '  left 3m 12s'
    >>> left.summary()                              # the end estimated at step 10, against the real end
    {'end estimated at step 10': '14:02:10 (312 s after step 10)', 'end': '14:02:30 (...; estimate 6% short)'}

A step's time is the wall time from the end of one step to the end of the next, less the evals and
saves measured in between, so that the data loading and logging between steps count, and a save does
not make the step after it look slow. The recent step time is the median of the last 20 steps: the first
steps (compilation, warm-up) leave it within a few steps. An eval or a save not yet measured counts as
nothing until it is (the first checkpoint of a run without --save-every is its last).

A pass that runs long says so while it runs: a training step, an eval pass, encoding a dataset's rows.

    >>> with running("eval pass", total=len(batches), unit="batches") as progress:
    ...     for b in batches:
    ...         ...; progress.done += 1

After SILENT_S seconds with no log line, and then every EVERY_S seconds while it lasts, a thread prints
where the innermost pass is and what it has left: `  ... eval pass: 23 of 178 batches, 31 s so far, left
~3m 29s` (from its own pace), or for a step `left ~42 s` from the recent steps' median, `the first step: no
step time measured yet` before any. `in_progress()` gives the same words (a SIGTERM that waits for the step
says them).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from collections import deque

from core import process

ESTIMATE_STEP = 10  # the step of the run whose estimate the summary holds against the real end
RECENT = 20  # steps in the median step time
SILENT_S = 10.0  # a pass that has left the log silent this long gets a line
EVERY_S = 30.0  # and another as often while it lasts
POLL_S = 1.0  # how often the thread that prints them looks


def duration(seconds: float) -> str:
    """'42 s', '5m 12s', '1h 02m'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def periodic_steps(every: int | None, first: int, last: int) -> int:
    """How many of the steps first..last (counted from 1) run an event that training.py runs every `every`
    steps (0 or None: never) and after the last step: an eval pass, a checkpoint save."""
    if first > last:
        return 0
    periodic = (last // every - (first - 1) // every) if every else 0
    return periodic + (0 if every and last % every == 0 else 1)


class TimeLeft:
    def __init__(self, steps: int, start: int, eval_every: int | None, save_every: int | None, saving: bool,
                 answers: bool = False, clock=time.monotonic, wall=time.time):
        self.steps, self.start = steps, start
        self.eval_every, self.save_every, self.saving, self.answers = eval_every, save_every, saving, answers
        self.clock, self.wall = clock, wall
        self.took: dict[str, float] = {}  # the last duration of each kind: eval, save, answers
        self.recent: deque[float] = deque(maxlen=RECENT)
        self._mark = None  # the clock at the end of the last step
        self._between = 0.0  # evals and saves measured since then
        self.estimate = None  # (step, estimated end on the wall clock, wall clock at that step)

    @contextlib.contextmanager
    def measure(self, kind: str):
        t0 = self.clock()
        try:
            yield
        finally:
            self.took[kind] = self.clock() - t0
            self._between += self.took[kind]

    def begin(self) -> None:
        self._mark, self._between = self.clock(), 0.0

    def step_done(self, step: int) -> None:
        now = self.clock()
        self.recent.append(now - self._mark - self._between)
        self._mark, self._between = now, 0.0
        if step == self.start + ESTIMATE_STEP and step < self.steps:
            wall = self.wall()
            self.estimate = (step, wall + self.seconds(step), wall)

    def seconds(self, step: int) -> float:
        """Seconds left after `step` finished its training and its eval, before its checkpoint save."""
        per_step = statistics.median(self.recent) if self.recent else 0.0
        left = (self.steps - step) * per_step
        left += periodic_steps(self.eval_every, step + 1, self.steps) * self.took.get("eval", 0.0)
        if self.saving:
            left += periodic_steps(self.save_every, step, self.steps) * self.took.get("save", 0.0)
        if self.answers:
            left += self.took.get("answers", 0.0)  # the sample answers after training, as long as those before
        return left

    def text(self, step: int) -> str:
        return f"  left {duration(self.seconds(step))}"

    def step_seconds(self) -> float | None:
        """The recent steps' median time, None before a step is done."""
        return statistics.median(self.recent) if self.recent else None

    def summary(self) -> dict:
        """The end estimated at step 10 of the run against the real end (now), as summary rows; none for a
        run of 10 steps or fewer."""
        if self.estimate is None:
            return {}
        step, estimated, at = self.estimate
        end = self.wall()
        real, said = end - at, estimated - at
        off = "on time" if round(said) == round(real) else (
            f"estimate {abs(real - said) / max(real, 1e-9):.0%} {'short' if said < real else 'long'}")
        return {f"end estimated at step {step}": f"{time.strftime('%H:%M:%S', time.localtime(estimated))} "
                                                 f"({duration(said)} after step {step})",
                "end": f"{time.strftime('%H:%M:%S', time.localtime(end))} ({duration(real)} after step {step}; {off})"}


# ------------------------------------------------------------------------------------------------
# A long pass in progress (module docstring)
# ------------------------------------------------------------------------------------------------
class Pass:
    """One pass in progress: `what` ("step 3 of 10", "eval pass"), begun at `began`; `done` of `total` `unit`
    so far (the caller counts), or an `expected_s` from earlier passes of its kind (None: none measured yet,
    `unknown` says so)."""

    def __init__(self, what: str, total: int | None = None, unit: str = "", expected_s: float | None = None,
                 unknown: str = "no estimate yet", clock=time.monotonic):
        self.what, self.total, self.unit, self.expected_s, self.unknown = what, total, unit, expected_s, unknown
        self.clock, self.began, self.done = clock, clock(), 0

    def left(self, now: float) -> float | None:
        """Seconds still to go: from its own pace once a part is done, else from `expected_s`."""
        elapsed = now - self.began
        if self.total and self.done:
            return elapsed / self.done * max(self.total - self.done, 0)
        if self.expected_s is not None:
            return self.expected_s - elapsed
        return None

    def text(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed, left = now - self.began, self.left(now)
        said = f"{self.what}: " + (f"{self.done} of {self.total} {self.unit}, " if self.total else "")
        said += f"{duration(elapsed)} so far"
        if left is None:
            return f"{said}, {self.unknown}"
        if left < 0:  # longer than the passes before it
            return f"{said}, longer than the {duration(self.expected_s)} expected"
        return f"{said}, left ~{duration(left)}"


_PASSES: list[Pass] = []  # the passes in progress, the innermost last
_LINES = {"thread": None, "last": 0.0}  # the thread that prints, and when it last did


@contextlib.contextmanager
def running(what: str, total: int | None = None, unit: str = "", expected_s: float | None = None,
            unknown: str = "no estimate yet"):
    """A pass in progress for the block (module docstring): yields its Pass, whose `done` the caller counts."""
    progress = Pass(what, total, unit, expected_s, unknown)
    _PASSES.append(progress)
    _start_lines()
    try:
        yield progress
    finally:
        _PASSES.remove(progress)


def in_progress() -> str | None:
    """Where the innermost pass in progress is, and what it has left (None: none is)."""
    passes = list(_PASSES)
    return passes[-1].text() if passes else None


def due(now: float, began: float, last_line: float) -> bool:
    """Whether a pass begun at `began` gets a line now: the log silent for SILENT_S since the pass began or the
    last line, and EVERY_S since the last line this module printed."""
    return now - max(began, last_line) >= SILENT_S and now - _LINES["last"] >= EVERY_S


def _say(line: str) -> None:
    if sys.stderr.isatty():  # a terminal: above the progress bar of the steps (common.interactive), which stays whole
        from tqdm import tqdm

        tqdm.write(line)
    else:
        process.log(line)


def _lines() -> None:
    while True:
        time.sleep(POLL_S)
        passes = list(_PASSES)
        if not passes or not process.is_main():
            continue
        now = time.monotonic()
        if due(now, passes[-1].began, process.LAST_LINE[0]):
            try:
                _say(f"  ... {passes[-1].text(now)}")
            except Exception:  # noqa: BLE001  (output that cannot be written: the pass goes on)
                pass
            _LINES["last"] = process.LAST_LINE[0] = time.monotonic()


def _start_lines() -> None:
    if _LINES["thread"] is None:
        _LINES["thread"] = threading.Thread(target=_lines, name="playbook progress lines", daemon=True)
        _LINES["thread"].start()
