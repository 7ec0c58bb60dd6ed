"""Tests of the fine-tuning workflow: kernels patched in correctly, and the same training curve.

    $ python finetune_test.py       # a readable report
    $ pytest finetune_test.py

Loss parity, the test that matters most: the baseline and the optimized model start from the same
seed and see the same batches (real text from a file of this repository, so the loss actually
falls) for 20 AdamW steps. bf16 training is not bit-reproducible across implementations, so the
test asks what testkit.py asks of every kernel: the optimized bf16 run may be at most twice as far
from an fp32 baseline run as the plain PyTorch bf16 run is, plus one bf16 ulp; for the loss at
every step and for every final parameter tensor.
"""

import argparse
import contextlib
import functools
import io
import os
from pathlib import Path

import pytest
import torch

import common
from common import Batches, apply_kernels, build_preset, make_optimizer, training_step
from rmsnorm_kernel import TritonRMSNorm
from testkit import close_to_reference, record, run_as_script

HERE = Path(__file__).resolve().parent
STEPS = 20


def _args(**kw):
    a = dict(batch_size=4, seq_len=64, seed=0, data=HERE / "cross_entropy_kernel.py", optimizer="adamw-foreach",
             lr=1e-3, device=torch.device("cpu"), model="llama-tiny", num_layers=None, steps=STEPS)
    a.update(kw)
    return argparse.Namespace(**a)


ALL_KERNELS = "rmsnorm,flce,swiglu,rope"  # finetune_optimized.py's default: every kernel on
PLAYBOOK_KERNELS = "rmsnorm,ce,swiglu"  # the fused cross-entropy on materialised logits instead


@pytest.fixture(autouse=True)
def _restore_hugging_face_rope():
    """apply_kernels(rope=True) swaps a module-level function of transformers; undo it after each test."""
    import importlib

    families = {f: importlib.import_module(f"transformers.models.{f}.modeling_{f}")
                for f in common.SUPPORTED_MODEL_TYPES}
    saved = {f: m.apply_rotary_pos_emb for f, m in families.items()}
    yield
    for f, m in families.items():
        m.apply_rotary_pos_emb = saved[f]


@functools.lru_cache(maxsize=None)
def _train(kernels: str, dtype: torch.dtype, in_backward: bool = False):
    """Train the tiny preset for STEPS steps on CPU; return the loss curve and final parameters."""
    import importlib

    args = _args(optimizer_in_backward=in_backward)
    model, _ = build_preset("llama-tiny", None, args.device, dtype)
    model.config.use_cache = False
    model.train()
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    hf_rope = llama.apply_rotary_pos_emb
    if kernels != "none":
        k = common.parse_kernels(kernels)
        apply_kernels(model, rmsnorm=k["rmsnorm"], cross_entropy=k["cross_entropy"], swiglu=k["swiglu"],
                      flce=k["flce"], rope=k["rope"], verbose=False)
    opt = make_optimizer(model, args)
    data = Batches(args, model.config.vocab_size)
    try:
        losses = [training_step(model, opt, data.get(i, args.device)).float() for i in range(STEPS)]
    finally:
        llama.apply_rotary_pos_emb = hf_rope  # the cached runs must not leak a patched RoPE
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


RUNS = [pytest.param(ALL_KERNELS, False, id="all kernels"),
        pytest.param(PLAYBOOK_KERNELS, False, id="cross-entropy on logits"),
        pytest.param(ALL_KERNELS, True, id="all kernels, optimizer in backward")]


@pytest.mark.parametrize("kernels, in_backward", RUNS)
def test_loss_curve_matches_baseline(kernels, in_backward):
    ref_losses, _ = _train("none", torch.float32)
    base_losses, _ = _train("none", torch.bfloat16)
    ours_losses, _ = _train(kernels, torch.bfloat16, in_backward)
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the tiny model should learn the text (else parity is vacuous)"
    close_to_reference(f"loss at each of {STEPS} steps (bf16)", ours_losses, base_losses, ref_losses, torch.bfloat16)


@pytest.mark.parametrize("kernels, in_backward", RUNS)
def test_final_parameters_match_baseline(kernels, in_backward):
    _, ref = _train("none", torch.float32)
    _, base = _train("none", torch.bfloat16)
    _, ours = _train(kernels, torch.bfloat16, in_backward)
    worst = max(ref, key=lambda n: ((ours[n].double() - ref[n].double()).abs().max()).item())
    for name in ref:  # every tensor is checked; the report shows the one with the largest error
        close_to_reference(f"final params: {name}" if name == worst else name, ours[name], base[name], ref[name],
                           torch.bfloat16)
    record(f"all {len(ref)} parameter tensors within tolerance", 0.0, 0.0, True)


def test_apply_kernels_replaces_every_rmsnorm_and_the_loss():
    model, _ = build_preset("llama-tiny", 3, torch.device("cpu"), torch.float32)
    report = apply_kernels(model, swiglu=True, verbose=False)
    norms = [m for m in model.modules() if isinstance(m, TritonRMSNorm)]
    assert report["rmsnorm"] == len(norms) == 2 * 3 + 1, "2 per layer + the final norm"
    assert report["swiglu"] == 3 and all(l.mlp.forward.__func__.__name__ == "swiglu_mlp_forward" for l in model.model.layers)
    assert model.loss_function.__qualname__.startswith("fused_causal_lm_loss")
    record("3 layers: 7 RMSNorm modules replaced, loss patched", 0.0, 0.0, True)


