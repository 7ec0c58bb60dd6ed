"""The free memory a plan is held to: the GPU's, the host's, or the stand-in of PLAYBOOK_FREE_MEMORY_GB, and how
the messages say it.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path

import torch

from playbook.plan.inputs import GB
from playbook.runtime import common, environment

FREE_MEMORY_ENV = environment.FREE_MEMORY_GB  # a stand-in for the free memory (tests, or planning for another GPU)
GPU_FREE = "free on "  # free_memory's `where` on a GPU: "free on <its name>"
HOST_AVAILABLE = "available on the host (MemAvailable)"
CGROUP_LIMIT = "this process's memory limit (cgroup)"
PROCESS_LIMIT = "this process's memory limit"


def free_memory(device) -> tuple[float, str]:
    """(bytes free, where): the GPU's free memory (torch.cuda.mem_get_info), the host's MemAvailable on a
    CPU, or the stand-in of PLAYBOOK_FREE_MEMORY_GB (a value it cannot take: environment.BadValue, a ValueError
    holding the line that says so). `where` names the figure's source, as the plan's table shows it (said_free:
    as a sentence)."""
    stand_in = environment.free_memory_gb()
    if stand_in is not None:
        return stand_in * GB, f"{FREE_MEMORY_ENV}={shlex.quote(os.environ[FREE_MEMORY_ENV].strip())}"
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"{GPU_FREE}{torch.cuda.get_device_name(device)}"
    limit = common.host_memory_limit()  # a container's or job's cgroup limit, where lower than the RAM
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = float(line.split()[1]) * 1024
                if limit is not None and limit < available:
                    return float(limit), CGROUP_LIMIT
                return available, HOST_AVAILABLE
    except OSError:
        pass
    if limit is not None:
        return float(limit), PROCESS_LIMIT
    return math.inf, "on the host (unknown)"


def free_for_plan(device) -> tuple[float, str]:
    """free_memory for the plan's own lines: a stand-in it cannot take ends the run with that line, exit code 2."""
    try:
        return free_memory(device)
    except environment.BadValue as err:
        raise environment.refused(err) from None


def said_free(free: float, where: str) -> str:
    """The free memory in a sentence that names where the figure comes from (free_memory's `where`):
    "PLAYBOOK_FREE_MEMORY_GB=2.4 says this machine has 2.4 GB free", "the GPU has 79.1 GB free (NVIDIA H100 ...)"."""
    amount = f"{gb_text(free)} GB"
    if where.startswith(f"{FREE_MEMORY_ENV}="):
        return f"{where} says this machine has {amount} free"
    if where.startswith(GPU_FREE):
        return f"the GPU has {amount} free ({where[len(GPU_FREE):]})"
    if where == HOST_AVAILABLE:
        return f"this machine has {amount} available (MemAvailable)"
    if where in (CGROUP_LIMIT, PROCESS_LIMIT):
        return f"this process may use {amount} ({where.replace('this process', 'its')})"
    return f"{amount} {where}"


def gb_text(nbytes: float) -> str:
    """Bytes as GB in the messages: one decimal from 1 GB up, two significant digits below (0.45, 0.0034), so
    that a small plan or stand-in does not read as 0.0."""
    value = nbytes / GB
    return f"{value:,.1f}" if value >= 0.95 or value == 0 else f"{value:.2g}"
