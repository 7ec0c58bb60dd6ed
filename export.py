"""Export a saved run to one GGUF file, the format llama.cpp, Ollama and LM Studio read, with an Ollama Modelfile.

    python export.py out/smollm2/checkpoint-60                  # q8_0 (default): out/smollm2/checkpoint-60.q8_0.gguf
    python export.py out/smollm2/checkpoint-60 --type f16       # or bf16; q4_0 where every row width is a multiple of 32
    python export.py out/smollm2-lora/checkpoint-60             # a LoRA adapter: its base is loaded and the adapter merged
    python export.py out/tiny-lora/checkpoint-8 --base llama-tiny   # an adapter whose base its config cannot name
    ollama create my-model -f out/smollm2/checkpoint-60.q8_0.Modelfile

The source is what the fine-tuning scripts write: a checkpoint-N/ folder (or the --output-dir: the best
checkpoint where the run kept one with --load-best-model-at-end and ended with its weights, else the one its
`latest` names; the line before the export says which step), a merged/ folder, or a LoRA adapter folder with
its base model (merged on the way).
Written in pure Python by the `gguf` package; no llama.cpp build is needed.

An adapter is merged into its base as the run held it: with the layers the run kept (--num-layers, as
its checkpoint records it; an adapter saved without a checkpoint shows them by the layers it covers),
and only into the base weights it was trained on (the fingerprint its checkpoint records; a run that
held a float32 base in bf16 is merged into the bf16 rounding of it). Another base is refused, as is a
model the machine's free memory cannot hold while it is exported (its weights, and the file's).

What the file carries, for llama.cpp to run it as the fine-tune ran:
  the weights     2-D weights in --type; norms (and llama 3's rope factors) in f32, as llama.cpp keeps them.
                  q and k of the llama family are re-ordered for llama.cpp's rope, which rotates adjacent
                  pairs (x0, x1), (x2, x3), ... where Hugging Face's rotates the two halves of each head;
                  transformers' GGUF reader undoes it (permute_for_gguf_rope below).
  the tokenizer   byte-level BPE tokens, merges and token types; the bos, eos, pad, unk and end-of-turn ids;
                  whether a bos is added; the chat template. The end-of-turn token is what makes a chat model
                  stop after its answer: without it in the file, llama.cpp and Ollama let the model ramble on.
  the shapes      context, embedding and feed-forward lengths, layers, heads and KV heads, head size, rope
                  theta and scaling, the RMSNorm epsilon, the vocabulary size; tied embeddings write no
                  output.weight (llama.cpp then reuses token_embd.weight).

Families: llama, mistral (llama.cpp's llama architecture), qwen2 and qwen3 export; the others the
kernels support (gemma, gemma2, phi3) are refused in one line. Every refusal (a source that cannot
be read or does not match its checkpoint, a full disk) is one line and exit code 2.

What it writes: the GGUF file and the Modelfile beside it (<output>.Modelfile), each first into a
hidden temporary file of this export's own, renamed into place when both are complete. A failed
export leaves the files already there as they were; a killed one's temporary files are removed by
the next export to the same --output (those of one still running are left alone). A GGUF file at
--output is replaced, and the export says so. A Modelfile already there that differs from the one
this export writes (one its user edited) is kept as it is, and the export says so;
--replace-modelfile writes the new one in its place. Once the files are complete the export exits 0,
even when its report cannot be printed: a reader that went away (`| head`) gets nothing more, and a
full disk under standard output gets one line on standard error.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path

from playbook.runtime.signals import run_main
from playbook.startup import start  # imports no torch

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was written", kernels=False)  # (no kernel runs here)

from playbook.model import saved_run  # noqa: E402
from playbook.plan.inputs import Shape  # noqa: E402
from playbook.plan.shapes import model_shape  # noqa: E402

TYPES = ("f16", "bf16", "q8_0", "q4_0")
BLOCK = 32  # values per q8_0 / q4_0 block: each row's width must be a multiple of it
# model_type -> the llama.cpp architecture it is written as, and whether q/k are re-ordered for its rope
ARCHITECTURES = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
                 "qwen3": ("qwen3", False)}
NOT_EXPORTED = {
    "gemma": "its norms apply (1 + weight) and its embeddings are scaled, which llama.cpp's gemma "
             "architecture expects written in its own form",
    "gemma2": "its norms apply (1 + weight) and it caps its logits, which llama.cpp's gemma2 architecture "
              "expects written in its own form",
    "phi3": "llama.cpp's phi3 architecture reads q, k and v as one fused tensor, with its own rope factors",
}
# Pre-tokenizer regexes of the byte-level vocabularies llama.cpp knows (its `tokenizer.ggml.pre` names).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Token types of the GGUF vocabulary (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


class Refused(Exception):
    """Input that cannot be exported: the message is the one line the user sees."""


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("run", help="a checkpoint-N/ folder, an --output-dir (its latest checkpoint), a merged/ folder, "
                               "or a LoRA adapter folder")
    p.add_argument("--type", choices=TYPES, default="q8_0",
                   help="f16, bf16, q8_0 (8 bits a value, default), q4_0 (4 bits; rows must be multiples of 32 wide)")
    p.add_argument("--base", default=None,
                   help="a LoRA adapter's base model (default: the one its adapter_config.json names)")
    p.add_argument("--output", type=Path, default=None,
                   help="the .gguf file to write (default: beside the run, <run>.<type>.gguf)")
    p.add_argument("--name", default=None, help="the model's name in the Ollama command (default: the run's folder name)")
    p.add_argument("--replace-modelfile", action="store_true",
                   help="replace a Modelfile beside --output that differs from the one this export writes (one its "
                        "user edited, say); without it such a file is kept as it is, and the export says so")
    a = p.parse_args(argv)
    if a.output is not None and a.output.suffix.lower() != ".gguf":
        p.error(f"--output {a.output}: give a file name ending in .gguf")
    return a


# ------------------------------------------------------------------------------------------------
# The run: a checkpoint, a merged folder, or an adapter with its base
# ------------------------------------------------------------------------------------------------
def resolve_run(run: str) -> Path:
    """The folder holding the model: the run itself, or the checkpoint an --output-dir's `latest` names."""
    try:
        return saved_run.find(run, follow_latest=True)[0]
    except saved_run.Refusal as err:
        raise Refused(str(err)) from None


