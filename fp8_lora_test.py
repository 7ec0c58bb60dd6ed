"""Tests of LoRA on a frozen base kept in FP8 (fp8_lora_kernel.py): the stored weight, its forward and input
gradient within e4m3's worst case, the bytes left, a LoRA run against bf16 LoRA, and
`finetune_optimized.py --lora-r --fp8` with its checkpoint. Tolerances: fp8_linear_test.py's module
docstring, and the comment below.

    $ python fp8_lora_test.py     # a readable report
    $ pytest fp8_lora_test.py
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import math

import pytest
import torch
from torch import nn

from playbook.store.files import RESULTS_DIR
from playbook.model import models
from playbook.run import training
from core.kernel_utils import DEVICE
from testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script
from fp8_linear_kernel import (FP8_DTYPE, Float8Linear, compiled_graph_trusted, patch_model, quantize_rows,
                               quantize_rows_ref)
import fp8_lora_kernel
from fp8_lora_kernel import store_fp8_weight
import fp8_recipes_kernel
from fp8_linear_test import (ACC, MODEL_FACTOR, RMS_BOUND, SUB, U, bits, dequant_rows, gradients_close, run_config,
                             spread, tiny_llama, worst_ratio)

# ------------------------------------------------------------------------------ LoRA on a frozen FP8 base
# A frozen weight kept in FP8 (`store_fp8_weight`): one row-scaled e4m3 copy serves the
# forward (y = x W^T) and the input gradient (dx = dy W, W's row scales folded into dy's quantization).
# Tolerances: the quantized operands equal the references bit for bit; each matmul is within the worst
# case of its two e4m3 roundings (`_frozen_bound`: per element U of the value plus SUB of its scale, for
# each operand) and the bf16 output rounding, and its relative L2 error within RMS_BOUND; models within
# MODEL_FACTOR of bf16's distance from fp32, as the other FP8 model tests.
@pytest.mark.parametrize("shape", [(37, 48), (300, 16), (9, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_rows_with_column_factors_matches_reference(shape):
    """quantize_rows(dy, col_scale=s) quantizes dy * s[None, :] (fp32 product, in registers): the same
    bits as the reference on that product, in both loops of the row kernel (9 x 4096 double-buffers)."""
    dy = spread(shape, torch.bfloat16, seed=shape[1] + 1)
    s = (torch.rand(shape[1], generator=torch.Generator().manual_seed(shape[0])) * 2.0**-6 + 2.0**-12).to(DEVICE)
    q, scale, col_max = quantize_rows(dy, col_max=True, col_scale=s)
    rq, rs = quantize_rows_ref(dy.float() * s[None, :])
    exactly(f"{list(shape)} dy * s: row scales", scale, rs)
    exactly(f"{list(shape)} dy * s: rows (fp8 bits)", bits(q), bits(rq))
    exactly(f"{list(shape)} dy * s: column maxima of the product", col_max,
            (dy.float() * s).abs().amax(dim=0))
    expect_error(ValueError, quantize_rows, dy, True, False, s[:-1])


@pytest.mark.parametrize("shape", [(48, 64), (300, 17), (1, 1), (0, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_transpose_bytes_matches_pytorch(shape):
    """The transposing copy of a stored FP8 weight: the bytes of PyTorch's q.t().contiguous(), for tiles
    cut at both edges, one element and no rows."""
    q = spread(shape, torch.bfloat16, seed=sum(shape)).to(FP8_DTYPE)
    qt = fp8_lora_kernel.transpose_bytes(q)
    assert qt.dtype == FP8_DTYPE and qt.shape == shape[::-1] and qt.is_contiguous()
    exactly(f"{list(shape)}: transposed bytes", bits(qt), bits(q).t().contiguous())
    expect_error(ValueError, fp8_lora_kernel.transpose_bytes, q.float())


def _stored(w: torch.Tensor, recipe: str = "rowwise") -> Float8Linear:
    """A Float8Linear around a frozen copy of w, its weight kept in FP8."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = Float8Linear.from_linear(linear.requires_grad_(False), keep_fp8_input=True, recipe=recipe)
    store_fp8_weight(layer)
    return layer


