"""One table of refusals, run against every training script: the same wrong command line ends in the same line.

    $ pytest tests/refusals_test.py

Each row is a command line that no training script can run, and the line it ends in (exit code 2). Every
script in SCRIPTS parses it through its own entry point (the argument check each runs before anything is
loaded, well under a second), and must refuse it:

- with the row's words, where the script takes every flag of the row;
- with "<script> does not use <flag>", where it takes one of them not at all (distill.py keeps no
  checkpoints, the Trainer runs no CUDA graphs);
- naming, in any advice, only flags that the script takes (or that the command line gave).

Add a row, and every script is checked against it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import distill
import finetune_trainer
from playbook.config import BASELINE, OPTIMIZED, make_parser, parse_config, unused_options
from playbook.model.registry import DEFAULT_KERNELS


def _own_loop(script):
    return lambda: make_parser("t", kernels_default=None if script is BASELINE else DEFAULT_KERNELS)


# script -> (its parser, as the script builds it; how the script parses its command line)
SCRIPTS = {
    "finetune_baseline.py": (_own_loop(BASELINE), lambda argv: parse_config(make_parser("t"), BASELINE, argv)),
    "finetune_optimized.py": (_own_loop(OPTIMIZED), lambda argv: parse_config(
        make_parser("t", kernels_default=DEFAULT_KERNELS), OPTIMIZED, argv)),
    "finetune_trainer.py": (finetune_trainer.make_trainer_parser, finetune_trainer.parse_args),
    "distill.py": (distill.make_parser, distill.parse_args),
}

CHAT = str(Path(__file__).resolve().parent.parent / "examples" / "chat.jsonl")

# (command line, the line that refuses it)
REFUSALS = [
    (["--lr-warmup-steps", "2", "--warmup-ratio", "0.1"],
     "choose one of --lr-warmup-steps (a number of steps) and --warmup-ratio (a share of the run's steps)"),
    (["--steps", "3", "--lr-warmup-steps", "100"],
     "--lr-warmup-steps 100 is longer than the run's 3 steps: the learning rate would end at 3 % of --lr"),
    (["--steps", "3", "--epochs", "1", "--dataset", CHAT], "choose one of --steps and --epochs"),
    (["--early-stopping-patience", "2"], "--early-stopping-patience 2 counts evals: give --eval-every N"),
    (["--load-best-model-at-end"], "--load-best-model-at-end keeps the checkpoint of the lowest eval loss: it needs "
                                   "--eval-every N"),
    (["--early-stopping-threshold", "0.1"], "--early-stopping-threshold applies to --early-stopping-patience"),
    (["--save-every", "2"], "--save-every needs --output-dir"),
    (["--save-total-limit", "2"], "--save-total-limit needs --output-dir"),
    (["--overwrite-output-dir"], "--overwrite-output-dir needs --output-dir"),
    (["--eval-every", "2"], "--eval-every evaluates on held-out rows: it needs --dataset"),
    (["--optimizer-in-backward", "--grad-accum", "2"],
     "--optimizer-in-backward updates each parameter inside backward, which rules out --grad-accum"),
    (["--resume", "no-such-run/checkpoint-2"], "--resume no-such-run/checkpoint-2: no such checkpoint directory"),
    (["--lora-alpha", "16"], "--lora-alpha needs --lora-r (the adapters' rank)"),
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe chooses how --fp8 scales its matmuls: add --fp8"),
    (["--packing"], "--packing/--no-packing, --train-on-prompt, --eval-fraction and --epochs need --dataset"),
]

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _expected(script: str, argv: list[str], words: str) -> list[str]:
    """What the line must say: the row's words, or, where the script takes some of the row's flags not at all,
    "<script> does not use" and each of those flags."""
    parser = SCRIPTS[script][0]()
    unused = [f for f in argv if f in unused_options(parser)]
    return [f"{script} does not use ", *unused] if unused else [words]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv, words", REFUSALS, ids=[" ".join(argv) for argv, _ in REFUSALS])
def test_every_training_script_refuses_the_row(script, argv, words, capsys):
    """Each row ends in one line (exit code 2) in every script, before anything is loaded; where the script takes
    the row's flags, in the row's words; any flag the line advises is one the script takes."""
    parser = SCRIPTS[script][0]()
    with pytest.raises(SystemExit) as stop:
        SCRIPTS[script][1](argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2, (script, argv, stop.value.code, err)
    assert err.startswith("error: ") and len(err.splitlines()) == 1, (script, argv, err)
    for expected in _expected(script, argv, words):
        assert expected in err, (script, argv, expected, err)
    taken = {o for action in parser._actions for o in action.option_strings} - unused_options(parser)
    advised = set(FLAG.findall(err.split(" does not use ")[0] if " does not use " in err else err)) - set(argv)
    assert advised <= taken, (script, argv, sorted(advised - taken), err)


def test_the_table_reaches_every_refusal_kind():
    """The table is not vacuous: some row is refused in its own words by every script that takes its flags, and
    some by a script that does not take them."""
    kinds = {(script, _expected(script, argv, words) == [words]) for script in SCRIPTS for argv, words in REFUSALS}
    assert {s for s, own in kinds if own} == set(SCRIPTS), kinds
    assert any(not own for _, own in kinds), kinds


# ------------------------------------------------------------------------------------------------
# Warm-up as users count it, and a resume that changes the schedule, in the Trainer as in the own loop
# ------------------------------------------------------------------------------------------------
def test_a_warmup_ratio_rounds_up_to_whole_steps():
    """--warmup-ratio 0.05 --steps 10 was 0 warm-up steps (int() of 0.5); the Hugging Face Trainer counts 1, and so
    does every script now. A product a binary float overshoots (0.1 * 30 = 3.0000000000000004) is the 3 it means."""
    from playbook.optim.schedule import describe, warmup_steps

    assert [warmup_steps(0, 0.05, 10), warmup_steps(0, 0.1, 30), warmup_steps(0, 0.25, 10), warmup_steps(0, 0.0, 10),
            warmup_steps(4, 0.0, 10)] == [1, 3, 3, 0, 4]
    cfg = SCRIPTS["finetune_optimized.py"][1](["--steps", "10", "--warmup-ratio", "0.05"])
    assert warmup_steps(cfg.training.lr_warmup_steps, cfg.training.warmup_ratio, 10) == 1  # the own loop's schedule
    assert describe(cfg.training, 1) == "lr 2e-05 linear after 1 warm-up steps"  # the run's start line
    assert describe(cfg.training, 0) == "lr 2e-05 linear"


def test_the_trainer_warms_up_with_epochs_and_refuses_a_resume_with_another_lr(tmp_path, capsys):
    """finetune_trainer.py with --epochs and --warmup-ratio had no warm-up at all (the ratio of an unset --steps);
    resumed with another --lr it exited 0 and trained at the checkpoint's rates. Now the warm-up is the ratio of
    the epoch's steps, rounded up, and the resume is refused with the own loop's words, before the model is built.
    (llama-tiny, 5 steps of 4 rows on the CPU: about 6 s.)"""
    import json

    rows = tmp_path / "chat.jsonl"
    qa = [("What is 2 + 2?", "4."), ("Name a colour.", "Blue."), ("Capital of France?", "Paris."),
          ("Opposite of hot?", "Cold."), ("A fruit?", "An apple."), ("Say hi.", "Hi!")] * 3
    rows.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": a}]}) for q, a in qa))
    argv = ["--model", "llama-tiny", "--dataset", str(rows), "--epochs", "1", "--warmup-ratio", "0.05", "--seq-len",
            "64", "--batch-size", "4", "--log-every", "1", "--eval-fraction", "0", "--kernels", "none", "--lr", "1e-3",
            "--output-dir", str(tmp_path / "o"), "--save-every", "2"]
    trainer, _ = finetune_trainer.main(argv)
    rates = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert len(rates) == 5 and rates[1] == pytest.approx(1e-3), rates  # 18 rows / 4: 5 steps, 1 warming up
    assert "Learning-rate warm-up: 1 of 5 steps (--warmup-ratio 0.05" in capsys.readouterr().out
    assert (tmp_path / "o" / "checkpoint-2" / finetune_trainer.SETTINGS_FILE).is_file()
    resumed = [a if a != "1e-3" else "2e-3" for a in argv] + ["--resume", str(tmp_path / "o" / "checkpoint-2")]
    with pytest.raises(SystemExit) as stop:
        finetune_trainer.main(resumed)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "this run's settings differ from the checkpoint's" in err, err
    assert "--lr: checkpoint 0.001, this run 0.002" in err, err


@pytest.mark.parametrize("script", ["finetune_optimized.py", "distill.py"])
def test_a_results_folder_that_cannot_be_written_is_refused_before_any_model(script, monkeypatch, capsys):
    """A read-only checkout: one line that names PLAYBOOK_RESULTS_DIR, the way to choose another folder, before any
    model is built (distill.py found out after its run, writing its summary)."""
    from playbook.run import resume, start, training

    def no_model(*a, **k):
        raise AssertionError("a model was built before the results folder was checked")

    monkeypatch.setattr(resume, "RESULTS_DIR", Path("/proc/playbook-no-results"))  # a folder no one can make
    monkeypatch.setattr(start, "build", no_model)
    monkeypatch.setattr(distill, "build_model", no_model)
    with pytest.raises(SystemExit) as stop:
        if script == "distill.py":
            distill.main(["--steps", "2"])
        else:
            training.train(SCRIPTS[script][1](["--steps", "2"]))
    err = capsys.readouterr().err
    assert stop.value.code == 2, (stop.value.code, err)
    assert "the results folder /proc/playbook-no-results cannot be written" in err, err
    assert "set PLAYBOOK_RESULTS_DIR to a writable folder" in err, err


def test_the_resume_command_after_a_sigterm_is_quoted_for_the_shell(tmp_path):
    """The line a pre-empted run ends with holds a command to copy: an --output-dir with a space in it is one word."""
    import shlex

    from playbook.run import training

    out = tmp_path / "my runs" / "out"
    cfg = SCRIPTS["finetune_optimized.py"][1](["--steps", "4", "--output-dir", str(out)])
    line = training.stop_after_sigterm(cfg, 2, 4, out / "checkpoint-2", save_now=lambda: out / "checkpoint-2")
    assert line.endswith(f"resume with --resume {shlex.quote(str(out))}"), line
    assert shlex.split(line.split("resume with ")[1]) == ["--resume", str(out)], line
