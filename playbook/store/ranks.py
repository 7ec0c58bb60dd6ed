"""Several processes saving or loading one checkpoint: each step agreed on by every rank.

An error on one rank (a bad path, a corrupt file, a full disk) is raised on every rank, so none is left
waiting in a collective (playbook/store/checkpoint.py writes, playbook/store/checkpoint_load.py reads).
"""

from __future__ import annotations

import os

import torch.distributed as dist


def world_of(what: str) -> tuple[int, int]:
    """(rank, world size): of the process group when there is one, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    size = int((os.environ.get("WORLD_SIZE") or "").strip() or 1)  # unset, empty or blank: 1 (runtime/environment.py)
    if size > 1:
        raise RuntimeError(f"{what}: WORLD_SIZE is {size} but torch.distributed is not initialized; every process "
                           "must call torch.distributed.init_process_group before saving or loading a checkpoint")
    return 0, 1


ERROR_TYPES = {e.__name__: e for e in (ValueError, TypeError, KeyError, RuntimeError, OSError, FileNotFoundError,
                                        NotADirectoryError)}


def together(size: int, fn):
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
            raise ERROR_TYPES.get(kind, RuntimeError)(f"(on rank {rank}) {message}")
    if error is not None:
        raise error
    return result


def from_rank0(size: int, fn):
    """fn() on rank 0 only; its value (or its error) reaches every rank."""
    value = together(size, lambda: fn() if size == 1 or dist.get_rank() == 0 else None)
    if size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def same_on_every_rank(size: int, what: str, **values) -> None:
    """Refuse on every rank when the ranks disagree on a value (a checkpoint step or directory)."""
    if size == 1:
        return
    seen = [None] * size
    dist.all_gather_object(seen, values)
    for rank, other in enumerate(seen):
        if other != seen[0]:
            raise ValueError(f"{what}: every process must pass the same arguments; rank 0 has {seen[0]}, "
                             f"rank {rank} has {other}")


def is_sharded(p) -> bool:
    return type(p).__name__ == "DTensor"
