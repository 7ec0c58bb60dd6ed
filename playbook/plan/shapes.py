"""The Shape of --model NAME from what is on this machine: a preset, a local directory, a GGUF file's header, the
Hugging Face cache, or the real model's numbers before its file is installed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from playbook.model import pretrained
from playbook.model.presets import PRESETS
from playbook.plan.inputs import Shape


# The real model's shape as its GGUF header gives it (tests/memory_plan_test.py checks the two agree where the
# file is installed): a plan for it before the file is installed or converted.
KNOWN_SHAPES = {"smollm2-135m": dict(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                                     head_dim=64, tied=True, positions=8192)}


def _known_shape(name: str, num_layers: int | None) -> Shape | None:
    known = KNOWN_SHAPES.get(name.lower())
    if known is None:
        return None
    return replace(Shape(**known), layers=min(num_layers or known["layers"], known["layers"]))


def model_shape(name: str, num_layers: int | None = None) -> Shape | None:
    """The Shape of --model NAME from what is on this machine (a preset, a local directory, a GGUF file,
    the Hugging Face cache); None where its config is not here yet (it comes with the weights)."""
    if name in PRESETS:
        return Shape.from_config(PRESETS[name], num_layers)
    try:
        if pretrained.is_pretrained_name(name):
            folder = pretrained.cached_directory(name)
            if (folder / "config.json").is_file():
                return Shape.from_config(json.loads((folder / "config.json").read_text()), num_layers)
            try:
                return _gguf_shape(pretrained.gguf_file(name), num_layers)
            except (OSError, ValueError, KeyError, TypeError, SystemExit, ImportError):
                return _known_shape(name, num_layers)  # its file is not installed here (yet)
        local = Path(name).expanduser()
        if local.is_dir():
            return Shape.from_config(json.loads((local / "config.json").read_text()), num_layers)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return Shape.from_config(json.loads(Path(cached).read_text()), num_layers)
    except (OSError, ValueError, KeyError, TypeError, SystemExit, ImportError):
        return None
    return None


def _gguf_shape(path: Path, num_layers: int | None) -> Shape | None:
    """A GGUF file's architecture from its metadata (the gguf package reads the header, not the weights)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key):
        f = reader.fields.get(key)
        return None if f is None else f.parts[f.data[0]].tolist()[0]

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    hidden, heads = value(f"{arch}.embedding_length"), value(f"{arch}.attention.head_count")
    return Shape.from_config({
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data), "hidden_size": hidden,
        "intermediate_size": value(f"{arch}.feed_forward_length"), "num_hidden_layers": value(f"{arch}.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": value(f"{arch}.attention.head_count_kv"),
        "head_dim": value(f"{arch}.attention.key_length") or hidden // heads,
        "max_position_embeddings": value(f"{arch}.context_length"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}, num_layers)
