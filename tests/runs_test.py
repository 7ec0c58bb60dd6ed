"""Tests of the run around the kernels: nothing is lost, resume continues the saved run or says why not.

    $ PYTHONPATH=. python tests/runs_test.py     # a readable report
    $ pytest tests/runs_test.py

Every run is the real scripts' path, `training.train(parse_config(make_parser(...), "finetune_optimized",
argv))`, on the llama-tiny preset for a few steps; a test of an exit code or of "no traceback" runs
the script itself in a child process. What is checked:

- output locations are checked before the first step: a path under a file, a place that cannot be
  written, a folder holding another run's checkpoints (refused; --overwrite-output-dir deletes them);
- --save-total-limit keeps the newest N checkpoints;
- a checkpoint that cannot be written, and a NaN loss, stop the run with a clear message, and the
  summary JSON is still written;
- the settings a checkpoint stores are the config's resumable fields, the keys and order older checkpoints
  hold;
- resume refuses other settings (one line each, exit code 2), accepts more --steps (the decaying
  schedule is rebuilt for the new length), warns for a checkpoint without stored settings;
- every damaged --resume gives one `error:` line and exit code 2;
- a saved LoRA adapter names its base (AutoPeftModelForCausalLM loads it); an adapter directory
  given as --model says how to use it.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from playbook.run import training
from playbook.store.files import RESULTS_DIR
from playbook.store import checkpoint, checkpoint_load
from playbook.model import registry as ak
from playbook.config import make_parser, parse_config
from core.kernel_utils import DEVICE
from testkit import record, run_as_script

HERE = Path(__file__).resolve().parent.parent  # the repository root
TEXT = HERE / "examples" / "chat.jsonl"  # a file no code change edits
# --model and --batch-size are named: the defaults differ by machine (a GPU's default model is the 8B preset)
BASE = ["--model", "llama-tiny", "--batch-size", "2", "--steps", "4", "--timing-warmup-steps", "0", "--seq-len", "32",
        "--kernels", "none", "--lr", "1e-3", "--log-every", "100", "--overwrite"]
_TAGS = []


def config(*argv):
    return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized", list(argv))


def run(*argv, tag="test_runs"):
    """One whole run of finetune_optimized in this process (BASE, then argv: later flags win)."""
    _TAGS.append(tag)
    return training.train(config(*BASE, "--tag", tag, *argv))


def exits(capsys, *argv, code=2, tag="test_runs_error"):
    """Run, expect SystemExit(code) and no other exception; return stderr + the exit message."""
    with pytest.raises(SystemExit) as stop:
        run(*argv, tag=tag)
    said = capsys.readouterr().err
    got = stop.value.code
    if isinstance(got, str):  # SystemExit("error: ...") exits with code 1, its text on stderr
        said, got = said + got, 1
    assert got == code, (got, said)
    return said


def summary(tag):
    return json.loads((RESULTS_DIR / f"{tag}.json").read_text())


def names(folder):
    return sorted(p.name for p in Path(folder).glob("checkpoint-*"))


@pytest.fixture(autouse=True)
def _cleanup_results():
    yield
    for tag in _TAGS:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)
    _TAGS.clear()


# ------------------------------------------------------------------------------------------------
# Nothing is lost
# ------------------------------------------------------------------------------------------------
def test_output_dir_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    said = exits(capsys, "--output-dir", str(blocker / "out"), tag="test_runs_unwritable")
    assert f"lies under {blocker}, which is a file" in said, said
    assert not (RESULTS_DIR / "test_runs_unwritable.json").exists()  # stopped before any step
    said = exits(capsys, "--output-dir", "/proc/playbook-test-out", tag="test_runs_unwritable")
    assert "cannot be written" in said, said
    record("--output-dir under a file / not writable: refused before the first step", 0.0, 0.0, True)


def test_another_runs_checkpoints_are_never_mixed_with_this_one(tmp_path, capsys):
    out = tmp_path / "out"
    run("--output-dir", str(out), "--save-every", "2", tag="test_runs_first")
    assert names(out) == ["checkpoint-2", "checkpoint-4"]
    before = (out / "checkpoint-2" / "model.safetensors").read_bytes()
    said = exits(capsys, "--steps", "3", "--output-dir", str(out), tag="test_runs_second")
    assert "holds another run's checkpoints (checkpoint-2, checkpoint-4)" in said and "--overwrite-output-dir" in said
    assert names(out) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "checkpoint-2" / "model.safetensors").read_bytes() == before  # untouched
    # resuming an earlier checkpoint of the folder with another length: the later ones are another run's
    said = exits(capsys, "--steps", "6", "--output-dir", str(out), "--resume", str(out / "checkpoint-2"),
                 tag="test_runs_second")
    assert "checkpoint-4, later than the resumed checkpoint-2" in said, said
    run("--steps", "3", "--output-dir", str(out), "--overwrite-output-dir", tag="test_runs_second")
    assert "deleted checkpoint-2, checkpoint-4" in capsys.readouterr().out
    assert names(out) == ["checkpoint-3"] and (out / "latest").read_text() == "checkpoint-3\n"
    record("another run's checkpoints: refused, or deleted with --overwrite-output-dir", 0.0, 0.0, True)


def test_save_total_limit_keeps_the_newest(tmp_path):
    out = tmp_path / "out"
    run("--output-dir", str(out), "--save-every", "1", "--save-total-limit", "2", tag="test_runs_limit")
    assert names(out) == ["checkpoint-3", "checkpoint-4"]
    record("--save-total-limit 2 keeps checkpoint-3 and checkpoint-4", 0.0, 0.0, True)


def _no_space():
    raise OSError(28, "No space left on device")


def _torch_short_write():
    """What torch's serializer raises on a full disk: its own RuntimeError, which names no disk (the real one, from
    a write to /dev/full, where the system has it)."""
    if not os.path.exists("/dev/full"):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    torch.save({"weights": torch.ones(4096)}, "/dev/full")


@pytest.mark.parametrize("full", [_no_space, _torch_short_write], ids=["ENOSPC", "torch-serializer"])
def test_a_checkpoint_that_cannot_be_written_still_leaves_the_summary(full, tmp_path, capsys, monkeypatch):
    """A full disk at a save: one line that calls it a full disk (torch's serializer reported it as
    "[enforce fail at inline_container.cc:672]"), the last complete checkpoint, exit 1, the summary written."""
    real_save = checkpoint.save_checkpoint

    def disk_full_at_the_end(output_dir, step, *args, **kwargs):
        if step == 4:
            full()
        return real_save(output_dir, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", disk_full_at_the_end)
    out = tmp_path / "out"
    said = exits(capsys, "--output-dir", str(out), "--save-every", "2", code=1, tag="test_runs_disk_full")
    assert "the checkpoint of step 4 could not be written" in said and "(the disk is full" in said, said
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}" in said, said
    saved = summary("test_runs_disk_full")
    assert len(saved["losses"]) == 4 and "the disk is full" in saved["stopped"]
    record("final save fails: message, exit 1, summary written", 0.0, 0.0, True)


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX file size limit (RLIMIT_FSIZE)")
def test_a_file_size_limit_at_a_save_stops_naming_the_last_complete_checkpoint(tmp_path, capsys, monkeypatch):
    """`ulimit -f`, a quota or a full disk as the weights are written (safetensors raises its own error,
    not an OSError): one message naming the last complete checkpoint, exit 1, the summary written, and
    no half-written checkpoint left."""
    import resource

    real_save = checkpoint.save_checkpoint
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def step_4_over_the_limit(output_dir, step, *args, **kwargs):
        if step != 4:
            return real_save(output_dir, step, *args, **kwargs)
        # the weights are 316 KB; Python ignores SIGXFSZ, so the write fails with EFBIG ("File too large")
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
        try:
            return real_save(output_dir, step, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)

    monkeypatch.setattr(checkpoint, "save_checkpoint", step_4_over_the_limit)
    out = tmp_path / "out"
    said = exits(capsys, "--output-dir", str(out), "--save-every", "2", code=1, tag="test_runs_file_size")
    assert "the checkpoint of step 4 could not be written" in said and "File too large" in said, said
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}" in said and "Traceback" not in said, said
    assert len(summary("test_runs_file_size")["losses"]) == 4
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "latest"], list(out.iterdir())
    record("a save over the file size limit: message, exit 1, summary written, nothing half-written", 0.0, 0.0, True)


def test_a_nan_loss_stops_with_step_causes_and_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    real_step, calls = training.training_step, []

    def poisoned(*args, **kwargs):  # the third step's loss is NaN, as after an overflow
        loss, norm = real_step(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), norm

    monkeypatch.setattr(training, "training_step", poisoned)
    out = tmp_path / "out"
    # eager steps: the NaN comes from a Python wrapper of the step, which a replayed CUDA graph never calls
    said = exits(capsys, "--steps", "5", "--output-dir", str(out), "--save-every", "1", "--cuda-graphs", "off", code=1,
                 tag="test_runs_nan")
    assert "the loss is nan at step 3 of 5" in said, said
    assert "the learning rate (--lr 0.001: try a lower one" in said and "data" in said and "fp16" in said, said
    assert f"last good checkpoint (finite weights): {out / 'checkpoint-2'} (step 2)" in said, said
    saved = summary("test_runs_nan")
    assert len(saved["losses"]) == 2 and "step 3" in saved["stopped"]
    assert names(out) == ["checkpoint-1", "checkpoint-2"]
    record("NaN loss: step, causes, last good checkpoint, summary written", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# Resume continues the saved run, or says what differs
# ------------------------------------------------------------------------------------------------
# The settings every checkpoint stores, in their stored order, with the flags that name them: older
# checkpoints hold exactly these, so a change here is a change of the checkpoint format
STORED_SETTINGS = [
    ("model", "--model"), ("num_layers", "--num-layers"), ("lora_r", "--lora-r"), ("lora_alpha", "--lora-alpha"),
    ("lora_dropout", "--lora-dropout"), ("lora_targets", "--lora-targets"), ("load_in_4bit", "--load-in-4bit"),
    ("data", "--data / --dataset"), ("batch_size", "--batch-size"), ("grad_accum", "--grad-accum"),
    ("seq_len", "--seq-len"), ("packing", "--packing"), ("train_on_prompt", "--train-on-prompt"),
    ("drop_long", "--drop-long"), ("eval_fraction", "--eval-fraction"), ("seed", "--seed"), ("lr", "--lr"),
    ("lr_schedule", "--lr-schedule"), ("lr_warmup_steps", "--lr-warmup-steps"), ("warmup_ratio", "--warmup-ratio"),
    ("weight_decay", "--weight-decay"), ("repeat_batches", "--repeat-batches"),
]


def test_resume_settings_are_the_stored_keys_in_the_stored_order(tmp_path):
    """The settings derived from the config's resumable fields are the ones older checkpoints store: the same
    keys in the same order, the same values (the LoRA ones None without LoRA, the model's local folder as
    an absolute path, the data as its identity)."""
    from playbook.run.resume import RESUME_SETTINGS, resume_settings

    assert list(RESUME_SETTINGS.items()) == STORED_SETTINGS
    full = config("--model", "llama-tiny", "--batch-size", "2")
    assert list(resume_settings(full, full.model.model).items()) == [
        ("model", "llama-tiny"), ("num_layers", None), ("lora_r", 0), ("lora_alpha", None), ("lora_dropout", None),
        ("lora_targets", None), ("load_in_4bit", False), ("data", "synthetic"), ("batch_size", 2), ("grad_accum", 1),
        ("seq_len", full.data.seq_len), ("packing", False), ("train_on_prompt", False), ("drop_long", False),
        ("eval_fraction", 0.0), ("seed", 0), ("lr", full.training.lr), ("lr_schedule", "linear"), ("lr_warmup_steps",
                                                                                                   0),
        ("warmup_ratio", 0.0), ("weight_decay", 0.0), ("repeat_batches", None)]
    folder = tmp_path / "model"
    folder.mkdir()
    lora = config("--model", "llama-tiny", "--batch-size", "4", "--lora-r", "4", "--lora-targets", "attention",
                  "--dataset", str(TEXT), "--eval-fraction", "0.1", "--seed", "3", "--lr", "1e-3", "--warmup-ratio",
                  "0.1", "--grad-accum", "2", "--num-layers", "1")
    got = resume_settings(lora, str(folder))
    assert [k for k, _ in STORED_SETTINGS] == list(got)
    digest = hashlib.sha256(TEXT.read_bytes()).hexdigest()
    assert got == {
        "model": str(folder.resolve()), "num_layers": 1, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "load_in_4bit": False,
        "data": {"path": str(TEXT.resolve()), "bytes": TEXT.stat().st_size, "sha256": digest}, "batch_size": 4,
        "grad_accum": 2, "seq_len": lora.data.seq_len, "packing": True, "train_on_prompt": False, "drop_long": False,
        "eval_fraction": 0.1, "seed": 3, "lr": 1e-3, "lr_schedule": "linear", "lr_warmup_steps": 0,
        "warmup_ratio": 0.1, "weight_decay": 0.0, "repeat_batches": None}
    record(f"resume settings: the {len(STORED_SETTINGS)} stored keys, in the stored order, with today's values",
           0.0, 0.0, True)


def test_every_resumable_field_is_stored_and_named_by_its_flag():
    """Each field of the RunConfig's sections marked resumable is in the settings a checkpoint stores, under its own name, and its
    flag is an option of the scripts' parser; the computed values are all of marked fields."""
    from dataclasses import fields

    from playbook.config import SECTIONS
    from playbook.run.resume import COMPUTED_SETTINGS, resume_settings

    marked = {f.name: f.metadata["resume"] for kind in SECTIONS.values() for f in fields(kind)
              if "resume" in f.metadata}
    cfg = config("--model", "llama-tiny", "--batch-size", "2", "--lora-r", "4")
    stored = resume_settings(cfg, cfg.model.model)
    assert set(marked) <= set(stored), f"resumable fields missing from the stored settings: {set(marked) - set(stored)}"
    assert set(stored) == set(marked), f"stored settings that are no resumable field: {set(stored) - set(marked)}"
    assert set(COMPUTED_SETTINGS) <= set(marked), set(COMPUTED_SETTINGS) - set(marked)
    options = set(make_parser("test", kernels_default=ak.DEFAULT_KERNELS)._option_string_actions)
    for name, flag in marked.items():
        assert all(word in options for word in flag.split(" / ")), (name, flag)
    record(f"resume settings: all {len(marked)} resumable fields stored, each flag a parser option", 0.0, 0.0, True)


