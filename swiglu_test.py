"""Tests of the fused SwiGLU (`silu(gate) * up`): output and both gradients against float64.

    $ python swiglu_test.py         # a readable report
    $ pytest swiglu_test.py

Tolerances follow testkit.py's rule (at most 2x PyTorch's own error against float64, plus one ulp
of the output scale). PyTorch rounds silu(gate) to the input dtype before the multiply; the kernel
keeps it in fp32 and rounds once, so it is usually the closer of the two.
"""

import pytest
import torch

from kernel_utils import DEVICE
from swiglu_kernel import swiglu, swiglu_mlp_forward, swiglu_ref
from testkit import close_to_reference, expect_error, random_like_grad, record, run_as_script

ON_GPU = DEVICE.type == "cuda"


def _inputs(shape, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)  # +-9: both tails of sigmoid
    up = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return gate, up


def _check(tag, gate, up):
    dtype = gate.dtype
    dh = random_like_grad(gate.new_empty(gate.shape), seed=5)

    def run(fn, cast):
        gi, ui = cast(gate.detach()).clone().requires_grad_(), cast(up.detach()).clone().requires_grad_()
        h = fn(gi, ui)
        h.backward(cast(dh))
        return h, gi.grad, ui.grad

    ours, same, ref = run(swiglu, lambda t: t), run(swiglu_ref, lambda t: t), run(swiglu_ref, lambda t: t.double())
    assert ours[0].dtype == dtype and ours[0].shape == gate.shape
    for what, o, s, r in zip(("h", "dgate", "dup"), ours, same, ref):
        close_to_reference(f"{tag} {what}", o, s, r, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 1), (5, 123), (2, 3, 4097), (2, 2, 2, 64)])
def test_matches_reference(shape, dtype):
    _check(f"{list(shape)}", *_inputs(shape, dtype))


def test_halves_of_a_fused_projection():
    """gate and up as the two halves of one [rows, 2I] projection: row stride 2I, no copy."""
    gu = torch.randn(9, 2 * 300, device=DEVICE).to(torch.bfloat16)
    _check("halves of [9, 600]", gu[:, :300], gu[:, 300:])
    t, _ = _inputs((40, 12), torch.float32)
    _check("transposed (copied)", t.t(), t.t() * 0.5 + 1)


def test_empty_batch():
    gate, up = _inputs((0, 64), torch.bfloat16)
    gate.requires_grad_()
    h = swiglu(gate, up)
    h.sum().backward()
    assert h.shape == (0, 64) and gate.grad.shape == (0, 64)
    record("empty batch", 0.0, 0.0, True)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_gradients_and_what_is_saved(dtype):
    """Gradients of x and all three weights match HF's LlamaMLP, and backward keeps no [N, I] tensor
    besides gate and up (h = silu(gate) * up is recomputed)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(1)
    N, H, I = 24, 32, 80
    base = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I)).to(DEVICE, dtype)
    x0 = torch.randn(2, N // 2, H, device=DEVICE, dtype=dtype)
    dout = torch.randn(2, N // 2, H, device=DEVICE, dtype=dtype)
    results = []
    for tag, cast, fwd in (("ours", dtype, swiglu_mlp_forward), ("same", dtype, LlamaMLP.forward),
                           ("ref", torch.float64, LlamaMLP.forward)):
        mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I)).to(DEVICE, cast)
        mlp.load_state_dict(base.state_dict())
        x = x0.detach().to(cast).clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out = fwd(mlp, x)
        out.backward(dout.to(cast))
        results.append([x.grad] + [getattr(mlp, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")])
        if tag == "ours":
            wide = [s for s in saved if s[-1] == I and len(s) > 1 and s != (H, I)]
            assert len(wide) == 2, f"only gate and up may be saved at width {I}, got {wide}"
    for i, what in enumerate(("dx", "d gate_proj", "d up_proj", "d down_proj")):
        close_to_reference(f"MLP {what} ({str(dtype)[6:]})", results[0][i], results[1][i], results[2][i], dtype, n=I)


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(4, 9)), ValueError, id="shape mismatch"),
        pytest.param(lambda: (torch.randn(4, 8), torch.randn(4, 8).half()), ValueError, id="dtype mismatch"),
        pytest.param(lambda: (torch.randint(0, 3, (4, 8)), torch.randint(0, 3, (4, 8))), TypeError, id="integers"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    gate, up = make()
    expect_error(error, swiglu, gate.to(DEVICE), up.to(DEVICE))


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused SwiGLU: test report"))
