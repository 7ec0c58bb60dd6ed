"""Training checkpoints: written atomically, loadable by Hugging Face alone, and enough to resume exactly.

    >>> from playbook.store.checkpoint import save_checkpoint, load_checkpoint
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
every rank, so none is left waiting in a collective.

A checkpoint written by N processes resumes on M: the weights, the optimizer state (its keys are
converted between positions and names) and the schedule carry over exactly. The random generators
are restored only when N == M (with N != M there is no rank-for-rank counterpart); what the data
position means across a change of N is for the caller to judge (training.py refuses it for a
--dataset, whose epochs are dealt out per process).
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
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_model_state_dict

from core.process import is_peft_model
from core.tensors import sum_and_norm
from playbook.store.files import fsync_directory, fsync_tree, write_atomic

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
# Several processes: agreeing on each step
# ------------------------------------------------------------------------------------------------
def _world(what: str) -> tuple[int, int]:
    """(rank, world size): of the process group when there is one, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    size = int((os.environ.get("WORLD_SIZE") or "").strip() or 1)  # unset, empty or blank: 1 (runtime/environment.py)
    if size > 1:
        raise RuntimeError(f"{what}: WORLD_SIZE is {size} but torch.distributed is not initialized; every process "
                           "must call torch.distributed.init_process_group before saving or loading a checkpoint")
    return 0, 1


_ERROR_TYPES = {e.__name__: e for e in (ValueError, TypeError, KeyError, RuntimeError, OSError, FileNotFoundError,
                                        NotADirectoryError)}


def _together(size: int, fn):
    """fn() on this rank. If it raised on any rank, every rank raises (its own error, or the first rank's
    error's type and message), so that no rank goes on to a collective the others never reach."""
    error, result = None, None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001  (passed on to the other ranks, then raised)
        error = err
    if size > 1:
        outcomes = [None] * size
        dist.all_gather_object(outcomes, None if error is None else (type(error).__name__, str(error)))  # a sync point
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
        if failed and error is None:
            rank, (kind, message) = failed[0]
            raise _ERROR_TYPES.get(kind, RuntimeError)(f"(on rank {rank}) {message}")
    if error is not None:
        raise error
    return result


def _from_rank0(size: int, fn):
    """fn() on rank 0 only; its value (or its error) reaches every rank."""
    value = _together(size, lambda: fn() if size == 1 or dist.get_rank() == 0 else None)
    if size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def _same_on_every_rank(size: int, what: str, **values) -> None:
    """Refuse on every rank when the ranks disagree on a value (a checkpoint step or directory)."""
    if size == 1:
        return
    seen = [None] * size
    dist.all_gather_object(seen, values)
    for rank, other in enumerate(seen):
        if other != seen[0]:
            raise ValueError(f"{what}: every process must pass the same arguments; rank 0 has {seen[0]}, "
                             f"rank {rank} has {other}")


def _is_sharded(p) -> bool:
    return type(p).__name__ == "DTensor"


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


def _set_rng_state(state: dict, where: Path) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            raise RuntimeError(f"{where}: saved with {len(saved)} CUDA devices visible, now "
                               f"{torch.cuda.device_count()}: the CUDA random state cannot be restored")
        torch.cuda.set_rng_state_all(saved)
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _as_tuples(value):
    """random.setstate needs tuples all the way down."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _is_peft(model) -> bool:
    return is_peft_model(model)


def _base_fingerprint(model) -> dict:
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
            if _is_sharded(p):
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


def _parameter_names(model, optimizer) -> list[str]:
    """The model's name of each of the optimizer's parameters, in the optimizer's order (the order
    of the integer keys of optimizer.state_dict())."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = sum(id(p) not in names for p in params)
    if missing:
        raise RuntimeError(f"{missing} of the optimizer's parameters are not parameters of the model")
    return [names[id(p)] for p in params]


