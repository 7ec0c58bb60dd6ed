"""Estimate against measured, for the runs under results/ (`python selfcheck.py --memory-table FILES`).
"""

from __future__ import annotations

import json
from pathlib import Path

from playbook.model.presets import PRESETS
from playbook.plan import shapes
from playbook.plan.estimate import estimate
from playbook.plan.inputs import GB, Setup, Shape
from playbook.plan.runs import setup_from


def measured_run(path: Path) -> tuple[Shape, Setup, float, str] | None:
    """(Shape, Setup, measured peak in bytes, label) of a saved summary with a peak; None for other files."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):  # (a JSON list or value: chat.py --json's answers, not a run's summary)
        return None
    config, peak = data.get("config"), data.get("peak_memory_gb")
    if not config or not peak or "batch_size" not in config or data.get("script") == "distill":
        return None

    if config.get("model") not in PRESETS and not str(config.get("model")).startswith("smollm2"):
        return None
    name = config["model"]
    shape = shapes.model_shape(name, config.get("num_layers"))
    if shape is None:
        return None
    setup = setup_from(config, shape, world=int(data.get("world_size") or 1))
    return shape, setup, peak * GB, data.get("gpu", ""), _caveat(config, setup)


def _caveat(config: dict, setup: Setup) -> str:
    """What the estimate does not model in a saved run, for the table's last column."""
    if config.get("warmup_steps") == 0 and not setup.lora_r:
        return "peak of the first step: AdamW's moments are made at its end"
    if config.get("compile") and setup.kernels == "hf":
        return "torch.compile frees what the estimate counts"
    if setup.partial_kernels:
        return "a partial kernel set"
    if config.get("packing"):
        return "packed rows"
    return ""


def table(paths) -> str:
    rows = []
    for path in paths:
        found = measured_run(Path(path))
        if found is None:
            continue
        shape, setup, measured, gpu, caveat = found
        est = estimate(shape, setup).peak
        rows.append((str(path), gpu.split(" (")[0].replace("NVIDIA ", ""), f"{setup.batch} x {setup.seq}",
                     f"{est / GB:.1f}", f"{measured / GB:.1f}", f"{100 * (est - measured) / measured:+.1f}%", caveat))
    head = ("run", "GPU", "tokens", "estimated (GB)", "measured (GB)", "error", "not modelled")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = "| " + " | ".join(f"{{:{'<' if i < 3 or i == 6 else '>'}{w}}}" for i, w in enumerate(widths)) + " |"
    return "\n".join([fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt.format(*r) for r in rows])
