"""Tests of the time a run has left (playbook/time_left.py), on a stand-in clock that the test moves.

    $ PYTHONPATH=. python tests/time_left_test.py     # a readable report
    $ pytest tests/time_left_test.py

The training loop's log lines carry `left ...` (checked on a real run in tests/export_test.py's full
circle, whose fine-tune logs every step).
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import sys
import time

from playbook.testkit import run_as_script
from playbook.time_left import TimeLeft, duration


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


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Time left: steps, evals and saves still to come"))