def test_resume_refuses_other_settings_line_by_line(tmp_path, capsys):
    out = tmp_path / "out"
    run("--data", str(TEXT), "--output-dir", str(out), "--save-every", "2", tag="test_runs_settings")
    other = tmp_path / "other.txt"
    other.write_text(TEXT.read_text()[::-1])
    said = exits(capsys, "--data", str(other), "--batch-size", "4", "--seq-len", "48", "--grad-accum", "2",
                 "--seed", "1", "--lr-schedule", "cosine", "--resume", str(out / "checkpoint-2"))
    for line in ("--batch-size: checkpoint 2, this run 4", "--seq-len: checkpoint 32, this run 48",
                 "--grad-accum: checkpoint 1, this run 2", "--seed: checkpoint 0, this run 1",
                 "--lr-schedule: checkpoint linear, this run cosine",
                 f"--data / --dataset: checkpoint {TEXT} ({TEXT.stat().st_size:,} bytes"):
        assert line in said, (line, said)
    assert said.count(": checkpoint ") == 6, said
    # the same bytes under another name are the same data; other kernels are allowed
    copy = tmp_path / "copy.txt"
    shutil.copy(TEXT, copy)
    got = run("--data", str(copy), "--kernels", "rmsnorm", "--resume", str(out / "checkpoint-2"),
              tag="test_runs_settings_ok")
    assert got["losses"][:2] == summary("test_runs_settings")["losses"][:2] and len(got["losses"]) == 4
    record("resume: each differing setting named, exit 2; moved data and other kernels accepted", 0.0, 0.0, True)