def read_json(path: Path) -> dict:
    """A config file of a run (config.json, adapter_config.json) as a dict, or one line saying what is wrong."""
    try:
        return saved_run.read_json(path)
    except saved_run.Refusal as err:
        raise Refused(str(err)) from None


# What a value takes in memory: a model's weights in their dtype, and the file's weights in each --type, which
# the gguf writer holds until it writes the file (q8_0 and q4_0: 32 values and their f16 scale per block)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TYPE_BYTES = {"f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}


def config_dtype(config: dict) -> str:
    """The dtype transformers loads a saved model in (`dtype="auto"`): its config's, float32 when it names none."""
    named = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return named if named in DTYPE_BYTES else "float32"


def check_memory(what: str, shape, dtype: str, weight_type: str) -> None:
    """Refuse, before it is built, a model this machine cannot hold while exporting it: its weights in `dtype` and
    the file's weights in --type. `shape`: its plan.inputs.Shape (None: unknown until it is downloaded)."""
    from playbook.plan.free_memory import FREE_MEMORY_ENV, free_memory
    from playbook.plan.inputs import GB

    if shape is None:
        return
    n, embeddings = shape.params, shape.vocab * shape.hidden * (1 if shape.tied else 2)
    weights = n * DTYPE_BYTES[dtype]

    def file_bytes(kind: str) -> float:  # q4_0 keeps the embeddings and the output layer in q8_0 (tensors below)
        return (n - embeddings) * TYPE_BYTES[kind] + embeddings * TYPE_BYTES["q8_0" if kind == "q4_0" else kind]

    try:
        free, where = free_memory("cpu")
    except (ValueError, SystemExit):  # (a stand-in that is not a number)
        raise Refused(f"{FREE_MEMORY_ENV}={os.environ.get(FREE_MEMORY_ENV)!r}: not a number of GB; set it to the free "
                      "memory in GB (for example 16), or unset it to use the machine's") from None
    need = weights + file_bytes(weight_type)
    if need <= free:
        return

    def size(nbytes: float) -> str:
        return f"{nbytes / GB:.1f} GB" if nbytes >= GB / 10 else f"{nbytes / 1e6:.1f} MB"

    smaller = [t for t in ("q8_0", "q4_0")
               if file_bytes(t) < file_bytes(weight_type) and weights + file_bytes(t) <= free]
    way = (f"--type {smaller[0]} needs {size(weights + file_bytes(smaller[0]))}" if smaller else
           f"export it on a machine with {size(need)} of free memory, or close the programs holding it")
    raise Refused(f"{what}: exporting it on the CPU needs about {size(need)} of memory ({n / 1e9:.2f} B parameters: "
                  f"{size(weights)} in {dtype}, and {size(file_bytes(weight_type))} of {weight_type} weights for the "
                  f"file), and {size(free)} is free ({where}); {way}")