def test_fused_head_and_rope_match_hugging_face():
    """flce + rope on LLaMA: same loss and gradients as HF, with -100 labels and num_items_in_batch;
    no logits are returned when labels are given, and logits are HF's when they are not."""
    import rope_kernel
    from transformers.models.llama import modeling_llama

    base, _ = build_preset("llama-tiny", 2, torch.device("cpu"), torch.float32)
    ours, _ = build_preset("llama-tiny", 2, torch.device("cpu"), torch.float32)
    ours.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, base.config.vocab_size, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    results = {}
    for tag, model in (("hf", base), ("ours", ours)):
        if tag == "ours":
            report = apply_kernels(model, flce=True, cross_entropy=False, rope=True, verbose=False)
            assert report["flce"] and report["rope"]
            assert modeling_llama.apply_rotary_pos_emb is rope_kernel.apply_rotary_pos_emb
        for n_items in (None, torch.tensor(23)):
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items)
            out.loss.backward()
            results[tag, n_items is None] = (out.loss.detach(), model.lm_head.weight.grad.clone(),
                                             model.model.layers[0].self_attn.q_proj.weight.grad.clone(), out.logits)
        with torch.no_grad():
            results[tag, "logits"] = model(input_ids=ids).logits
    for mean in (True, False):
        (l_ours, w_ours, q_ours, logits), (l_hf, w_hf, q_hf, _) = results["ours", mean], results["hf", mean]
        what = "mean" if mean else "sum / num_items"
        assert logits is None, "with labels, the fused head returns no logits"
        close_to_reference(f"loss ({what})", l_ours, l_hf, l_hf.double(), torch.float32, n=512, factor=0)
        close_to_reference(f"lm_head grad ({what})", w_ours, w_hf, w_hf.double(), torch.float32, n=32, factor=0)
        close_to_reference(f"layer-0 q_proj grad, through RoPE ({what})", q_ours, q_hf, q_hf.double(),
                           torch.float32, n=32, factor=0)
    close_to_reference("logits without labels", results["ours", "logits"], results["hf", "logits"],
                       results["hf", "logits"].double(), torch.float32, n=64, factor=0)


def test_fused_head_with_tied_embeddings():
    """LLaMA 3.2-style tied embeddings: the fused head must use (and train) the shared weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**common.PRESETS["llama-tiny"], "tie_word_embeddings": True})
    torch.manual_seed(3)
    base = LlamaForCausalLM(cfg)
    ours = LlamaForCausalLM(cfg)
    ours.load_state_dict(base.state_dict())
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr(), "weights must be tied"
    apply_kernels(ours, rmsnorm=False, cross_entropy=False, flce=True, verbose=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    losses, grads = [], []
    for model in (ours, base):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.model.embed_tokens.weight.grad)
    close_to_reference("tied: loss", losses[0], losses[1], losses[1].double(), torch.float32, n=cfg.vocab_size, factor=0)
    close_to_reference("tied: embedding gradient (lookup + head)", grads[0], grads[1], grads[1].double(),
                       torch.float32, n=24, factor=0)


def test_optimizer_in_backward():
    """Same updates as AdamW after backward; no gradient left after the step; clipping and
    accumulation refused with a clear message."""
    args = _args(optimizer_in_backward=True)
    params = {}
    for in_backward in (False, True):
        model, _ = build_preset("llama-tiny", 1, torch.device("cpu"), torch.float32)
        opt = make_optimizer(model, _args(optimizer_in_backward=in_backward))
        data = Batches(args, model.config.vocab_size)
        for i in range(3):
            training_step(model, opt, data.get(i, args.device))
        params[in_backward] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if in_backward:
            assert all(p.grad is None for p in model.parameters()), "gradients must be freed in backward"
            with pytest.raises(RuntimeError, match="accumulation"):  # two backwards, no step in between
                for _ in range(2):
                    model(input_ids=data.get(0, args.device), labels=data.get(0, args.device)).loss.backward()
    for name, p in params[False].items():
        close_to_reference(name, params[True][name], p, p.double(), torch.float32, factor=0)
    with pytest.raises(SystemExit, match="max-grad-norm"):
        common.finish_args(argparse.Namespace(model=None, batch_size=None, seq_len=None, steps=None, optimizer=None,
                                              optimizer_in_backward=True, max_grad_norm=1.0))
    record("in-backward AdamW == AdamW after backward; grads freed; clip/accumulation refused", 0.0, 0.0, True)


def test_out_of_memory_is_recognised():
    """cuBLAS reports a full GPU as a RuntimeError; it must get the same advice as PyTorch's OOM."""
    assert common.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert common.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not common.is_out_of_memory(RuntimeError("shape mismatch"))
    assert "--batch-size" in common.oom_message(_args(), RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))