def test_resume_with_more_steps_rebuilds_the_schedule(tmp_path, capsys):
    """The decaying schedule is rebuilt for the new length: step s of N runs at lr * (1 - s / N) (no
    warm-up), so the remaining steps follow the new length, not the saved one."""
    out = tmp_path / "out"
    first = run("--lr-schedule", "linear", "--output-dir", str(out), tag="test_runs_short")
    capsys.readouterr()
    longer = run("--lr-schedule", "linear", "--steps", "8", "--output-dir", str(out), "--resume", str(out),
                 tag="test_runs_long")
    said = capsys.readouterr().out
    assert "schedule's length changes from 4 to 8 steps" in said and "step 5: 0.0005 instead of 0" in said, said
    assert longer["losses"][:4] == first["losses"] and len(longer["losses"]) == 8
    rows = [json.loads(line) for line in (RESULTS_DIR / "test_runs_long.metrics.jsonl").read_text().splitlines()]
    lrs = {row["step"]: row["lr"] for row in rows}
    for step in range(5, 9):
        want = 1e-3 * (1 - (step - 1) / 8)
        # exactly as a float, or in float32 on a GPU, where the captured step computes its rate on the device:
        # the base rate and the schedule's factor each rounded to float32 and their product rounded again,
        # three roundings of 2^-24 each (a wrong schedule is off by 1/8 of the rate or more)
        assert lrs[step] == pytest.approx(want, rel=1e-12 if DEVICE.type == "cpu" else 3 * 2.0**-24), (step, lrs)
    assert names(out) == ["checkpoint-4", "checkpoint-8"]
    record("resume with --steps 8 after 4: linear schedule rebuilt for 8 steps", 0.0, 0.0, True)