def memory_check(weight_type: str):
    """The check saved_run.load runs before it builds each model: check_memory, from the model's shape."""
    def check(what: str, kind: str, source, layers, config) -> None:
        if kind == "run":
            try:
                shape = Shape.from_config(config)
            except (TypeError, ValueError, KeyError):
                shape = None  # (a config without these numbers: transformers says what is wrong with it)
            return check_memory(what, shape, config_dtype(config), weight_type)
        shape = model_shape(str(source), layers)
        if kind == "hub":  # its config, when the Hub's cache holds it
            if shape is None:
                return None
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
            dtype = config_dtype(json.loads(Path(cached).read_text())) if isinstance(cached, str) else "float32"
        else:
            dtype = {"preset": "float32", "pretrained": "bfloat16"}.get(kind) or config_dtype(config)
        return check_memory(what, shape, dtype, weight_type)
    return check


def load_run(run: str, base: str | None, weight_type: str = "q8_0"):
    """(model on the CPU, tokenizer, what it is) of a saved run; an adapter is merged into its base, built as
    the run that trained it held it: its layers, the base weights its checkpoint records."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # (the GGUF reader's progress bars and notes)
    try:
        return saved_run.load(run, follow_latest=True, base=base, as_trained=True, dtype="auto",
                              memory=memory_check(weight_type))
    except saved_run.Refusal as err:
        raise Refused(str(err)) from None


# ------------------------------------------------------------------------------------------------
# The tokenizer and the chat template
# ------------------------------------------------------------------------------------------------
def pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for how a byte-level tokenizer splits text before its merges (`tokenizer.ggml.pre`)."""
    kind = (pre or {}).get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = [(p.get("type"), p) for p in (pre or {}).get("pretokenizers", [])] if kind == "Sequence" else []
    if [k for k, _ in parts] == ["Digits", "ByteLevel"] and parts[0][1].get("individual_digits"):
        return "smollm"
    if [k for k, _ in parts] == ["Split", "ByteLevel"]:
        pattern = parts[0][1].get("pattern", {}).get("Regex")
        named = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
        if pattern in named:
            return named[pattern]
    raise Refused(f"the tokenizer splits text in a way llama.cpp has no name for ({json.dumps(pre)[:120]}); "
                  "export.py writes the byte-level tokenizers of GPT-2, LLaMA 3, SmolLM and Qwen2")


