"""Training checkpoints: written atomically, loadable by Hugging Face alone, and enough to resume exactly.

    >>> from playbook.store.checkpoint import save_checkpoint
    >>> from playbook.store.checkpoint_load import load_checkpoint
    >>> save_checkpoint("out", 100, model, tokenizer, optimizer, scheduler, {"micro_batch": 400}, keep_last=3)
    PosixPath('out/checkpoint-100')
    >>> load_checkpoint("out", model, optimizer, scheduler)     # follows out/latest
    {'micro_batch': 400, 'step': 100}

Layout of `output_dir/checkpoint-<step>/`:

    config.json, model.safetensors   the weights, Hugging Face's format and key names: loads with
    (or *.index.json + shards)        AutoModelForCausalLM.from_pretrained(dir), no code of this project
    adapter_config.json,              instead of the weights, for a LoRA (peft) model: the adapter only;
    adapter_model.safetensors         the frozen base is the model the run started from
    tokenizer files                   when a tokenizer is given
    trainer_state.pt                  step, optimizer and scheduler state, `extra` (data position,
                                      config, losses, ...), RNG states (python, torch CPU, CUDA, numpy)
                                      of every process, and for an adapter a fingerprint of the frozen
                                      base weights

and `output_dir/latest`, one line: the name of the newest checkpoint directory.

Atomic: everything is written into a hidden sibling `.checkpoint-<step>.tmp-*`, flushed to disk
(fsync), and renamed into place in one `os.replace`; then `latest` is replaced the same way. A save
that dies part-way leaves the previous checkpoints and `latest` as they were; the next save removes
its leftovers. Re-saving an existing step (a resumed run passing the same step) replaces that
checkpoint: the old one is renamed aside, the new one renamed in, the old one deleted; should the
process die between those two renames, the next save renames the old one back.

trainer_state.pt is read with `torch.load(weights_only=True)`: no code runs when a checkpoint is
loaded, so `extra` may hold only str, int, float, bool, None, tensors, and lists, tuples and dicts
of those (save_checkpoint refuses anything else, naming the key).

Several processes (torchrun, FSDP2): every process calls save_checkpoint and load_checkpoint with the
same arguments; the files are the same as one process writes.
    saving   the sharded weights and optimizer state are gathered whole onto rank 0's CPU
             (get_model_state_dict / get_optimizer_state_dict with full_state_dict=True), and rank 0
             alone writes the directory; every rank returns once it is renamed into place and
             `latest` points at it, so no rank can read a half-written checkpoint. The optimizer
             state is then keyed by parameter name instead of position. Every rank's RNG state is
             kept. A LoRA model gathers its trainable (adapter) parameters only.
    loading  rank 0 reads the weights and checks them; set_model_state_dict (and
             set_optimizer_state_dict) with broadcast_from_rank0 sends every rank its shard.
Each step is agreed on: an error on one rank (a bad path, a corrupt file, a full disk) is raised on
every rank, so none is left waiting in a collective (playbook/store/ranks.py).

A checkpoint written by N processes resumes on M: the weights, the optimizer state (its keys are
converted between positions and names) and the schedule carry over exactly. The random generators
are restored only when N == M (with N != M there is no rank-for-rank counterpart); what the data
position means across a change of N is for the caller to judge (training.py refuses it for a
--dataset, whose epochs are dealt out per process).

This module writes checkpoints; playbook/store/checkpoint_load.py reads them back.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from core.process import is_peft_model
from core.tensors import sum_and_norm
from playbook.store.files import fsync_directory, fsync_tree, write_atomic
from playbook.store.ranks import is_sharded, same_on_every_rank, together, world_of

STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest"
BEST_FILE = "best"  # --load-best-model-at-end: the checkpoint of the lowest eval loss, which the run ends with
FINAL_STEP_FILE = "final_step.json"  # finetune_trainer.py's final/ folder: the training step its weights are from
PREFIX = "checkpoint-"
FORMAT = 2  # trainer_state.pt layout version (1: one process only, read too)
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(checkpoint-\d+)\.(tmp|old)-[0-9a-f-]+$")
# ------------------------------------------------------------------------------------------------
# Atomic directories (an atomic file: playbook/store/files.py)
# ------------------------------------------------------------------------------------------------
def _check_directory_path(path: Path, what: str) -> None:
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise NotADirectoryError(f"{what} {path}: {p} is an existing file, not a directory")


@contextlib.contextmanager
def atomic_directory(final):
    """Yield a temporary sibling directory of `final`; on success flush it and rename it to `final`
    (replacing an existing `final`); on an exception delete it and leave `final` untouched."""
    final = Path(final)
    _check_directory_path(final, "directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = final.parent / f".{final.name}.tmp-{token}"
    os.mkdir(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            aside = final.parent / f".{final.name}.old-{token}"
            os.replace(final, aside)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(aside, final)
                raise
            fsync_directory(final.parent)
            shutil.rmtree(aside)
        else:
            os.replace(tmp, final)
            fsync_directory(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _clean_leftovers(output_dir: Path) -> None:
    """Remove temporary directories of saves that died; rename back a checkpoint left aside."""
    for p in output_dir.iterdir():
        m = _LEFTOVER.match(p.name)
        if not m or not p.is_dir():
            continue
        target = output_dir / m.group(1)
        if m.group(2) == "old" and not target.exists():
            os.replace(p, target)  # the save that replaced it died between its two renames
        else:
            shutil.rmtree(p, ignore_errors=True)


def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint-<step> directory in output_dir, by step."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


# ------------------------------------------------------------------------------------------------
# What goes into trainer_state.pt
# ------------------------------------------------------------------------------------------------
def _check_plain(value, where: str) -> None:
    """`extra` must survive torch.load(weights_only=True) unchanged: plain Python values and tensors."""
    if value is None or isinstance(value, (str, int, float, bool, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where} has a key of type {type(k).__name__} ({k!r}); use str or int keys")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r:.60}); a checkpoint stores only str, int, "
                     "float, bool, None, tensors and lists / tuples / dicts of them (convert it, e.g. str(path))")


def _rng_state(size: int) -> dict:
    """This process's generators. CUDA: every visible device for one process; under torchrun only the
    rank's own device (touching the others would open a CUDA context on each of them)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        if size == 1:
            state["cuda"] = torch.cuda.get_rng_state_all()
        else:
            state["cuda_device"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def _is_peft(model) -> bool:
    return is_peft_model(model)


def base_fingerprint(model) -> dict:
    """name -> (float64 sum, float64 L2 norm) of every frozen parameter: tells the base a LoRA run
    started from apart from any other, without storing it. No copy of a floating weight is made (an
    integer one, a QLoRA base, is widened a chunk at a time). A sharded parameter's sums are those of
    the whole parameter (its shards' sums, added over the ranks): the same numbers, up to the order
    of summation, as one process gets. A parameter whose module recorded the fingerprint of the weight
    it was made from (`base_fingerprints`: a frozen weight kept in FP8) counts as that weight, so the
    base is the same whether its projections are kept in bf16 or in FP8."""
    out, partial = {}, {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                continue
            owner, _, leaf = name.rpartition(".")
            recorded = getattr(model.get_submodule(owner), "base_fingerprints", {}).get(leaf)
            if recorded is not None:
                out[name] = tuple(recorded)
                continue
            if is_sharded(p):
                total, norm = sum_and_norm(p.to_local())
                partial[name] = torch.stack([total, norm ** 2])
            else:
                total, norm = sum_and_norm(p)
                out[name] = (total.item(), norm.item())
        if partial:
            sums = torch.stack(list(partial.values()))
            dist.all_reduce(sums)  # a sync point: every rank has every sharded parameter
            for name, (total, squares) in zip(partial, sums.tolist()):
                out[name] = (total, squares ** 0.5)
    return out


def _optimizer_state(model, optimizer, size: int):
    """(state, "index" or "name"). One process, or nothing stepped yet: optimizer.state_dict() (the
    full-state gather would first take a zero-lr step to create a state, which counts as a step).
    Several processes: the whole state on rank 0 (an empty dict elsewhere), keyed by name."""
    if optimizer is None:
        return None, None
    if size == 1 or not optimizer.state:
        return optimizer.state_dict(), "index"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"save_checkpoint: the optimizer of a sharded run must be a torch.optim.Optimizer "
                        f"(got {type(optimizer).__name__})")

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options), "name"


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------
def _check_save_arguments(output_dir, step, keep_last, extra) -> tuple[Path, dict]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an integer >= 1, got {keep_last!r}")
    extra = dict(extra or {})
    if extra.get("step", step) != step:
        raise ValueError(f"extra['step'] is {extra['step']!r} but the checkpoint is for step {step}")
    extra.pop("step", None)
    _check_plain(extra, "extra")
    output_dir = Path(output_dir)
    _check_directory_path(output_dir, "output_dir")
    return output_dir, extra


