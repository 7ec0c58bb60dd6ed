"""Tests of the fused RoPE: Hugging Face's apply_rotary_pos_emb, forward and backward, LLaMA 3.1 angles.

    $ python rope_test.py  # a readable report: every check, its error and tolerance
    $ pytest rope_test.py  # the same tests under pytest

Inputs are laid out the way the attention layers hand them over: [batch, heads, seq, head_dim]
views of [batch, seq, heads, head_dim] projections. The angles come from transformers' own rotary
embedding module with LLaMA 3.1's rope scaling, at positions past its original 8192-token context.
Tolerances follow the rule in testkit.py (each output value combines 2 products: n = 2).
"""

import pytest
import torch

from kernel_utils import DEVICE
from rope_kernel import apply_rotary_pos_emb, rope, rope_ref
from testkit import close_to_reference, exactly, expect_error, random_like_grad, run_as_script

ON_GPU = DEVICE.type == "cuda"
LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


def _angles(batch, positions, head_dim, dtype, scaling=True):
    """cos/sin [batch, T, head_dim] from transformers' LlamaRotaryEmbedding (as the model computes them)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=500000.0,
                      max_position_embeddings=131072, rope_scaling=LLAMA31_SCALING if scaling else None)
    rotary = LlamaRotaryEmbedding(cfg).to(DEVICE)
    probe = torch.empty(1, dtype=dtype, device=DEVICE)
    cos, sin = rotary(probe, positions.to(DEVICE).expand(batch, -1))
    return cos, sin


def _qk(batch, hq, hk, seq, head_dim, dtype, seed=0):
    """q and k as the attention layer makes them: projections viewed as [B, heads, T, D]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, seq, hq, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(batch, seq, hk, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    return q, k


def _run(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    torch.autograd.backward([qo, ko], [dq, dk])
    return qo.detach(), ko.detach(), q.grad, k.grad


def _check(tag, q, k, cos, sin):
    dtype = q.dtype
    dq, dk = random_like_grad(q, 1), random_like_grad(k, 2)
    ours = _run(rope, q, k, cos, sin, dq, dk)
    same = _run(rope_ref, q, k, cos, sin, dq, dk)
    ref = _run(rope_ref, q.double(), k.double(), cos.double(), sin.double(), dq.double(), dk.double())
    for i, what in enumerate(("q_embed", "k_embed", "dq", "dk")):
        close_to_reference(f"{tag} {what}", ours[i], same[i], ref[i], dtype, n=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hk, head_dim", [(4, 2, 16), (4, 1, 16), (6, 6, 64), (3, 1, 24)])
def test_matches_hugging_face(hq, hk, head_dim, dtype):
    """GQA (2 groups), one KV head (MQA), MHA, and head counts / dims that are not powers of 2."""
    positions = torch.arange(5).unsqueeze(0) * 2000 + 9000  # 9000 ... 17000: past the 8192 context
    cos, sin = _angles(2, positions, head_dim, dtype)
    q, k = _qk(2, hq, hk, 5, head_dim, dtype)
    _check(f"hq={hq} hk={hk} d={head_dim}", q, k, cos, sin)


def test_llama31_scaling_changes_the_angles():
    """The kernel must honour the tables it is given: scaled and unscaled angles give other results."""
    positions = torch.arange(6).unsqueeze(0) * 3000
    q, k = _qk(1, 2, 1, 6, 16, torch.float32, seed=3)
    scaled = rope(q, k, *_angles(1, positions, 16, torch.float32, scaling=True))[0]
    plain = rope(q, k, *_angles(1, positions, 16, torch.float32, scaling=False))[0]
    ref = rope_ref(q, k, *_angles(1, positions, 16, torch.float32, scaling=True))[0]
    close_to_reference("LLaMA 3.1 scaled angles", scaled, ref, ref, torch.float32, n=2, factor=0)
    assert (scaled - plain).abs().max() > 0.1, "scaled and unscaled angles must differ at long positions"


def test_per_sequence_positions_and_contiguous_inputs():
    """Each sequence its own positions (packing, left padding); q/k plain contiguous tensors."""
    positions = torch.stack([torch.arange(7), torch.arange(7) + 100, torch.arange(7).flip(0)])
    cos, sin = _angles(3, positions, 32, torch.bfloat16)
    q, k = (t.contiguous() for t in _qk(3, 4, 2, 7, 32, torch.bfloat16, seed=4))
    _check("per-sequence positions, contiguous q/k", q, k, cos, sin)


def test_one_table_for_the_whole_batch():
    positions = torch.arange(9).unsqueeze(0)
    cos, sin = _angles(1, positions, 16, torch.float32)  # [1, T, D], broadcast over 2 sequences
    q, k = _qk(2, 2, 2, 9, 16, torch.float32, seed=5)
    _check("cos/sin [1, T, D] broadcast", q, k, cos, sin)


def test_hugging_face_signature_and_layouts():
    positions = torch.arange(4).unsqueeze(0)
    cos, sin = _angles(2, positions, 16, torch.float32)
    q, k = _qk(2, 2, 1, 4, 16, torch.float32, seed=6)
    ref = rope_ref(q, k, cos, sin)
    out = apply_rotary_pos_emb(q, k, cos, sin)
    exactly("drop-in, unsqueeze_dim=1 == rope()", out[0], rope(q, k, cos, sin)[0])
    close_to_reference("drop-in q", out[0], ref[0], ref[0], torch.float32, n=2, factor=0)
    out_bthd = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    exactly("[B, T, heads, D] layout (unsqueeze_dim=2)", out_bthd[1].transpose(1, 2), out[1])
    old_style = apply_rotary_pos_emb(q, k, cos, sin, None, 1)  # (position_ids, unsqueeze_dim) of older releases
    exactly("older signature with position_ids", old_style[0], out[0])


def test_empty_sequence():
    cos = torch.zeros(1, 0, 16, device=DEVICE)
    q, k = _qk(2, 2, 1, 0, 16, torch.float32)
    qo, ko = rope(q, k, cos, cos)
    assert qo.shape == q.shape and ko.shape == k.shape


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda q, k, c: (q, k, c[..., :8], c[..., :8]), ValueError, id="cos of another head_dim"),
        pytest.param(lambda q, k, c: (q[..., :15], k[..., :15], c[..., :15], c[..., :15]), ValueError, id="odd head_dim"),
        pytest.param(lambda q, k, c: (q, k[:, :, :3], c, c), ValueError, id="q and k of different lengths"),
        pytest.param(lambda q, k, c: (q, k.double(), c, c), TypeError, id="q and k of different dtypes"),
        pytest.param(lambda q, k, c: (q[0], k[0], c, c), ValueError, id="3-D q"),
        pytest.param(lambda q, k, c: (q.long(), k.long(), c, c), TypeError, id="integer q"),
    ],
)
def test_bad_input_gives_clear_error(make, error):
    cos, _ = _angles(2, torch.arange(4).unsqueeze(0), 16, torch.float32)
    q, k = _qk(2, 2, 1, 4, 16, torch.float32)
    expect_error(error, rope, *make(q, k, cos))


def test_learned_angles_are_refused():
    cos, sin = _angles(1, torch.arange(4).unsqueeze(0), 16, torch.float32)
    q, k = _qk(1, 2, 1, 4, 16, torch.float32)
    expect_error(NotImplementedError, rope, q, k, cos.clone().requires_grad_(), sin)


# ---------------------------------------------------------------------------- GPU-only, full size
@pytest.mark.skipif(not ON_GPU, reason="LLaMA-size attention inputs need a GPU (the interpreter is slow)")
def test_llama_31_8b_shapes():
    """4 x 2048 tokens, 32 query heads, 8 KV heads, head_dim 128, bf16, positions 0..2047."""
    positions = torch.arange(2048).unsqueeze(0)
    cos, sin = _angles(4, positions, 128, torch.bfloat16)
    q, k = _qk(4, 32, 8, 2048, 128, torch.bfloat16, seed=7)
    _check("LLaMA 3.1 8B, 4 x 2048", q, k, cos, sin)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fused RoPE: test report"))