def _byte_level(decoder: dict | None) -> bool:
    """Whether a tokenizer.json decoder maps byte-level tokens back to text: ByteLevel itself, or a Sequence
    holding it (transformers 5.17, the NGC image's, reads a LLaMA-3-style GGUF tokenizer into a Sequence of
    ByteFallback, Fuse, Replace and ByteLevel)."""
    decoder = decoder or {}
    if decoder.get("type") == "Sequence":
        return any(_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def vocabulary(tokenizer, vocab_size: int) -> dict:
    """What the GGUF file says of the tokenizer: tokens (in id order, `vocab_size` of them), types, merges,
    pre-tokenizer, special ids, whether bos / eos are added."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise Refused(f"the tokenizer is a slow (Python) {type(tokenizer).__name__}; export.py reads a fast "
                      "tokenizer's tokenizer.json")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    byte_level = _byte_level(spec.get("decoder"))
    if model.get("type") != "BPE" or not byte_level:
        raise Refused(f"the tokenizer is a {model.get('type')} model without byte-level decoding (a sentencepiece "
                      "vocabulary); export.py writes byte-level BPE tokenizers only")
    tokens, types = [None] * vocab_size, [NORMAL] * vocab_size
    entries = [(i, t, NORMAL) for t, i in model["vocab"].items()]
    entries += [(a["id"], a["content"], CONTROL if a["special"] else USER_DEFINED) for a in spec.get("added_tokens", [])]
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    dropped = []
    for i, text, kind in entries:
        if i >= vocab_size and i in special:
            raise Refused(f"the tokenizer's special token {i} ({text!r}) is past the model's {vocab_size} embeddings")
        if i >= vocab_size:  # an added token the model has no embedding for (transformers' GGUF reader adds
            dropped.append(f"{i} {text!r}")  # GPT-2's <|endoftext|> so): no input or output can be it
            continue
        tokens[i], types[i] = text, kind
    for i, text in enumerate(tokens):
        if text is None:  # a slot of the embedding no token uses: marked CONTROL so that no reader prints it
            tokens[i], types[i] = f"[PAD{i}]", CONTROL  # (Hugging Face decodes such an id to nothing)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    probe = tokenizer("a")["input_ids"]
    return {
        "tokens": tokens, "types": types, "merges": merges, "dropped": dropped, "pre": pre_tokenizer_name(spec.get("pre_tokenizer")),
        "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
        "add_bos": tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id],
        "add_eos": tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id] and len(probe) > 1,
    }


class ChatStyle:
    """A chat layout as pieces (a turn's opening for a role, its closing, the assistant's opening), from which
    both Ollama's Go TEMPLATE and a Python rendering are made, so the two can be compared with the
    model's own Jinja template."""

    def __init__(self, name: str, open_turn: str, close_turn: str, end_of_turn: str, turn_marker: str):
        self.name, self.open_turn, self.close_turn = name, open_turn, close_turn
        self.end_of_turn, self.turn_marker = end_of_turn, turn_marker

    def go_template(self) -> str:
        return ("{{ if .System }}" + self.open_turn.format(role="system") + "{{ .System }}" + self.close_turn
                + "{{ end }}{{ range .Messages }}{{ if ne .Role \"system\" }}" + self.open_turn.format(role="{{ .Role }}")
                + "{{ .Content }}" + self.close_turn + "{{ end }}{{ end }}" + self.open_turn.format(role="assistant"))

    def render(self, system: str | None, messages: list[dict]) -> str:
        """What go_template renders for this conversation (Ollama passes the system prompt as .System)."""
        text = self.open_turn.format(role="system") + system + self.close_turn if system else ""
        for m in messages:
            if m["role"] != "system":
                text += self.open_turn.format(role=m["role"]) + m["content"] + self.close_turn
        return text + self.open_turn.format(role="assistant")


CHAT_STYLES = (
    ChatStyle("ChatML", "<|im_start|>{role}\n", "<|im_end|>\n", "<|im_end|>", "<|im_start|>"),
    ChatStyle("LLaMA 3", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", "<|eot_id|>",
              "<|start_header_id|>"),
)
PROBE = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi. How can I help?"},
         {"role": "user", "content": "Name a colour."}]
PROBE_SYSTEM = "You answer briefly."


def chat_style(tokenizer, add_bos: bool):
    """(style, default system prompt or None, note) of the tokenizer's chat template; style None when it is
    neither ChatML nor LLaMA 3's, or when the pieces do not reproduce it (note says which)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None, None, "the tokenizer has no chat template"

    def jinja(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        bos = tokenizer.bos_token or ""
        return text[len(bos):] if add_bos and bos and text.startswith(bos) else text  # llama.cpp adds that bos

    from jinja2 import TemplateError

    try:
        plain, with_system = jinja(PROBE), jinja([{"role": "system", "content": PROBE_SYSTEM}, *PROBE])
    except (TemplateError, ValueError, TypeError, KeyError) as err:  # a template that refuses a system turn
        return None, None, f"the chat template did not render a sample conversation ({str(err)[:80]})"
    style = next((s for s in CHAT_STYLES if s.turn_marker in plain), None)
    if style is None:
        return None, None, "the chat template is neither ChatML nor LLaMA 3's"
    opening = style.open_turn.format(role="system")
    default = None
    if plain.startswith(opening):  # a system prompt the template adds by itself
        default = plain[len(opening):plain.index(style.close_turn)]
    same = style.render(default, PROBE) == plain and style.render(PROBE_SYSTEM, PROBE) == with_system
    if not same:
        return None, None, f"the chat template is {style.name}-like but lays turns out its own way"
    return style, default, None


def modelfile(gguf_name: str, style, default_system: str | None, stops: list[str], note: str | None) -> str:
    lines = [f"FROM ./{gguf_name}", ""]
    if style is None:
        lines += [f"# No TEMPLATE: {note}; Ollama falls back to the chat template inside the GGUF file", ""]
    else:
        lines += [f'TEMPLATE """{style.go_template()}"""', ""]
        if default_system:
            lines += [f'SYSTEM """{default_system}"""', ""]
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# The weights
# ------------------------------------------------------------------------------------------------
def permute_for_gguf_rope(w, heads: int):
    """Rows of q_proj / k_proj (or their bias) from Hugging Face's rope layout to llama.cpp's.

    Hugging Face rotates each head's first half against its second half (rotate_half: x_i with x_{i+d/2});
    llama.cpp's llama architecture rotates adjacent pairs (x_{2i} with x_{2i+1}). Interleaving the two
    halves of every head's rows, [a0 a1 .. | b0 b1 ..] -> [a0 b0 a1 b1 ..], makes llama.cpp's pairs the
    ones Hugging Face rotated together, so q.k comes out the same. transformers' GGUF reader undoes it.
    """
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_metadata(config, head_dim: int):
    """(rope theta, scaling as {kind, factor, low_freq_factor, high_freq_factor, original_context} or None)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear"):
        raise Refused(f"rope scaling of type {kind!r}: export.py writes llama 3's and linear scaling")
    return theta, {"kind": kind, "factor": float(params["factor"]),
                   "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
                   "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
                   "original_context": int(params.get("original_max_position_embeddings", 8192))}


