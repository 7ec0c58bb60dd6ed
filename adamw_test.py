"""Tests of TritonAdamW (adamw_kernel.py): steps against PyTorch's AdamW, one launch per group, state
dicts and checkpoints, refusals, the training scripts' `--optimizer adamw-triton`, sharded parameters
(FSDP2: two CPU processes under torchrun, bit for bit the unsharded optimizer's values), capturable mode
(step counts and rate on the device) with the CUDA graphs it exists for, and the roundings that keep
updates smaller than half a bf16 ulp (stochastic, Kahan, fp32 master: `--optimizer-rounding`,
`--master-weights`), whose statistical tolerances are derived where they are checked.

    $ python adamw_test.py       # a readable report
    $ pytest adamw_test.py

Tolerances follow testkit/__init__.py's rule, after the same steps on the same gradients: every parameter and
state may be at most 2x as far from PyTorch's single-tensor AdamW (foreach=False) run in float64, the
truth, as PyTorch's fused AdamW run in the tested dtype is, plus one ulp of the tensor's scale. The
fused one is the yardstick because it computes as the kernel does (fp32 arithmetic, one rounding per
stored value); the single-tensor AdamW rounds after each of its eight ops, and in fp16 its
exp_avg_sq underflows to 0 and its updates blow up, which would make any tolerance derived from it
meaningless. On a CPU the kernel runs in Triton's interpreter, which is made to round to bf16 as a
GPU does (see `_round_like_a_gpu`), so the same rule holds there.
Results that must not depend on rounding at all (a resumed run, a copied gradient, a transposed
parameter, the in-backward variant, sharded parameters, capturable mode against the host path: see
`test_capturable_matches_the_host_path_over_steps`) are checked bitwise.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import functools
import io
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import adamw_kernel
from playbook.store.files import RESULTS_DIR
from playbook.model import models
from playbook.run import training
from playbook.optim.optimizer import param_groups, weight_rounding
from adamw_kernel import TritonAdamW, adamw_ref, ideal_bytes
from core.kernel_utils import DEVICE
from playbook.config import make_parser, parse_config
import testkit
from testkit import (close_to_reference, exactly, expect_error, python_path, record, run_as_script,
                              two_process_device, two_process_env)
from playbook.optim.optimizer import make_optimizer
from playbook.run.start import make_run_data

ON_GPU = DEVICE.type == "cuda"
HERE = Path(__file__).resolve().parent
TEXT = HERE / "examples" / "chat.jsonl"  # real text for the tiny training runs, in a file no code change edits

# Odd shapes; an empty tensor; one element; 70001 elements span two 65536-element chunks, the second
# ending in a masked partial block.
SHAPES = [(37, 53), (129,), (0,), (1, 1), (3, 5, 7), (70001,)]
STEPS = 4


def _groups(params, lr_tensors=False):
    """Two param groups with different hyperparameters, as a decay / no-decay split has. lr_tensors:
    each group's rate is a 0-d float32 tensor on the device, as a capturable optimizer's is."""
    rate = (lambda lr: torch.tensor(lr, dtype=torch.float32, device=DEVICE)) if lr_tensors else float
    return [dict(params=params[0::2], lr=rate(1e-2), weight_decay=0.1),
            dict(params=params[1::2], lr=rate(3e-3), weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6)]


def _lr_factor(step):
    return (step + 1) / 2 if step < 2 else 0.7**step  # warm-up, then decay: lr changes every step


def _gradients(shapes, steps, seed=0):
    """Random gradients per step; parameter 3 has none at step 1 (skipped: its step count falls behind)."""
    g = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    if steps > 1 and len(shapes) > 3:
        grads[1][3] = None
    return grads


def _fp32(value: float) -> float:
    """`value` rounded to float32, as a float32 rate tensor holds it."""
    return float(torch.tensor(value, dtype=torch.float32))


def _set_rate(group, lr, fp32_rates):
    """A group's rate for the next step: a rate tensor is filled in place (as LRSchedule fills a capturable
    optimizer's, which a CUDA graph reads), a float replaced; fp32_rates: the float is rounded as the tensor is."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = _fp32(lr) if fp32_rates else lr


def _train(make, start, grads, dtypes, steps=None, opt=None, params=None, lr_tensors=False, fp32_rates=False):
    """Step an optimizer made by `make(groups)` on copies of `start`, the i-th in dtypes[i % len].
    lr_tensors: the groups' rates are tensors (see _groups); fp32_rates: float rates are rounded to float32,
    so that a run with float rates sees exactly the rates of a run with rate tensors."""
    if params is None:  # copies: for fp32 on a CPU, .to() without copy=True would hand every run `start` itself
        params = [t.to(DEVICE, dtypes[i % len(dtypes)], copy=True) for i, t in enumerate(start)]
    opt = opt or make(_groups(params, lr_tensors))
    base = [_fp32(float(g["lr"])) if fp32_rates else float(g["lr"]) for g in opt.param_groups]  # (a tensor's: fp32)
    for step in steps or range(len(grads)):
        for p, gr in zip(params, grads[step]):
            p.grad = None if gr is None else gr.to(DEVICE, p.dtype)
        for group, lr in zip(opt.param_groups, base):
            _set_rate(group, lr * _lr_factor(step), fp32_rates)
        opt.step()
    for group, lr in zip(opt.param_groups, base):
        _set_rate(group, lr, False)
    return params, opt


def _start(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _torch_fused(groups, **hyperparameters):
    """PyTorch's fused AdamW (CPU and CUDA): the yardstick of the tolerance rule (see the docstring)."""
    return torch.optim.AdamW(groups, fused=True, **hyperparameters)


def _compare(tag, ours, same, ref):
    """testkit's rule on every parameter and state; step counts exactly as PyTorch's."""
    (p_o, opt_o), (p_s, opt_s), (p_r, opt_r) = ours, same, ref
    for a, b, c in zip(p_o, p_s, p_r):
        if not a.numel():
            continue
        name = f"{tag} {list(a.shape)} {str(a.dtype)[6:]}"
        close_to_reference(f"{name} param", a, b, c, a.dtype)
        for key in ("exp_avg", "exp_avg_sq"):
            close_to_reference(f"{name} {key}", opt_o.state[a][key], opt_s.state[b][key], opt_r.state[c][key], a.dtype)
        assert float(opt_o.state[a]["step"]) == float(opt_r.state[c]["step"])


# ------------------------------------------------------------------------------------------------
# The arithmetic
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float16,),
                                    (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "fp16", "fp32+bf16"])
def test_matches_torch_adamw_over_steps(dtypes):
    """4 steps, two groups, lr changing every step, a parameter skipped once: as PyTorch's AdamW."""
    start, grads = _start(SHAPES), _gradients(SHAPES, STEPS)
    ours = _train(TritonAdamW, start, grads, dtypes)
    same = _train(_torch_fused, start, grads, dtypes)
    ref = _train(adamw_ref, start, grads, (torch.float64,))
    _compare("4 steps", ours, same, ref)
    assert float(ours[1].state[ours[0][3]]["step"]) == STEPS - 1, "the skipped step must not be counted"


def test_parameters_without_gradients_are_untouched():
    """A parameter whose gradient is None: no state, no change; a step without any gradient changes nothing."""
    params = [torch.randn(9, 4, device=DEVICE), torch.randn(5, device=DEVICE)]
    before = [p.clone() for p in params]
    opt = TritonAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    exactly("parameter without a gradient", params[1], before[1])
    assert params[1] not in opt.state and float(opt.state[params[0]]["step"]) == 1
    assert not torch.equal(params[0], before[0])
    params[0].grad = None
    opt.step()  # nothing to do anywhere
    assert float(opt.state[params[0]]["step"]) == 1


def test_maximize_and_an_lr_tensor():
    """maximize=True ascends the gradient; lr may be a CPU tensor (read on the host, no GPU wait)."""
    start, grads = _start(SHAPES[:2]), _gradients(SHAPES[:2], 2)

    def run(make, dtype):
        params = [t.to(DEVICE, dtype, copy=True) for t in start]
        opt = make([{"params": params}], lr=torch.tensor(1e-2), maximize=True, weight_decay=0.1)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(DEVICE, dtype)
            opt.step()
        return params

    ours, same, ref = run(TritonAdamW, torch.float32), run(_torch_fused, torch.float32), run(adamw_ref, torch.float64)
    for a, b, c in zip(ours, same, ref):
        close_to_reference(f"maximize {list(a.shape)}", a, b, c, torch.float32)


# ------------------------------------------------------------------------------------------------
# Capturable mode: step counts and rate on the device, nothing read on the host (for CUDA graphs)
# ------------------------------------------------------------------------------------------------
def _torch_capturable(groups, **hyperparameters):
    """PyTorch's AdamW with capturable=True, the yardstick in capturable mode: its fused variant, the only
    one PyTorch runs on CPU tensors with that flag (single-tensor and foreach refuse them), and the one whose
    arithmetic the kernel's is (bias corrections in float64 from the float32 count on the device)."""
    return torch.optim.AdamW(groups, fused=True, capturable=True, **hyperparameters)