def _frozen_bound(a, b, e_a, e_b, out):
    """Worst-case |error| of each element of a @ b.T when each operand value v is replaced by v' with
    |v' - v| <= e (e_a, e_b: elementwise bounds shaped like a and b): (a' b' - a b) = (a' - a) b +
    a (b' - b) + (a' - a)(b' - b) summed over the reduction, plus the bf16 output's rounding (2^-8 of
    itself) and fp32 sums (n 2^-24 of the sum of |a b|, or `ACC` on a GPU)."""
    a, b, e_a, e_b = a.double(), b.double(), e_a.double(), e_b.double()
    n = a.shape[1]
    return (e_a @ b.abs().t() + a.abs() @ e_b.t() + e_a @ e_b.t() + 2.0**-8 * out.double().abs()
            + n * ACC * ((a.abs() + e_a) @ (b.abs() + e_b).t()))


def _check_frozen(tag, ours, a, b, a_deq, b_deq, e_a, e_b):
    """ours ~ a @ b.T: against the dequantized operands (rule 1 of the module docstring), against the exact
    product within `_frozen_bound`, and its relative L2 error within RMS_BOUND."""
    n = a.shape[1]
    plumbing = a_deq @ b_deq.t()
    bound = 2.0**-8 * plumbing.abs() + (1 + 2.0**-8) * n * ACC * (a_deq.abs() @ b_deq.abs().t())
    ratio = worst_ratio((ours.double() - plumbing).abs(), bound)
    record(f"{tag}: vs dequantized operands, / bound", ratio, 1.0, ratio <= 1.0)
    exact = a.double() @ b.double().t()
    ratio = worst_ratio((ours.double() - exact).abs(), _frozen_bound(a, b, e_a, e_b, ours))
    record(f"{tag}: vs exact, / worst case of two e4m3 roundings", ratio, 1.0, ratio <= 1.0)
    rel = (torch.linalg.vector_norm(ours.double() - exact) / torch.linalg.vector_norm(exact)).item()
    record(f"{tag}: relative L2 error", rel, RMS_BOUND, rel <= RMS_BOUND)


def test_frozen_fp8_weight_forward_and_input_gradient():
    """74 tokens, 64 -> 48 features, bf16: the weight kept as 1 byte per value plus one fp32 scale per
    row (the bf16 copy gone), y = x W^T and dx = dy W from it, each within e4m3's worst case; backward
    keeps only the stored weight and its scales, and W gets no gradient."""
    x = spread((74, 64), torch.bfloat16, seed=40).view(2, 37, 64)
    w = spread((48, 64), torch.bfloat16, seed=41)
    dy = random_like_grad(x.new_empty(2, 37, 48), seed=42)
    layer = _stored(w)
    assert layer.weight.dtype == FP8_DTYPE and not layer.weight.requires_grad and layer.stores_fp8()
    assert layer.weight.untyped_storage().nbytes() == 48 * 64 and layer.weight_scale.shape == (48,)
    assert set(dict(layer.named_parameters())) == {"weight"} and set(dict(layer.named_buffers())) == {"weight_scale"}
    wq, ws = quantize_rows_ref(w)
    exactly("stored weight == W quantized per row (fp8 bits)", bits(layer.weight), bits(wq))
    exactly("stored scales == W's row scales", layer.weight_scale, ws)
    xi = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(xi)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(FP8_DTYPE, (48, 64)), (torch.float32, (48,))]
    assert saved[0].data_ptr() == layer.weight.data_ptr(), "backward keeps the stored weight itself, not a copy"
    y.backward(dy)
    assert y.dtype == xi.grad.dtype == torch.bfloat16 and layer.weight.grad is None
    x2, dy2 = x.reshape(74, 64), dy.reshape(74, 48)
    w_deq = wq.double() * ws.double()[:, None]
    s_x = quantize_rows_ref(x2)[1].double()[:, None]
    e_w = U * w.double().abs() + SUB * ws.double()[:, None]  # W per row, in W's units
    _check_frozen("frozen W, y = x W^T", y.reshape(74, 48), x2, w, dequant_rows(x2), w_deq,
                  U * x2.double().abs() + SUB * s_x, e_w)
    # dx = (dy s) q: dy's error in its own units is that of dy * s, divided by s (s: W's row scales)
    dyq, sdy = quantize_rows_ref(dy2.float() * ws[None, :])
    dy_deq = dyq.double() * sdy.double()[:, None] / ws.double()[None, :]
    e_dy = U * dy2.double().abs() + SUB * sdy.double()[:, None] / ws.double()[None, :]
    _check_frozen("frozen W, dx = dy W", xi.grad.reshape(74, 64), dy2, w.t(), dy_deq, w_deq.t(), e_dy, e_w.t())


