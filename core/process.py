"""The process: its rank under torchrun (which sets RANK and WORLD_SIZE), and log lines that only rank 0 prints."""
from __future__ import annotations

import os
import sys
import time

LAST_LINE = [0.0]  # time.monotonic() of the last line log() printed (a silent stretch: playbook/runtime/time_left.py)


def _whole(name: str, default: int) -> int:
    """torchrun's variable as a number; unset, empty or blank: the default (playbook/runtime/environment.py checks
    the value as each script starts)."""
    return int((os.environ.get(name) or "").strip() or default)


def world() -> tuple[int, int]:
    return _whole("RANK", 0), _whole("WORLD_SIZE", 1)


def is_main() -> bool:
    return world()[0] == 0


def log(*a, **k):
    if is_main():
        print(*a, **k, flush=True)
        LAST_LINE[0] = time.monotonic()


def is_peft_model(model) -> bool:
    """Whether `model` is a peft model (peft is not imported to find out: no peft loaded, no peft model)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