def _exactly_the_same_run(tag, ours, expected):
    """Every parameter, state and step count of `ours` bit for bit those of `expected`."""
    (p_o, opt_o), (p_e, opt_e) = ours, expected
    for a, b in zip(p_o, p_e):
        name = f"{tag} {list(a.shape)} {str(a.dtype)[6:]}"
        exactly(f"{name} param", a, b)
        assert (a in opt_o.state) == (b in opt_e.state)
        if a in opt_o.state:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                exactly(f"{name} {key}", opt_o.state[a][key], opt_e.state[b][key])


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16", "fp32+bf16"])
def test_capturable_matches_the_host_path_over_steps(dtypes):
    """capturable=True over 4 steps, two groups, each rate a tensor filled in place every step, a parameter
    skipped once (so one launch holds tensors with step counts 4 and 3): by the rule against PyTorch's
    capturable AdamW and float64, and bit for bit the host path's results on the same fp32 rates."""
    start, grads = _start(SHAPES), _gradients(SHAPES, STEPS)
    capturable = functools.partial(TritonAdamW, capturable=True)
    ours = _train(capturable, start, grads, dtypes, lr_tensors=True)
    same = _train(_torch_capturable, start, grads, dtypes, lr_tensors=True)
    ref = _train(adamw_ref, start, grads, (torch.float64,), fp32_rates=True)
    _compare("capturable", ours, same, ref)
    # Bit for bit, not by the rule: both modes compute the bias corrections and step sizes in float64 from
    # the same counts and rates and round each once to fp32 (the host in Python floats, capturable mode on
    # the device: _device_scalars), then run the same kernel arithmetic on the same fp32 scalars. A wrong
    # tensor's scalars (the skipped parameter's count is 3, its neighbours' 4) would change many bits.
    host = _train(TritonAdamW, start, grads, dtypes, fp32_rates=True)
    _exactly_the_same_run("capturable == host path", ours, host)
    # A float rate in capturable mode (a constant of a captured graph) takes the same device path
    _exactly_the_same_run("capturable, float lr == host path",
                          _train(capturable, start, grads, dtypes, fp32_rates=True), host)
    params, opt = ours
    for p in params:
        if p in opt.state:
            step = opt.state[p]["step"]
            assert (step.dim(), step.dtype, step.device) == (0, torch.float32, p.device), "a count on the device"
    assert float(opt.state[params[3]]["step"]) == STEPS - 1, "the skipped step must not be counted"


_HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


def _refuse_host_reads(monkeypatch):
    """Make every way of reading a tensor's value into Python raise (on a CPU all tensors are CPU tensors,
    so a capturable step, which must never read a GPU value, is held to reading none at all)."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor's value was read on the host")

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_capturable_step_reads_nothing_on_the_host(monkeypatch):
    """Once its address tables are built (from host lists, by the first step of a parameter set: also the
    one step a CUDA graph cannot hold), a capturable step reads no tensor's value on the host: not with new
    gradient tensors, nor a new rate, nor two step counts in one group (a parameter without a gradient at
    the first step), which still take one launch per group. The host path, which reads its CPU step counts,
    trips the same trap: the trap works."""
    kernel = _CountingKernel(adamw_kernel._adamw_multi_tensor)
    monkeypatch.setattr(adamw_kernel, "_adamw_multi_tensor", kernel)
    g = torch.Generator().manual_seed(7)
    shapes = [(33, 7), (70001,), (5,), (2, 2, 2)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]

    def run(capturable, trap_from):
        params = [t.to(DEVICE, copy=True) for t in start]
        lr = torch.tensor(1e-2, device=DEVICE) if capturable else 1e-2
        opt = TritonAdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=lr,
                          weight_decay=0.1, capturable=capturable)
        for step, step_grads in enumerate(grads):
            for p, gr in zip(params, step_grads):
                p.grad = None if (step == 0 and p is params[2]) else gr.to(DEVICE)  # new tensors each step
            with monkeypatch.context() as trap:
                if step >= trap_from:
                    _refuse_host_reads(trap)
                if capturable:
                    lr.fill_(1e-2 * 0.7**step)  # in place, on the device: not a read
                else:
                    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = _fp32(1e-2 * 0.7**step)
                opt.step()
        return params, opt

    kernel.grids.clear()
    params, opt = run(capturable=True, trap_from=2)  # step 1 builds the second group's table anew
    assert len(kernel.grids) == 2 * len(grads), "one launch per group and step, though the counts differ"
    assert [float(opt.state[p]["step"]) for p in params] == [5, 5, 4, 5]
    record("capturable: no .item/.tolist/float/int/bool of a tensor in steps 3-5; one launch per group", 0.0, 0.0,
           True)
    with pytest.raises(AssertionError, match="read on the host"):
        run(capturable=False, trap_from=2)
    # The same trajectory on the host path, without the trap: the same bits
    _exactly_the_same_run("capturable == host path", (params, opt), run(capturable=False, trap_from=len(grads)))


def test_capturable_state_dicts_load_into_either_mode():
    """2 steps, save, load into an optimizer of the other mode, 2 more steps == 4 host-path steps, bit for
    bit. Each optimizer keeps its own mode (PyTorch's AdamW would take the checkpoint's) and finds its step
    counts where that mode keeps them: on the CPU, or on the parameter's device; a capturable optimizer
    keeps its own rate tensor (the one a captured graph reads), holding the checkpoint's rate."""
    start, grads = _start(SHAPES), _gradients(SHAPES, STEPS)
    dtypes = (torch.bfloat16,)
    straight = _train(TritonAdamW, start, grads, dtypes, fp32_rates=True)
    for saved_capturable in (True, False):
        capturable = not saved_capturable
        first, opt_first = _train(functools.partial(TritonAdamW, capturable=saved_capturable), start, grads, dtypes,
                                  steps=range(2), lr_tensors=saved_capturable, fp32_rates=True)
        saved = _through_a_file(opt_first.state_dict())
        assert all(g["capturable"] == saved_capturable for g in saved["param_groups"])
        params = [p.detach().clone() for p in first]
        opt = TritonAdamW(_groups(params, lr_tensors=capturable), capturable=capturable)
        rates = [g["lr"] for g in opt.param_groups]
        opt.load_state_dict(saved)
        for group, rate, saved_group in zip(opt.param_groups, rates, saved["param_groups"]):
            assert group["capturable"] == capturable, "the optimizer's own mode, not the checkpoint's"
            if capturable:
                assert group["lr"] is rate and float(rate) == _fp32(float(saved_group["lr"]))
            else:
                assert not isinstance(group["lr"], torch.Tensor) or group["lr"].device.type == "cpu"
        for p in params:
            if p in opt.state:
                step = opt.state[p]["step"]
                where = p.device if capturable else torch.device("cpu")
                assert (step.dtype, step.device) == (torch.float32, where), (capturable, step.device)
        resumed = _train(TritonAdamW, start, grads, dtypes, steps=range(2, STEPS), opt=opt, params=params,
                         fp32_rates=True)
        mode = "capturable" if capturable else "host path"
        _exactly_the_same_run(f"{mode} after the other mode's 2 steps", resumed, straight)


