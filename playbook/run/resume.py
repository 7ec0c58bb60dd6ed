"""What is checked before the first step: the run's output folders, and a --resume checkpoint against this run.

A resumed run continues the saved one: the settings that decide the data order and the learning-rate
schedule (RESUME_SETTINGS) must be the checkpoint's, and --output-dir must not hold another run's
checkpoints. `load` then brings the weights, the optimizer, the schedule and the losses so far back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from core.process import is_main, log, world
from playbook.config import resumable_settings
from playbook.model.lora import parse_targets
from playbook.optim.optimizer import make_capturable, rounding_of, weight_rounding
from playbook.optim.schedule import length_change
from playbook.runtime import environment
from playbook.runtime.common import usage_error
from playbook.store import checkpoint_load
from playbook.store.checkpoint import BEST_FILE, LATEST_FILE, list_checkpoints
from playbook.store.checkpoint_load import read_checkpoint_info
from playbook.store.files import RESULTS_DIR
from playbook.sections import RunConfig


# The settings that decide a run's data order and learning-rate schedule: name in the checkpoint -> the flag
# that sets it, from the RunConfig's fields marked `resumable` (playbook/sections.py), in their stored order. A
# resumed run must have the same values (the kernels, the optimizer's implementation, logging and the number
# of steps may change).
RESUME_SETTINGS = resumable_settings()


def data_identity(cfg: RunConfig) -> dict | str:
    """The training data, as a checkpoint records it: a file's path, size and SHA-256 (a moved file with
    the same bytes is the same data), a hub dataset's id, or "synthetic"."""
    source = cfg.data.data if cfg.data.data is not None else cfg.data.dataset
    if source is None:
        return "synthetic"
    path = Path(source).expanduser()
    if not path.is_file():
        return {"hub": str(source)}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _model(cfg: RunConfig, model_name: str) -> str:
    local = Path(model_name).expanduser()
    return str(local.resolve()) if local.is_dir() else model_name  # a local directory, wherever it is named from


def _lora_targets(cfg: RunConfig, model_name: str) -> list | None:
    return list(parse_targets(cfg.model.lora_targets)) if cfg.model.lora_r else None


# The settings whose stored value is computed rather than the field's own: field name -> value(cfg, model_name).
# Without LoRA (lora_r 0) the other LoRA settings are unused, and stored as None.
COMPUTED_SETTINGS = {
    "model": _model,
    "lora_alpha": lambda cfg, _: (cfg.model.lora_alpha or 2 * cfg.model.lora_r) if cfg.model.lora_r else None,
    "lora_dropout": lambda cfg, _: cfg.model.lora_dropout if cfg.model.lora_r else None,
    "lora_targets": _lora_targets,
    "data": lambda cfg, _: data_identity(cfg),
}


def resume_settings(cfg: RunConfig, model_name: str) -> dict:
    """This run's values of RESUME_SETTINGS, as stored in every checkpoint it writes: each field's value, or
    its COMPUTED_SETTINGS value."""
    return {key: COMPUTED_SETTINGS[key](cfg, model_name) if key in COMPUTED_SETTINGS else cfg.value(key)
            for key in RESUME_SETTINGS}


def _show_setting(key: str, value) -> str:
    if key == "data" and isinstance(value, dict):
        if "hub" in value:
            return f"hub dataset {value['hub']}"
        return f"{value['path']} ({value['bytes']:,} bytes, sha256 {value['sha256'][:12]})"
    if key == "num_layers" and value is None:
        return "all layers"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def settings_differences(saved: dict, ours: dict) -> list[str]:
    """One line per setting that differs: "--batch-size: checkpoint 4, this run 8"."""
    lines = []
    for key, flag in RESUME_SETTINGS.items():
        a, b = saved.get(key), ours.get(key)
        if key == "data" and isinstance(a, dict) and isinstance(b, dict) and "sha256" in a and "sha256" in b:
            same = (a["bytes"], a["sha256"]) == (b["bytes"], b["sha256"])  # the same bytes, wherever they are
        else:
            same = a == b
        if not same:
            lines.append(f"{flag}: checkpoint {_show_setting(key, a)}, this run {_show_setting(key, b)}")
    return lines