def _strip_settings(ckpt: Path) -> None:
    """Make `ckpt` an older checkpoint: its trainer state without the stored settings."""
    state = torch.load(ckpt / checkpoint.STATE_FILE, weights_only=True)
    state["extra"].pop("settings")
    torch.save(state, ckpt / checkpoint.STATE_FILE)


def test_resume_of_an_older_checkpoint_warns(tmp_path, capsys):
    out = tmp_path / "out"
    run("--output-dir", str(out), "--save-every", "2", tag="test_runs_old")
    _strip_settings(out / "checkpoint-2")
    got = run("--resume", str(out / "checkpoint-2"), tag="test_runs_old_resumed")
    assert "stores no run settings (an older checkpoint)" in capsys.readouterr().out
    assert len(got["losses"]) == 4
    record("checkpoint without settings: resumed with a one-line warning", 0.0, 0.0, True)


# A checkpoint's saved config as playbook/run/training.py wrote it while RunConfig held every field itself (before
# the sections were nested, #61): one flat dict, its keys in this order (summaries hold the same form)
FLAT_CONFIG_KEYS = [
    "script", "device", "seed", "model", "model_explicit", "num_layers", "gradient_checkpointing", "checkpoint_layers",
    "offload_activations", "keep_attention", "recompute_norms", "offload_layers", "mlp_chunk_tokens", "kernels", "fp8",
    "fp8_backend", "fp8_recipe", "fp8_layers", "compile", "lora_r", "lora_alpha", "lora_dropout", "lora_targets",
    "merge_lora", "load_in_4bit", "batch_size", "seq_len", "data", "dataset", "packing", "train_on_prompt", "drop_long",
    "eval_dataset", "eval_fraction", "eval_every", "repeat_batches", "grad_accum", "steps", "epochs", "warmup_steps",
    "lr", "lr_schedule", "lr_warmup_steps", "warmup_ratio", "weight_decay", "optimizer", "optimizer_rounding",
    "master_weights", "optimizer_in_backward", "max_grad_norm", "cuda_graphs", "output_dir", "save_every",
    "save_total_limit", "overwrite_output_dir", "load_best_model_at_end", "early_stopping_patience",
    "early_stopping_threshold", "resume", "log_every", "tag", "overwrite", "report_to", "sample_prompts",
    "ignore_memory_plan", "extra"]


