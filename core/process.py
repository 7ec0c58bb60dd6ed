"""The process: its rank under torchrun (which sets RANK and WORLD_SIZE), and log lines that only rank 0 prints."""
from __future__ import annotations

import os
import sys
import time

LAST_LINE = [0.0]  # time.monotonic() of the last line log() printed (a silent stretch: playbook/runtime/time_left.py)


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


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
