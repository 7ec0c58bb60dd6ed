"""Reading a training checkpoint back (playbook/store/checkpoint.py writes it, and describes its layout):
find it (an output folder's `latest` followed), say what it holds without loading it, and load the weights
or the adapter, the optimizer state, the schedule and the random generators, every step agreed on by every
rank (playbook/store/ranks.py).

    >>> from playbook.store.checkpoint_load import load_checkpoint
    >>> load_checkpoint("out", model, optimizer, scheduler)     # follows out/latest
    {'micro_batch': 400, 'step': 100}
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from core.process import is_peft_model
from playbook.store.checkpoint import FORMAT, LATEST_FILE, STATE_FILE, base_fingerprint
from playbook.store.ranks import from_rank0, is_sharded, together, world_of


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
    _, size = world_of("read_checkpoint_info")
    ckpt = from_rank0(size, lambda: resolve_checkpoint(path))
    state = together(size, lambda: _read_state(ckpt, mmap=True))
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

    saved = together(size, lambda: _read_full_weights(ckpt, model) if rank == 0 else {})
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

    fingerprint = base_fingerprint(model)  # a collective when sharded: before any rank can stop on an error
    # An adapter is small (tens of MB for an 8B model): every rank reads and checks it.
    saved = together(size, lambda: _read_adapter(ckpt, model, state, fingerprint))
    if size > 1:
        from torch.distributed.tensor import distribute_tensor

        # Each whole tensor placed as the model's sharded parameter is (every rank keeps its shard),
        # then loaded by peft's own function, which puts back the adapter's name in the keys.
        placed = get_peft_model_state_dict(model)
        saved = {k: distribute_tensor(v.to(placed[k].device), placed[k].device_mesh, placed[k].placements)
                 if is_sharded(placed[k]) else v for k, v in saved.items()}
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

        by_name = together(size, checked)
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
    rank, size = world_of("load_checkpoint")
    ckpt = from_rank0(size, lambda: resolve_checkpoint(path))  # every rank follows the `latest` rank 0 read
    state = together(size, lambda: _read_state(ckpt, mmap=size > 1))
    adapter = is_peft_model(model)
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


# ------------------------------------------------------------------------------------------------
# The random generators and the optimizer's keys, as saved
# ------------------------------------------------------------------------------------------------
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