def test_checkpoint_written_before_the_nested_config_resumes(tmp_path, capsys):
    """A checkpoint whose saved settings and config are in the flat form written before RunConfig held its
    sections as fields (#61) resumes: its settings are checked key by key (a differing one still refused), its
    config is read, and today's as_dict is that same flat form, in the same order."""
    out = tmp_path / "out"
    run("--output-dir", str(out), "--save-every", "2", tag="test_runs_flat")
    assert list(config(*BASE).as_dict()) == FLAT_CONFIG_KEYS
    ckpt = out / "checkpoint-2"
    state = torch.load(ckpt / checkpoint.STATE_FILE, weights_only=True)
    saved = state["extra"]["config"]
    state["extra"]["config"] = {key: saved[key] for key in FLAT_CONFIG_KEYS}  # (written out whole, as then)
    state["extra"]["settings"] = {  # BASE's values, as the settings were stored then: flat, in this order
        "model": "llama-tiny", "num_layers": None, "lora_r": 0, "lora_alpha": None, "lora_dropout": None,
        "lora_targets": None, "load_in_4bit": False, "data": "synthetic", "batch_size": 2, "grad_accum": 1,
        "seq_len": 32, "packing": False, "train_on_prompt": False, "drop_long": False, "eval_fraction": 0.0,
        "seed": 0, "lr": 1e-3, "lr_schedule": "linear", "lr_warmup_steps": 0, "warmup_ratio": 0.0,
        "weight_decay": 0.0, "repeat_batches": None}
    torch.save(state, ckpt / checkpoint.STATE_FILE)
    info = checkpoint_load.read_checkpoint_info(ckpt)
    assert list(info["extra"]["config"]) == FLAT_CONFIG_KEYS and info["extra"]["settings"]["batch_size"] == 2
    capsys.readouterr()
    got = run("--resume", str(ckpt), tag="test_runs_flat_resumed")
    said = capsys.readouterr().out
    assert "stores no run settings" not in said, said
    assert got["losses"][:2] == summary("test_runs_flat")["losses"][:2] and len(got["losses"]) == 4
    assert ": checkpoint 2, this run 4" in exits(capsys, "--batch-size", "4", "--resume", str(ckpt))
    record("a checkpoint of the flat config (before #61's sections) resumes; a differing setting still refused",
           0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# Every damaged --resume: one line, exit code 2
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """A full fine-tune and a LoRA run of 2 steps, and a local model directory that is not llama-tiny."""
    from playbook.model.tokenizer import byte_tokenizer
    from playbook.model.models import build_preset

    root = tmp_path_factory.mktemp("saved")
    args = [*BASE, "--steps", "2", "--tag", "test_runs_saved"]
    try:
        training.train(config(*args, "--output-dir", str(root / "full")))
        training.train(config(*args, "--lora-r", "4", "--output-dir", str(root / "lora")))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"test_runs_saved{suffix}").unlink(missing_ok=True)
    other = build_preset("llama-tiny", 1, torch.device("cpu"), torch.bfloat16)
    other.save_pretrained(root / "other-model")
    byte_tokenizer().save_pretrained(root / "other-model")
    return root


