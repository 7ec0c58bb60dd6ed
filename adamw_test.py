"""Tests of TritonAdamW (adamw_kernel.py): steps against PyTorch's AdamW, one launch per group, state
dicts and checkpoints, refusals, and the training scripts' `--optimizer adamw-triton`.

    $ python adamw_test.py       # a readable report
    $ pytest adamw_test.py

Tolerances follow playbook/testkit.py's rule, after the same steps on the same gradients: every parameter and
state may be at most 2x as far from PyTorch's single-tensor AdamW (foreach=False) run in float64, the
truth, as PyTorch's fused AdamW run in the tested dtype is, plus one ulp of the tensor's scale. The
fused one is the yardstick because it computes as the kernel does (fp32 arithmetic, one rounding per
stored value); the single-tensor AdamW rounds after each of its eight ops, and in fp16 its
exp_avg_sq underflows to 0 and its updates blow up, which would make any tolerance derived from it
meaningless. On a CPU the kernel runs in Triton's interpreter, which is made to round to bf16 as a
GPU does (see `_round_like_a_gpu`), so the same rule holds there.
Results that must not depend on rounding at all (a resumed run, a copied gradient, a transposed
parameter, the in-backward variant) are checked bitwise.
"""

import io
from pathlib import Path

import pytest
import torch

import adamw_kernel
from playbook import common
from playbook import models
from playbook import training
from adamw_kernel import TritonAdamW, adamw_ref, ideal_bytes
from playbook.kernel_utils import DEVICE
from playbook.config import make_parser, parse_config
from playbook.testkit import close_to_reference, exactly, expect_error, record, run_as_script

ON_GPU = DEVICE.type == "cuda"
HERE = Path(__file__).resolve().parent
TEXT = HERE / "examples" / "chat.jsonl"  # real text for the tiny training runs, in a file no code change edits

# Odd shapes; an empty tensor; one element; 70001 elements span two 65536-element chunks, the second
# ending in a masked partial block.
SHAPES = [(37, 53), (129,), (0,), (1, 1), (3, 5, 7), (70001,)]
STEPS = 4


def _groups(params):
    """Two param groups with different hyperparameters, as a decay / no-decay split has."""
    return [dict(params=params[0::2], lr=1e-2, weight_decay=0.1),
            dict(params=params[1::2], lr=3e-3, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6)]


def _lr_factor(step):
    return (step + 1) / 2 if step < 2 else 0.7**step  # warm-up, then decay: lr changes every step


def _gradients(shapes, steps, seed=0):
    """Random gradients per step; parameter 3 has none at step 1 (skipped: its step count falls behind)."""
    g = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    if steps > 1 and len(shapes) > 3:
        grads[1][3] = None
    return grads


def _train(make, start, grads, dtypes, steps=None, opt=None, params=None):
    """Step an optimizer made by `make(groups)` on copies of `start`, the i-th in dtypes[i % len]."""
    if params is None:
        params = [t.to(DEVICE, dtypes[i % len(dtypes)]) for i, t in enumerate(start)]
    opt = opt or make(_groups(params))
    base = [g["lr"] for g in opt.param_groups]
    for step in steps or range(len(grads)):
        for p, gr in zip(params, grads[step]):
            p.grad = None if gr is None else gr.to(DEVICE, p.dtype)
        for group, lr in zip(opt.param_groups, base):
            group["lr"] = lr * _lr_factor(step)
        opt.step()
    for group, lr in zip(opt.param_groups, base):
        group["lr"] = lr
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
        params = [t.to(DEVICE, dtype) for t in start]
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
    """torch.save and torch.load(weights_only=True), as playbook/checkpoint.py stores the optimizer."""
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
    """finetune_optimized --optimizer adamw-triton: trains, checkpoints (playbook/checkpoint.py), resumes bit for bit."""
    out = tmp_path / "ckpt"
    args = ["--model", "llama-tiny", "--num-layers", "1", "--optimizer", "adamw-triton", "--data", str(TEXT),
            "--steps", "4", "--timing-warmup-steps", "1", "--lr", "3e-3", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--kernels", "none", "--batch-size", "2", "--seq-len", "32", "--output-dir", str(out)]
    whole = _run(*args, "--save-every", "2", tag="test_adamw_whole")
    resumed = _run(*args, "--resume", str(out / "checkpoint-2"), tag="test_adamw_resumed")
    assert whole["optimizer"] == "adamw-triton"
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
        opt = training.make_optimizer(model, cfg)
        data = training.make_run_data(cfg, model, None)
        for i in range(2):
            training.training_step(model, opt, [data.batch(i, DEVICE)])
        params[in_backward] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if in_backward:
            assert all(p.grad is None for p in model.parameters()), "gradients are freed in backward"
    for name, p in params[False].items():
        exactly(f"in backward: {name}", params[True][name], p)


def test_command_line_refusals(monkeypatch):
    """The Trainer builds its own optimizer and FSDP2 shards parameters: adamw-triton refuses both."""
    with pytest.raises(SystemExit) as info:
        _config("--optimizer", "adamw-triton", script="finetune_trainer")
    assert info.value.code == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        _config("--optimizer", "adamw-triton")
    assert info.value.code == 2
    record("adamw-triton refused for the Trainer and for torchrun (exit code 2)", 0.0, 0.0, True)


def _config(*argv, script="finetune_optimized"):
    return parse_config(make_parser("test", kernels_default=()), script, list(argv))


def _run(*argv, tag):
    """One whole run of the training loop, as finetune_optimized.py runs it; returns the summary."""
    try:
        return training.train(_config("--tag", tag, "--overwrite", *argv))
    finally:
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (common.RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)


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
    record(f"8B bf16: {14 * n:,} B = {14 * n / 4.27e12 * 1e3:.1f} ms at 4.27 TB/s", 0.0, 0.0, True)


def test_benchmark_entry_checks_and_measures():
    """benchmark_kernels.py's adamw entry at its smoke size: every implementation passes the check
    against float64 and is measured; the byte count is this module's."""
    import benchmark_kernels as bk

    spec = bk.SPECS["adamw"]
    case = spec.smoke[0]
    assert sum(torch.Size(s).numel() for s in bk._adamw_shapes(case["n_params"])) == case["n_params"]
    rows = bk._measure_impls(spec, case, torch.bfloat16, spec.impls())
    assert [r["impl"].split(" +")[0] for r in rows] == ["ours", "torch-fused", "torch-foreach"]
    assert all(r["fwd_bytes"] == ideal_bytes(case["n_params"], torch.bfloat16) for r in rows)
    assert bk.kernel_list("adamw") == ("adamw",) and bk.kernel_list("all") == bk.KERNEL_NAMES


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
    TritonAdamW([p]).step()
    ptx = kernel.compiled[0].asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "the full blocks must use 16-byte loads and stores"
    record("PTX: 16-byte loads and stores (ld/st.global.v4)", 0.0, 0.0, True)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_gpu_step_can_be_captured_in_a_cuda_graph():
    """After one eager step (which builds the tables), a step captures; its replays update in place
    (with the captured step's bias corrections and lr, as any capture of a non-capturable optimizer)."""
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
    p.grad = torch.randn_like(p)  # new gradient memory: the table would need a copy, refused in capture
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()


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
    raise SystemExit(run_as_script(__name__, "TritonAdamW: test report"))
