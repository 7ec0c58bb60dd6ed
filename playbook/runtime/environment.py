"""The environment variables the scripts read, each read and checked here as a command-line flag is checked.

    PLAYBOOK_FREE_MEMORY_GB=80   the free memory the memory plan checks a run against, in GB (10^9 bytes):
                                 a stand-in for the GPU's (to plan for another GPU) or, without one, the host's.
                                 A positive, finite number; the unit may be written out (80GB, 80 GB)
    PLAYBOOK_MODEL_CACHE=DIR     where converted models are kept (playbook/model/pretrained.py): a folder, made where
                                 missing; `~` is expanded
    PLAYBOOK_RESULTS_DIR=DIR     where runs write results/<tag>.json, metrics, plots and traces instead of the
                                 repository's results/: a folder, made where missing; `~` is expanded
    TESTKIT_REPORT=FILE          a test file run as a script writes its full report there (testkit/__init__.py):
                                 a file in a folder that exists, written over
    CPU_DEMO=1                   run the CPU demo even where a GPU is present but unusable (playbook/runtime/setup_check.py);
                                 1 or 0
    WORLD_SIZE, RANK, LOCAL_RANK torchrun's: the number of processes (1 or more) and this one's place among them
                                 (0 or more), whole numbers

Unset, empty or blank: the default. A bad value stops the script as a bad flag does: one line naming the
variable, its value and what it takes, exit code 2. `check()` reads every one of them as each script starts
(playbook.startup.start), before anything else is done. Each reader below checks its variable again where it is
read (a test may set one after the start-up) and raises BadValue, a ValueError holding that line, which its
caller turns into the line and exit code 2 (`refused`).

This module imports no torch (the start-up runs before torch is installed).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from pathlib import Path

FREE_MEMORY_GB = "PLAYBOOK_FREE_MEMORY_GB"
MODEL_CACHE = "PLAYBOOK_MODEL_CACHE"
RESULTS_DIR = "PLAYBOOK_RESULTS_DIR"
REPORT_FILE = "TESTKIT_REPORT"
CPU_DEMO = "CPU_DEMO"
TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # set by torchrun for each process it starts

_GB_UNIT = re.compile(r"\s*gb$", re.IGNORECASE)  # PLAYBOOK_FREE_MEMORY_GB=80GB: the unit its name gives, written out


class BadValue(ValueError):
    """A value a variable cannot take; `line`: the one line that says so (the variable, its value as a shell would
    write it, what is wrong with it and what it takes)."""

    def __init__(self, name: str, value: str, problem: str, takes: str):
        self.line = f"{name}={shlex.quote(value)} {problem}: {takes}"
        super().__init__(self.line)


def refused(err: BadValue) -> SystemExit:
    """The line of a bad value on stderr, and the SystemExit with code 2 for the caller to raise, as a bad flag
    gets."""
    print(f"error: {err.line}", file=sys.stderr, flush=True)
    return SystemExit(2)


def _raw(name: str) -> str | None:
    """The variable's value; None where it is unset, empty or blank (its default then)."""
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def free_memory_gb() -> float | None:
    """PLAYBOOK_FREE_MEMORY_GB as a number of GB; None where unset."""
    raw = _raw(FREE_MEMORY_GB)
    if raw is None:
        return None
    takes = (f"it takes the free memory the memory plan checks a run against, a positive number of GB (10^9 bytes), "
             f"e.g. {FREE_MEMORY_GB}=80 or 80GB; unset it to plan for this machine's own free memory")
    try:
        gb = float(_GB_UNIT.sub("", raw.strip()))
    except ValueError:
        raise BadValue(FREE_MEMORY_GB, raw, "is not a number of GB", takes) from None
    if not math.isfinite(gb):
        raise BadValue(FREE_MEMORY_GB, raw, "is not a finite number", takes)
    if gb <= 0:
        raise BadValue(FREE_MEMORY_GB, raw, "is not above 0", takes)
    return gb


def _kind(path: Path) -> str:
    """"folder", "file" (anything else that is there), "missing", or why the path cannot be looked at."""
    try:
        return "folder" if path.is_dir() else "file" if path.exists() else "missing"
    except OSError as err:  # a name too long for the file system, a loop of links
        return f"cannot be used ({err.strerror or err})"


