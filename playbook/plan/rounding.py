"""The rounding of a run that left --optimizer-rounding open: chosen from the plan and the free memory, and
agreed between the processes of a torchrun job.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from core.process import log
from playbook.plan.estimate import combine
from playbook.plan.free_memory import FREE_MEMORY_ENV, free_for_plan, gb_text, said_free
from playbook.plan.inputs import Plan
from playbook.plan.runs import run_plans
from playbook.sections import RunConfig


KAHAN_BYTES = 2  # per trained weight: the Kahan compensation, in bf16 (adamw_kernel.py)


def choose_rounding(cfg: RunConfig) -> tuple[str, str | None]:
    """The rounding of a run that left --optimizer-rounding open (config.default_rounding: a full fine-tune
    whose bf16 weights the Triton AdamW updates), and the log line that says why:
      kahan       where the plan with its buffer (2 bytes per weight) fits the free memory: the GPU's, or the
                  stand-in of PLAYBOOK_FREE_MEMORY_GB. On SmolLM2 it closed 97-100 % of the gap between rounding
                  to nearest and fp32 master weights, in half the memory of the master (docs/quality.md);
      stochastic  where it does not fit, and where the plan cannot say: no GPU (and no stand-in),
                  --ignore-memory-plan (the run is told not to go by the plan), a model whose config comes
                  with its weights. It needs no memory, and closed 83 % of that gap at lr 1e-5 (at 2e-5 it
                  ended worse than nearest: docs/quality.md);
      nearest     (no line) where the weights turn out fp32 (a real model on a CPU without bf16 matmuls):
                  rounding to bf16 loses nothing there.
    Under torchrun each process judges its own GPU's free memory; agree_on_rounding then gives every process the
    choice that fits on all of them."""
    free, where_free = (math.inf, "") if cfg.output.ignore_memory_plan else free_for_plan(cfg.run.device)
    return rounding_for(cfg, free, where_free)


def rounding_for(cfg: RunConfig, free: float, where_free: str) -> tuple[str, str | None]:
    """choose_rounding for the free memory `free` (`where_free`: where that figure comes from)."""
    plans = run_plans(replace(cfg, training=replace(cfg.training, optimizer_rounding="kahan")))
    if plans and plans[-1][2].weight_bytes != 2:
        return "nearest", None
    choose = "--optimizer-rounding kahan or nearest to choose"
    if not plans:
        return "stochastic", (f"Optimizer rounding: stochastic (no memory plan before {cfg.model.model} is loaded, so the "
                              f"Kahan buffer, {KAHAN_BYTES} bytes per weight, cannot be checked against the free "
                              f"memory; stochastic rounding needs none; {choose})")
    plan = combine(plans)
    buffer = plan_part(plan, "optimizer states") - plan_part(
        combine(run_plans(replace(cfg, training=replace(cfg.training,
                                                        optimizer_rounding="stochastic")))), "optimizer states")
    if cfg.output.ignore_memory_plan:
        return "stochastic", (f"Optimizer rounding: stochastic (--ignore-memory-plan: the run does not go by the "
                              f"plan, so it takes the rounding that needs no memory; kahan would add "
                              f"{gb_text(buffer)} GB; {choose})")
    if not cfg.on_gpu and not where_free.startswith(f"{FREE_MEMORY_ENV}="):
        return "stochastic", (f"Optimizer rounding: stochastic (no GPU: kahan is chosen where the memory plan fits "
                              f"it in a GPU's free memory, or in {FREE_MEMORY_ENV}; stochastic rounding needs no "
                              f"memory; {choose})")
    if plan.peak <= free:
        return "kahan", (f"Optimizer rounding: kahan (fits: the plan's peak with its {gb_text(buffer)} GB buffer is "
                         f"{gb_text(plan.peak)} GB, and {said_free(free, where_free)}; stochastic where it does not "
                         f"fit; --optimizer-rounding nearest to turn off)")
    return "stochastic", (f"Optimizer rounding: stochastic (kahan does not fit: the plan's peak with its "
                          f"{gb_text(buffer)} GB buffer would be {gb_text(plan.peak)} GB, and "
                          f"{said_free(free, where_free)}; stochastic rounding needs no memory; --optimizer-rounding "
                          f"nearest to turn off)")


def plan_part(plan: Plan, name: str) -> float:
    """The bytes of one part of a plan, summed over its models ("optimizer states", "student optimizer states")."""
    return sum(nbytes for key, (nbytes, _) in plan.parts.items() if key == name or key.endswith(" " + name))


ROUNDING_ORDER = ("nearest", "stochastic", "kahan")  # a process's choice, least memory first


def agree_on_rounding(cfg: RunConfig):
    """Under torchrun (the process group started by run/start.py's settle, before the plan): each process chose its
    default rounding from its own GPU's free memory, and near the limit they may differ. Every process takes the
    choice that fits on all of them (the first of ROUNDING_ORDER that any chose), with one line where that changes
    this one's. Returns the RunConfig to go on with; one process, or no process group: unchanged."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return cfg
    device = cfg.run.device if dist.get_backend() == "nccl" else "cpu"
    choice = torch.tensor([ROUNDING_ORDER.index(cfg.training.optimizer_rounding)], device=device)
    dist.all_reduce(choice, op=dist.ReduceOp.MIN)
    agreed = ROUNDING_ORDER[int(choice.item())]
    if agreed == cfg.training.optimizer_rounding:
        return cfg

    log(f"Optimizer rounding: {agreed} on every process (this one's plan chose {cfg.training.optimizer_rounding}; another "
        f"process's free memory did not fit it)")
    return replace(cfg, training=replace(cfg.training, optimizer_rounding=agreed))
