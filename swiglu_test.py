"""Tests of the fused SwiGLU (`silu(gate) * up`) and GeGLU (`gelu_tanh(gate) * up`): output and
both gradients against float64.

    $ python swiglu_test.py         # a readable report
    $ pytest swiglu_test.py

Tolerances follow testkit/__init__.py's rule (at most 2x PyTorch's own error against float64, plus one ulp
of the output scale). PyTorch rounds silu(gate) to the input dtype before the multiply; the kernel
keeps it in fp32 and rounds once, so it is usually the closer of the two. Then the MLP path (the
down projection fused in, its checks, autocast) against Hugging Face's LLaMA, Gemma and Phi-3
MLPs, the kernels as PyTorch operators (opcheck, torch.compile, no double backward), the patch of
Hugging Face models, and the byte count. The patch's contract shared with the other lessons (the count,
patching twice, the Parameters, the patched logits; the docstring's byte counts) is
tests/lesson_contract_test.py's, which calls check_patched below for what is SwiGLU's own.
"""

from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("no test was run")

import copy

import pytest
import torch

from core.kernel_utils import DEVICE
from swiglu_kernel import (geglu, ideal_bytes, patch_model, swiglu, swiglu_bwd_op, swiglu_down, swiglu_down_bwd_op,
                           swiglu_down_fwd_op, swiglu_fwd_op, swiglu_mlp_forward, swiglu_ref)
from testkit import close_to_reference, exactly, expect_error, random_like_grad, record, run_as_script

ON_GPU = DEVICE.type == "cuda"


def _inputs(shape, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)  # +-9: both tails of sigmoid
    up = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return gate, up


def _check(tag, gate, up, dh=None, activation="silu"):
    dtype = gate.dtype
    if dh is None:
        dh = random_like_grad(gate.new_empty(gate.shape), seed=5)

    def run(fn, cast):
        gi, ui = cast(gate.detach()).clone().requires_grad_(), cast(up.detach()).clone().requires_grad_()
        h = fn(gi, ui, activation)
        h.backward(cast(dh))
        return h, gi.grad, ui.grad

    ours, same, ref = run(swiglu, lambda t: t), run(swiglu_ref, lambda t: t), run(swiglu_ref, lambda t: t.double())
    assert ours[0].dtype == dtype and ours[0].shape == gate.shape
    for what, o, s, r in zip(("h", "dgate", "dup"), ours, same, ref):
        close_to_reference(f"{tag} {what}", o, s, r, dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 1), (5, 123), (2, 3, 4097), (2, 2, 2, 64)])
def test_matches_reference(shape, dtype, activation):
    _check(f"{activation} {list(shape)}", *_inputs(shape, dtype), activation=activation)


