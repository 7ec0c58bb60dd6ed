"""A run's plans from its configuration: the Setup of a RunConfig's fields or a saved summary's, and the
(title, Shape, Setup) of each model the run holds at once.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core.process import world
from playbook.memory import options
from playbook.model.lora import parse_targets
from playbook.model.presets import PRESETS, weights_dtype
from playbook.optim.optimizer import rounding_of
from playbook.plan import shapes
from playbook.plan.inputs import Setup, Shape
from playbook.sections import RunConfig


def setup_from(values: dict, shape: Shape, world: int = 1, weight_bytes: int = 2, trains: bool = True) -> Setup:
    """A Setup from a RunConfig's fields (`cfg.as_dict()`, or the `config` of a saved summary)."""
    kernels = tuple(values.get("kernels") or ())
    if "liger" in kernels:
        layer_kind = "liger"
    else:
        layer_kind = "hf" if not ({"rmsnorm", "swiglu"} & set(kernels)) else "playbook"
    loss = ("fused" if "linear_cross_entropy" in kernels or "liger" in kernels else
            "chunked" if "cross_entropy" in kernels else "full")
    recipe = values.get("fp8_recipe") or ""
    rounding = rounding_of(values.get("master_weights"), values.get("optimizer_rounding"))

    lora_r = int(values.get("lora_r") or 0)
    return Setup(
        batch=int(values["batch_size"]), seq=int(values["seq_len"]), grad_accum=int(values.get("grad_accum") or 1),
        lora_r=lora_r, lora_targets=tuple(parse_targets(values.get("lora_targets") or "all")),
        load_in_4bit=bool(values.get("load_in_4bit")), fp8=bool(values.get("fp8")),
        fp8_rule=values.get("fp8_layers") or "auto", fp8_recipe=recipe or "rowwise",
        optimizer=values.get("optimizer") or "adamw-fused", rounding=rounding, in_backward=bool(values.get("optimizer_in_backward")), kernels=layer_kind, loss=loss,
        world=world, weight_bytes=weight_bytes, trains=trains,
        partial_kernels=bool(kernels) and "liger" not in kernels and not _full_set(kernels),
        **options.plan_terms(options.values(values), shape.layers))


def _full_set(kernels) -> bool:
    return {"rmsnorm", "linear_cross_entropy", "swiglu"} <= set(kernels)



def run_plans(cfg: RunConfig) -> list[tuple[str, Shape, Setup]]:
    """(title, Shape, Setup) of each model the run holds at once: the model it fine-tunes, or distill.py's
    teacher and student (its section's `plan_models()`); [] when a config is not on this machine yet."""
    values = cfg.as_dict()
    models = ((cfg.extra is not None and cfg.extra.plan_models())
              or [(cfg.model.model, cfg.model.num_layers, True, None, None)])
    out = []
    for name, num_layers, trains, config, loss in models:
        shape = Shape.from_config(config, num_layers) if config is not None else shapes.model_shape(name, num_layers)
        if shape is None and name == cfg.model.model and not cfg.model.model_explicit:
            shape = Shape.from_config(PRESETS["llama-3.1-8b"], num_layers)  # load_model's fallback
        if shape is None:
            return []
        role = dict(values, model=name)
        wbytes = 2 if name in PRESETS or config is not None else weights_dtype(replace_model(cfg, name),
                                                                                torch.bfloat16).itemsize
        if not trains:  # a frozen teacher: its weights, one forward without saved activations
            role.update(lora_r=0, load_in_4bit=False, fp8=False, **options.FROZEN)
        setup = setup_from(role, shape, world=world()[1], weight_bytes=wbytes, trains=trains)
        out.append((name, shape, replace(setup, loss=loss) if loss else setup))
    return out


def replace_model(cfg: RunConfig, name):
    return replace(cfg, model=replace(cfg.model, model=name))