def _damage(case: str, root: Path, tmp: Path) -> tuple[list, str]:
    """(command-line words, what the message says) for one damaged --resume."""
    full = tmp / "full"
    shutil.copytree(root / "full", full)
    ckpt = full / "checkpoint-2"
    if case == "empty directory":
        (tmp / "empty").mkdir()
        return ["--resume", str(tmp / "empty")], "not a checkpoint"
    if case == "not a checkpoint":
        (tmp / "notes").mkdir()
        (tmp / "notes" / "readme.txt").write_text("hello")
        return ["--resume", str(tmp / "notes")], "not a checkpoint"
    if case == "truncated model.safetensors":
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        return ["--resume", str(ckpt)], "cannot be read"
    if case == "missing model.safetensors":
        (ckpt / "model.safetensors").unlink()
        return ["--resume", str(ckpt)], "no model.safetensors"
    if case == "missing trainer_state.pt":
        (ckpt / checkpoint.STATE_FILE).unlink()
        return ["--resume", str(ckpt)], "no trainer_state.pt"
    if case == "garbage trainer_state.pt":
        (ckpt / checkpoint.STATE_FILE).write_bytes(b"\x00garbage" * 50)
        return ["--resume", str(ckpt)], "cannot be read"
    if case == "latest names a missing checkpoint":
        (full / "latest").write_text("checkpoint-9\n")
        return ["--resume", str(full)], "names 'checkpoint-9', which is not a checkpoint directory"
    if case == "LoRA checkpoint into a full fine-tune":
        shutil.copytree(root / "lora", tmp / "lora")
        return ["--resume", str(tmp / "lora")], "--lora-r: checkpoint 4, this run 0"
    if case == "full checkpoint into LoRA":
        return ["--lora-r", "4", "--resume", str(full)], "--lora-r: checkpoint 0, this run 4"
    if case == "LoRA into a full fine-tune, older checkpoint":
        shutil.copytree(root / "lora", tmp / "lora")
        _strip_settings(tmp / "lora" / "checkpoint-2")
        return ["--resume", str(tmp / "lora")], "holds a LoRA adapter, and the model is a model without adapters"
    if case == "other --num-layers":
        return ["--num-layers", "1", "--resume", str(full)], "--num-layers: checkpoint all layers, this run 1"
    if case == "other --num-layers, older checkpoint":
        _strip_settings(ckpt)
        return ["--num-layers", "1", "--resume", str(full)], "does not match the model: unexpected model.layers.1"
    if case == "renamed tensor key":
        from safetensors.torch import load_file, save_file

        tensors = load_file(ckpt / "model.safetensors")
        tensors["model.norm.weight_renamed"] = tensors.pop("model.norm.weight")
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
        return ["--resume", str(full)], "missing model.norm.weight; unexpected model.norm.weight_renamed"
    if case == "other model":
        return ["--model", str(root / "other-model"), "--resume", str(full)], "--model: checkpoint llama-tiny, this run"
    raise AssertionError(case)


