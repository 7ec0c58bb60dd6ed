"""The optimizer of a training run.

AdamW as --optimizer names it (PyTorch's foreach or fused, or the Triton AdamW of adamw_kernel.py),
with --optimizer-rounding / --master-weights for how it rounds each new bf16 weight, optionally stepped
inside backward (OptimizerInBackward). The learning-rate schedule is beside it (schedule.py).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from playbook.sections import RunSection, TrainingSection


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices get weight decay; norms and biases (1-D) do not. Frozen parameters are left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SystemExit("error: the model has no trainable parameters")
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def rounding_of(master_weights: str | None, optimizer_rounding: str | None) -> str:
    """The one mapping from the flags to how the Triton AdamW rounds each new bf16 weight (adamw_kernel.ROUNDINGS):
    --master-weights fp32 is "fp32-master", else --optimizer-rounding. "auto" (neither given) is decided as a run
    starts (plan/check.start); read before that, or where nothing was given (None), it rounds to nearest."""
    if master_weights == "fp32":
        return "fp32-master"
    return "nearest" if optimizer_rounding in (None, "auto") else optimizer_rounding


def weight_rounding(training: TrainingSection) -> str:
    """How the optimizer of a run (its training section) rounds each new bf16 weight (rounding_of its flags)."""
    return rounding_of(training.master_weights, training.optimizer_rounding)


def describe_optimizer(training: TrainingSection) -> str:
    """--optimizer and what changes it, as the log and the summary name it: "adamw-triton, stochastic rounding"."""
    rounding = weight_rounding(training)
    extra = {"nearest": "", "stochastic": ", stochastic rounding", "kahan": ", Kahan-compensated",
             "fp32-master": ", fp32 master weights"}[rounding]
    return training.optimizer + extra + (" in backward" if training.optimizer_in_backward else "")


def make_optimizer(model: nn.Module, training: TrainingSection, run: RunSection, capturable: bool = False):
    """AdamW as --optimizer names it. capturable: for a CUDA graph (cuda_graph.py), its step count and
    learning rate live on the GPU (one rate tensor for every group, which LRSchedule fills in place).
    --optimizer-rounding and --master-weights: the Triton AdamW's `rounding`, its random bits seeded by --seed."""
    kind = {"fused": True} if training.optimizer == "adamw-fused" else {"foreach": True}
    adamw = torch.optim.AdamW
    rounding = weight_rounding(training)
    if training.optimizer == "adamw-triton":  # one multi-tensor Triton launch per param group
        from adamw_kernel import TritonAdamW as adamw

        kind = {} if rounding == "nearest" else {"rounding": rounding, "seed": run.seed}
    elif rounding != "nearest":
        raise ValueError(f"rounding {rounding!r} is TritonAdamW's (--optimizer adamw-triton), not {training.optimizer}'s")
    lr = training.lr
    if capturable:
        lr = torch.tensor(float(training.lr), dtype=torch.float32, device=run.device)
        kind["capturable"] = True
    groups = param_groups(model, training.weight_decay)
    if training.optimizer_in_backward:
        if "seed" in kind:  # one optimizer per parameter: each its own seed, so that no two draw the same bits
            places = itertools.count(1)
            return OptimizerInBackward(groups, lambda group: adamw([group], lr=lr, **{
                **kind, "seed": run.seed + (next(places) << 32)}))
        return OptimizerInBackward(groups, lambda group: adamw([group], lr=lr, **kind))
    return adamw(groups, lr=lr, **kind)


def make_capturable(optimizer, device) -> None:
    """After `load_state_dict`: the saved groups replace ours, with their float rate and their
    `capturable` flag. Give every group back one rate tensor on the GPU and the flag, and put the step
    counts on the GPU, as a capturable AdamW keeps them."""
    inner = getattr(optimizer, "optimizers", None)  # OptimizerInBackward: one AdamW per parameter
    optimizers = list(inner.values()) if inner is not None else [optimizer]
    groups = [g for opt in optimizers for g in opt.param_groups]
    lr = next((g["lr"] for g in groups if isinstance(g["lr"], torch.Tensor) and g["lr"].device.type == "cuda"), None)
    if lr is None:
        lr = torch.tensor(float(groups[0]["lr"]), dtype=torch.float32, device=device)
    for g in groups:
        lr.fill_(float(g["lr"]))  # the groups share one rate; LRSchedule sets it every step
        g["lr"], g["capturable"] = lr, True
    for opt in optimizers:
        for state in opt.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=device, dtype=torch.float32)


class OptimizerInBackward:
    """Each parameter's optimizer step runs inside backward, as soon as its gradient is accumulated.

    Ordinarily every parameter's gradient is kept until `optimizer.step()` after backward: for an 8B
    model in bf16 that is 16 GB alive at the end of backward, on top of the activations. Here a
    `register_post_accumulate_grad_hook` on every parameter steps a one-parameter AdamW the moment
    that parameter's gradient is complete, then drops the gradient, so at most a few gradients
    exist at a time. The arithmetic is the same AdamW, parameter by parameter.

    What it cannot do: global gradient clipping (it needs the norm of *all* gradients before the
    first update) and gradient accumulation over several backward passes (each backward would update
    the weights); the command line refuses both, and a second backward before `step()` raises.
    """

    def __init__(self, groups, make):
        self.optimizers = {}
        for g in groups:
            for p in g["params"]:
                self.optimizers[p] = make({"params": [p], "weight_decay": g["weight_decay"]})
        self._stepped = set()  # parameters updated since the last step()
        for p in self.optimizers:
            p.register_post_accumulate_grad_hook(self._step_param)

    def _step_param(self, p):
        if id(p) in self._stepped:
            raise RuntimeError("--optimizer-in-backward: a second backward before optimizer.step() would update the "
                               "weights twice; gradient accumulation is not possible with the optimizer inside backward")
        self._stepped.add(id(p))
        self.optimizers[p].step()
        p.grad = None  # frees the gradient right away

    def step(self):
        self._stepped.clear()  # the updates already happened during backward

    def zero_grad(self, set_to_none: bool = True):
        pass  # gradients are dropped as soon as they are used

    @property
    def param_groups(self):  # one group per parameter, for the learning-rate schedule
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def state_dict(self) -> dict:
        return {"per_parameter": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers.values(), state["per_parameter"], strict=True):
            opt.load_state_dict(s)