def llama3_rope_factors(theta: float, head_dim: int, s: dict):
    """The per-frequency divisors of llama 3's rope scaling, which llama.cpp reads as the tensor
    rope_freqs.weight: 1 for wavelengths under original_context / high_freq_factor, `factor` above
    original_context / low_freq_factor, and a smooth blend between (transformers' _compute_llama3_parameters)."""
    import math

    import torch

    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < s["original_context"] / s["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > s["original_context"] / s["low_freq_factor"]:
            out.append(s["factor"])
        else:
            smooth = (s["original_context"] / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return torch.tensor(out, dtype=torch.float32)


def tensors(model, kind: str, arch: str, permute: bool, weight_type: str):
    """(GGUF name, Hugging Face name, tensor, ggml type name, heads) of every weight, in the model's order; heads:
    the head count to re-order its rows by for llama.cpp's rope, or None. The tensors are the model's own:
    each is converted only as it is written (as_ggml), so that no float32 copy of the whole model is made."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    out = []
    for hf_name, param in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd.weight when output.weight is absent
        stem, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise Refused(f"the {kind} model has a weight GGUF has no name for: {hf_name}")
        heads = None
        if permute and stem.endswith("self_attn.q_proj"):
            heads = config.num_attention_heads
        elif permute and stem.endswith("self_attn.k_proj"):
            heads = config.num_key_value_heads
        if param.dim() < 2:
            kind_here = "f32"  # norms and biases: llama.cpp keeps them in f32
        elif weight_type == "q4_0" and mapped in ("token_embd", "output"):
            kind_here = "q8_0"  # the embeddings and the output projection in 8 bits, as llama.cpp's Q4_0 files have them
        else:
            kind_here = weight_type
        out.append((f"{mapped}.{suffix}", hf_name, param.detach(), kind_here, heads))
    return out


def check_widths(weights, weight_type: str) -> None:
    for gguf_name, hf_name, w, kind, _ in weights:
        if kind in ("q8_0", "q4_0") and w.shape[-1] % BLOCK:
            raise Refused(f"--type {weight_type}: {hf_name} has rows {w.shape[-1]} values wide, not a multiple of "
                          f"{BLOCK} (the {kind} block); export this model with --type f16 or --type bf16")
        if kind == "f16" and not bool(w.abs().amax() <= 65504):
            raise Refused(f"--type f16: {hf_name} holds values beyond f16's range (65,504); use --type bf16")


def as_ggml(w, kind: str, heads: int | None):
    """(numpy array, ggml type) of a weight in `kind`, its rows re-ordered for llama.cpp's rope when `heads`."""
    import gguf
    import numpy as np
    import torch

    w = w.to("cpu", torch.float32)
    if heads is not None:
        w = permute_for_gguf_rope(w, heads)
    array = w.numpy()
    if kind == "f32":
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if kind == "f16":
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[kind]
    return gguf.quants.quantize(array, qtype), qtype


# ------------------------------------------------------------------------------------------------
# The file
# ------------------------------------------------------------------------------------------------
FILE_TYPES = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


def refuse_family(kind) -> None:
    if kind in NOT_EXPORTED:
        raise Refused(f"a {kind} model: export.py does not write the {kind} family ({NOT_EXPORTED[kind]}); "
                      f"it writes {', '.join(ARCHITECTURES)}")
    if kind not in ARCHITECTURES:
        raise Refused(f"a {kind} model: not a family this project supports; export.py writes {', '.join(ARCHITECTURES)}")


def GGUFWriter(path, arch):  # noqa: N802  (the gguf package's writer; tests put a stand-in here)
    import gguf

    return gguf.GGUFWriter(path, arch)


def gguf_contents(model, tokenizer, weight_type: str) -> dict:
    """What the GGUF file of `model` holds, before a byte is written: its architecture, rope, vocabulary and
    tensors, and what the Modelfile needs (the chat style, its default system prompt, the stop strings)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    refuse_family(kind)
    arch, permute = ARCHITECTURES[kind]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta, scaling = rope_metadata(config, head_dim)
    vocab = vocabulary(tokenizer, config.vocab_size)
    style, default_system, note = chat_style(tokenizer, vocab["add_bos"])
    weights = tensors(model, kind, arch, permute, weight_type)
    check_widths(weights, weight_type)
    if scaling is not None and scaling["kind"] != "linear":  # (llama 3's scaling: the rope_freqs tensor, below)
        weights.append(("rope_freqs.weight", "(llama 3 rope scaling)", llama3_rope_factors(theta, head_dim, scaling),
                        "f32", None))
    end_of_turn = style.end_of_turn if style else None
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    stops = list(dict.fromkeys(t for t in (end_of_turn, vocab["tokens"][vocab["eos"]] if vocab["eos"] is not None
                                           else None, style.turn_marker if style else None) if t in ids))
    return {"config": config, "arch": arch, "head_dim": head_dim, "theta": theta, "scaling": scaling, "vocab": vocab,
            "weights": weights, "end_of_turn": end_of_turn, "ids": ids, "chat_template":
            getattr(tokenizer, "chat_template", None), "style": style, "system": default_system, "stops": stops,
            "note": note, "tensors": len(weights), "dropped": vocab["dropped"]}


def write_gguf(path: Path, contents: dict, weight_type: str, name: str) -> None:
    """Write the file gguf_contents() describes to `path` (export() gives the temporary file of atomic_file, which
    flushes it to disk and renames it into place)."""
    import gguf

    config, arch, head_dim, theta, scaling, vocab, ids, end_of_turn = (contents[k] for k in (
        "config", "arch", "head_dim", "theta", "scaling", "vocab", "ids", "end_of_turn"))
    w = None
    try:
        w = GGUFWriter(path, arch)
        w.add_name(name)
        w.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[weight_type]).value)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_block_count(config.num_hidden_layers)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(float(theta))
        w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        w.add_vocab_size(config.vocab_size)
        if scaling is not None and scaling["kind"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(scaling["factor"])
        elif scaling is not None:
            # llama.cpp applies llama 3's scaling through the rope_freqs tensor; a rope.scaling.type of "llama3"
            # would stop it (it knows none, linear, yarn, longrope), and a rope.scaling.factor would scale twice.
            # The numbers the tensor was made from are kept, under keys no reader acts on.
            w.add_rope_scaling_orig_ctx_len(scaling["original_context"])
            for key in ("factor", "low_freq_factor", "high_freq_factor"):
                w.add_float32(f"{arch}.rope.scaling.llama3.{key}", scaling[key])  # (the tensor: gguf_contents)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(vocab["pre"])
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_token_merges(vocab["merges"])
        if not vocab["merges"]:  # (transformers' reader passes over an empty merges list and derives them from
            w.add_token_scores([0.0] * len(vocab["tokens"]))  # scores; from these, none, as the tokenizer has)
        for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id),
                         ("unk", w.add_unk_token_id)):
            if vocab[key] is not None:
                add(vocab[key])
        if end_of_turn in ids:
            w.add_eot_token_id(ids[end_of_turn])
        w.add_add_bos_token(vocab["add_bos"])
        w.add_add_eos_token(vocab["add_eos"])
        if contents["chat_template"]:
            w.add_chat_template(contents["chat_template"])
        for gguf_name, _, tensor, kind_here, heads in contents["weights"]:
            array, qtype = as_ggml(tensor, kind_here, heads)
            w.add_tensor(gguf_name, array, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    except BaseException:
        if w is not None:
            with contextlib.suppress(OSError):  # (its handle closed; atomic_file removes the file)
                w.close()
        raise


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # (signal 0: nothing is sent; only whether the process exists)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (PermissionError): alive
        return True
    return True


def remove_leftovers(path: Path) -> None:
    """Remove what killed exports to `path` left: the temporary files (playbook.store.files.temporary_beside) of
    this host whose process is gone. Those of an export still running, or of another host (a shared disk), are
    left alone."""
    own = re.compile(rf"^\.{re.escape(path.name)}\.tmp-(.+)-(\d+)-[0-9a-f]+$")
    host = socket.gethostname()
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        found = own.match(leftover.name)
        if found and found.group(1) == host and not process_alive(int(found.group(2))):
            leftover.unlink(missing_ok=True)


def modelfile_there(path: Path, text: str) -> str | None:
    """What is at the Modelfile's path already: None (nothing), "broken" (a link to nothing: it holds no Modelfile,
    and the `ollama create` command would point at nothing, so the new one is written in the link's place, the
    link's target left alone), "same" (this text) or "other" (a Modelfile its user edited, one written for another
    chat template, or any other file)."""
    if not path.exists():
        return "broken" if path.is_symlink() else None
    try:
        return "same" if path.read_text(encoding="utf-8") == text else "other"
    except (OSError, ValueError):  # unreadable, or not text
        return "other"


def failed(output: Path, modelfile_path: Path, err: OSError, placed: list, existed: list) -> str:
    """The one line of an export whose files could not be written: why, and what is on disk now."""
    from playbook.store.files import is_full_disk, write_failure

    why = write_failure(err)  # (a short write of the GGUF writer, numpy's, is a full disk too)
    way = "; free some space there, or choose another --output" if is_full_disk(err) else ""
    if placed:  # the GGUF was renamed into place, the Modelfile could not be
        return (f"--output {output} was written, but its Modelfile {modelfile_path} could not be ({why})"
                + (f"; the {modelfile_path.name} already there is as it was" if modelfile_path in existed else "")
                + way)
    kept = " and ".join(p.name for p in existed)
    left = (f"nothing was left behind, and the {kept} already there {'is' if len(existed) == 1 else 'are'} as "
            f"{'it was' if len(existed) == 1 else 'they were'}" if existed else "nothing was left behind")
    return f"--output {output}: could not be written ({why}); {left}{way}"


def default_output(folder: Path, weight_type: str) -> Path:
    folder = folder.resolve()
    return folder.parent / f"{folder.name}.{weight_type}.gguf"


def ollama_name(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._") or "model"


def export(run: str, weight_type: str = "q8_0", output: Path | None = None, base: str | None = None,
           name: str | None = None, replace_modelfile: bool = False) -> dict:
    """Export a run; returns {"gguf", "modelfile", "name", "bytes", "replaced", "kept_modelfile", ...}. Raises
    Refused for bad input. Writes only its own temporary files, renamed into place when both are complete (the
    GGUF file first)."""
    from playbook.store.files import atomic_file

    folder = resolve_run(run)
    if base is not None and not (folder / "adapter_config.json").is_file():
        raise Refused(f"--base {base}: {folder} holds a whole model (no adapter_config.json), which is exported as it "
                      "is; --base names the base of a LoRA adapter: drop it, or give the adapter's folder")
    if folder != Path(run).expanduser():  # a run folder: say up front which checkpoint is exported
        print(f"{run}: exporting {saved_run.find(run, follow_latest=True)[1]}", flush=True)
    if (folder / "config.json").is_file():  # a family it does not write: refused before the weights load
        kind = read_json(folder / "config.json").get("model_type")
        if not isinstance(kind, str) or not kind:
            raise Refused(f"{folder / 'config.json'} names no model_type: the file is damaged; restore it, or export "
                          "another checkpoint")
        refuse_family(kind)
    output = Path(output) if output is not None else default_output(folder, weight_type)
    if not output.parent.is_dir():
        raise Refused(f"--output {output}: the folder {output.parent} does not exist")
    modelfile_path = output.with_suffix(".Modelfile")
    for path in (output, modelfile_path):
        if path.is_dir():
            raise Refused(f"--output {output}: {path} is a folder; choose another --output")
    if base is not None and output.exists() and Path(base).expanduser().is_file() \
            and os.path.samefile(Path(base).expanduser(), output):
        raise Refused(f"--output {output} is the base model the adapter is merged into (--base); choose another "
                      "--output")
    model, tokenizer, what = load_run(run, base, weight_type)
    name = name or folder.name
    existed = [p for p in (output, modelfile_path) if p.exists()]
    for path in (output, modelfile_path):
        remove_leftovers(path)
    contents = gguf_contents(model, tokenizer, weight_type)
    text = modelfile(output.name, contents["style"], contents["system"], contents["stops"], contents["note"])
    there = modelfile_there(modelfile_path, text)
    kept = there == "same" or (there == "other" and not replace_modelfile)
    placed = []
    try:
        with contextlib.ExitStack() as modelfile_written:  # renamed into place after the GGUF file, when both are whole
            if not kept:
                with open(modelfile_written.enter_context(atomic_file(modelfile_path)), "w", encoding="utf-8") as f:
                    f.write(text)
            with atomic_file(output) as tmp:
                write_gguf(tmp, contents, weight_type, name)
            placed.append(output)
    except OSError as err:
        raise Refused(failed(output, modelfile_path, err, placed, existed)) from None
    made = {k: contents[k] for k in ("style", "system", "stops", "note", "tensors", "dropped")}
    return {**made, "gguf": output, "modelfile": modelfile_path, "name": ollama_name(name), "what": what,
            "replaced_link": there == "broken",
            "bytes": output.stat().st_size, "replaced": output in existed, "kept_modelfile": kept and there == "other"}


def quiet_stdout() -> None:
    """Send what is still buffered for standard output, and anything printed later, to /dev/null (a reader that
    went away, a full disk): nothing is retried, and Python's flush at exit fails no more."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv=None) -> int:
    a = parse(argv)
    from playbook.runtime.signals import exit_on_ctrl_c_while_importing

    with exit_on_ctrl_c_while_importing("nothing was written"):  # torch's import can swallow a KeyboardInterrupt
        import torch  # noqa: F401
        import transformers  # noqa: F401

    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # (what the loaders print goes with the notes)
            done = export(a.run, a.type, a.output, a.base, a.name, a.replace_modelfile)
    except Refused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        report(done, a.type, time.perf_counter() - t0)
        sys.stdout.flush()
    except BrokenPipeError:  # a reader that went away (`| head`): quiet, as Unix tools are; the files are whole
        quiet_stdout()
    except OSError as err:  # a full disk under standard output
        quiet_stdout()
        print(f"warning: the export's report could not be written to standard output ({err.strerror or err}); "
              f"the export is complete: {done['gguf']} and {done['modelfile']}", file=sys.stderr)
    return 0


def report(done: dict, weight_type: str, seconds: float) -> None:
    from core.process import log

    log(f"Exported {done['what']} in {seconds:.1f} s: {done['gguf']} ({done['bytes'] / 1e6:,.1f} MB, {weight_type}, "
        f"{done['tensors']} tensors{', replacing the file there' if done['replaced'] else ''})")
    if done["dropped"]:
        log(f"Left out of the vocabulary: token {', '.join(done['dropped'])}, past the model's embeddings")
    if done["kept_modelfile"]:
        log(f"Ollama Modelfile: {done['modelfile']} kept as it is: it differs from the one this export writes "
            "(edited?); --replace-modelfile writes the new one in its place")
    else:
        chat = (f"{done['style'].name} chat template, stop on {', '.join(done['stops'])}" if done["style"] else
                f"no TEMPLATE ({done['note']})")
        log(f"Ollama Modelfile: {done['modelfile']} ({chat})")
    if done.get("replaced_link"):
        log(f"({done['modelfile']} was a link to a file that does not exist: the Modelfile is written in its place)")
    name, modelfile_path, gguf_path = (shlex.quote(str(v)) for v in (done["name"], done["modelfile"], done["gguf"]))
    log(f"Run it:  ollama create {name} -f {modelfile_path}  &&  ollama run {name}")  # (quoted for the shell: a
    log(f"     or: llama-cli -m {gguf_path} -cnv")  # path with spaces is copied as one word)


if __name__ == "__main__":
    sys.exit(run_main(main, "nothing was written (a partly written file is removed)"))