def test_geglu_is_gelu_tanh_times_up():
    """`geglu` is the "gelu_tanh" activation, and the reference is transformers' gelu_pytorch_tanh."""
    from transformers.activations import ACT2FN

    gate, up = _inputs((6, 40), torch.float32, seed=11)
    exactly("geglu(g, u) == swiglu(g, u, 'gelu_tanh')", geglu(gate, up), swiglu(gate, up, "gelu_tanh"))
    exactly("reference == ACT2FN['gelu_pytorch_tanh'](g) * u", swiglu_ref(gate, up, "gelu_tanh"),
            ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_halves_of_a_fused_projection():
    """gate and up as the two halves of one [rows, 2I] projection: row stride 2I, no copy."""
    gu = torch.randn(9, 2 * 300, device=DEVICE).to(torch.bfloat16)
    _check("halves of [9, 600]", gu[:, :300], gu[:, 300:])
    t, _ = _inputs((40, 12), torch.float32)
    _check("transposed (copied)", t.t(), t.t() * 0.5 + 1)


def test_upstream_gradient_of_a_sum_or_a_broadcast():
    """Stride-0 upstream gradients: `(h * c).sum()` gives strides (0, 0), a broadcast row (0, 1)."""
    gate, up = _inputs((6, 50), torch.bfloat16, seed=2)
    c = torch.randn((), device=DEVICE).to(torch.bfloat16)  # random, so a dropped dh would show
    _check("dh with strides (0, 0), as .sum() gives", gate, up, dh=c.expand(6, 50))
    row = torch.randn(50, device=DEVICE).to(torch.bfloat16)
    _check("dh with strides (0, 1), a broadcast row", gate, up, dh=row.expand(6, 50))


def test_empty_batch():
    gate, up = _inputs((0, 64), torch.bfloat16)
    w = torch.randn(16, 64, device=DEVICE).to(torch.bfloat16)
    for name, fn, args in (("swiglu", swiglu, (gate, up)), ("swiglu_down", swiglu_down, (gate, up, w))):
        args = [a.clone().requires_grad_() for a in args]
        out = fn(*args)
        out.backward(random_like_grad(out))
        assert out.shape[0] == 0 and all(a.grad.shape == a.shape for a in args)
        if name == "swiglu_down":  # no rows: the weight gradient is an exact zero, not garbage
            exactly("empty batch: d weight of swiglu_down is zero", args[2].grad, torch.zeros_like(w))
    record("empty batch: forward and backward of swiglu and swiglu_down", 0.0, 0.0, True)


@pytest.mark.skipif(not ON_GPU, reason="the LLaMA MLP width needs a GPU (the interpreter is slow)")
def test_llama_shape():
    _check("4096 tokens x 14336", *_inputs((4, 1024, 14336), torch.bfloat16))


def test_llama_mlp_forward_matches_hugging_face():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=80)).to(DEVICE)
    x = torch.randn(3, 5, 32, device=DEVICE)
    ref = LlamaMLP.forward(mlp, x.double().to(torch.float32))
    ours = swiglu_mlp_forward(mlp, x)
    close_to_reference("LlamaMLP with fused SwiGLU", ours, ref, ref, torch.float32, n=80, factor=1)


MLP_FAMILIES = {  # family -> (config class, MLP class): SwiGLU, GeGLU, and one fused gate_up_proj
    "llama": ("LlamaConfig", "transformers.models.llama.modeling_llama.LlamaMLP"),
    "gemma": ("GemmaConfig", "transformers.models.gemma.modeling_gemma.GemmaMLP"),
    "phi3": ("Phi3Config", "transformers.models.phi3.modeling_phi3.Phi3MLP"),
}


def _family_mlp(kind, H, I):
    """A Hugging Face MLP of the family, and its activation as swiglu_kernel names it."""
    import importlib

    import transformers
    from swiglu_kernel import HF_ACTIVATIONS

    config_name, path = MLP_FAMILIES[kind]
    module, _, name = path.rpartition(".")
    config = getattr(transformers, config_name)(hidden_size=H, intermediate_size=I, pad_token_id=None,
                                                bos_token_id=None, eos_token_id=None)
    return getattr(importlib.import_module(module), name)(config), HF_ACTIVATIONS[config.hidden_act]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(MLP_FAMILIES))
def test_mlp_gradients_and_what_is_saved(kind, dtype):
    """Gradients of x and all weights match HF's LlamaMLP, GemmaMLP (GeGLU) and Phi3MLP (gate and up
    as halves of one projection), and backward keeps no [N, I] tensor besides gate and up
    (h = act(gate) * up is recomputed)."""
    torch.manual_seed(1)
    N, H, I = 24, 32, 80
    base, activation = _family_mlp(kind, H, I)
    base.to(DEVICE, dtype)
    mlp_class = type(base)
    x0 = torch.randn(2, N // 2, H, device=DEVICE, dtype=dtype)
    dout = torch.randn(2, N // 2, H, device=DEVICE, dtype=dtype)
    results = []
    for tag, cast, fwd in (("ours", dtype, swiglu_mlp_forward), ("same", dtype, mlp_class.forward),
                           ("ref", torch.float64, mlp_class.forward)):
        mlp = copy.deepcopy(base).to(DEVICE, cast)
        mlp.fused_activation = activation  # what patch_model sets
        x = x0.detach().to(cast).clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out = fwd(mlp, x)
        out.backward(dout.to(cast))
        results.append([x.grad] + [p.grad for p in mlp.parameters()])
        names = ["dx"] + [f"d {n}" for n, _ in mlp.named_parameters()]
        if tag == "ours":
            # gate and up: two [.., I] tensors, or for Phi-3's joined gate_up_proj one [.., 2I] tensor
            wide = [s for s in saved if s[-1] in (I, 2 * I) and len(s) > 1 and s not in ((H, I), (H, 2 * I))]  # not weights
            assert [s[-1] for s in wide] == ([2 * I] if kind == "phi3" else [I, I]), \
                f"only gate and up may be saved at width {I} (or joined, {2 * I}), got {wide}"
    for i, what in enumerate(names):
        close_to_reference(f"{kind} MLP {what} ({str(dtype)[6:]})", results[0][i], results[1][i], results[2][i],
                           dtype, n=I)


def _mlp(dtype=torch.float32, H=32, I=80, seed=2):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(seed)
    return LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I)).to(DEVICE, dtype)