def test_tables_of_a_captured_step_are_kept(monkeypatch):
    """A captured step's tables outlive the steps that no longer use them (a replay reads them every time):
    an eager step on another set of parameters drops its own last tables, never a graph's."""
    params = [torch.randn(9, 4, device=DEVICE), torch.randn(5, device=DEVICE)]
    opt = TritonAdamW(params, lr=torch.tensor(1e-2, device=DEVICE), capturable=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # eager: builds the table
    table = next(iter(opt._tables.values()))
    with monkeypatch.context() as m:
        m.setattr(adamw_kernel, "_capturing", lambda: True)  # as if torch.cuda.graph were capturing this step
        opt.step()
    params[1].grad = None
    opt.step()  # another set of tensors, another table: the captured one leaves _tables
    assert table not in opt._tables.values() and table in opt._graph_tables.values()
    params[1].grad = torch.randn_like(params[1])
    opt.step()
    assert next(iter(opt._tables.values())) is table, "the set of the captured step finds its table again"
    record("a captured step's table is kept while eager steps use other tables", 0.0, 0.0, True)


def test_make_capturable_switches_a_host_path_optimizer():
    """playbook/optim/optimizer.make_capturable, as the training loop calls it after load_state_dict: it sets
    group["capturable"], gives the groups one rate tensor and moves the step counts to the device. The
    optimizer then takes the device path, and continues exactly as the host path would."""
    from playbook.optim import optimizer

    start, grads = _start(SHAPES), _gradients(SHAPES, STEPS)

    def run(switch):
        params = [t.to(DEVICE, torch.bfloat16, copy=True) for t in start]
        opt = TritonAdamW([{"params": params[0::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=1e-2,
                          weight_decay=0.1)
        for step, step_grads in enumerate(grads):
            if switch and step == 2:
                optimizer.make_capturable(opt, DEVICE)
            for p, gr in zip(params, step_grads):
                p.grad = None if gr is None else gr.to(DEVICE, p.dtype)
            for group in opt.param_groups:
                _set_rate(group, 1e-2 * _lr_factor(step), fp32_rates=True)
            opt.step()
        return params, opt

    switched = run(switch=True)
    params, opt = switched
    assert all(g["capturable"] and isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
    assert all(opt.state[p]["step"].device == p.device for p in params if p in opt.state)
    _exactly_the_same_run("make_capturable after 2 steps", switched, run(switch=False))


# ------------------------------------------------------------------------------------------------
# One launch per group, tables built once
# ------------------------------------------------------------------------------------------------
class _CountingKernel:
    """Stands in for the jitted kernel: launches it, keeping each launch's grid and compiled kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.compiled = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(grid)
            self.compiled.append(self.kernel[grid](*args, **kwargs))

        return launch


def test_one_launch_per_group_and_tables_built_once(monkeypatch):
    kernel = _CountingKernel(adamw_kernel._adamw_multi_tensor)
    monkeypatch.setattr(adamw_kernel, "_adamw_multi_tensor", kernel)
    uploads, real_upload = [], adamw_kernel._upload

    def upload(dst, host):
        uploads.append(host.numel())
        real_upload(dst, host)

    monkeypatch.setattr(adamw_kernel, "_upload", upload)

    params = [torch.randn(s, device=DEVICE) for s in [(33, 7), (70001,), (5,), (0,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = TritonAdamW(params, lr=1e-3)
    opt.step()
    assert kernel.grids == [(1 + 2 + 1 + 1,)], "one launch; one program per 65536-element chunk (none if empty)"
    assert len(uploads) == 2, "one copy of the table, one of the gradients' addresses"
    table = next(iter(opt._tables.values()))
    opt.step()  # same tensors, same gradients: no copy at all
    assert len(kernel.grids) == 2 and len(uploads) == 2 and next(iter(opt._tables.values())) is table
    for p in params:
        p.grad = torch.randn_like(p)  # new gradient tensors: only their 5 addresses are copied
    opt.step()
    assert len(uploads) == 3 and uploads[-1] == len(params) and next(iter(opt._tables.values())) is table
    params[0].data = params[0].data.clone()  # a parameter moved: a new table
    opt.step()
    assert next(iter(opt._tables.values())) is not table and len(opt._tables) == 1
    record("5 tensors: 1 launch of 5 programs; table copied once; gradients only when they move", 0.0, 0.0, True)

    kernel.grids.clear()
    opt = TritonAdamW(_groups(params), lr=1e-3)
    opt.step()
    assert len(kernel.grids) == 2, "one launch per param group"
    params[0].grad = None
    opt.step()
    params[0].grad = torch.randn_like(params[0])
    kernel.grids.clear()
    opt.step()
    assert len(kernel.grids) == 3, "the group whose parameters' step counts differ takes one launch per count"
    record("2 groups: 2 launches; step counts 3 and 2 in one group: 2 launches for it", 0.0, 0.0, True)


# ------------------------------------------------------------------------------------------------
# State dicts and checkpoints
# ------------------------------------------------------------------------------------------------
def _through_a_file(state_dict):
    """torch.save and torch.load(weights_only=True), as playbook/store/checkpoint.py stores the optimizer."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_is_exact():
    """2 steps, save, load into a fresh optimizer, 2 more steps == 4 steps straight, bit for bit."""
    start, grads = _start(SHAPES), _gradients(SHAPES, STEPS)
    dtypes = (torch.bfloat16,)
    straight, opt_straight = _train(TritonAdamW, start, grads, dtypes)
    first, opt_first = _train(TritonAdamW, start, grads, dtypes, steps=range(2))
    saved = _through_a_file(opt_first.state_dict())
    params = [p.detach().clone() for p in first]  # fresh tensors at new addresses, a fresh optimizer
    opt = TritonAdamW(_groups(params))
    opt.load_state_dict(saved)
    resumed, opt = _train(TritonAdamW, start, grads, dtypes, steps=range(2, STEPS), opt=opt, params=params)
    for a, b in zip(resumed, straight):
        exactly(f"resumed {list(a.shape)} param", a, b)
        if b in opt_straight.state:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                exactly(f"resumed {list(a.shape)} {key}", opt.state[a][key], opt_straight.state[b][key])


def test_state_dict_has_torch_adamw_structure_and_loads_both_ways():
    """Same keys, dtypes, devices as torch.optim.AdamW's; each optimizer continues from the other's."""
    start, grads = _start(SHAPES), _gradients(SHAPES, STEPS)
    dtypes = (torch.float32,)
    ours, opt_ours = _train(TritonAdamW, start, grads, dtypes, steps=range(2))
    theirs, opt_theirs = _train(adamw_ref, start, grads, dtypes, steps=range(2))
    a, b = opt_ours.state_dict(), opt_theirs.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k in ("step", "exp_avg", "exp_avg_sq"):
            x, y = a["state"][i][k], b["state"][i][k]
            assert (x.dtype, x.device, x.shape) == (y.dtype, y.device, y.shape), (i, k)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    record("state_dict: torch.optim.AdamW's keys, dtypes, devices, param indices", 0.0, 0.0, True)

    def continue_from(state, params, make):
        params = [p.detach().clone() for p in params]
        opt = make(_groups(params))
        opt.load_state_dict(_through_a_file(state))
        return _train(make, start, grads, dtypes, steps=range(2, STEPS), opt=opt, params=params)

    # A trajectory that changes optimizer half-way must be as good as PyTorch's all the way
    same, ref = _train(adamw_ref, start, grads, dtypes), _train(adamw_ref, start, grads, (torch.float64,))
    _compare("torch AdamW after our 2 steps", continue_from(a, ours, adamw_ref), same, ref)
    _compare("ours after torch AdamW's 2 steps", continue_from(b, theirs, TritonAdamW), same, ref)


def test_training_script_saves_and_resumes(tmp_path):
    """finetune_optimized --optimizer adamw-triton: trains, checkpoints (playbook/store/checkpoint.py), resumes bit for bit,
    with the rounding the run chose (plan/rounding.choose_rounding: kahan on a GPU, where the tiny model fits;
    stochastic on a CPU, where the plan does not decide), recorded in the summary."""
    out = tmp_path / "ckpt"
    args = ["--model", "llama-tiny", "--num-layers", "1", "--optimizer", "adamw-triton", "--data", str(TEXT),
            "--steps", "4", "--timing-warmup-steps", "1", "--lr", "3e-3", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--kernels", "none", "--batch-size", "2", "--seq-len", "32", "--output-dir", str(out)]
    whole = _run(*args, "--save-every", "2", tag="test_adamw_whole")
    resumed = _run(*args, "--resume", str(out / "checkpoint-2"), tag="test_adamw_resumed")
    chosen = "kahan" if DEVICE.type == "cuda" else "stochastic"
    assert whole["config"]["optimizer_rounding"] == resumed["config"]["optimizer_rounding"] == chosen, whole["config"]
    assert whole["optimizer"] == {"kahan": "adamw-triton, Kahan-compensated",
                                  "stochastic": "adamw-triton, stochastic rounding"}[chosen], whole["optimizer"]
    assert resumed["losses"] == whole["losses"], (resumed["losses"], whole["losses"])
    record("4 steps == 2 + resume + 2 (bit for bit)", 0.0, 0.0, True)


def test_optimizer_in_backward_makes_the_same_updates():
    """--optimizer-in-backward with adamw-triton (one launch per parameter, inside backward) updates
    exactly as adamw-triton after backward."""
    params = {}
    for in_backward in (False, True):
        cfg = _config("--data", str(TEXT), "--kernels", "none", "--optimizer", "adamw-triton", "--lr", "1e-3",
                      "--weight-decay", "0.1", "--batch-size", "2", "--seq-len", "64",
                      *(["--optimizer-in-backward"] if in_backward else []))
        model = models.build_preset("llama-tiny", 1, DEVICE, torch.float32)
        opt = make_optimizer(model, cfg.training, cfg.run)
        data = make_run_data(cfg, model, None)
        for i in range(2):
            training.training_step(model, opt, [data.batch(i, DEVICE)])
        params[in_backward] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if in_backward:
            assert all(p.grad is None for p in model.parameters()), "gradients are freed in backward"
    for name, p in params[False].items():
        exactly(f"in backward: {name}", params[True][name], p)


def test_command_line_refusals(monkeypatch):
    """The Trainer builds its own optimizer: adamw-triton refuses it. Under torchrun (FSDP2) it is accepted,
    with every rounding: each process updates its own shards (test_sharded_steps_match_unsharded)."""
    with pytest.raises(SystemExit) as info:
        _config("--optimizer", "adamw-triton", script="finetune_trainer")
    assert info.value.code == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # as torchrun sets them (parse_config checks)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _config("--optimizer", "adamw-triton").training.optimizer == "adamw-triton"
    for argv in (["--optimizer-rounding", "stochastic"], ["--optimizer-rounding", "kahan"], ["--master-weights", "fp32"]):
        assert _config(*argv).training.optimizer == "adamw-triton", argv
    record("adamw-triton refused for the Trainer (exit code 2), accepted under torchrun", 0.0, 0.0, True)


def test_the_default_set_picks_the_triton_adamw_where_it_runs(monkeypatch):
    """`adamw` is in the default kernel set: the Triton AdamW on a GPU in the scripts' own loop, on one
    process or under torchrun, PyTorch's AdamW on a CPU and in the Trainer; an --optimizer wins; adamw named
    in --kernels keeps asking for the Triton AdamW (and clashes with another --optimizer)."""
    from playbook.model.registry import DEFAULT_KERNELS

    def optimizer(*argv, script="finetune_optimized", gpu=False, world=1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("MASTER_ADDR", "localhost")  # as torchrun sets them (parse_config checks)
        monkeypatch.setenv("MASTER_PORT", "29500")
        return parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), script, list(argv)).training.optimizer

    got = {
        "GPU": optimizer(gpu=True),
        "CPU": optimizer(),
        "Trainer on a GPU": optimizer(script="finetune_trainer", gpu=True),
        "torchrun": optimizer(gpu=True, world=2),
        "--optimizer adamw-fused": optimizer("--optimizer", "adamw-fused", gpu=True),
        "--kernels default,adamw on a CPU": optimizer("--kernels", "default,adamw"),
        "--kernels rmsnorm on a GPU": optimizer("--kernels", "rmsnorm", gpu=True),
    }
    assert got == {"GPU": "adamw-triton", "CPU": "adamw-foreach", "Trainer on a GPU": "adamw-fused",
                   "torchrun": "adamw-triton", "--optimizer adamw-fused": "adamw-fused",
                   "--kernels default,adamw on a CPU": "adamw-triton", "--kernels rmsnorm on a GPU": "adamw-fused"}, got
    with pytest.raises(SystemExit) as info:
        optimizer("--kernels", "default,adamw", "--optimizer", "adamw-fused", gpu=True)
    assert info.value.code == 2
    record("default set -> " + ", ".join(f"{k}: {v}" for k, v in got.items()), 0.0, 0.0, True)


def _config(*argv, script="finetune_optimized"):
    return parse_config(make_parser("test", kernels_default=()), script, list(argv))


def _run(*argv, tag):
    """One whole run of the training loop, as finetune_optimized.py runs it; returns the summary."""
    try:
        return training.train(_config("--tag", tag, "--overwrite", *argv))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------
# Layouts and refusals
# ------------------------------------------------------------------------------------------------
def test_strided_gradients_and_transposed_parameters():
    """A gradient laid out unlike its parameter is copied into the parameter's layout; a transposed
    (dense) parameter is walked as flat memory. Both give exactly the contiguous case's result."""
    g = torch.Generator().manual_seed(4)
    p0, g0 = torch.randn(13, 17, generator=g), torch.randn(13, 17, generator=g)

    def step(p, grad):
        p = p.to(DEVICE)
        p.grad = grad.to(DEVICE)
        TritonAdamW([p], lr=1e-2).step()
        return p

    plain = step(p0.clone(), g0.clone())
    strided = step(p0.clone(), g0.t().contiguous().t())  # strides (1, 13) against the parameter's (17, 1)
    exactly("gradient with other strides", strided, plain)
    transposed = step(p0.t().contiguous().t(), g0.t().contiguous().t())  # parameter and gradient transposed
    assert not transposed.is_contiguous()
    exactly("transposed parameter", transposed, plain)


def test_refusals():
    p = torch.randn(4, 4, device=DEVICE)
    expect_error(ValueError, lambda: TritonAdamW([p], amsgrad=True))
    expect_error(ValueError, lambda: TritonAdamW([p], lr=-1.0))
    expect_error(ValueError, lambda: TritonAdamW([p], betas=(0.9, 1.0)))

    def step_with(param, grad):
        param.grad = grad
        TritonAdamW([param]).step()

    dense = torch.randn(6, 3, device=DEVICE)
    expect_error(RuntimeError, step_with, dense, torch.randn_like(dense).to_sparse())
    c = torch.randn(3, dtype=torch.complex64, device=DEVICE)
    expect_error(TypeError, step_with, c, torch.randn_like(c))
    view = torch.randn(8, 8, device=DEVICE)[:, ::2]  # every other column: not one block of memory
    assert "strided view" in expect_error(ValueError, step_with, view, torch.randn(8, 4, device=DEVICE))
    opt = TritonAdamW([p])
    state = opt.state_dict()
    state["param_groups"][0]["amsgrad"] = True
    opt.load_state_dict(state)
    p.grad = torch.randn_like(p)
    expect_error(ValueError, opt.step)


# ------------------------------------------------------------------------------------------------
# Bytes and the benchmark's entry
# ------------------------------------------------------------------------------------------------
def test_ideal_bytes():
    n = 8_030_261_248  # LLaMA 3.1 8B
    assert ideal_bytes(n, torch.bfloat16, torch.bfloat16) == 14 * n == 112_423_657_472
    assert ideal_bytes(n, torch.bfloat16, torch.float32) == 22 * n
    assert ideal_bytes(n, torch.float32) == 28 * n
    assert ideal_bytes(n, dtype=torch.bfloat16, backward=True) == 14 * n  # the benchmark's keywords
    assert [ideal_bytes(n, rounding=r) for r in adamw_kernel.ROUNDINGS] == [14 * n, 14 * n, 18 * n, 20 * n]
    record(f"8B bf16: {14 * n:,} B = {14 * n / 4.27e12 * 1e3:.1f} ms at 4.27 TB/s", 0.0, 0.0, True)


def test_benchmark_entry_checks_and_measures():
    """benchmark_kernels.py's adamw entry at its smoke size: every implementation passes the check
    against float64 and is measured; the byte count is this module's."""
    import benchmark_kernels as bk
    from benchmarks.specs import adamw_shapes

    spec = bk.SPECS["adamw"]
    case = spec.smoke[0]
    assert sum(torch.Size(s).numel() for s in adamw_shapes(case["n_params"])) == case["n_params"]
    rows = bk._measure_impls(spec, case, torch.bfloat16, spec.impls())
    assert [r["impl"].split(" +")[0] for r in rows] == ["ours", "torch-fused", "torch-foreach"]
    assert all(r["fwd_bytes"] == ideal_bytes(case["n_params"], torch.bfloat16) for r in rows)
    assert bk.kernel_list("adamw") == ("adamw",) and bk.kernel_list("all") == bk.KERNEL_NAMES


# ------------------------------------------------------------------------------------------------
# Updates that stick: stochastic rounding, Kahan compensation, fp32 master weights (module docstring)
# ------------------------------------------------------------------------------------------------
ULP_NEAR_002 = 2.0**-13  # bf16's ulp for 2^-6 <= |w| < 2^-5, as for the docstring's w = 0.02: 1.22e-4
SMALL_LR = 2.0**-17  # 7.6e-6: an eighth of half that ulp, lost by rounding to nearest; w - lr is exact in fp32


def _bits(t):
    """The fp32 bits of a bf16 or fp32 tensor (bf16's are their top 16), as non-negative int64."""
    return t.detach().cpu().float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _near_002(n, seed=0):
    """n bf16 weights of both signs with 0.019 <= |w| < 0.027: one ulp (2^-13) for all of them, and far enough
    from 2^-6 and 2^-5 that some dozens of small steps, and their rounding noise, keep them there."""
    g = torch.Generator().manual_seed(seed)
    w = 0.019 + 0.008 * torch.rand(n, generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.5, -w, w).to(torch.bfloat16)


def _signs(n, seed=1):
    """Gradients of +1 and -1. With betas (0, 0), AdamW's update is then exactly lr * sign(g) (m = g, v = 1,
    no bias correction, and 1 + eps is 1 in fp32), so the exact weight after S steps is w - S * lr * g."""
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.bfloat16)


def _exact_steps(rounding, w, grad, steps, lr=SMALL_LR, **kwargs):
    """`steps` steps of lr * sign(grad) (see _signs) from w; the parameter and its state."""
    p = w.to(DEVICE, copy=True)
    opt = TritonAdamW([p], lr=lr, betas=(0.0, 0.0), weight_decay=0.0, rounding=rounding, **kwargs)
    for _ in range(steps):
        p.grad = grad.to(DEVICE)
        opt.step()
    return p, opt.state[p]


def test_stochastic_rounding_is_unbiased_where_nearest_loses_every_step():
    """32 steps of lr = 2^-17 on 8192 weights near 0.02: rounding to nearest loses every update; stochastic
    rounding moves the weights by the exact 32 lr on average; Kahan's weight + compensation and the fp32
    master are the exact weight, bit for bit (every value here is exact in fp32 and in the buffers)."""
    n, steps = 8192, 32
    w, grad = _near_002(n), _signs(n)
    exact = w.double() - steps * SMALL_LR * grad.double()
    nearest, _ = _exact_steps("nearest", w, grad, steps)
    exactly("nearest: every update below half an ulp is lost", nearest, w)

    p, _ = _exact_steps("stochastic", w, grad, steps, seed=3)
    move = float(((w.double() - p.double().cpu()) * grad.double()).mean())  # along -g: 32 lr, exactly, on average
    # Given all that came before it, a step's rounding error has mean 0 and variance q (1 - q) ulp^2 <= ulp^2 / 4
    # (q: where the exact value lies between its two neighbours). A weight's error after S steps, the sum of
    # its steps' errors, then has variance at most S ulp^2 / 4, and the mean of n weights, whose random bits are
    # independent, at most S ulp^2 / (4 n): 5 of those standard deviations (3.8e-6 here; 8% of the move).
    tol = 5 * ULP_NEAR_002 * (steps / (4 * n)) ** 0.5
    err = abs(move - steps * SMALL_LR)
    record(f"stochastic: mean move {move:.4e} (exact {steps * SMALL_LR:.4e}) over {n} weights", err, tol, err <= tol)
    assert (p.cpu() != w).float().mean() > 0.5, "most weights must have moved by whole ulps"

    kahan, state = _exact_steps("kahan", w, grad, steps)
    exactly("kahan: weight + compensation == the exact weight", kahan.double() + state["kahan_comp"].double(),
            exact.to(DEVICE))
    assert (kahan.double() - exact.to(DEVICE)).abs().max() <= ULP_NEAR_002 / 2, "the model's weight: nearest to it"
    master_p, state = _exact_steps("fp32-master", w, grad, steps)
    exactly("fp32-master: the master == the exact weight", state["master_param"].double(), exact.to(DEVICE))
    exactly("fp32-master: the weight is the master rounded to nearest", master_p,
            state["master_param"].to(torch.bfloat16))


def test_stochastic_rounding_picks_a_bf16_neighbour_with_the_right_odds():
    """One step on 65536 weights spread over many binades: each new weight is one of the two bf16 neighbours of
    the exact fp32 value, the one away from zero as often as where the value lies between them says."""
    n, lr = 65536, 3e-5
    g = torch.Generator().manual_seed(5)
    w, grad = (0.05 * torch.randn(n, generator=g)).to(torch.bfloat16), _signs(n, seed=6)
    p, _ = _exact_steps("stochastic", w, grad, 1, lr=lr)
    x = w.float() - torch.tensor(lr, dtype=torch.float32) * grad.float()  # the kernel's fp32 value (see _signs)
    xb, pb = _bits(x), _bits(p)
    low = xb & 0xFFFF  # where x lies between its neighbours, in 2^-16 ulps
    toward_zero = xb - low  # the neighbour toward zero (x's top 16 bits), and the one away from it
    away = (pb == toward_zero + 0x10000) & (low != 0)
    neighbour = (pb == toward_zero) | away
    record(f"stochastic: {int(neighbour.sum())} of {n} values are a bf16 neighbour of the fp32 value", 0.0, 0.0,
           bool(neighbour.all()))
    # Each value goes away from zero with probability q = low / 2^16, independently: the number that do has
    # mean sum(q) and variance sum(q (1 - q)); 5 standard deviations
    q = low.double() / 65536
    err, tol = abs(float(away.sum() - q.sum())), 5 * float((q * (1 - q)).sum()) ** 0.5
    record(f"stochastic: {int(away.sum())} rounded away from zero, {float(q.sum()):.0f} expected", err, tol, err <= tol)


def test_stochastic_rounding_draws_new_bits_each_step(monkeypatch):
    """Capturable mode, as a replayed CUDA graph runs it: the same weights, gradients and rate at every call,
    only the step count on the device advancing. Each count draws its own bits (so successive calls round
    differently), the same count the same bits (a resumed run draws what the uninterrupted one drew), without
    reading anything on the host; two parameters with the same values draw different bits (each its own salt),
    a different seed other bits; and the host path, which hashes its CPU count, draws the very same ones."""
    n, lr = 9000, 3e-5  # two of the interpreter's blocks, the second one masked
    g = torch.Generator().manual_seed(8)
    w, grad = (0.05 * torch.randn(n, generator=g)).to(torch.bfloat16), _signs(n, seed=9)

    def calls(counts, capturable=True, seed=0):
        params = [w.to(DEVICE, copy=True), w.to(DEVICE, copy=True)]
        rate = torch.tensor(lr, device=DEVICE) if capturable else lr
        opt = TritonAdamW(params, lr=rate, betas=(0.0, 0.0), weight_decay=0.0, rounding="stochastic",
                          capturable=capturable, seed=seed)
        out = []
        for count in counts:
            for p in params:
                p.detach().copy_(w)  # the same inputs every time
                p.grad = grad.to(DEVICE)
                if p in opt.state:
                    opt.state[p]["step"].fill_(count - 1)  # in place, as a graph's count is advanced
            with monkeypatch.context() as trap:
                if opt.state and capturable:  # (the first step builds the tables, from host lists)
                    _refuse_host_reads(trap)
                opt.step()
            out.append([p.detach().clone() for p in params])
        return out

    x = w.float() - torch.tensor(lr, dtype=torch.float32) * grad.float()
    q = (_bits(x) & 0xFFFF).double() / 65536
    differ = 2 * q * (1 - q)  # the chance that two independent draws round an element differently

    def check_independent(name, a, b):
        # the number of elements rounded differently: mean sum(differ), variance sum(differ (1 - differ))
        got, expected = float((a != b).sum()), float(differ.sum())
        err, tol = abs(got - expected), 5 * float((differ * (1 - differ)).sum()) ** 0.5
        record(f"{name}: {got:.0f} of {n} rounded differently ({expected:.0f} expected)", err, tol, err <= tol)

    one, two, three, two_again = calls([1, 2, 3, 2])
    check_independent("step 1 vs step 2", one[0], two[0])
    check_independent("step 2 vs step 3", two[0], three[0])
    check_independent("two parameters, same values", one[0], one[1])
    check_independent("seed 0 vs seed 1", one[0], calls([1], seed=1)[0][0])
    for i in range(2):
        exactly(f"parameter {i}: step 2 again draws step 2's bits", two_again[i], two[i])
    host = calls([1, 2, 3, 2], capturable=False)
    for name, ours, theirs in zip(("1", "2", "3", "2 again"), (one, two, three, two_again), host):
        for i in range(2):
            exactly(f"capturable == host path, step {name}, parameter {i}", ours[i], theirs[i])


def test_kahan_tracks_the_fp32_master_where_nearest_drifts():
    """AdamW as the scripts run it (betas 0.9/0.999, weight decay, noisy gradients of a steady sign) for 32 steps
    of lr 1e-5 on 8192 weights near 0.02, each update under half an ulp: the fp32 master weights move several
    ulps, rounding to nearest none at all, and Kahan's weight + compensation stays within a small fraction of
    an ulp of the fp32 master, its bf16 weight within half an ulp (plus that)."""
    n, steps, lr = 8192, 32, 1e-5
    w = _near_002(n, seed=10)
    g = torch.Generator().manual_seed(11)
    sign = _signs(n, seed=12).float()
    grads = [(sign * (1 + 0.5 * torch.randn(n, generator=g))).to(torch.bfloat16) for _ in range(steps)]

    def run(rounding):
        p = w.to(DEVICE, copy=True)
        opt = TritonAdamW([p], lr=lr, weight_decay=0.1, rounding=rounding)
        for grad in grads:
            p.grad = grad.to(DEVICE)
            opt.step()
        return p.double().cpu(), {k: v.cpu() for k, v in opt.state[p].items()}

    _, master_state = run("fp32-master")
    master = master_state["master_param"].double()
    moved = float((master - w.double()).abs().mean()) / ULP_NEAR_002
    nearest, _ = run("nearest")
    exactly(f"nearest: no weight moved (the fp32 master moved {moved:.1f} ulps on average)", nearest, w.double())
    assert moved > 2, "the updates must add up to whole ulps, or the test shows nothing"
    kahan, kahan_state = run("kahan")
    # Each step rounds the compensation c (|c| <= ulp / 2) to bf16, which is off by at most 2^-8 |c| <= 2^-9 ulp.
    # Kahan's fp32 roundings of w + c, of the decay and of the update, and the master's of the last two, each
    # at most half an fp32 ulp (2^-16 bf16 ulps here) and five of them, add less than 2^-13 ulp. S steps:
    tol = steps * (2.0**-9 + 2.0**-13) * ULP_NEAR_002
    err = float((kahan + kahan_state["kahan_comp"].double() - master).abs().max())
    record(f"kahan: weight + compensation vs the fp32 master, {steps} steps", err, tol, err <= tol)
    err = float((kahan - master).abs().max())
    record("kahan: the bf16 weight vs the fp32 master (half an ulp)", err, ULP_NEAR_002 / 2 + tol,
           err <= ULP_NEAR_002 / 2 + tol)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "fp32-master"])
def test_rounding_state_dict_round_trip_is_exact(rounding):
    """2 steps, save (through a file), load into a fresh optimizer, 2 more == 4 steps straight, bit for bit:
    the Kahan compensation and the fp32 master are saved and loaded (the master as fp32: PyTorch's loader
    would round it to bf16), and stochastic rounding's bits depend on the seed and counts only."""
    shapes = SHAPES[:5]  # small: the interpreter's time goes to the 70001-element tensor
    start, grads = _start(shapes), _gradients(shapes, STEPS)
    make = functools.partial(TritonAdamW, rounding=rounding, seed=11)
    dtypes = (torch.bfloat16,)
    straight, opt_straight = _train(make, start, grads, dtypes)
    first, opt_first = _train(make, start, grads, dtypes, steps=range(2))
    saved = _through_a_file(opt_first.state_dict())
    params = [p.detach().clone() for p in first]
    opt = make(_groups(params))
    opt.load_state_dict(saved)
    buffer = adamw_kernel._BUFFERS.get(rounding)
    for p, old in zip(params, first):
        if buffer and old in opt_first.state:
            loaded = opt.state[p][buffer]
            assert loaded.dtype == opt_first.state[old][buffer].dtype, (buffer, loaded.dtype)
            exactly(f"{rounding}: {buffer} {list(p.shape)} loaded as saved", loaded, opt_first.state[old][buffer])
    resumed, opt = _train(make, start, grads, dtypes, steps=range(2, STEPS), opt=opt, params=params)
    for a, b in zip(resumed, straight):
        exactly(f"{rounding}: resumed {list(a.shape)} param", a, b)
        if b in opt_straight.state:
            assert opt.state[a].keys() == opt_straight.state[b].keys()
            for key in opt_straight.state[b]:
                exactly(f"{rounding}: resumed {list(a.shape)} {key}", opt.state[a][key], opt_straight.state[b][key])


def test_a_checkpoint_of_another_rounding_loads():
    """Each optimizer keeps its own rounding: a buffer the checkpoint lacks starts from the weights (a zero
    compensation, a master equal to the bf16 weight); one this rounding does not use is dropped, so that a
    stale fp32 master cannot come back at a later resume."""
    p0 = torch.randn(33, 7, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.bfloat16)
    grad = torch.randn(33, 7, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.bfloat16)
    saved = {}
    for rounding in adamw_kernel.ROUNDINGS:
        p = p0.clone()
        opt = TritonAdamW([p], lr=1e-2, rounding=rounding)
        p.grad = grad
        opt.step()
        saved[rounding] = (p, _through_a_file(opt.state_dict()))
    for (before, after) in (("nearest", "kahan"), ("fp32-master", "kahan"), ("kahan", "nearest"),
                            ("kahan", "fp32-master"), ("fp32-master", "stochastic")):
        p = saved[before][0].clone()
        opt = TritonAdamW([p], lr=1e-2, rounding=after)
        opt.load_state_dict(saved[before][1])
        assert opt.param_groups[0]["rounding"] == after, "the optimizer's own rounding, not the checkpoint's"
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, (before, after, set(opt.state[p]))
        p.grad = grad
        opt.step()
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} | (
            {adamw_kernel._BUFFERS[after]} if after in adamw_kernel._BUFFERS else set()), (before, after)
    record("a checkpoint of each rounding loads into another: buffers made or dropped", 0.0, 0.0, True)


def test_rounding_refusals():
    """Only bf16 weights lose updates to rounding: stochastic and Kahan rounding refuse other dtypes, the fp32
    master refuses fp32 weights; an unknown rounding is refused when the optimizer is made."""
    expect_error(ValueError, lambda: TritonAdamW([torch.zeros(3, device=DEVICE)], rounding="up"))
    for rounding, dtype in (("stochastic", torch.float32), ("kahan", torch.float16), ("fp32-master", torch.float32)):
        p = torch.zeros(5, device=DEVICE, dtype=dtype)
        p.grad = torch.ones_like(p)
        assert rounding in expect_error(ValueError, TritonAdamW([p], rounding=rounding).step)
    p = torch.zeros(5, device=DEVICE, dtype=torch.float16)  # fp16 and an fp32 master: allowed
    p.grad = torch.ones_like(p)
    opt = TritonAdamW([p], lr=1e-3, rounding="fp32-master")
    opt.step()
    exactly("fp16 + fp32 master: the weight is the master rounded", p, opt.state[p]["master_param"].half())


def test_rounding_options_on_the_command_line(monkeypatch, capsys):
    """--optimizer-rounding and --master-weights: the default unchanged (nearest, and PyTorch's AdamW: its fused
    form on a GPU, its foreach form on a CPU); either one asks for the Triton AdamW and reaches it through
    make_optimizer (in backward, with a seed per parameter); a combination that makes no sense is refused with
    one line and exit code 2."""
    cfg = _config()
    pytorchs = "adamw-fused" if torch.cuda.is_available() else "adamw-foreach"
    assert (cfg.training.optimizer_rounding, cfg.training.master_weights, cfg.training.optimizer) == ("nearest", "none",
                                                                                                      pytorchs)
    model = models.build_preset("llama-tiny", 1, DEVICE, torch.bfloat16)
    for argv, rounding in ((["--optimizer-rounding", "stochastic"], "stochastic"),
                           (["--optimizer-rounding", "kahan", "--optimizer", "adamw-triton"], "kahan"),
                           (["--master-weights", "fp32"], "fp32-master")):
        cfg = _config(*argv, "--seed", "5")
        assert cfg.training.optimizer == "adamw-triton" and weight_rounding(cfg.training) == rounding, argv
        opt = make_optimizer(model, cfg.training, cfg.run)
        assert isinstance(opt, TritonAdamW)
        assert all(g["rounding"] == rounding and g["seed"] == 5 for g in opt.param_groups)
    in_backward = _config("--optimizer-rounding", "stochastic", "--optimizer-in-backward")
    opt = make_optimizer(model, in_backward.training, in_backward.run)
    seeds = [g["seed"] for g in opt.param_groups]
    assert all(g["rounding"] == "stochastic" for g in opt.param_groups) and len(set(seeds)) == len(seeds)

    def refused(*argv, script="finetune_optimized", gpu=False, world=1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("MASTER_ADDR", "localhost")  # as torchrun sets them (parse_config checks)
        monkeypatch.setenv("MASTER_PORT", "29500")
        with pytest.raises(SystemExit) as info:
            if script == "distill":
                import distill

                distill.parse_args(list(argv))
            else:
                _config(*argv, script=script)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        return err

    assert "Triton AdamW" in refused("--optimizer-rounding", "stochastic", "--optimizer", "adamw-foreach")
    assert "Triton AdamW" in refused("--optimizer-rounding", "kahan", "--optimizer", "adamw-fused", gpu=True)
    assert "Triton AdamW" in refused("--master-weights", "fp32", "--optimizer", "adamw-fused", gpu=True)
    assert "give one of them" in refused("--optimizer-rounding", "kahan", "--master-weights", "fp32")
    assert "fp32" in refused("--optimizer-rounding", "stochastic", "--lora-r", "4")
    assert "Trainer" in refused("--optimizer-rounding", "stochastic", script="finetune_trainer")
    assert "Trainer" in refused("--master-weights", "fp32", script="finetune_trainer", gpu=True, world=2)
    assert "float32" in refused("--dtype", "float32", "--optimizer-rounding", "kahan", script="distill")
    record("--optimizer-rounding / --master-weights: 8 combinations refused (exit code 2, one line)", 0.0, 0.0, True)


def test_the_default_rounding_is_left_to_the_run_start(monkeypatch):
    """No --optimizer-rounding and no --master-weights: a full fine-tune whose bf16 weights the Triton AdamW
    updates leaves its rounding "auto", which memory_plan.start settles (tests/memory_plan_test.py: kahan where
    it fits, else stochastic); every other run keeps rounding to nearest, which is all its optimizer does or
    all its fp32 weights need; a rounding on the command line is kept as given. An optimizer made from a
    RunConfig no run start settled rounds to nearest."""
    import distill

    from playbook.model.registry import DEFAULT_KERNELS

    def rounding(*argv, script="finetune_optimized", gpu=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        if script == "distill":
            cfg = distill.parse_args(list(argv))
        else:
            cfg = parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), script, list(argv))
        return cfg.training.optimizer, cfg.training.optimizer_rounding, weight_rounding(cfg.training)

    assert rounding() == ("adamw-triton", "auto", "nearest")  # the GPU default: chosen as the run starts
    assert rounding("--optimizer-in-backward", "--fp8") == ("adamw-triton", "auto", "nearest")
    assert rounding("--optimizer", "adamw-triton", gpu=False) == ("adamw-triton", "auto", "nearest")
    assert rounding("--optimizer", "adamw-triton", script="distill", gpu=False)[1] == "auto"
    got = {
        "CPU": rounding(gpu=False), "--lora-r 16": rounding("--lora-r", "16"),
        "--kernels rmsnorm": rounding("--kernels", "rmsnorm"),
        "Trainer": rounding(script="finetune_trainer"),
        "distill --dtype float32": rounding("--dtype", "float32", "--optimizer", "adamw-triton", script="distill",
                                            gpu=False),
    }
    assert all(r == "nearest" and w == "nearest" for _, r, w in got.values()), got
    assert rounding("--optimizer-rounding", "nearest") == ("adamw-triton", "nearest", "nearest")
    assert rounding("--optimizer-rounding", "kahan") == ("adamw-triton", "kahan", "kahan")
    assert rounding("--optimizer-rounding", "stochastic", gpu=False) == ("adamw-triton", "stochastic", "stochastic")
    assert rounding("--master-weights", "fp32") == ("adamw-triton", "nearest", "fp32-master")
    record("the default rounding: 'auto' for a full fine-tune with the Triton AdamW, nearest elsewhere", 0.0, 0.0, True)


def test_training_script_resumes_a_kahan_run_exactly(tmp_path, capsys):
    """finetune_optimized --optimizer-rounding kahan: 3 steps straight == 1 step, a checkpoint (playbook/store/checkpoint.py)
    and a resumed run of 2, bit for bit: weights, losses and optimizer state, the compensation included. The
    same checkpoint resumed without the flag takes the rounding its run start chooses, and says so where it
    differs from the checkpoint's."""
    from playbook.store import checkpoint_load

    args = ["--model", "llama-tiny", "--num-layers", "1", "--optimizer-rounding", "kahan", "--steps", "3",
            "--timing-warmup-steps", "1", "--lr", "1e-4", "--kernels", "none", "--batch-size", "2", "--seq-len", "16"]
    whole = _run(*args, "--output-dir", str(tmp_path / "whole"), "--save-every", "1", tag="test_adamw_kahan_whole")
    resumed = _run(*args, "--output-dir", str(tmp_path / "resumed"), "--resume",
                   str(tmp_path / "whole" / "checkpoint-1"), tag="test_adamw_kahan_resumed")
    assert whole["optimizer"] == "adamw-triton, Kahan-compensated" and whole["config"]["optimizer_rounding"] == "kahan"
    assert resumed["losses"] == whole["losses"], (resumed["losses"], whole["losses"])
    a, b = tmp_path / "whole" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    saved_a, saved_b = (checkpoint_load._read_state(p)["optimizer"]["state"] for p in (a, b))
    assert saved_a.keys() == saved_b.keys() and all("kahan_comp" in s for s in saved_a.values())
    assert any(s["kahan_comp"].abs().max() > 0 for s in saved_a.values()), "the compensation holds something"
    for i in saved_a:
        for key in saved_a[i]:
            exactly(f"checkpoint-3 optimizer state {i} {key}", saved_b[i][key], saved_a[i][key])
    capsys.readouterr()
    plain = [w for w in args if w not in ("--optimizer-rounding", "kahan")] + ["--optimizer", "adamw-triton"]
    plain[plain.index("--steps") + 1] = "2"  # one step after the checkpoint
    default = _run(*plain, "--resume",
                   str(tmp_path / "whole" / "checkpoint-1"), tag="test_adamw_kahan_default")
    chosen = "kahan" if DEVICE.type == "cuda" else "stochastic"  # (memory_plan_test.py: the choice itself)
    out = capsys.readouterr().out
    assert default["config"]["optimizer_rounding"] == chosen and f"Optimizer rounding: {chosen} (" in out, out
    assert len(default["losses"]) == 2 and default["losses"][0] == whole["losses"][0], default["losses"]
    assert all(math.isfinite(loss) for loss in default["losses"])
    assert (chosen == "kahan") == ("The checkpoint's run rounded its weights with 'kahan'" not in out), out


# ------------------------------------------------------------------------------------------------
# Sharded parameters (FSDP2): two processes under torchrun, one GPU each (NCCL) where the machine has two,
# else on the CPU (gloo; testkit.two_process_env)
# ------------------------------------------------------------------------------------------------
SHARDED_ROUNDINGS = ("nearest", "kahan", "fp32-master", "stochastic")


def _sharded_worker(out: Path) -> int:
    """Runs under torchrun, called by test_sharded_steps_match_unsharded: for each rounding, one model
    sharded by FSDP2 (models.shard_model) and an unsharded copy, each with its TritonAdamW. The sharded
    model's forward and backward make the gradients (each rank its own batch, FSDP2 averaging them); the
    unsharded copy is given the very same gradients, gathered whole (`full_tensor()`), so that the two
    optimizers see the same values and any difference is the optimizer's. Rank 0 writes both models'
    weights and optimizer states, gathered whole, after the steps."""
    import copy

    import torch.distributed as dist

    device = two_process_device()
    models.init_distributed(device)  # NCCL on this rank's GPU, or gloo on the CPU
    rank = dist.get_rank()
    steps = {"stochastic": 1}  # one step: the test's one-ulp bound holds for one rounding, not for a chain of them
    results = {}
    for rounding in SHARDED_ROUNDINGS:
        whole = models.build_preset("llama-tiny", 2, device, torch.bfloat16)
        sharded = models.shard_model(copy.deepcopy(whole))
        optimizers = [TritonAdamW(param_groups(m, 0.1), lr=1e-2, rounding=rounding, seed=3)
                      for m in (whole, sharded)]
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, as in training
        for _ in range(steps.get(rounding, 3)):
            ids = torch.randint(0, whole.config.vocab_size, (2, 16), generator=gen).to(device)
            sharded(input_ids=ids, labels=ids).loss.backward()
            for p, q in zip(whole.parameters(), sharded.parameters(), strict=True):
                p.grad = q.grad.full_tensor()  # a collective: every rank's whole model gets the same gradient
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        names = [n for n, _ in whole.named_parameters()]
        got = {"whole": {}, "sharded": {}}
        for key, model, opt in (("whole", whole, optimizers[0]), ("sharded", sharded, optimizers[1])):
            for name, p in zip(names, model.parameters(), strict=True):
                full = {k: v.full_tensor() if adamw_kernel._is_dtensor(v) else v for k, v in opt.state[p].items()}
                got[key][name] = {"param": p.detach().full_tensor() if key == "sharded" else p.detach(), **full}
        got["shard_index"] = [adamw_kernel._shard_index(q) for q in sharded.parameters()]
        results[rounding] = got
    q = next(sharded.parameters())  # a whole, plain gradient for a sharded parameter: refused, in one line
    q.grad = torch.zeros(q.shape, dtype=q.dtype, device=device)
    try:
        TritonAdamW([q]).step()
        results["refusal"] = None
    except ValueError as err:
        results["refusal"] = str(err)
    if rank == 0:
        torch.save(results, out / "sharded.pt")
    (out / f"rank{rank}.txt").write_text(str(results["nearest"]["shard_index"][0]))
    dist.destroy_process_group()
    return 0


def test_sharded_steps_match_unsharded(tmp_path):
    """FSDP2, 2 processes (testkit.two_process_env): TritonAdamW on sharded parameters (each process its shard,
    states DTensors shaped like their parameters) leaves the weights and every state bit for bit where the unsharded TritonAdamW leaves them,
    given the same gradients, after 3 steps, for nearest, Kahan and fp32-master rounding.

    Bitwise, not a tolerance: AdamW is element-wise, so each element of a shard goes through the very
    operations, in the same order and on the same values, as that element of the whole tensor; only which
    program of which launch computes it differs. Stochastic rounding draws its bits per shard (its own salt,
    its own chunks): after one step every weight is one of the two bf16 neighbours of the same exact value,
    so the two runs lie at most one bf16 ulp apart, and not everywhere equal (the bits are not the same)."""
    import subprocess

    out = subprocess.run(testkit.torchrun(str(HERE / "adamw_test.py"), "--sharded-worker", str(tmp_path)),
                         cwd=HERE, capture_output=True, text=True, timeout=600,
                         env=two_process_env(OMP_NUM_THREADS="1", PYTHONPATH=python_path(HERE)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["0", "1"], "each rank holds its own shard"
    results = torch.load(tmp_path / "sharded.pt", map_location="cpu")
    assert "must be a DTensor sharded as it is" in results["refusal"] and "\n" not in results["refusal"], results["refusal"]
    for rounding in SHARDED_ROUNDINGS:
        whole, sharded = results[rounding]["whole"], results[rounding]["sharded"]
        assert whole.keys() == sharded.keys() and len(whole) > 0
        for name, states in whole.items():
            assert states.keys() == sharded[name].keys(), (rounding, name)
            if rounding == "stochastic":
                continue
            for key, value in states.items():
                exactly(f"{rounding}: {name} {key}, sharded vs unsharded", sharded[name][key], value)
        if rounding != "stochastic":
            record(f"FSDP2 (2 processes), {rounding}: weights and states == unsharded, bit for bit, 3 steps",
                   0.0, 0.0, True)
    whole, sharded = results["stochastic"]["whole"], results["stochastic"]["sharded"]
    a = torch.cat([whole[n]["param"].float().flatten() for n in whole])
    b = torch.cat([sharded[n]["param"].float().flatten() for n in whole])
    ulp = torch.where(a == 0, torch.zeros_like(a), 2.0 ** (torch.floor(torch.log2(a.abs())) - 7))
    assert bool(((a - b).abs() <= ulp).all()), "stochastic: more than one bf16 ulp apart after one step"
    assert not torch.equal(a, b), "stochastic: the shards draw their own bits, so some weights differ"
    record("FSDP2, stochastic rounding: within one bf16 ulp of unsharded after one step, bits drawn per shard",
           float((a != b).float().mean()), 0.0, True)


# ------------------------------------------------------------------------------------------------
# On a GPU only
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="the compiled kernel (PTX) needs a CUDA GPU")
def test_gpu_kernel_loads_16_bytes_at_a_time(monkeypatch):
    """The compiled kernel moves 16 bytes per load and store in its full blocks: the alignment hints
    reach the compiler through the int -> pointer casts (without them: 2-byte accesses)."""
    kernel = _CountingKernel(adamw_kernel._adamw_multi_tensor)
    monkeypatch.setattr(adamw_kernel, "_adamw_multi_tensor", kernel)
    p = torch.randn(4096, 1000, device=DEVICE, dtype=torch.bfloat16)
    p.grad = torch.randn_like(p)
    for capturable in (False, True):  # capturable: the same loop, its scalars loaded once per program
        lr = torch.tensor(1e-3, device=DEVICE) if capturable else 1e-3
        TritonAdamW([p], lr=lr, capturable=capturable).step()
        ptx = kernel.compiled[-1].asm["ptx"]
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "the full blocks must use 16-byte loads and stores"
        mode = "capturable" if capturable else "host path"
        record(f"PTX ({mode}): 16-byte loads and stores (ld/st.global.v4)", 0.0, 0.0, True)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_gpu_step_can_be_captured_in_a_cuda_graph():
    """After one eager step (which builds the tables), a step of the host path captures too; its replays
    update in place (with the captured step's bias corrections and lr, as any capture of a non-capturable
    optimizer). A parameter set without a table yet is refused inside capture, with a clear error."""
    p = torch.randn(1000, 77, device=DEVICE, dtype=torch.bfloat16)
    p.grad = torch.randn_like(p)
    opt = TritonAdamW([p], lr=1e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    before = p.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(p, before), "a replay must update the parameter"
    q = torch.randn(64, device=DEVICE)
    q.grad = torch.randn_like(q)
    with pytest.raises(RuntimeError, match="before capturing"):  # its first step builds its table: not in a graph
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            TritonAdamW([q], lr=1e-2, capturable=True).step()


def _gpu_steps_match(tag, params, opt, ref_params, ref_opt):
    """Parameters, states and step counts bit for bit those of the reference (the host path, run eagerly)."""
    for i, (p, r) in enumerate(zip(params, ref_params)):
        exactly(f"{tag}: param {i} {list(p.shape)}", p, r)
        for key in ("exp_avg", "exp_avg_sq"):
            exactly(f"{tag}: param {i} {key}", opt.state[p][key], ref_opt.state[r][key])
        step = opt.state[p]["step"]
        assert step.device == p.device and float(step) == float(ref_opt.state[r]["step"]), (tag, i)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_gpu_capturable_training_step_replays_in_a_cuda_graph():
    """Forward, backward and a capturable TritonAdamW step, captured as one CUDA graph after one eager
    step (as playbook/run/cuda_graph.py captures the training step) and replayed with new inputs and a new
    rate each time: each replay updates parameters and states exactly as the host-path TritonAdamW,
    run eagerly on the same gradients at the same rate, does.

    Bit for bit, not by the rule: both paths hand the kernel the same fp32 scalars (bias corrections
    and step sizes in float64 from the same counts and rate, rounded once: on the host, or on the GPU
    by _device_scalars) and the kernel's arithmetic is the same, so any difference is a bug (a stale
    gradient address, a rate or count the graph did not see change). The one conceivable exception:
    the GPU's float64 pow and the host's differing in their last bit exactly where that moves an fp32
    rounding of a step size (about 1e-6 per value); it would show here as 1 ulp, the same on every run.
    The reference is given the graph's own gradients rather than its own backward's, so that a
    difference can only come from the optimizer."""
    torch.manual_seed(0)
    # 320 x 320 = 102400 elements: two 65536-element chunks, the second a partial one
    model = torch.nn.Sequential(torch.nn.Linear(96, 320), torch.nn.GELU(), torch.nn.Linear(320, 320),
                                torch.nn.GELU(), torch.nn.Linear(320, 8)).to(DEVICE, torch.bfloat16)
    params = list(model.parameters())
    ref_params = [p.detach().clone() for p in params]

    def groups(ps, lr):  # a decay and a no-decay group, as the training scripts make them
        return [dict(params=[p for p in ps if p.dim() >= 2], weight_decay=0.1, lr=lr),
                dict(params=[p for p in ps if p.dim() < 2], weight_decay=0.0, lr=lr)]

    n_steps = 6
    rates = [_fp32(3e-3 * 0.8**i) for i in range(n_steps)]  # as the rate tensor holds them
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 96, generator=g).to(DEVICE, torch.bfloat16) for _ in range(n_steps)]
    ys = [torch.randn(16, 8, generator=g).to(DEVICE, torch.bfloat16) for _ in range(n_steps)]
    lr = torch.tensor(rates[0], dtype=torch.float32, device=DEVICE)
    opt = TritonAdamW(groups(params, lr), lr=lr, capturable=True)
    ref_opt = TritonAdamW(groups(ref_params, rates[0]), lr=rates[0])
    static_x, static_y = xs[0].clone(), ys[0].clone()

    def train_step():
        loss = torch.nn.functional.mse_loss(model(static_x).float(), static_y.float())
        loss.backward()
        opt.step()

    def reference_step(i, tag):
        for r, p in zip(ref_params, params):
            r.grad = p.grad.clone()
        for group in ref_opt.param_groups:
            group["lr"] = rates[i]
        ref_opt.step()
        _gpu_steps_match(tag, params, opt, ref_params, ref_opt)

    # Step 1 eagerly, on a side stream (PyTorch's recipe for capturing a whole network): it creates the
    # states, compiles the kernel and builds the address tables, none of which a capture could hold.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        train_step()
    torch.cuda.current_stream().wait_stream(side)
    reference_step(0, "eager step 1")

    warm_grads = [p.grad for p in params]  # kept alive: the graph's gradients cannot take their memory
    opt.zero_grad(set_to_none=True)  # so that the captured backward creates them, in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    moved = sum(p.grad.data_ptr() != w.data_ptr() for p, w in zip(params, warm_grads))
    assert moved == len(params), "the captured step's gradients are new tensors"
    record(f"captured with {moved} gradients at new addresses (copied into the table by the graph)", 0.0, 0.0, True)
    del warm_grads
    for i in range(1, n_steps):
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        lr.fill_(rates[i])  # in place: the graph reads this tensor
        graph.replay()
        reference_step(i, f"replay {i} (step {i + 1})")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_gpu_each_graph_copies_its_own_gradient_addresses():
    """Two graphs of one optimizer, captured with different gradient tensors, and eager steps between
    replays: each replay uses its own graph's gradients, whatever address the table held last (the one
    the other graph, or an eager step, wrote). Bit for bit the host path fed the same gradients in the same
    order (see the test above for why bitwise)."""
    g = torch.Generator().manual_seed(3)
    p = torch.randn(300, 257, generator=g).to(DEVICE, torch.bfloat16)  # 77100 elements: two chunks
    grads = [torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16) for _ in range(4)]  # each its own memory
    ref = p.clone()
    lr = torch.tensor(1e-2, device=DEVICE)
    opt = TritonAdamW([p], lr=lr, capturable=True)
    ref_opt = TritonAdamW([ref], lr=_fp32(1e-2))

    def capture(i):
        p.grad = grads[i]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        return graph

    def eager(i):
        p.grad = grads[i]
        opt.step()

    def expect(i, tag):
        ref.grad = grads[i]
        ref_opt.step()
        _gpu_steps_match(tag, [p], opt, [ref], ref_opt)

    eager(0)
    expect(0, "eager step, gradient 0")
    graph_1 = capture(1)
    eager(2)  # between two captures: also makes the row the next capture takes
    expect(2, "eager step, gradient 2")
    graph_3 = capture(3)  # the table was last told gradient 3's address
    graph_1.replay()
    expect(1, "graph 1 replayed, gradient 1")
    eager(3)  # the same gradient tensor as the table was last told of, but graph 1's replay rewrote the row
    expect(3, "eager step, gradient 3 after a replay")
    graph_3.replay()
    expect(3, "graph 3 replayed, gradient 3")
    eager(0)  # the table now holds gradient 0's address
    expect(0, "eager step, gradient 0")
    graph_1.replay()
    expect(1, "graph 1 replayed after an eager step, gradient 1")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_gpu_two_captures_in_a_row():
    """Two captures with no eager step between: the second finds no spare page-locked row (the first took
    it) and allocates one inside capture, which PyTorch's pinned-memory allocator serves from the graph's
    own host pool. Each graph then replays its own gradients, bit for bit the host path's steps."""
    g = torch.Generator().manual_seed(4)
    p = torch.randn(513, 129, generator=g).to(DEVICE, torch.bfloat16)
    grads = [torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    ref = p.clone()
    opt = TritonAdamW([p], lr=torch.tensor(1e-2, device=DEVICE), capturable=True)
    ref_opt = TritonAdamW([ref], lr=_fp32(1e-2))
    graphs = []
    for i in range(3):
        p.grad = grads[i]
        if i == 0:
            opt.step()
            continue
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            opt.step()
    for i in (0, 1, 2, 1):
        if i:
            graphs[i - 1].replay()
        ref.grad = grads[i]
        ref_opt.step()
        _gpu_steps_match(f"gradient {i}", [p], opt, [ref], ref_opt)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "fp32-master"])
