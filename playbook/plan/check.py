"""The memory plan at a run's start: the rounding settled, the plan printed, and a run that does not fit stopped
(exit code 2) with the options that would fit, before any model is built.
"""

from __future__ import annotations

import math
from dataclasses import replace

from core.process import is_main, log
from playbook.plan.estimate import combine
from playbook.plan.free_memory import free_for_plan, gb_text, said_free
from playbook.plan.inputs import GB, Plan
from playbook.plan.offers import offers, trained_model
from playbook.plan.rounding import agree_on_rounding, choose_rounding, rounding_for
from playbook.plan.runs import run_plans
from playbook.runtime.common import usage_error
from playbook.sections import RunConfig


def format_plan(plan: Plan, free: float, where_free: str) -> str:
    lines = ["Memory plan (estimated from the config, before the model is built; docs/memory.md#the-memory-plan):"]
    width = max(len(name) for name in plan.parts)
    smallest = min(plan.peak, free) / GB
    decimals = 2 if smallest >= 0.1 or smallest == 0 else 4  # a tiny model's plan in MB-sized GB, not 0.00
    for name, (nbytes, what) in plan.parts.items():
        lines.append(f"  {name:<{width}} {nbytes / GB:8.{decimals}f} GB  {what}")
    lines.append(f"  {'peak':<{width}} {plan.peak / GB:8.{decimals}f} GB  {plan.where}")
    if math.isfinite(free):
        verdict = (f"fits, {(free - plan.peak) / GB:.{decimals}f} GB to spare" if plan.peak <= free
                   else "does not fit")
        lines.append(f"  {'free':<{width}} {free / GB:8.{decimals}f} GB  {where_free}: {verdict}")
    lines += [f"  ({note})" for note in plan.notes]
    return "\n".join(lines)



def start(cfg: RunConfig):
    """The memory plan's part of a run's start (run/start.py, settle), before any model is built: the default
    rounding chosen where the command line left it open (cfg.optimizer_rounding "auto": choose_rounding, one log
    line) and agreed between the processes of a torchrun job (agree_on_rounding), then the plan printed and
    checked (check). Returns the RunConfig the run goes on with, holding the rounding it uses: the one place a
    run's rounding is decided."""
    line = None
    chosen = cfg.training.optimizer_rounding == "auto"
    if chosen:
        rounding, line = choose_rounding(cfg)
        cfg = agree_on_rounding(replace(cfg, training=replace(cfg.training, optimizer_rounding=rounding)))
        if cfg.training.optimizer_rounding != rounding:
            line = None  # agree_on_rounding said why every process takes another
    check(cfg, note=line, rounding_chosen=chosen)
    return cfg



def check(cfg: RunConfig, enforce: bool | None = None, note: str | None = None,
          rounding_chosen: bool = False) -> Plan | None:
    """Print the run's memory plan; stop (exit code 2) when it does not fit, naming the options that would
    (enforce: by default unless --ignore-memory-plan). Each script calls it as its run starts, before any
    model is built (training.train, profile_baseline.py and distill.py through start; finetune_trainer.py, whose
    Trainer builds its own optimizer, directly).
    note: a line printed after the plan (start's choice of rounding); rounding_chosen: start chose the rounding
    (the command line left it open, as it stays in the options offered)."""
    if enforce is None:
        enforce = not cfg.output.ignore_memory_plan

    plans = run_plans(cfg)
    if not plans:
        log(f"Memory plan: none before loading (the config of {cfg.model.model} is not on this machine yet)")
        if note:
            log(note)
        return None
    plan = combine(plans)
    free, where_free = free_for_plan(cfg.run.device)
    if is_main():
        log(format_plan(plan, free, where_free))
        if note:
            log(note)
    if plan.peak <= free or not enforce:
        return plan
    raise usage_error(too_big(replace(cfg, training=replace(cfg.training, optimizer_rounding="auto"))
                              if rounding_chosen else cfg, plans,
                              plan, free, where_free))


def problem(cfg: RunConfig) -> str | None:
    """The line check() stops a run with where its plan does not fit, found without printing the plan (for a
    command line with more than one thing wrong: config.parse_config names this one first); None where the run
    fits, where its plan cannot be made before loading, or with --ignore-memory-plan."""
    if cfg.output.ignore_memory_plan:
        return None
    free, where_free = free_for_plan(cfg.run.device)
    given = cfg
    if cfg.training.optimizer_rounding == "auto":
        cfg = replace(cfg, training=replace(cfg.training, optimizer_rounding=rounding_for(cfg, free, where_free)[0]))
    plans = run_plans(cfg)
    if not plans:
        return None
    plan = combine(plans)
    return None if plan.peak <= free else too_big(given, plans, plan, free, where_free)


def too_big(given: RunConfig, plans: list, plan: Plan, free: float, where_free: str) -> str:
    """The one line of a run whose plan does not fit: what it needs, the free memory and where that figure
    comes from, a --seq-len past the model's positions, and the options that fit (offers). `given`: the run as
    its command line gave it (a rounding left open still "auto")."""
    shape = plans[-1][1]
    past = (f" (--seq-len {given.data.seq_len:,} is past the {shape.positions:,} positions {trained_model(given)} was "
            f"trained on)" if shape.positions and given.data.seq_len > shape.positions else "")
    fits = offers(given, free, where_free)
    way = ("; options that fit (estimated peak): " + "; ".join(f"{o.text} ({gb_text(o.peak)} GB)" for o in fits)
           if fits else "; no single option brings it under; see docs/memory.md, or use several GPUs (torchrun)")
    if not given.on_gpu and given.model.model != "llama-tiny":
        way += "; on a CPU, --model llama-tiny runs the CPU demo"
    return (f"--batch-size {given.data.batch_size} x --seq-len {given.data.seq_len}{past}: the plan needs {gb_text(plan.peak)} "
            f"GB at its peak and {said_free(free, where_free)}{way}; --ignore-memory-plan runs it anyway")