def test_down_projection_on_another_device_or_dtype_is_refused():
    """The fused down projection reads its weight directly: a weight on another device (here the
    meta device, which has no data) or of another dtype must be refused, not multiplied."""
    mlp = _mlp()
    x = torch.randn(2, 3, 32, device=DEVICE)
    mlp.down_proj.to("meta")
    assert "meta" in expect_error(ValueError, swiglu_mlp_forward, mlp, x)
    mlp = _mlp()
    mlp.down_proj.to(torch.bfloat16)
    assert "bfloat16" in expect_error(ValueError, swiglu_mlp_forward, mlp, x)


def test_mlp_under_autocast():
    """torch.autocast: the projections compute in bf16 while the weights stay fp32; the fused path
    casts the down weight as autocast casts nn.Linear's, and matches Hugging Face's MLP."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    x0 = torch.randn(2, 5, 32, device=DEVICE)
    dout = random_like_grad(torch.empty(2, 5, 32, device=DEVICE), seed=3)
    results = []
    for fwd, dtype, amp in ((swiglu_mlp_forward, torch.float32, True), (LlamaMLP.forward, torch.float32, True),
                            (LlamaMLP.forward, torch.float64, False)):
        mlp, x = _mlp(dtype), x0.to(dtype).clone().requires_grad_()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
            out = fwd(mlp, x)
        out.backward(dout.to(out.dtype))
        results.append((out, x.grad, mlp.down_proj.weight.grad, mlp.gate_proj.weight.grad))
    assert results[0][0].dtype == torch.bfloat16, "under autocast the MLP's output is bf16, as in Hugging Face"
    for i, what in enumerate(("out", "dx", "d down_proj", "d gate_proj")):
        close_to_reference(f"autocast bf16: {what}", *(r[i] for r in results), torch.bfloat16, n=80)


def test_second_order_gradients_raise():
    gate, up = _inputs((4, 24), torch.float32)
    w = torch.randn(8, 24, device=DEVICE)
    for name, fn, args in (("swiglu", swiglu, (gate, up)), ("swiglu_down", swiglu_down, (gate, up, w))):
        gi = args[0].clone().requires_grad_()
        out = fn(gi, *args[1:])
        (dg,) = torch.autograd.grad(out, gi, random_like_grad(out), create_graph=True)
        assert "second-order" in expect_error(RuntimeError, lambda: dg.sum().backward())


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake implementation, autograd registration, and AOTAutograd
    with dynamic shapes (gradients included for the forward operators)."""
    gate, up = _inputs((5, 37), torch.bfloat16, seed=4)
    w = torch.randn(6, 37, device=DEVICE).to(torch.bfloat16)
    dh, dout = random_like_grad(gate, seed=6), random_like_grad(gate.new_empty(5, 6), seed=7)
    grad = [t.clone().requires_grad_() for t in (gate, up, w)]
    torch.library.opcheck(swiglu_fwd_op, tuple(grad[:2]))
    torch.library.opcheck(swiglu_bwd_op, (dh, gate, up))
    torch.library.opcheck(swiglu_down_fwd_op, tuple(grad))
    for need_gate_up, need_weight in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(swiglu_down_bwd_op, (dout, gate, up, w, need_gate_up, need_weight))
    # GeGLU: the activation is an operator argument that reaches the backward
    torch.library.opcheck(swiglu_fwd_op, tuple(grad[:2]) + ("gelu_tanh",))
    torch.library.opcheck(swiglu_down_fwd_op, tuple(grad) + ("gelu_tanh",))
    record("opcheck: swiglu_fwd (x2), swiglu_bwd, swiglu_down_fwd (x2), swiglu_down_bwd (x3)", 0.0, 0.0, True)