def _probe_folder(folder, what: str, how: str) -> None:
    """Refuse (exit code 2) a folder that is a file, lies under a file, or cannot be created or written; `how`:
    the way to choose another (the flag or variable that names it)."""
    for p in (folder, *folder.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == folder else f"lies under {p}, which is a file"
            raise usage_error(f"{what} {folder} {where}, not a directory: {how}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise usage_error(f"{what} {folder} cannot be written ({err.strerror or err}): {how}") from None


def check_output_folders(cfg: RunConfig) -> None:
    """results/ and --output-dir are directories this run can write, checked before the model is built."""
    _probe_folder(RESULTS_DIR, "the results folder", f"set {environment.RESULTS_DIR} to a writable folder (e.g. "
                                                     f"{environment.RESULTS_DIR}=~/playbook-results) to write there")
    if cfg.output.output_dir is not None:
        _probe_folder(cfg.output.output_dir, "--output-dir", "give an --output-dir in a writable folder")


def resume_error(cfg: RunConfig, err) -> SystemExit:
    """A checkpoint that cannot be resumed: one line naming it and what is wrong, exit code 2."""
    return usage_error(f"--resume {cfg.output.resume}: {str(err).strip()}")


def read_resume(cfg: RunConfig) -> dict:
    """read_checkpoint_info of --resume, its errors as resume_error."""
    try:
        return read_checkpoint_info(cfg.output.resume)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:
        raise resume_error(cfg, err) from None


def refuse_differences(cfg: RunConfig, lines: list[str]) -> None:
    """Stop (exit code 2) a resume whose settings differ from the checkpoint's (settings_differences' lines), in
    the words every training script uses; nothing where `lines` is empty."""
    if not lines:
        return
    print(f"error: --resume {cfg.output.resume}: this run's settings differ from the checkpoint's; they decide the "
          "data order and the learning-rate schedule:", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    print("Resume with the checkpoint's values, or start a new run (another --output-dir).", file=sys.stderr)
    raise SystemExit(2)


def check_resume(cfg: RunConfig, info: dict, settings: dict, steps: int) -> None:
    """Stop (exit code 2) when this run's settings differ from the checkpoint's, one line each; warn when
    the checkpoint predates stored settings; say how the schedule changes when the length does."""
    saved = info["extra"].get("settings")
    if saved is None:
        log(f"warning: {info['path']} stores no run settings (an older checkpoint): whether this run's batch size, "
            "data, sequence length and schedule are the saved run's cannot be checked")
    else:
        refuse_differences(cfg, settings_differences(saved, settings))
    schedule = info["scheduler"]
    if schedule and schedule["total"] != steps and info["step"] < steps:
        log(length_change(schedule, info["step"], steps, cfg.training))


def check_resumed_run(cfg: RunConfig, info: dict, settings: dict, steps: int) -> None:
    """Everything a --resume checkpoint must agree with before the optimizer is built: the number of
    processes of a --dataset run, the settings (check_resume); a change of rounding is said, not refused."""
    size = world()[1]
    saved_size = int(info["extra"].get("world_size", 1))
    if saved_size != size and cfg.data.dataset:
        raise resume_error(cfg, f"the checkpoint was written by {saved_size} process(es), this run has {size}: a "
                                "--dataset epoch is dealt out among the processes, so at another count the step "
                                f"no longer says which rows were seen; resume with {saved_size} process(es)")
    check_resume(cfg, info, settings, steps)
    saved = info["extra"].get("config") or {}
    saved_rounding = rounding_of(saved.get("master_weights"), saved.get("optimizer_rounding"))
    if saved_rounding != weight_rounding(cfg.training):  # allowed, as a change of --optimizer is
        log(f"The checkpoint's run rounded its weights with {saved_rounding!r}, this one with "
            f"{weight_rounding(cfg.training)!r}: a Kahan compensation or fp32 master weight the checkpoint lacks starts "
            "from the bf16 weights, one this run does not use is dropped")


def check_output_checkpoints(cfg: RunConfig, info: dict | None, steps: int) -> None:
    """--output-dir must not hold another run's checkpoints: this run's would be mixed with them.

    Allowed: no checkpoints; resuming from a checkpoint of this folder, the later ones (if any)
    belonging to the same run (same length: with the same settings they are what this run computes
    again, and it replaces them as it reaches them). Otherwise stop, unless --overwrite-output-dir,
    which deletes those checkpoints (all of them, or the ones after the resumed one) first."""
    out = cfg.output.output_dir
    if out is None:
        return
    found = list_checkpoints(out)
    if not found:
        return
    inside = info is not None and info["path"].resolve().parent == out.resolve()
    if inside:
        others = [p for s, p in found if s > info["step"]]
        schedule = info["scheduler"] or {}
        if not others or schedule.get("total") == steps:
            return
        what = (f"{', '.join(p.name for p in others)}, later than the resumed {info['path'].name} and from a run of "
                f"{schedule.get('total')} steps (this one has {steps})")
    else:
        others = [p for _, p in found]
        what = f"another run's checkpoints ({', '.join(p.name for p in others)})"
    if not cfg.output.overwrite_output_dir:
        raise usage_error(f"--output-dir {out} holds {what}: this run's checkpoints would be mixed with them. Choose "
                          "another --output-dir, resume that run (--resume), or add --overwrite-output-dir to delete "
                          "them before training")
    if is_main():
        for p in others:
            shutil.rmtree(p)
        for pointer in (out / LATEST_FILE, out / BEST_FILE):  # (a pointer to a deleted checkpoint goes with it)
            if pointer.is_file() and not (out / pointer.read_text().strip()).is_dir():
                pointer.unlink()
    log(f"--overwrite-output-dir: deleted {', '.join(p.name for p in others)} from {out} before training")


def load(cfg: RunConfig, info: dict, model, optimizer, schedule, result, steps: int, capturable: bool) -> int:
    """Load the --resume checkpoint into the model, the optimizer and the schedule, and its losses into
    `result`; returns the step it is at (the run goes on from the next). capturable: the optimizer is
    made for a CUDA graph, and gets its rate and step counts back on the GPU (optimizer.make_capturable)."""
    try:
        # (through the module: a test records the load)
        state = checkpoint_load.load_checkpoint(info["path"], model, optimizer, schedule)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:
        raise resume_error(cfg, err) from None
    start = int(state["step"])
    if capturable:
        make_capturable(optimizer, cfg.run.device)
    saved_size, size = int(state.get("world_size", 1)), world()[1]
    if saved_size != size:
        log(f"The checkpoint was written by {saved_size} process(es), this run has {size}: the weights, optimizer "
            "and schedule carry over; the batches and random numbers from here on are this run's own")
    result.losses = list(state.get("losses", []))[:start]
    result.eval_losses = [tuple(e) for e in state.get("eval_losses", []) if e[0] <= start]
    log(f"Resumed from {info['path']} at step {start} of {steps}")
    if start >= steps:
        raise resume_error(cfg, f"the checkpoint is at step {start}, and this run has only {steps} steps; give "
                                f"more --steps (or --epochs) to continue it")
    return start