DAMAGED = ["empty directory", "not a checkpoint", "truncated model.safetensors", "missing model.safetensors",
           "missing trainer_state.pt", "garbage trainer_state.pt", "latest names a missing checkpoint",
           "LoRA checkpoint into a full fine-tune", "full checkpoint into LoRA",
           "LoRA into a full fine-tune, older checkpoint", "other --num-layers", "other --num-layers, older checkpoint",
           "renamed tensor key", "other model"]


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_resume_is_one_clean_line(case, saved_runs, tmp_path, capsys):
    argv, says = _damage(case, saved_runs, tmp_path)
    said = exits(capsys, *argv, tag="test_runs_damaged")
    assert "error: --resume " in said and says in said, (case, said)
    assert "Traceback" not in said
    record(f"--resume, {case}: one line, exit 2", 0.0, 0.0, True)


def test_damaged_resume_from_the_script_exits_2_without_traceback(saved_runs, tmp_path):
    argv, says = _damage("truncated model.safetensors", saved_runs, tmp_path)
    proc = subprocess.run([sys.executable, str(HERE / "finetune_optimized.py"), *BASE, "--tag", "test_runs_script",
                           *argv], cwd=HERE, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(HERE)})
    _TAGS.append("test_runs_script")
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    record("finetune_optimized.py --resume (damaged): exit 2, no traceback", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# LoRA adapters other tools load
# ------------------------------------------------------------------------------------------------
def test_lora_adapter_names_its_base_and_auto_peft_loads_it(saved_runs, tmp_path, capsys):
    from peft import AutoPeftModelForCausalLM

    preset = json.loads((saved_runs / "lora" / "checkpoint-2" / "adapter_config.json").read_text())
    assert preset["base_model_name_or_path"] == "llama-tiny"
    assert "AutoPeftModelForCausalLM cannot fetch it" in preset["base_model_note"]

    base = saved_runs / "other-model"  # a local model directory: AutoPeft loads base and adapter from disk
    run("--model", str(base), "--lora-r", "4", "--steps", "2", "--output-dir", str(tmp_path / "out"),
        tag="test_runs_adapter")
    adapter = tmp_path / "out" / "checkpoint-2"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base.resolve()) and "base_model_note" not in saved
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    assert type(model).__name__ == "PeftModelForCausalLM" and len(model.base_model.model.model.layers) == 1

    said = exits(capsys, "--model", str(adapter), tag="test_runs_adapter_as_model")
    assert f"--model {adapter} is a LoRA adapter" in said and f"--model {base.resolve()} --lora-r 4 --resume" in said
    assert "Hub cannot be reached" not in said
    record("adapter names its base; AutoPeft loads it; an adapter as --model is explained", 0.0, 0.0, True)



def test_the_summary_reports_the_host_queue_time():
    """Each timed step's host queue time (from the step's start until its last launch returns, before the
    synchronisation) is kept beside its step time, and the summary gives its median."""
    gpu = torch.cuda.is_available()  # eager steps on a GPU too: a replayed graph queues no launches per step
    run("--steps", "4", "--timing-warmup-steps", "1", *(["--cuda-graphs", "off"] if gpu else []),
        tag="test_runs_host_queue")
    payload = summary("test_runs_host_queue")
    queued, steps = payload["host_queue_s"], payload["step_times_s"]
    assert len(queued) == len(steps) == 3, (queued, steps)
    assert all(0 < q <= t for q, t in zip(queued, steps)), (queued, steps)  # queued is a part of the step
    median = payload["summary"]["host queue median (ms)"]
    assert median == sorted(queued)[1] * 1e3, (median, queued)
    share = payload["summary"]["host queue (% of step)"]
    assert share == 100 * sorted(queued)[1] / sorted(steps)[1], (share, queued, steps)
    assert payload["summary"]["step mode"] == ("off (--cuda-graphs off)" if gpu else "off (no GPU)"), payload["summary"]
    record(f"host queue {median:.1f} ms of a {payload['summary']['step time median (ms)']:.1f} ms step (CPU)",
           0.0, 0.0, True)


if __name__ == "__main__":
    sys.exit(run_as_script(__name__, "Runs: nothing lost, exact resume, clean errors"))