def test_frozen_fp8_weight_bf16_dgrad_recipe_and_refusals():
    """rowwise-bf16-dgrad: dx = dy W as a bf16 matmul of dy and the dequantized stored weight; a trained
    weight, a block-scaled recipe and a stored weight twice are refused or left alone."""
    x = spread((33, 32), torch.bfloat16, seed=43).requires_grad_()
    w = spread((16, 32), torch.bfloat16, seed=44)
    dy = random_like_grad(x.new_empty(33, 16), seed=45)
    layer = _stored(w, "rowwise-bf16-dgrad")
    layer(x).backward(dy)
    w_deq = (layer.weight.float() * layer.weight_scale[:, None]).to(torch.bfloat16)
    exactly("rowwise-bf16-dgrad: dx == dy @ dequantized W (bf16)", x.grad, dy @ w_deq)
    before = layer.weight
    store_fp8_weight(layer)
    assert layer.weight is before, "storing twice changes nothing"
    trained = Float8Linear.from_linear(nn.Linear(32, 16).to(DEVICE, torch.bfloat16))
    assert "frozen" in expect_error(ValueError, store_fp8_weight, trained)
    tiles = fp8_recipes_kernel.Float8ScaledLinear.from_linear(nn.Linear(512, 512).to(DEVICE, torch.bfloat16).requires_grad_(False),
                                     recipe="blockwise")
    assert "row-wise" in expect_error(ValueError, store_fp8_weight, tiles)
    record("frozen FP8 weight: bf16-dgrad recipe, refusals", 0.0, 0.0, True)


def test_frozen_fp8_weight_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of the layer on the CPU (where the compiled graph is trusted): no
    graph break, so no host sync (`.item()`) in the forward or the input gradient; the same bits as eager."""
    if not compiled_graph_trusted(torch.device(DEVICE)):
        pytest.skip("the compiled FP8 graph is not trusted on this device (compiled_graph_trusted)")
    torch._dynamo.reset()
    layer = _stored(spread((48, 64), torch.bfloat16, seed=46))
    x = spread((3, 19, 64), torch.bfloat16, seed=47)
    dy = random_like_grad(x.new_empty(3, 19, 48), seed=48)
    compiled = torch.compile(lambda t: fp8_lora_kernel.fp8_frozen_linear(t, layer.weight, layer.weight_scale),
                             fullgraph=True)
    results = []
    for fn in (layer, compiled):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        results.append((y, xi.grad))
    for what, a, b in zip(("y", "dx"), *results):
        exactly(f"frozen FP8 weight, torch.compile(fullgraph=True) == eager: {what}", b, a)


def _lora_config(*argv):
    return run_config("--model", "llama-tiny", "--lora-r", "4", "--seq-len", "32", *argv)


# --fp8 for LoRA on the FP8 base in these tests: the row-wise recipe, every projection (on a GPU the size
# rule, --fp8-layers auto, would keep all of llama-tiny's narrow projections bf16; the CPU converts all)
FP8_BASE = ("--fp8", "--fp8-recipe", "rowwise", "--fp8-layers", "all")


def _bytes(model) -> int:
    """Bytes of every distinct storage the model's parameters and buffers live in."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def test_lora_fp8_base_keeps_one_byte_per_weight(capsys):
    """prepare_model with --lora-r --fp8: every decoder projection's weight is float8_e4m3fn (1 byte per
    value, plus 4 per row for its scale), no bf16 copy of it is left anywhere (the Parameters it replaced
    are freed), and the model's parameters and buffers take exactly those bytes."""
    import gc
    import weakref

    base = tiny_llama(layers=2)
    originals = [weakref.ref(p) for n, p in base.named_parameters() if "_proj" in n]
    n_proj = sum(p().numel() for p in originals)
    model = models.prepare_model(_lora_config(*FP8_BASE), model=base)[0]
    logged = capsys.readouterr().out
    assert "FP8 base: 14 frozen projection weights kept in FP8" in logged, logged[-2000:]
    gc.collect()
    alive = [r() for r in originals if r() is not None]
    assert not alive, f"{len(alive)} bf16 projection weights are still held"
    stored = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(stored) == 14 and all(m.weight.dtype == FP8_DTYPE and m.weight.element_size() == 1 for m in stored)
    rows = sum(m.weight.shape[0] for m in stored)
    others = sum(t.numel() * t.element_size() for n, t in (*model.named_parameters(), *model.named_buffers())
                 if "base_layer" not in n)  # embeddings, norms, lm_head, adapters; the rotary frequencies
    assert _bytes(model) == others + n_proj + 4 * rows, (_bytes(model), others, n_proj, rows)
    bf16 = _bytes(models.prepare_model(_lora_config(), model=tiny_llama(layers=2))[0])
    record(f"parameters and buffers: {_bytes(model):,} B with the FP8 base, {bf16:,} B with bf16 "
           f"(projections {n_proj:,} values: 1 B each + 4 B per row)", 0.0, 0.0, _bytes(model) == bf16 - n_proj + 4 * rows)