def test_kernel_list_errors():
    with pytest.raises(SystemExit, match="choose one loss kernel"):
        common.parse_kernels("rmsnorm,ce,flce")
    with pytest.raises(SystemExit, match="liger"):
        common.parse_kernels("liger,rmsnorm")
    with pytest.raises(SystemExit, match="unknown"):
        common.parse_kernels("rmsnorm,fast")
    assert common.parse_kernels("liger")["liger"] and not common.parse_kernels("none")["flce"]


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_apply_kernels_on_other_families(family):
    """Same-family models are patched too (Qwen3 adds q_norm / k_norm: 4 per layer + 1)."""
    import transformers

    cfg_cls = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family]
    lm_cls = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg = getattr(transformers, cfg_cls)(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    base = getattr(transformers, lm_cls)(cfg).eval()
    patched = getattr(transformers, lm_cls)(cfg).eval()
    patched.load_state_dict(base.state_dict())
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ref = base(input_ids=ids, labels=ids).loss  # before patching: RoPE is a module-level swap
    report = apply_kernels(patched, swiglu=True, cross_entropy=False, flce=True, rope=True, verbose=False)
    assert report["rmsnorm"] == common.expected_rmsnorm_count(cfg) == (4 if family == "qwen3" else 2) * 2 + 1
    assert report["swiglu"] == 2 and report["flce"] and report["rope"]
    with torch.no_grad():
        ours = patched(input_ids=ids, labels=ids).loss
    close_to_reference(f"{family}: loss with kernels vs without", ours, ref, ref.double(), torch.float32, n=128, factor=0)


def test_default_model_unavailable_falls_back_to_the_preset():
    """No token / offline: one clear paragraph, then the 8B preset (here on the meta device)."""
    args = _args(model=common.DEFAULT_MODEL, model_explicit=False, num_layers=1, device=torch.device("meta"))
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            model, tok, desc = common.load_model(args)
    finally:
        os.environ.pop("HF_HUB_OFFLINE") if old is None else os.environ.__setitem__("HF_HUB_OFFLINE", old)
    out = printed.getvalue()
    assert args.model == "llama-3.1-8b" and "unavailable" in desc and tok is None
    assert model.config.hidden_size == 4096 and model.config.num_hidden_layers == 1
    assert "HF_TOKEN" in out and "loss values are not meaningful" in out, out
    record("fallback to the llama-3.1-8b preset with advice", 0.0, 0.0, True)


def test_patched_loss_equals_hugging_face_loss():
    """Same value as HF's ForCausalLMLoss, including shifted labels, -100 padding and num_items."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 50, generator=g)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :3] = -100  # a masked prompt
    fused = common.fused_causal_lm_loss(inplace_grad=False)
    for n_items in (None, torch.tensor(11)):
        ref = ForCausalLMLoss(logits.double(), labels, 50, num_items_in_batch=n_items)
        ours = fused(logits, labels, 50, num_items_in_batch=n_items)
        same = ForCausalLMLoss(logits, labels, 50, num_items_in_batch=n_items)
        close_to_reference(f"HF causal-LM loss, num_items={n_items}", ours, same, ref, torch.float32, n=50)


def test_unsupported_model_is_refused_clearly():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="gpt2"):
        apply_kernels(model)


def test_explicit_unavailable_model_is_a_clear_error():
    """A gated model without a token (or offline) ends with advice, not a traceback."""
    args = _args(model="meta-llama/Llama-3.1-8B", model_explicit=True, num_layers=None)
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # fail fast and the same way with or without a network
    try:
        with pytest.raises(SystemExit) as info:
            common.load_model(args)
    finally:
        os.environ.pop("HF_HUB_OFFLINE") if old is None else os.environ.__setitem__("HF_HUB_OFFLINE", old)
    msg = str(info.value)
    assert "HF_TOKEN" in msg and "--model llama-3.1-8b" in msg, msg
    record("clear advice instead of a traceback", 0.0, 0.0, True)


def test_preset_matches_llama_3_1_8b():
    """The preset has the real architecture: build it on the meta device and count parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**common.PRESETS["llama-3.1-8b"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    n = common.count_params(model)
    assert n == 8_030_261_248, f"LLaMA 3.1 8B has 8,030,261,248 parameters, the preset {n:,}"
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.num_key_value_heads == 8
    record(f"preset has {n:,} parameters", 0.0, 0.0, True)


def test_fsdp2_two_processes():
    """torchrun with 2 processes shards the model with FSDP2 (gloo on CPU: same code path as GPUs)."""
    import json
    import subprocess
    import sys

    tag = "test_fsdp2_cpu"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "finetune_optimized.py", "--steps", "2", "--warmup-steps", "1", "--tag", tag],
                         cwd=HERE, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    path = HERE / "results" / f"{tag}.json"
    result = json.loads(path.read_text())
    path.unlink()
    assert result["world_size"] == 2 and result["summary"]["tokens/s (job)"] > 0
    assert all(l == l for l in result["losses"]), "loss is NaN"
    record("2-process FSDP2 run: finite losses, job tokens/s reported", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Fine-tuning workflow: test report"))