def test_gpu_rounding_replays_in_a_cuda_graph(rounding):
    """A capturable step with each rounding, captured after one eager step and replayed with new gradients:
    each replay gives the host path's eager step bit for bit, the rounding's buffer included. Stochastic
    rounding: the count the replay advances on the device picks its bits, so replays draw what eager steps
    with those counts draw (and not the captured step's bits again)."""
    g = torch.Generator().manual_seed(14)
    p = (0.02 * torch.randn(300, 257, generator=g)).to(DEVICE, torch.bfloat16)  # 77100 elements: two chunks
    grads = [torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16) for _ in range(4)]
    ref = p.clone()
    static_grad = torch.zeros_like(p)
    opt = TritonAdamW([p], lr=torch.tensor(1e-4, device=DEVICE), rounding=rounding, capturable=True, seed=2)
    ref_opt = TritonAdamW([ref], lr=_fp32(1e-4), rounding=rounding, seed=2)

    def expect(i, tag):
        ref.grad = grads[i]
        ref_opt.step()
        exactly(f"{rounding}, {tag}: param", p, ref)
        for key in ref_opt.state[ref]:
            exactly(f"{rounding}, {tag}: {key}", opt.state[p][key].cpu(), ref_opt.state[ref][key].cpu())

    p.grad = static_grad  # one gradient tensor, refilled before each replay
    static_grad.copy_(grads[0])
    opt.step()  # eager: the states, the buffer and the table
    expect(0, "eager step 1")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for i in range(1, len(grads)):
        static_grad.copy_(grads[i])
        graph.replay()
        expect(i, f"replay {i} (step {i + 1})")


@pytest.mark.skipif(not ON_GPU, reason="a GPU copy of a checkpoint's step count needs a CUDA GPU")
def test_gpu_loads_a_fused_adamw_checkpoint():
    """PyTorch's fused AdamW keeps `step` on the GPU; loaded into TritonAdamW it moves to the CPU once."""
    p = torch.randn(64, 3, device=DEVICE)
    p.grad = torch.randn_like(p)
    fused = torch.optim.AdamW([p], fused=True)
    fused.step()
    opt = TritonAdamW([p])
    opt.load_state_dict(fused.state_dict())
    assert opt.state[p]["step"].device.type == "cpu" and float(opt.state[p]["step"]) == 1
    opt.step()
    assert float(opt.state[p]["step"]) == 2


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sharded-worker"]:  # one of the two processes of test_sharded_steps_match_unsharded
        code = _sharded_worker(Path(sys.argv[2]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # without the interpreter's teardown, as tests/checkpoint_test.py's worker (it says why)
    raise SystemExit(run_as_script(__name__, "TritonAdamW: test report"))