def test_torch_compile_matches_eager():
    """fullgraph=True around both entry points: the operators are opaque, so the compiled graph
    runs the same kernels on the same data, and every result is equal bit for bit."""
    def both(gate, up, w):
        return swiglu(gate, up), swiglu_down(gate, up, w)

    torch._dynamo.reset()
    compiled = torch.compile(both, fullgraph=True)
    gate, up = _inputs((2, 3, 40), torch.bfloat16, seed=8)
    w = torch.randn(12, 40, device=DEVICE).to(torch.bfloat16)
    results = []
    for fn in (both, compiled):
        args = [t.clone().requires_grad_() for t in (gate, up, w)]
        h, out = fn(*args)
        torch.autograd.backward([h, out], [random_like_grad(h, 9), random_like_grad(out, 10)])
        results.append((h, out) + tuple(a.grad for a in args))
    for what, eager, comp in zip(("h", "swiglu_down", "d gate", "d up", "d weight"), *results):
        exactly(f"torch.compile == eager: {what}", comp, eager)


def _tiny_model(kind="llama", **overrides):
    import transformers

    config_class = {"llama": "LlamaConfig", "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "phi3": "Phi3Config"}
    torch.manual_seed(0)
    config = getattr(transformers, config_class[kind])(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, bos_token_id=None, eos_token_id=None, pad_token_id=None, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)


# the activation each family's patch uses: Gemma's gelu_pytorch_tanh is GeGLU
PATCHED_ACTIVATION = {"llama": "silu", "gemma": "gelu_tanh", "gemma2": "gelu_tanh", "phi3": "silu"}


# tests/lesson_contract_test.py patches a tiny model of each of these families: the count expected_patches says,
# patching twice a no-op, the same Parameters, the logits of the unpatched model; then calls check_patched.
CONTRACT_FAMILIES = tuple(PATCHED_ACTIVATION)


def check_patched(kind: str, model, count: int):
    """SwiGLU's own part of the contract: every decoder layer's MLP runs the fused forward, with the family's
    activation (GeGLU for Gemma)."""
    layers = model.model.layers
    assert count == len(layers) == model.config.num_hidden_layers, (kind, count)
    assert all(layer.mlp.forward.__func__ is swiglu_mlp_forward for layer in layers)
    assert all(layer.mlp.fused_activation == PATCHED_ACTIVATION[kind] for layer in layers)
    record(f"{kind}: {count} MLPs fused, activation {PATCHED_ACTIVATION[kind]}", 0.0, 0.0, True)


def test_patch_model_refuses_another_activation():
    model = _tiny_model(hidden_act="gelu")
    assert "gelu" in expect_error(NotImplementedError, patch_model, model)


def test_ideal_bytes_is_the_hand_count():
    """LLaMA 3.1 8B's MLP width at 8192 tokens, bf16: the hand count behind the module docstring's figures (that
    the docstring states what ideal_bytes gives is tests/lesson_contract_test.py's)."""
    n, width, e = 8192, 14336, 2
    forward = ideal_bytes(n, width, torch.bfloat16)
    both = ideal_bytes(n, width, torch.bfloat16, backward=True)
    assert forward == (2 + 1) * e * n * width  # gate and up read, h written
    assert both == forward + (3 + 2) * e * n * width  # dh, gate and up read; d gate and d up written
    record(f"ideal bytes at 8192 x 14336 bf16: fwd {forward / 1e6:.1f} MB, fwd+bwd {both / 1e6:.1f} MB",
           0.0, 0.0, True)


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(4, 9)), ValueError, id="shape mismatch"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(4, 8).half()), ValueError, id="dtype mismatch"),
        pytest.param(lambda: (torch.randint(0, 3, (4, 8)), torch.randint(0, 3, (4, 8))), TypeError, id="integers"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(4, 8), "gelu"), ValueError, id="unknown activation"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    gate, up, *activation = make()
    expect_error(error, swiglu, gate.to(DEVICE), up.to(DEVICE), *activation)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused SwiGLU: test report"))