def test_fp8_layers_all_forces_every_projection_into_the_fp8_base():
    """The size rule (sizes="auto", --fp8-layers auto on a GPU) keeps llama-tiny's projections (all
    narrower than FP8_MIN_WIDTH) bf16, and none of their weights is then kept in FP8; "all" (the CPU's
    choice, and --fp8-layers all) converts and stores all 14."""
    from playbook.model.lora import apply_lora

    for sizes, expected in (("auto", 0), ("all", 14)):
        model = tiny_llama(layers=2)
        assert patch_model(model, "rowwise", sizes=sizes) == expected
        model = apply_lora(model, r=4)
        assert models.apply_fp8_base(model) == expected
        weights = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
        assert sum(p.dtype == FP8_DTYPE for p in weights) == expected and len(weights) == 14
    record("--fp8-layers auto: tiny projections stay bf16; all: 14 weights kept in FP8", 0.0, 0.0, True)


def _lora_models(fused: bool):
    """The same 1-layer llama-tiny with LoRA r=4 on all seven projections: fp32 (the reference), bf16, and
    bf16 on the frozen FP8 base; the adapters equal in all three, B not zero (peft starts it at zero)."""
    kernels = "default" if fused else "none"
    built = []
    for argv, dtype in (((), torch.float32), ((), torch.bfloat16), (FP8_BASE, torch.bfloat16)):
        cfg = _lora_config("--kernels", kernels, *argv)
        built.append(models.prepare_model(cfg, model=tiny_llama(layers=1, dtype=dtype))[0])
    g = torch.Generator().manual_seed(50)
    with torch.no_grad():
        for name, p in built[0].named_parameters():
            if "lora_" in name:
                value = torch.randn(p.shape, generator=g) * (0.1 if "lora_B" in name else 1.0) / p.shape[1] ** 0.5
                for model in built:
                    dict(model.named_parameters())[name].copy_(value)
    return built


