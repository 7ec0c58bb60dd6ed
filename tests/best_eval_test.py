"""The best checkpoint, early stopping and the word when a run memorizes (playbook/run/best.py), as Hugging Face
Trainer users find them: --eval-every (--eval-steps), --load-best-model-at-end, --early-stopping-patience and
--early-stopping-threshold, in the scripts' own loop and in finetune_trainer.py.

The runs memorize on purpose: llama-tiny trained on one batch of random words over and over (--repeat-batches
1) at a high learning rate learns the letters' statistics in its first steps, then memorizes that batch, and
the held-out rows (other random words) get worse from then on. Each run takes a few seconds on a CPU.

    $ PYTHONPATH=. python tests/best_eval_test.py     # a readable report
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import json
from pathlib import Path
import random

import pytest
import torch

from playbook.run import training
from playbook.store.files import RESULTS_DIR
from playbook.run.best import BestEval
from playbook.config import BASELINE, make_parser, parse_config
from testkit import record, run_as_script


def _memorizing_data(path):
    """16 conversations of random lower-case words: nothing of one predicts another beyond letter statistics."""
    r = random.Random(0)

    def words(n):
        return " ".join("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 7)))
                        for _ in range(n))

    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": words(3)},
                                                      {"role": "assistant", "content": words(25)}]}) + "\n"
                            for _ in range(16)))
    return path


def _argv(data, *extra):
    return ["--model", "llama-tiny", "--dataset", str(data), "--eval-fraction", "0.5", "--batch-size", "1",
            "--seq-len", "64", "--repeat-batches", "1", "--lr", "2e-2", "--lr-schedule", "constant",
            "--eval-every", "5", "--log-every", "5", "--timing-warmup-steps", "1", *extra]


def _train(argv, tag, capsys, monkeypatch=None):
    """One run of finetune_baseline's loop in this process: (its summary JSON, what it printed, the model at the
    end of the run)."""
    ended = {}
    if monkeypatch is not None:
        report = training.write_report

        def keep_model(cfg, result, model, *a, **k):
            ended["weights"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
            return report(cfg, result, model, *a, **k)

        monkeypatch.setattr(training, "write_report", keep_model)
    try:
        payload = training.train(parse_config(make_parser("test"), BASELINE, [*argv, "--tag", tag, "--overwrite"]))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)
    return payload, capsys.readouterr().out, ended.get("weights")


def test_best_checkpoint_and_early_stopping_on_a_run_that_memorizes(tmp_path, capsys, monkeypatch):
    data, out = _memorizing_data(tmp_path / "words.jsonl"), tmp_path / "out"
    payload, said, weights = _train(_argv(data, "--steps", "40", "--output-dir", str(out), "--load-best-model-at-end",
                                          "--early-stopping-patience", "2", "--save-total-limit", "1"),
                                    "test_best_stop", capsys, monkeypatch)
    evals = [loss for step, loss in payload["eval_losses"] if step > 0]
    best = payload["best_eval"]
    assert best["eval loss"] == min(evals) and best["step"] == 5, payload["eval_losses"]  # it memorizes from then on
    # the word, once, when the eval loss rose above its best while the training loss fell
    lines = [line for line in said.splitlines() if "memorizing its training rows" in line]
    assert len(lines) == 1 and "above its best" in lines[0] and f"checkpoint: {out / 'checkpoint-5'}" in lines[0], said
    # early stopping: two evals in a row without a new best, so the run ended at step 15 of 40
    assert len(payload["losses"]) == 15 and payload["summary"]["stopped early at step"] == 15
    assert "early stopping after step 15: 2 evals in a row" in said
    # the best checkpoint survives --save-total-limit 1; the last step's is there too, for --resume
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-5"]
    # the run ends with the best step's weights, and says whose
    from safetensors.torch import load_file

    saved = load_file(out / "checkpoint-5" / "model.safetensors")
    assert all(torch.equal(weights[n], saved[n]) for n in saved) and len(saved) == len(weights)
    assert payload["summary"]["model at the end"].startswith("step 5's weights")
    assert f"best eval loss: {best['eval loss']:.4f} at step 5 of 15" in said
    # the summary's final eval loss is the model's as it ends (step 5's), the last step's beside it
    assert payload["summary"]["final eval loss"] == best["eval loss"], payload["summary"]
    assert payload["summary"]["last step's eval loss"] == payload["eval_losses"][-1][1] > best["eval loss"]
    # the run folder stands for its best checkpoint (export.py and chat.py), which names its step
    from playbook.model import saved_run

    assert (out / "best").read_text() == "checkpoint-5\n"
    folder, what = saved_run.find(str(out), follow_latest=True)
    assert folder == out / "checkpoint-5", folder
    assert "the run's best checkpoint, step 5, kept by --load-best-model-at-end; the last, checkpoint-15" in what, what
    record("memorizing run: best step 5 kept and loaded, stopped at 15", 0.0, 0.0, True)
    # resumed with the same flags, it says before the first step that the patience is spent (it stops at step 20)
    _, said, _ = _train(_argv(data, "--steps", "40", "--output-dir", str(out), "--load-best-model-at-end",
                              "--early-stopping-patience", "2", "--save-total-limit", "1", "--resume", str(out)),
                        "test_best_stop_resumed", capsys)
    line = next((line for line in said.splitlines() if line.startswith("Resumed after")), "")
    assert line.startswith("Resumed after 2 evals in a row without a new best"), said
    assert "--early-stopping-patience 2 allows 0 more, so the run stops after step 20" in line, line
    assert said.index("Resumed after") < said.index("Training: steps 16-40"), said
    assert "early stopping after step 20" in said, said


def test_a_run_with_periodic_evals_names_its_best_step_and_how_to_keep_it(tmp_path, capsys):
    data = _memorizing_data(tmp_path / "words.jsonl")
    payload, said, _ = _train(_argv(data, "--steps", "15"), "test_best_words", capsys)
    assert payload["summary"]["best eval step"] == payload["best_eval"]["step"] == 5
    line = next(line for line in said.splitlines() if "memorizing its training rows" in line)
    assert ("Step 5's weights are not kept: --load-best-model-at-end with --output-dir keeps the best checkpoint, "
            "and --early-stopping-patience N stops such a run.") in line
    assert len(payload["losses"]) == 15 and "stopped early at step" not in payload["summary"]  # no patience: all run


def test_a_resumed_run_keeps_the_best_of_the_steps_before_it(tmp_path, capsys):
    """The evals of the checkpoint a run resumes from are candidates too: their best checkpoint is kept through
    --save-total-limit and loaded at the end, and the memorizing line compares with the training loss there."""
    data, out = _memorizing_data(tmp_path / "words.jsonl"), tmp_path / "out"
    _train(_argv(data, "--steps", "10", "--output-dir", str(out), "--save-every", "5"), "test_best_first", capsys)
    payload, said, _ = _train(_argv(data, "--steps", "20", "--output-dir", str(out), "--resume", str(out),
                                    "--load-best-model-at-end", "--save-total-limit", "1"), "test_best_resumed", capsys)
    assert payload["best_eval"] == {"step": 5, "eval loss": payload["eval_losses"][1][1],
                                    "checkpoint": str(out / "checkpoint-5")}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-5"]
    assert payload["summary"]["model at the end"].startswith("step 5's weights")
    assert "at step 15 is above its best" in said and "memorizing its training rows" in said, said


def test_best_eval_counts_the_threshold_and_the_patience():
    best = BestEval(patience=2, threshold=0.1)
    assert best.update(2, 3.0, [4.0]) and (best.step, best.loss) == (2, 3.0)
    assert not best.update(4, 2.95, [3.5]) and best.evals_since == 1  # lower, but not by more than 0.1
    assert not best.should_stop
    assert best.update(6, 2.8, [3.2]) and best.evals_since == 0  # 0.2 lower: a new best, the count starts again
    assert not best.update(8, 2.85, [3.0]) and not best.update(10, 2.9, [2.9]) and best.should_stop
    # memorizing: above the best by more than the margin while the training loss fell below its level at the best
    assert best.memorizing(2.9, [2.5]) and not best.memorizing(2.9, [3.5]) and not best.memorizing(2.81, [2.5])
    assert "--early-stopping-patience 2, --early-stopping-threshold 0.1" in best.stop_line(10)


@pytest.mark.parametrize("argv, says", [
    (["--dataset", "x.jsonl", "--load-best-model-at-end", "--output-dir", "o"], "it needs --eval-every N"),
    (["--dataset", "x.jsonl", "--load-best-model-at-end", "--eval-every", "5"], "--output-dir (where the checkpoint"),
    (["--dataset", "x.jsonl", "--early-stopping-patience", "3"], "counts evals: give --eval-every N"),
    (["--dataset", "x.jsonl", "--eval-every", "5", "--early-stopping-threshold", "0.1"], "give both"),
])
def test_the_flags_say_what_they_need(argv, says, capsys):
    with pytest.raises(SystemExit) as err:
        parse_config(make_parser("test"), BASELINE, ["--model", "llama-tiny", *argv])
    assert err.value.code == 2 and says in capsys.readouterr().err


def test_help_names_the_flags_as_the_hugging_face_trainer_does():
    text = make_parser("test").format_help()
    for flag in ("--eval-every", "--eval-steps", "--load-best-model-at-end", "--early-stopping-patience",
                 "--early-stopping-threshold"):
        assert flag in text, flag


def test_the_trainer_keeps_the_best_checkpoint_and_stops_early(tmp_path, capsys):
    """finetune_trainer.py hands the same flags to the Trainer (load_best_model_at_end, EarlyStoppingCallback)
    and says the same words."""
    import finetune_trainer

    data, out = _memorizing_data(tmp_path / "words.jsonl"), tmp_path / "trainer"
    # (the Trainer takes one example per row and has no --repeat-batches: its 8 rows, 5 times over)
    trainer, metrics = finetune_trainer.main([
        "--model", "llama-tiny", "--kernels", "none", "--dataset", str(data), "--eval-fraction", "0.5",
        "--batch-size", "1", "--seq-len", "64", "--lr", "2e-2", "--lr-schedule", "constant", "--steps", "40",
        "--eval-every", "5", "--log-every", "1", "--output-dir", str(out), "--load-best-model-at-end",
        "--early-stopping-patience", "1"])
    said = capsys.readouterr().out
    state = trainer.state
    assert state.global_step < 40, "early stopping did not end the run"
    assert state.best_model_checkpoint and state.best_metric == min(
        h["eval_loss"] for h in state.log_history if "eval_loss" in h)
    assert f"best eval loss: {state.best_metric:.4f} at step" in said and state.best_model_checkpoint in said
    assert abs(metrics["eval_loss"] - state.best_metric) < 1e-6  # the model it ends with is the best checkpoint's
    # its --output-dir is a run export.py and chat.py take, as the own loop's is: `best` names the checkpoint the
    # run ends with, `latest` the last one saved, and both scripts say which step they took
    import chat
    import export

    best = Path(state.best_model_checkpoint)
    assert (out / "best").read_text().strip() == best.name and (out / (out / "latest").read_text().strip()).is_dir()
    assert export.resolve_run(str(out)) == best
    _, _, what = chat.load(str(out), torch.device("cpu"))
    assert f"best checkpoint, step {best.name.removeprefix('checkpoint-')}," in what, what


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "The best checkpoint, early stopping, memorizing"))