def save_checkpoint(output_dir, step: int, model, tokenizer, optimizer, scheduler, extra: dict | None,
                    keep_last: int | None = None, keep=None) -> Path:
    """Write output_dir/checkpoint-<step>/ atomically, point output_dir/latest at it, and (keep_last)
    delete all but the newest `keep_last` checkpoints by step (never the one just written, nor `keep`: the best
    checkpoint of --load-best-model-at-end).

    model: a Hugging Face model (weights saved) or a peft model (adapter saved), sharded by FSDP2 or
    not. tokenizer, optimizer, scheduler: saved when not None (optimizer and scheduler through
    state_dict()). extra: plain values to get back from load_checkpoint (data position, config,
    losses...). Under torchrun every rank calls it with the same arguments. Returns the checkpoint
    directory.
    """
    rank, size = world_of("save_checkpoint")
    output_dir, extra = together(size, lambda: _check_save_arguments(output_dir, step, keep_last, extra))
    same_on_every_rank(size, "save_checkpoint", output_dir=str(output_dir.absolute()), step=step)
    adapter = _is_peft(model)
    # Collectives first, on every rank: the whole weights, optimizer state and random states.
    weights = None
    if size > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter)
        weights = get_model_state_dict(model, options=options)  # rank 0: full CPU tensors; the others: {}
    optimizer_state, optimizer_keys = _optimizer_state(model, optimizer, size)
    rng = [_rng_state(size)]
    if size > 1:
        rng = [None] * size
        dist.all_gather_object(rng, _rng_state(size))
    state = {
        "format": FORMAT,
        "step": step,
        "weights": "adapter" if adapter else "full",
        "optimizer": optimizer_state,
        "optimizer_keys": optimizer_keys,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra,
        "rng": rng,  # one per rank
        "base_fingerprint": base_fingerprint(model) if adapter else None,
    }
    final = output_dir / f"{PREFIX}{step}"

    def write():
        output_dir.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(output_dir)
        with atomic_directory(final) as tmp:
            if weights is None:
                model.save_pretrained(tmp, safe_serialization=True)
            else:
                model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
            if adapter:
                add_base_model_note(tmp, model)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            torch.save(state, tmp / STATE_FILE)
        write_atomic(output_dir / LATEST_FILE, final.name + "\n")
        if keep_last is not None:
            kept = {final.name, Path(keep).name if keep is not None else None}
            others = [p for _, p in list_checkpoints(output_dir) if p.name not in kept]
            for old in others[: max(0, len(others) - (keep_last - 1))]:
                shutil.rmtree(old)

    # Rank 0 writes; the others wait for it here (the agreement is a sync point), then return.
    together(size, lambda: write() if rank == 0 else None)
    return final


def mark_best(output_dir, checkpoint) -> None:
    """Point output_dir/best at `checkpoint` (a checkpoint-N folder in it): the run keeps it as its best
    (--load-best-model-at-end) and ends with its weights, so export.py and chat.py take it for the run folder.
    The main process writes it; the others return."""
    if world_of("mark_best")[0] == 0:
        write_atomic(Path(output_dir) / BEST_FILE, Path(checkpoint).name + "\n")


BASE_NOTE_KEY = "base_model_note"  # adapter_config.json: what base_model_name_or_path names, when it needs a word


def add_base_model_note(directory: Path, model) -> None:
    """Merge the model's `base_model_note` record (set by lora.name_base_model for a preset: its name and
    a line saying AutoPeft cannot fetch it) into directory/adapter_config.json."""
    record = getattr(model, BASE_NOTE_KEY, None)
    config_file = Path(directory) / "adapter_config.json"
    if record and config_file.is_file():
        config = json.loads(config_file.read_text())
        config.update(record)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