@pytest.mark.parametrize("fused", [True, False], ids=["fused LoRA path", "peft's path"])
def test_lora_on_fp8_base_close_to_bf16_lora(fused, monkeypatch):
    """Loss and adapter gradients of LoRA on the FP8 base, against the fp32 model: at most MODEL_FACTOR
    times as far as bf16 LoRA's (plus one bf16 ulp, relative), through lora_kernel's fused functions
    and through peft's own forward (Float8FrozenLinearFunction); only the adapters get gradients, and
    the 7 projections run their forward (and the 4 whose input needs a gradient their dx) from the
    stored FP8 weights."""
    ref, bf16, ours = _lora_models(fused)
    calls = []
    for name in ("frozen_forward", "frozen_input_grad"):
        real = getattr(fp8_lora_kernel, name)
        monkeypatch.setattr(fp8_lora_kernel, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(51)).to(DEVICE)
    runs = []
    for model in (ref, bf16, ours):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach().float(), {n: p.grad.double() for n, p in model.named_parameters()
                                             if p.grad is not None}))
    (lr, gr), (lb, gb), (lo, go) = runs
    # q/k/v of the first layer read the normed frozen embeddings: nothing upstream needs their dx
    assert calls.count("frozen_forward") == 7 and calls.count("frozen_input_grad") == 4, calls
    with_grad = set(go)
    assert with_grad == {n for n, _ in ours.named_parameters() if "lora_" in n} and len(with_grad) == 14, sorted(go)
    close_to_reference("loss, LoRA on the FP8 base", lo, lb, lr, torch.bfloat16, factor=MODEL_FACTOR)
    worst = gradients_close(go, gb, gr, with_grad)
    record(f"adapter gradients ({'fused' if fused else 'peft'}), worst of 14: {worst[0]}", worst[1], worst[2], True)


def test_finetune_optimized_lora_on_fp8_base(tmp_path, capsys):
    """`finetune_optimized.py --model llama-tiny --lora-r 4 --fp8 --fp8-recipe rowwise --fp8-layers all
    --steps 3 --output-dir DIR`, in this process: three finite steps; the adapter it saves loads with peft's
    AutoPeftModelForCausalLM on the bf16 base (the same adapter tensors); the run resumes from its
    checkpoint on the bf16 base (without --fp8: the checkpoint's base fingerprint is the bf16 weights');
    --merge-lora (and --load-in-4bit) are refused before training, and merge_and_save on an FP8 base
    says why."""
    import json

    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file
    from playbook.model.lora import merge_and_save

    out = tmp_path / "run"
    run = ["--model", "llama-tiny", "--lora-r", "4", "--output-dir", str(out), "--overwrite"]
    fp8 = FP8_BASE
    tag = "test_lora_fp8_base"
    try:
        result = training.train(run_config(*run, *fp8, "--steps", "3", "--tag", tag))
        logged = capsys.readouterr().out
        resumed = training.train(run_config(*run, "--steps", "4", "--resume", str(out), "--tag", tag + "_resumed"))
    finally:
        for name in (tag, tag + "_resumed"):
            for suffix in (".json", ".png", ".metrics.jsonl"):
                (RESULTS_DIR / f"{name}{suffix}").unlink(missing_ok=True)
    assert "FP8 base: 14 frozen projection weights kept in FP8" in logged, logged[-2000:]
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"])
    assert len(resumed["losses"]) == 4 and resumed["losses"][:3] == result["losses"]
    ckpt = out / "checkpoint-3"
    saved = load_file(ckpt / "adapter_model.safetensors")
    assert saved and all("lora_" in k and v.dtype == torch.float32 for k, v in saved.items())
    # AutoPeft loads the base its adapter_config.json names: here the bf16 preset, written to a directory
    base_dir = tmp_path / "base"
    models.build_preset("llama-tiny", None, torch.device("cpu"), torch.bfloat16).save_pretrained(base_dir)
    config_file = ckpt / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(base_dir)
    config_file.write_text(json.dumps(config))
    loaded = AutoPeftModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    state = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert loaded.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    capsys.readouterr()
    expect_error(SystemExit, run_config, *run, *fp8, "--merge-lora")
    assert "kept in FP8" in capsys.readouterr().err
    expect_error(SystemExit, run_config, *run, *fp8, "--load-in-4bit")  # two quantized bases: one is chosen
    assert "choose one" in capsys.readouterr().err
    stored = models.prepare_model(_lora_config(*fp8), model=tiny_llama(layers=1))[0]
    assert "kept in FP8" in expect_error(RuntimeError, merge_and_save, stored, tmp_path / "merged")
    record(f"--lora-r 4 --fp8: losses {[round(v, 3) for v in result['losses']]}; adapter loads on the bf16 base; "
           "resumes there; --merge-lora refused", 0.0, 0.0, True)



if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "FP8 base for LoRA: test report"))
