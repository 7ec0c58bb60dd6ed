"""The tokenizer that comes with a model: a Hugging Face model's own (with LLaMA 3's chat template for the base
LLaMA 3 models, which have none), or the offline byte tokenizer for the random-weight presets.

    tokenizer = make_tokenizer(None, preset=True)  # or make_tokenizer("meta-llama/Llama-3.1-8B-Instruct", False)

The offline tokenizer
---------------------
The random-weight presets cannot download a tokenizer, so `make_tokenizer(..., preset=True)` builds
one in-process: 256 byte tokens (id = byte value) plus LLaMA 3's special tokens (ids 256-261), 262
ids in all, so it fits any preset's vocabulary (llama-tiny has 512), with a LLaMA-3-style chat
template. Every UTF-8 text round-trips; one character is 1-4 tokens.

tokenizers and transformers are imported when a tokenizer is made: the scripts import this module before
torch (chat.py and export.py load torch and transformers under their Ctrl-C guard).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from playbook.model import pretrained

# LLaMA 3's special tokens, in the byte tokenizer at ids 256, 257, ...
BOS, EOS, HEADER_START, HEADER_END, EOT, PAD = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|finetune_right_pad_id|>")
BYTE_SPECIAL_TOKENS = (BOS, EOS, HEADER_START, HEADER_END, EOT, PAD)

# The message layout of LLaMA 3 chat models: a header with the role, a blank line, the content, <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _byte_symbols() -> list[str]:
    """One printable character per byte value, as byte-level BPE tokenizers spell their vocabulary.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are moved to
    unused code points from U+0100 on, in byte order, so no symbol is whitespace or invisible.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, moved = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + moved))
            moved += 1
    return symbols


def byte_tokenizer():
    """A LLaMA-3-style tokenizer with no download: token id = byte value, special tokens at 256-261."""
    vocab = {symbol: b for b, symbol in enumerate(_byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every byte stays its own token
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                        special_tokens=[(BOS, core.token_to_id(BOS))])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                  model_max_length=1 << 30, name_or_path="byte-level (offline)")
    tok.chat_template = LLAMA3_CHAT_TEMPLATE
    return tok


def make_tokenizer(model_name_or_path: str | None, preset: bool):
    """The tokenizer of a Hugging Face model (id or local directory), or the byte tokenizer for a preset.

    A model tokenizer without a chat template whose vocabulary has LLaMA 3's header tokens (the base
    LLaMA 3 models) gets LLAMA3_CHAT_TEMPLATE, the layout its special tokens were made for.
    """
    if preset:
        return byte_tokenizer()
    if not model_name_or_path:
        raise ValueError("make_tokenizer: give a model id or directory, or preset=True for the byte tokenizer")

    if pretrained.is_pretrained_name(model_name_or_path):  # smollm2-135m or a .gguf: its converted directory
        model_name_or_path = str(pretrained.local_directory(model_name_or_path))
    try:
        tok = AutoTokenizer.from_pretrained(model_name_or_path)
    except (OSError, ValueError) as err:  # hub errors are OSError subclasses
        raise RuntimeError(f"could not load the tokenizer of '{model_name_or_path}' ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200]})") from None
    if getattr(tok, "chat_template", None) is None:
        vocab = tok.get_vocab()
        if all(t in vocab for t in (HEADER_START, HEADER_END, EOT)):
            tok.chat_template = LLAMA3_CHAT_TEMPLATE
    return tok
