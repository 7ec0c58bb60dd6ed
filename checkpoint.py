"""Training checkpoints: written atomically, loadable by Hugging Face alone, and enough to resume exactly.

    >>> from checkpoint import save_checkpoint, load_checkpoint
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
                                      config, losses, ...), RNG states (python, torch CPU, CUDA, numpy),
                                      and for an adapter a fingerprint of the frozen base weights

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

Several processes (torchrun, FSDP2): not supported; save_checkpoint and load_checkpoint refuse a
world size above 1 with a clear error. (A single-process checkpoint cannot be written from sharded
parameters without gathering them; that path is not implemented.)
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

STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest"
PREFIX = "checkpoint-"
FORMAT = 1  # trainer_state.pt layout version
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(checkpoint-\d+)\.(tmp|old)-[0-9a-f-]+$")


# ------------------------------------------------------------------------------------------------
# Atomic files and directories
# ------------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under root, then every directory (so their entries are on disk too)."""
    for folder, dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _check_directory_path(path: Path, what: str) -> None:
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise NotADirectoryError(f"{what} {path}: {p} is an existing file, not a directory")


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file through a temporary sibling, fsync it, and os.replace it into place."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
        _fsync_tree(tmp)
        if final.exists():
            aside = final.parent / f".{final.name}.old-{token}"
            os.replace(final, aside)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(aside, final)
                raise
            _fsync_dir(final.parent)
            shutil.rmtree(aside)
        else:
            os.replace(tmp, final)
            _fsync_dir(final.parent)
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
def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _refuse_distributed(what: str) -> None:
    size = _world_size()
    if size > 1:
        raise RuntimeError(f"{what}: checkpoints of a run over {size} processes (FSDP2) are not supported; "
                           "train on one process to save and resume checkpoints")


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


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
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
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _as_tuples(value):
    """random.setstate needs tuples all the way down."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _is_peft(model) -> bool:
    from lora import is_peft_model

    return is_peft_model(model)


def _base_fingerprint(model) -> dict:
    """name -> (float64 sum, float64 L2 norm) of every frozen parameter: tells the base a LoRA run
    started from apart from any other, without storing it. No copy of a weight is made."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                out[name] = (torch.sum(p, dtype=torch.float64).item(),
                             torch.linalg.vector_norm(p, dtype=torch.float64).item())
    return out


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------
def save_checkpoint(output_dir, step: int, model, tokenizer, optimizer, scheduler, extra: dict | None,
                    keep_last: int | None = None) -> Path:
    """Write output_dir/checkpoint-<step>/ atomically, point output_dir/latest at it, and (keep_last)
    delete all but the newest `keep_last` checkpoints by step (never the one just written).

    model: a Hugging Face model (weights saved) or a peft model (adapter saved). tokenizer,
    optimizer, scheduler: saved when not None (optimizer and scheduler through state_dict()).
    extra: plain values to get back from load_checkpoint (data position, config, losses...).
    Returns the checkpoint directory.
    """
    _refuse_distributed("save_checkpoint")
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
    output_dir.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(output_dir)

    adapter = _is_peft(model)
    state = {
        "format": FORMAT,
        "step": step,
        "weights": "adapter" if adapter else "full",
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra,
        "rng": _rng_state(),
        "base_fingerprint": _base_fingerprint(model) if adapter else None,
    }
    final = output_dir / f"{PREFIX}{step}"
    with atomic_directory(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(state, tmp / STATE_FILE)
    write_text_atomic(output_dir / LATEST_FILE, final.name + "\n")
    if keep_last is not None:
        others = [p for _, p in list_checkpoints(output_dir) if p.name != final.name]
        for old in others[: max(0, len(others) - (keep_last - 1))]:
            shutil.rmtree(old)
    return final


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
    latest = path / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        target = path / name
        if not name or not (target / STATE_FILE).is_file():
            raise FileNotFoundError(f"{latest} names {name!r}, which is not a checkpoint directory in {path}")
        return target
    raise FileNotFoundError(f"{path}: not a checkpoint (no {STATE_FILE}) nor an output directory (no {LATEST_FILE})")


def _read_state(ckpt: Path) -> dict:
    file = ckpt / STATE_FILE
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, wrong format, disallowed type...
        raise RuntimeError(f"{file}: cannot be read ({str(err).splitlines()[0][:200]}); the checkpoint is "
                           "corrupt or not one of these checkpoints") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RuntimeError(f"{file}: not a trainer state of format {FORMAT} (found {got!r})")
    return state


def _read_safetensors(files: list[Path]) -> dict:
    from safetensors.torch import load_file

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


def _load_full_weights(ckpt: Path, model) -> None:
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
    model.load_state_dict(saved, strict=True)


def _load_adapter(ckpt: Path, model, state: dict) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

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
    fingerprint = state.get("base_fingerprint") or {}
    now = _base_fingerprint(model)
    if fingerprint.keys() != now.keys():
        raise RuntimeError(f"{ckpt}: the frozen base parameters differ from the ones this adapter was trained on "
                           f"({_describe_keys(fingerprint.keys() ^ now.keys())})")
    for name, pair in fingerprint.items():
        # Same weights give the same float64 sums up to the order of summation (another device or
        # thread count): ~1e-12 relative at most; any other base differs in the 3rd digit or earlier.
        if any(abs(a - b) > 1e-9 * max(1.0, abs(a), abs(b)) for a, b in zip(pair, now[name])):
            raise RuntimeError(f"{ckpt}: the base weight {name} is not the one this adapter was trained on; "
                               "load the same base model before resuming")
    result = set_peft_model_state_dict(model, saved)
    if result.unexpected_keys:
        raise RuntimeError(f"{weights}: peft did not place {_describe_keys(result.unexpected_keys)}")


def load_checkpoint(path, model, optimizer=None, scheduler=None) -> dict:
    """Restore a checkpoint written by save_checkpoint into model, optimizer and scheduler (those not
    None) and restore the random number generators. path: a checkpoint directory, or the output
    directory (its `latest` is followed). Returns the saved `extra` plus "step"."""
    _refuse_distributed("load_checkpoint")
    ckpt = resolve_checkpoint(path)
    state = _read_state(ckpt)
    adapter = _is_peft(model)
    if (state["weights"] == "adapter") != adapter:
        have = "a LoRA adapter" if state["weights"] == "adapter" else "full weights"
        need = "a LoRA (peft) model" if adapter else "a model without adapters"
        raise RuntimeError(f"{ckpt} holds {have}, and the model is {need}: resume with the same --lora-r settings")
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None and state[name] is None:
            raise RuntimeError(f"{ckpt}: saved without {name} state, and a {name} was given to restore")
    if adapter:
        _load_adapter(ckpt, model, state)
    else:
        _load_full_weights(ckpt, model)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise RuntimeError(f"{ckpt}: the optimizer state does not fit this optimizer "
                               f"({str(err).splitlines()[0][:200]})") from None
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"], ckpt)
    return {**state["extra"], "step": state["step"]}
