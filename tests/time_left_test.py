"""Tests of the time a run has left (playbook/runtime/time_left.py), on a stand-in clock that the test moves.

    $ PYTHONPATH=. python tests/time_left_test.py     # a readable report
    $ pytest tests/time_left_test.py

The training loop's log lines carry `left ...` (checked on a real run in tests/export_test.py's full
circle, whose fine-tune logs every step). A long pass (a step, an eval pass) says how far it is while it
runs: the words on the stand-in clock, and the line of a real eval pass, whose batches take a while here.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import sys
import time

import pytest

from playbook.runtime import time_left
from testkit import record, run_as_script
from playbook.runtime.time_left import Pass, TimeLeft, duration


class Clock:
    """Seconds that pass only when the test says so; the wall clock is the same time from 12:00:00 local."""

    def __init__(self):
        self.now = time.mktime((2026, 1, 1, 12, 0, 0, 0, 0, -1))

    def __call__(self):
        return self.now

    def run(self, seconds):
        self.now += seconds


def test_steps_evals_and_saves_still_to_come():
    clock = Clock()
    left = TimeLeft(steps=30, start=0, eval_every=10, save_every=None, saving=True, answers=True,
                    clock=clock, wall=clock)
    with left.measure("eval"):  # before training
        clock.run(2)
    with left.measure("answers"):  # the sample answers before training
        clock.run(3)
    left.begin()
    for step in range(1, 31):
        clock.run(1 if step > 1 else 9)  # the first step compiles: the median leaves it out
        if step % 10 == 0:
            with left.measure("eval"):
                clock.run(2)
        left.step_done(step)
        if step == 10:  # 20 steps, the evals of steps 20 and 30, the answers after training; no save measured yet
            assert left.seconds(10) == 20 * 1 + 2 * 2 + 3
            assert left.text(10) == "  left 27 s"
        if step == 30:
            with left.measure("save"):  # the one checkpoint, at the end
                clock.run(5)
    assert left.seconds(30) == 0 + 5 + 3  # after the last step: its save (now measured) and the answers
    clock.run(3)  # the answers after training
    # real: 20 steps, 2 evals, the save, the answers = 32 s after step 10; estimated 27 s
    assert left.summary() == {"end estimated at step 10": "12:00:52 (27 s after step 10)",
                              "end": "12:00:57 (32 s after step 10; estimate 16% short)"}


def test_periodic_saves_and_a_resumed_run():
    clock = Clock()
    left = TimeLeft(steps=100, start=40, eval_every=None, save_every=25, saving=True, clock=clock, wall=clock)
    left.begin()
    for step in range(41, 51):
        clock.run(2)
        if step == 50:
            with left.measure("save"):
                clock.run(4)
        left.step_done(step)
    # after step 50 of a run resumed at 40: 50 steps, the saves of steps 50 (the loop writes it after the log
    # line), 75 and 100 at 4 s each; the final eval was never measured (no eval data): nothing for it
    assert left.seconds(50) == 50 * 2 + 3 * 4
    assert left.estimate[0] == 50  # the 10th step of this run
    assert TimeLeft(5, 0, None, None, False).summary() == {}  # 10 steps or fewer: no estimate to hold


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (0.4, 42, 312, 3720, 90000)] == ["0 s", "42 s", "5m 12s", "1h 02m", "25h 00m"]


def test_a_pass_in_progress_says_how_far_it_is_and_what_it_has_left():
    clock = Clock()
    evals = Pass("eval pass", total=12, unit="batches", unknown="the first batch still running", clock=clock)
    clock.run(8)
    assert evals.text() == "eval pass: 0 of 12 batches, 8 s so far, the first batch still running"
    clock.run(22)
    evals.done = 3  # 30 s for 3 batches: 9 more at the same pace
    assert evals.text() == "eval pass: 3 of 12 batches, 30 s so far, left ~1m 30s"
    first = Pass("step 1 of 3", unknown="no step time measured yet", clock=clock)
    clock.run(70)
    assert first.text() == "step 1 of 3: 1m 10s so far, no step time measured yet"
    later = Pass("step 3 of 3", expected_s=100.0, clock=clock)  # the recent steps' median
    clock.run(40)
    assert later.text() == "step 3 of 3: 40 s so far, left ~1m 00s"
    clock.run(90)
    assert later.text() == "step 3 of 3: 2m 10s so far, longer than the 1m 40s expected"
    record("a pass in progress: its count, its time so far, what is left (or why that is not known)", 0, 0, True)


def test_a_long_eval_pass_prints_where_it_is(monkeypatch, capsys):
    """training.evaluate over batches that take a while (a stand-in model, 0.1 s a batch) with the thresholds made
    short: the thread prints `... eval pass: k of n batches, ..., left ~...` while the pass runs, as it does after
    SILENT_S of silence in a real run (an eval of 178 batches was 120 s without a word)."""
    import torch

    from playbook.run import training

    class Slow(torch.nn.Module):
        def forward(self, input_ids, labels):
            time.sleep(0.1)
            return type("Out", (), {"loss": torch.tensor(2.0)})()

    monkeypatch.setattr(time_left, "SILENT_S", 0.25)
    monkeypatch.setattr(time_left, "EVERY_S", 0.25)
    monkeypatch.setattr(time_left, "POLL_S", 0.05)
    ids = torch.zeros(1, 8, dtype=torch.long)
    loss = training.evaluate(Slow(), [{"input_ids": ids, "labels": ids}] * 12)
    lines = [line for line in capsys.readouterr().out.splitlines() if "eval pass" in line]
    assert loss == pytest.approx(2.0) and lines, lines
    assert all(line.startswith("  ... eval pass: ") and " of 12 batches, " in line for line in lines), lines
    assert any("left ~" in line for line in lines), lines  # once a batch is done: the pace gives what is left
    assert time_left.in_progress() is None  # the pass is over
    record(f"a 1.2 s eval pass with 0.25 s thresholds: {len(lines)} progress line(s), e.g. {lines[-1].strip()!r}",
           0, 0, True)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Time left: steps, evals and saves still to come"))