def _optimizer_by_name(saved: dict, names: list[str]) -> dict:
    """optimizer.state_dict() (parameters numbered) -> the same keyed by parameter name, the form of
    get_optimizer_state_dict."""
    numbered = [i for group in saved["param_groups"] for i in group["params"]]
    if sorted(numbered) != list(range(len(names))):
        raise RuntimeError(f"the checkpoint's optimizer has {len(numbered)} parameters, this one {len(names)}")
    return {"state": {names[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}


def _optimizer_by_index(saved: dict, names: list[str]) -> dict:
    """The inverse of _optimizer_by_name: parameter names -> this optimizer's positions."""
    index = {name: i for i, name in enumerate(names)}
    unknown = {n for g in saved["param_groups"] for n in g["params"]} - index.keys()
    if unknown:
        raise RuntimeError(f"the checkpoint's optimizer holds {_describe_keys(unknown)}, not trained here")
    return {"state": {index[n]: s for n, s in saved["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]}


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
    rank, size = _world("save_checkpoint")
    output_dir, extra = _together(size, lambda: _check_save_arguments(output_dir, step, keep_last, extra))
    _same_on_every_rank(size, "save_checkpoint", output_dir=str(output_dir.absolute()), step=step)
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
        "base_fingerprint": _base_fingerprint(model) if adapter else None,
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
    _together(size, lambda: write() if rank == 0 else None)
    return final


def mark_best(output_dir, checkpoint) -> None:
    """Point output_dir/best at `checkpoint` (a checkpoint-N folder in it): the run keeps it as its best
    (--load-best-model-at-end) and ends with its weights, so export.py and chat.py take it for the run folder.
    The main process writes it; the others return."""
    if _world("mark_best")[0] == 0:
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


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
def resolve_checkpoint(path) -> Path:
    """A checkpoint directory, or an output_dir whose `latest` names one -> the checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (or output) directory")
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: is a file; give a checkpoint directory or the output directory")
    if (path / STATE_FILE).is_file():
        return path
    if path.name.startswith("checkpoint-") and any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no {STATE_FILE} (the optimizer, schedule and data position of this "
                                f"checkpoint are missing; its weights alone can be loaded as --model {path})")
    latest = path / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        target = path / name
        if name and target.is_dir() and not (target / STATE_FILE).is_file():
            raise FileNotFoundError(f"{target}: no {STATE_FILE} (the checkpoint that {latest} names is incomplete: "
                                    f"a save that did not finish, or a file deleted since)")
        if not name or not (target / STATE_FILE).is_file():
            raise FileNotFoundError(f"{latest} names {name!r}, which is not a checkpoint directory in {path}")
        return target
    raise FileNotFoundError(f"{path}: not a checkpoint (no {STATE_FILE}) nor an output directory (no {LATEST_FILE})")


def read_checkpoint_info(path) -> dict:
    """What a checkpoint holds, without loading it into a model: {"path": the checkpoint directory
    (`latest` followed), "step", "weights": "full" or "adapter", "scheduler": its state or None,
    "extra": the saved `extra`}. The file is memory-mapped: the optimizer state is not read. Raises
    the errors of resolve_checkpoint and of a corrupt trainer_state.pt, on every rank."""
    _, size = _world("read_checkpoint_info")
    ckpt = _from_rank0(size, lambda: resolve_checkpoint(path))
    state = _together(size, lambda: _read_state(ckpt, mmap=True))
    return {"path": ckpt, "step": state["step"], "weights": state["weights"], "scheduler": state["scheduler"],
            "extra": state["extra"]}


def _read_state(ckpt: Path, mmap: bool = False) -> dict:
    """trainer_state.pt, in the current format (a format-1 file, written by one process, is converted).
    mmap: map the file instead of reading it (the optimizer state is then read only where it is used)."""
    file = ckpt / STATE_FILE
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, wrong format, disallowed type...
        raise RuntimeError(f"{file}: cannot be read ({str(err).splitlines()[0][:200]}); the checkpoint is "
                           "corrupt or not one of these checkpoints") from None
    if not isinstance(state, dict) or state.get("format") not in (1, FORMAT):
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RuntimeError(f"{file}: not a trainer state of format 1 or {FORMAT} (found {got!r})")
    if state["format"] == 1:
        state = {**state, "rng": [state["rng"]], "optimizer_keys": "index" if state["optimizer"] is not None else None}
    return state


def _read_safetensors(files: list[Path]) -> dict:
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except Exception as err:  # SafetensorError (corrupt header, truncated), OSError
            raise RuntimeError(f"{f}: cannot be read ({str(err).splitlines()[0][:200]})") from None
    return tensors


def _weight_files(ckpt: Path) -> list[Path]:
    single, index = ckpt / "model.safetensors", ckpt / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as err:
            raise RuntimeError(f"{index}: not a safetensors index ({err})") from None
        return [ckpt / s for s in shards]
    raise FileNotFoundError(f"{ckpt}: no model.safetensors (nor model.safetensors.index.json)")


def _describe_keys(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _check_tensors(where, saved: dict, expected: dict) -> None:
    """Same names, shapes and dtypes, or one clear error naming what differs."""
    missing, unexpected = expected.keys() - saved.keys(), saved.keys() - expected.keys()
    if missing or unexpected:
        parts = ([f"missing {_describe_keys(missing)}"] if missing else []) + (
            [f"unexpected {_describe_keys(unexpected)}"] if unexpected else [])
        raise RuntimeError(f"{where} does not match the model: " + "; ".join(parts))
    for name, t in saved.items():
        ref = expected[name]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise RuntimeError(f"{where}: {name} is {tuple(t.shape)} {t.dtype} in the checkpoint, "
                               f"{tuple(ref.shape)} {ref.dtype} in the model")


def _read_full_weights(ckpt: Path, model) -> dict:
    """The checkpoint's weights, checked against the model's names, shapes and dtypes (those of the
    whole parameters when the model is sharded)."""
    files = _weight_files(ckpt)
    saved = _read_safetensors(files)
    expected = model.state_dict()
    # A tied weight (lm_head sharing the embedding) is saved once, under one of its names.
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        present = [n for n in names if n in saved]
        for n in names:
            if present and n not in saved:
                saved[n] = saved[present[0]]
    _check_tensors(", ".join(str(f) for f in files), saved, expected)
    return saved


def _load_full_weights(ckpt: Path, model, rank: int, size: int) -> None:
    if size == 1:
        model.load_state_dict(_read_full_weights(ckpt, model), strict=True)
        return

    saved = _together(size, lambda: _read_full_weights(ckpt, model) if rank == 0 else {})
    # rank 0 sends each tensor in turn; every rank keeps its own shard
    set_model_state_dict(model, saved, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _read_adapter(ckpt: Path, model, state: dict, fingerprint: dict) -> dict:
    """The checkpoint's adapter tensors (peft's names), after checking the LoRA settings, the names,
    shapes and dtypes, and that the frozen base (its fingerprint) is the one the adapter was trained on."""
    from peft import get_peft_model_state_dict

    config_file, weights = ckpt / "adapter_config.json", ckpt / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{ckpt}: a LoRA checkpoint without adapter_config.json / adapter_model.safetensors")
    try:
        saved_cfg = json.loads(config_file.read_text())
    except ValueError as err:
        raise RuntimeError(f"{config_file}: not JSON ({err})") from None
    ours = model.peft_config[model.active_adapter]
    for key in ("r", "lora_alpha"):
        if saved_cfg.get(key) != getattr(ours, key):
            raise RuntimeError(f"{config_file}: {key} = {saved_cfg.get(key)!r}, this model's LoRA has "
                               f"{getattr(ours, key)!r}; resume with the same LoRA settings")
    if set(saved_cfg.get("target_modules") or ()) != set(ours.target_modules or ()):
        raise RuntimeError(f"{config_file}: targets {sorted(saved_cfg.get('target_modules') or ())}, this model's "
                           f"LoRA has {sorted(ours.target_modules or ())}; resume with the same LoRA targets")
    saved = _read_safetensors([weights])
    _check_tensors(str(weights), saved, get_peft_model_state_dict(model))
    recorded = state.get("base_fingerprint") or {}
    if recorded.keys() != fingerprint.keys():
        raise RuntimeError(f"{ckpt}: the frozen base parameters differ from the ones this adapter was trained on "
                           f"({_describe_keys(recorded.keys() ^ fingerprint.keys())})")
    for name, pair in recorded.items():
        # Same weights give the same float64 sums up to the order of summation (another device,
        # thread count or number of shards): ~1e-12 relative at most; any other base differs in
        # the 3rd digit or earlier.
        if any(abs(a - b) > 1e-9 * max(1.0, abs(a), abs(b)) for a, b in zip(pair, fingerprint[name])):
            raise RuntimeError(f"{ckpt}: the base weight {name} is not the one this adapter was trained on; "
                               "load the same base model before resuming")
    return saved


def _load_adapter(ckpt: Path, model, state: dict, size: int) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    fingerprint = _base_fingerprint(model)  # a collective when sharded: before any rank can stop on an error
    # An adapter is small (tens of MB for an 8B model): every rank reads and checks it.
    saved = _together(size, lambda: _read_adapter(ckpt, model, state, fingerprint))
    if size > 1:
        from torch.distributed.tensor import distribute_tensor

        # Each whole tensor placed as the model's sharded parameter is (every rank keeps its shard),
        # then loaded by peft's own function, which puts back the adapter's name in the keys.
        placed = get_peft_model_state_dict(model)
        saved = {k: distribute_tensor(v.to(placed[k].device), placed[k].device_mesh, placed[k].placements)
                 if _is_sharded(placed[k]) else v for k, v in saved.items()}
    result = set_peft_model_state_dict(model, saved)
    if result.unexpected_keys:
        raise RuntimeError(f"{ckpt}/adapter_model.safetensors: peft did not place "
                           f"{_describe_keys(result.unexpected_keys)}")


def _load_optimizer(ckpt: Path, model, optimizer, state: dict, rank: int, size: int) -> None:
    saved, keys = state["optimizer"], state["optimizer_keys"]
    try:
        if size == 1 or not saved["state"]:
            # torch's own loader: positions; an optimizer that never stepped has no tensors to shard
            if keys == "name":
                saved = _optimizer_by_index(saved, _parameter_names(model, optimizer))
            optimizer.load_state_dict(saved)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        def checked():  # names and shapes, on every rank, so that the broadcast below cannot fail half-way
            by_name = saved if keys == "name" else _optimizer_by_name(saved, _parameter_names(model, optimizer))
            params = dict(model.named_parameters())
            ours = _optimizer_by_name(optimizer.state_dict(), _parameter_names(model, optimizer))
            if [g["params"] for g in by_name["param_groups"]] != [g["params"] for g in ours["param_groups"]]:
                raise ValueError("the parameter groups hold other parameters")
            for name, s in by_name["state"].items():
                for key, t in s.items():
                    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != params[name].shape:
                        raise ValueError(f"{name} {key} is {tuple(t.shape)}, the parameter {tuple(params[name].shape)}")
            return by_name

        by_name = _together(size, checked)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, optimizer, by_name if rank == 0 else {}, options=options)
    except (ValueError, KeyError, RuntimeError) as err:
        raise RuntimeError(f"{ckpt}: the optimizer state does not fit this optimizer "
                           f"({str(err).splitlines()[0][:200]})") from None


def load_checkpoint(path, model, optimizer=None, scheduler=None) -> dict:
    """Restore a checkpoint written by save_checkpoint into model, optimizer and scheduler (those not
    None) and restore the random number generators. path: a checkpoint directory, or the output
    directory (its `latest` is followed). Under torchrun every rank calls it with the same arguments
    (the model sharded by FSDP2 or not). Returns the saved `extra` plus "step"."""
    rank, size = _world("load_checkpoint")
    ckpt = _from_rank0(size, lambda: resolve_checkpoint(path))  # every rank follows the `latest` rank 0 read
    state = _together(size, lambda: _read_state(ckpt, mmap=size > 1))
    adapter = _is_peft(model)
    if (state["weights"] == "adapter") != adapter:
        have = "a LoRA adapter" if state["weights"] == "adapter" else "full weights"
        need = "a LoRA (peft) model" if adapter else "a model without adapters"
        raise RuntimeError(f"{ckpt} holds {have}, and the model is {need}: resume with the same --lora-r settings")
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None and state[name] is None:
            raise RuntimeError(f"{ckpt}: saved without {name} state, and a {name} was given to restore")
    if adapter:
        _load_adapter(ckpt, model, state, size)
    else:
        _load_full_weights(ckpt, model, rank, size)
    if optimizer is not None:
        _load_optimizer(ckpt, model, optimizer, state, rank, size)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) == size:  # another number of processes: no rank-for-rank counterpart
        _set_rng_state(state["rng"][rank], ckpt)
    return {**state["extra"], "step": state["step"]}