def _expand_home(name: str, raw: str, takes: str) -> Path:
    """`raw` with a leading `~` or `~user` expanded; a user this machine does not know (or a home it cannot find) is
    a BadValue, not the RuntimeError of Path.expanduser."""
    try:
        return Path(raw).expanduser()
    except RuntimeError:  # "Could not determine home directory": no such user, or no HOME
        user = raw.strip().split("/", 1)[0]
        raise BadValue(name, raw, f"starts with {user}, a home folder this machine does not know", takes) from None


def _folder(name: str, takes: str) -> Path | None:
    """A variable naming a folder (`~` expanded, made where missing by whoever writes there); None where unset."""
    raw = _raw(name)
    if raw is None:
        return None
    path = _expand_home(name, raw, takes)
    kind = _kind(path)
    if kind not in ("folder", "missing"):
        raise BadValue(name, raw, "is a file, not a folder" if kind == "file" else kind, takes)
    return path


def model_cache() -> Path | None:
    """PLAYBOOK_MODEL_CACHE as a folder; None where unset."""
    return _folder(MODEL_CACHE, "it takes the folder where converted models are kept (made where missing); unset it "
                                "for the default, $XDG_CACHE_HOME/kernel-playbook/models or ~/.cache/kernel-playbook/models")


def results_dir() -> Path | None:
    """PLAYBOOK_RESULTS_DIR as a folder; None where unset (the repository's results/)."""
    return _folder(RESULTS_DIR, "it takes the folder where runs write their summaries, metrics, plots and traces "
                                "(made where missing); unset it for the repository's results/")


def report_file() -> Path | None:
    """TESTKIT_REPORT as the file a test file run as a script writes its full report to; None where unset."""
    raw = _raw(REPORT_FILE)
    if raw is None:
        return None
    takes = ("it takes the file a test file run as a script writes its full report to (written over), in a folder "
             "that exists; unset it for the whole report on the screen")
    path = _expand_home(REPORT_FILE, raw, takes)
    kind, folder = _kind(path), _kind(path.parent)
    if kind == "folder":
        raise BadValue(REPORT_FILE, raw, "is a folder", takes)
    if folder != "folder":
        raise BadValue(REPORT_FILE, raw, f"names a file in {path.parent}, " + (
            "a folder that does not exist" if folder == "missing" else "which is not a folder"), takes)
    if kind not in ("file", "missing"):
        raise BadValue(REPORT_FILE, raw, kind, takes)
    return path


def cpu_demo() -> bool:
    """CPU_DEMO=1: the CPU demo even where a GPU is present but unusable; 0 or unset: not."""
    raw = _raw(CPU_DEMO)
    if raw is None or raw.strip() == "0":
        return False
    if raw.strip() == "1":
        return True
    raise BadValue(CPU_DEMO, raw, "is neither 1 nor 0",
                  "it takes 1 (run the CPU demo even where a GPU is present but cannot be used) or 0 (the default)")


_WHOLE_NUMBER = re.compile(r"[0-9]+")  # ASCII digits only: "¹" and "²" pass str.isdigit() and then fail int()


def torchrun_value(name: str) -> int:
    """WORLD_SIZE, RANK or LOCAL_RANK, as torchrun sets them: a whole number (WORLD_SIZE 1 or more). Unset, empty
    or blank: the default, 1 process (WORLD_SIZE) or place 0 (RANK, LOCAL_RANK)."""
    low = 1 if name == "WORLD_SIZE" else 0
    raw = _raw(name)
    if raw is None:
        return low
    if not _WHOLE_NUMBER.fullmatch(raw.strip()) or int(raw) < low:
        what = "the number of processes" if name == "WORLD_SIZE" else "this process's place among them, from 0"
        raise BadValue(name, raw, f"is not a whole number of {low} or more",
                      f"torchrun sets it to {what}; unset WORLD_SIZE, RANK and LOCAL_RANK to run one process "
                      "without torchrun")
    return int(raw)


def unset_blank_torchrun() -> None:
    """Remove WORLD_SIZE, RANK or LOCAL_RANK where empty or blank: they mean the default, as unset does, and the
    libraries that read them as well (transformers' TrainingArguments, accelerate, torch.distributed) take only a
    number or nothing (int("") fails there). The start-up calls this after check()."""
    for name in TORCHRUN:
        if name in os.environ and _raw(name) is None:
            del os.environ[name]


def check() -> None:
    """Every variable above, read and checked once (the start-up calls this first): a bad value's line, and
    SystemExit with exit code 2."""
    try:
        free_memory_gb()
        model_cache()
        results_dir()
        report_file()
        cpu_demo()
        for name in TORCHRUN:
            torchrun_value(name)
    except BadValue as err:
        raise refused(err) from None
