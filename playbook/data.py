"""Data for the fine-tuning scripts: instruction and chat rows, prompt masking, packing, an offline tokenizer.

    tokenizer = make_tokenizer(None, preset=True)  # or make_tokenizer("meta-llama/Llama-3.1-8B-Instruct", False)
    data = make_data("examples/chat.jsonl", "dataset", tokenizer, vocab_size=512, batch_size=4,
                     seq_len=512, seed=0, packing=True, eval_fraction=0.05)
    print(data.describe())
    for step in range(steps):
        loss = model(**data.batch(step, device)).loss

Three kinds of data, one interface (`TrainData.batch(index, device)`, deterministic in seed, rank and index,
so a resumed run needs only the step index):

    synthetic  uniform random token ids (speed and memory do not depend on the token values)
    text       one raw text file, tokenised once, cut into random windows of seq_len tokens
    dataset    rows of a .jsonl / .json / .parquet file or a Hugging Face dataset id:
                 chat               {"messages": [{"role": "user", "content": ...}, ...]}
                 prompt/completion  {"prompt": ..., "completion": ...}
                 Alpaca             {"instruction": ..., "input": ... (optional), "output": ...}
                 plain text         {"text": ...}

Labels
------
`labels` are NOT shifted: the label at position t is the token at position t, or -100 where that token
is not trained on. Hugging Face's causal-LM loss shifts them inside the model (logits at t - 1 predict
label t). Masked (-100): every prompt token (for chat, every token that is not part of an assistant
reply, template headers included; for prompt/completion and Alpaca, the prompt), padding, and the
first token of every example, which no earlier token of the same example can predict. The last rule
makes `labels != -100` count exactly the tokens the loss is taken over, which is what a training loop
needs to normalise a loss summed over gradient-accumulation micro-batches. `train_on_prompt=True`
trains on every token of an example except its first.

Batches
-------
Without packing, each example is one row, right-padded to seq_len (a fixed shape for every step,
which torch.compile and the step-time measurements prefer): `attention_mask` [B, T] is 1 on tokens,
0 on padding, and padding labels are -100.

With `packing=True` examples are concatenated into full rows of seq_len tokens. `position_ids`
restart at 0 at each example (RoPE then sees each example exactly as if it were alone) and
`attention_mask` is a 4-D boolean mask [B, 1, T, T], causal within each example and False across
examples. Why a 4-D mask and not position_ids alone: transformers 5.x (checked in 5.17 and 5.23,
masking_utils.find_packed_sequence_indices) infers example boundaries from position_ids, but only
when no 2-D attention_mask is passed AND no KV cache exists; LlamaConfig's default `use_cache=True`
makes the model create a cache even in a training forward, and then every token silently attends
across example boundaries. A 4-D mask is used as given by the eager and sdpa attention
implementations, whatever the cache setting (data_test.py checks both behaviours). It is not
supported by flash_attention_2, which needs position_ids alone. Its memory is B x T x T bytes
(16 MiB at 4 x 2048), built on the device.

The offline tokenizer
---------------------
The random-weight presets cannot download a tokenizer, so `make_tokenizer(..., preset=True)` builds
one in-process: 256 byte tokens (id = byte value) plus LLaMA 3's special tokens (ids 256-261), 262
ids in all, so it fits any preset's vocabulary (llama-tiny has 512), with a LLaMA-3-style chat
template. Every UTF-8 text round-trips; one character is 1-4 tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

IGNORE_INDEX = -100  # Hugging Face's label value for "no loss here"

KINDS = ("synthetic", "text", "dataset")

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

# Alpaca rows become a prompt in this layout; the model is trained on the output that follows it.
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

# Why a row can be dropped; DataReport counts rows by these reasons.
DROP_REASONS = {
    "not an object": "the row is not a JSON object",
    "unknown shape": "none of messages, prompt/completion, instruction/output, text",
    "missing field": "a recognised shape lacks a field (completion, output, a message's role or content)",
    "bad field type": "a field has the wrong type (content that is not a string, messages not a list)",
    "empty": "nothing to train on (empty completion, output, text or conversation)",
    "chat template mismatch": "the template's rendering of a shorter conversation is not a prefix of the full one",
    "longer than seq_len": "more tokens than seq_len",
    "no trainable token": "every label is masked (a conversation without an assistant reply)",
}


# ------------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------------
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

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
    from transformers import AutoTokenizer

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


# ------------------------------------------------------------------------------------------------
# Loading rows
# ------------------------------------------------------------------------------------------------
FILE_FORMATS = (".jsonl", ".json", ".parquet")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def load_rows(path_or_hub_id: str) -> list[dict]:
    """Rows of a local .jsonl / .json / .parquet file, or of a Hugging Face dataset id (split "train").

    A .json file holds a list of objects or {"data": [...]}. Rows are returned as they are; which
    ones are usable is decided (and counted) by `encode_rows`.
    """
    source = str(path_or_hub_id)
    path = Path(source).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a {' / '.join(FILE_FORMATS)} file or a dataset id")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".json":
            return _read_json(path)
        if suffix == ".parquet":
            return _read_parquet(path)
        raise ValueError(f"{path}: unknown data format '{suffix or '(no extension)'}'; use "
                         f"{', '.join(FILE_FORMATS)} (a raw text file is kind 'text', not 'dataset')")
    looks_like_file = path.suffix != "" or source.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(source)
    if looks_like_file:
        raise FileNotFoundError(f"data file {path} does not exist")
    return _load_hub_dataset(source)


def _read_jsonl(path: Path) -> list:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno})") from None
    return rows


def _read_json(path: Path) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    if isinstance(data, list):
        return data
    raise ValueError(f'{path}: a .json data file must hold a list of objects or {{"data": [...]}}')


def _read_parquet(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    except ImportError:  # pandas absent, or present without a parquet engine
        raise RuntimeError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None


def _load_hub_dataset(hub_id: str) -> list:
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"'{hub_id}' is not a local file; loading it as a Hugging Face dataset id needs the "
                           "`datasets` package (pip install datasets)") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        rows = datasets.load_dataset(hub_id, split="train")  # datasets honours HF_HUB_OFFLINE itself
    except Exception as err:  # noqa: BLE001  (network, missing repo, bad split: one readable line)
        hint = " (HF_HUB_OFFLINE=1: only datasets already in the local cache can be loaded)" if offline else ""
        raise RuntimeError(f"could not load the dataset '{hub_id}'{hint}: {type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200] if str(err) else ''}") from None
    return [dict(r) for r in rows]


# ------------------------------------------------------------------------------------------------
# Rows -> examples (token ids and masked labels)
# ------------------------------------------------------------------------------------------------
@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # the token, or IGNORE_INDEX; not shifted


class BadRow(Exception):
    """A row that cannot be used; `reason` is one of DROP_REASONS."""

    def __init__(self, reason: str):
        assert reason in DROP_REASONS, reason
        super().__init__(reason)
        self.reason = reason


@dataclass
class DataReport:
    """What became of the rows: kept, dropped by reason, and how many tokens are trained on."""

    source: str
    rows: int = 0
    dropped: dict = field(default_factory=dict)  # reason -> number of rows
    train_examples: int = 0
    eval_examples: int = 0
    tokens: int = 0  # tokens of the kept examples, before padding
    trainable_tokens: int = 0  # of those, the ones with a label (!= -100)

    @property
    def kept(self) -> int:
        return self.rows - sum(self.dropped.values())

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def __str__(self) -> str:
        n_dropped = sum(self.dropped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.dropped.items()))
        share = 100.0 * self.trainable_tokens / self.tokens if self.tokens else 0.0
        return (f"{self.source}: {self.rows} rows, {self.kept} kept ({self.train_examples} train, "
                f"{self.eval_examples} eval), {n_dropped} dropped" + (f" ({reasons})" if reasons else "")
                + f"; {self.tokens:,} tokens, {self.trainable_tokens:,} trainable ({share:.1f} %)")


def _text_field(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None:
        if required:
            raise BadRow("missing field")
        return ""
    if not isinstance(value, str):
        raise BadRow("bad field type")
    return value


def _offsets(tokenizer, text: str):
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise TypeError(f"{type(tokenizer).__name__} gives no character offsets; prompt masking needs a fast "
                        "(tokenizers-backed) tokenizer") from None
    return enc["input_ids"], enc["offset_mapping"]


def _encode_chat(row: dict, tokenizer) -> tuple[list[int], list[bool]]:
    messages = row["messages"]
    if not isinstance(messages, list):
        raise BadRow("bad field type")
    if not messages:
        raise BadRow("empty")
    for m in messages:
        if not isinstance(m, dict):
            raise BadRow("bad field type")
        if m.get("role") is None or m.get("content") is None:
            raise BadRow("missing field")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise BadRow("bad field type")
    if all(not m["content"].strip() for m in messages):
        raise BadRow("empty")
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"chat rows need a chat template, and the tokenizer {name} has none; use an instruct "
                         "model's tokenizer, or prompt/completion rows")
    render = tokenizer.apply_chat_template
    full = render(messages, tokenize=False)
    # Character spans of the assistant replies: what rendering message i adds after the assistant
    # header that add_generation_prompt would print. Found by rendering, so any template works
    # whose shorter conversations render as prefixes of the longer ones.
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render(messages[:i], tokenize=False, add_generation_prompt=True)
            through = render(messages[: i + 1], tokenize=False)
        except Exception:  # noqa: BLE001  (a template that refuses a partial conversation)
            raise BadRow("chat template mismatch") from None
        if not (through.startswith(before) and full.startswith(through)):
            raise BadRow("chat template mismatch")
        spans.append((len(before), len(through)))
    ids, offsets = _offsets(tokenizer, full)
    # A token belongs to a reply when its first character does (a BPE token that straddles the
    # header/reply boundary stays masked).
    trainable = [any(s <= start < e for s, e in spans) for start, _ in offsets]
    return ids, trainable


def _encode_prompt_completion(prompt: str, completion: str, tokenizer) -> tuple[list[int], list[bool]]:
    ids, offsets = _offsets(tokenizer, prompt + completion)
    trainable = [start >= len(prompt) for start, _ in offsets]
    if tokenizer.bos_token_id is not None:
        ids, trainable = [tokenizer.bos_token_id] + ids, [False] + trainable
    if tokenizer.eos_token_id is not None:  # the model learns to stop after the completion
        ids, trainable = ids + [tokenizer.eos_token_id], trainable + [True]
    return ids, trainable


def encode_row(row, tokenizer, train_on_prompt: bool = False) -> Example:
    """One row -> an Example (labels masked as the module docstring says). Raises BadRow(reason)."""
    if not isinstance(row, dict):
        raise BadRow("not an object")
    if "messages" in row:
        ids, trainable = _encode_chat(row, tokenizer)
    elif "prompt" in row or "completion" in row:
        prompt, completion = _text_field(row, "prompt"), _text_field(row, "completion")
        if not completion.strip():
            raise BadRow("empty")
        ids, trainable = _encode_prompt_completion(prompt, completion, tokenizer)
    elif "instruction" in row or "output" in row:
        instruction, output = _text_field(row, "instruction"), _text_field(row, "output")
        extra = _text_field(row, "input", required=False)
        if not output.strip() or not instruction.strip():
            raise BadRow("empty")
        prompt = (ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra) if extra.strip()
                  else ALPACA_PROMPT.format(instruction=instruction))
        ids, trainable = _encode_prompt_completion(prompt, output, tokenizer)
    elif "text" in row:
        text = _text_field(row, "text")
        if not text.strip():
            raise BadRow("empty")
        ids, _ = _encode_prompt_completion("", text, tokenizer)
        trainable = [True] * len(ids)
    else:
        raise BadRow("unknown shape")
    labels = [t if (keep or train_on_prompt) else IGNORE_INDEX for t, keep in zip(ids, trainable)]
    if labels:
        labels[0] = IGNORE_INDEX  # no token of this example comes before it
    return Example(list(ids), labels)


def encode_rows(rows: list, tokenizer, seq_len: int, train_on_prompt: bool = False,
                source: str = "rows") -> tuple[list[Example], DataReport]:
    """Encode every row; count the ones that cannot be used by reason instead of dropping them silently."""
    report = DataReport(source=source, rows=len(rows))
    examples = []
    for row in rows:
        try:
            ex = encode_row(row, tokenizer, train_on_prompt)
            if len(ex.input_ids) > seq_len:
                raise BadRow("longer than seq_len")
            if all(label == IGNORE_INDEX for label in ex.labels):
                raise BadRow("no trainable token")
        except BadRow as bad:
            report.drop(bad.reason)
            continue
        examples.append(ex)
        report.tokens += len(ex.input_ids)
        report.trainable_tokens += sum(label != IGNORE_INDEX for label in ex.labels)
    return examples, report


# ------------------------------------------------------------------------------------------------
# Examples -> fixed-size rows
# ------------------------------------------------------------------------------------------------
def pad_examples(examples: list[Example], seq_len: int, pad_id: int) -> dict:
    """One example per row, right-padded: input_ids, labels, attention_mask, all [N, seq_len]."""
    n = len(examples)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.long)
    for r, ex in enumerate(examples):
        k = len(ex.input_ids)
        ids[r, :k] = torch.tensor(ex.input_ids)
        labels[r, :k] = torch.tensor(ex.labels)
        mask[r, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack_examples(examples: list[Example], seq_len: int, pad_id: int) -> dict:
    """Examples in the given order, concatenated into rows of seq_len tokens (next fit: an example
    that does not fit in the current row starts the next one; the rest of the row is padding).

    Returns input_ids, labels, position_ids (restarting at 0 for each example) and segments (which
    example of its row a token belongs to, -1 for the padding), all [N, seq_len].
    """
    rows, current, used = [], [], 0
    for ex in examples:
        if used + len(ex.input_ids) > seq_len and current:
            rows.append(current)
            current, used = [], 0
        current.append(ex)
        used += len(ex.input_ids)
    if current:
        rows.append(current)
    n = len(rows)
    out = {"input_ids": torch.full((n, seq_len), pad_id, dtype=torch.long),
           "labels": torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long),
           "position_ids": torch.zeros((n, seq_len), dtype=torch.long),
           "segments": torch.zeros((n, seq_len), dtype=torch.long)}
    for r, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row):
            k = len(ex.input_ids)
            out["input_ids"][r, at: at + k] = torch.tensor(ex.input_ids)
            out["labels"][r, at: at + k] = torch.tensor(ex.labels)
            out["position_ids"][r, at: at + k] = torch.arange(k)
            out["segments"][r, at: at + k] = s
            at += k
        out["position_ids"][r, at:] = torch.arange(seq_len - at)
        out["segments"][r, at:] = -1
    return out


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query i may attend to key j when j <= i and both lie in the same example."""
    T = segments.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]


# ------------------------------------------------------------------------------------------------
# The data the training loop sees
# ------------------------------------------------------------------------------------------------
def _generator(*parts) -> torch.Generator:
    """A CPU generator seeded from any tuple of ints and strings (the same tuple, the same stream)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class TrainData:
    """Batches for step `index`: `batch(index, device)` -> dict of input_ids, labels [B, T] (long), and
    attention_mask / position_ids where the kind needs them. Built by `make_data`."""

    def __init__(self, kind: str, source: str | None, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                 rank: int, world_size: int, report: DataReport):
        self.kind, self.source = kind, source
        self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.report = report
        self.packing = False
        self.tokens: torch.Tensor | None = None  # text: the training token stream
        self.eval_tokens: torch.Tensor | None = None  # text: the held-out tail of the file
        self.rows: dict | None = None  # dataset: [N, T] tensors of the training rows
        self.eval_rows: dict | None = None
        self.tokenizer_name = "UTF-8 bytes"
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    # ---- sizes ----
    @property
    def batches_per_epoch(self) -> int | None:
        """Batches per epoch on each rank (dataset only; synthetic and text batches never run out)."""
        if self.rows is None:
            return None
        return (self.rows["input_ids"].shape[0] // self.world_size) // self.batch_size

    # ---- batches ----
    def batch(self, index: int, device) -> dict:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        B, T = self.batch_size, self.seq_len
        if self.kind == "synthetic":
            ids = torch.randint(0, self.vocab_size, (B, T), generator=_generator("synthetic", self.seed, self.rank, index))
            return self._to(_causal_batch(ids), device)
        if self.kind == "text":
            starts = torch.randint(0, self.tokens.numel() - T + 1, (B,),  # every window start, the last one included
                                   generator=_generator("text", self.seed, self.rank, index))
            ids = torch.stack([self.tokens[s: s + T] for s in starts.tolist()])
            return self._to(_causal_batch(ids), device)
        epoch, step = divmod(index, self.batches_per_epoch)
        picks = self._epoch_shard(epoch)[step * B: (step + 1) * B]
        return self._rows_batch(self.rows, picks, device)

    def eval_batches(self, device) -> list[dict]:
        """The held-out split in order, in batches of batch_size (the last may be smaller); the same on every rank."""
        B, T = self.batch_size, self.seq_len
        if self.eval_tokens is not None:
            windows = self.eval_tokens[: self.eval_tokens.numel() // T * T].view(-1, T)
            return [self._to(_causal_batch(windows[i: i + B]), device) for i in range(0, windows.shape[0], B)]
        if self.eval_rows is not None:
            n = self.eval_rows["input_ids"].shape[0]
            return [self._rows_batch(self.eval_rows, torch.arange(i, min(i + B, n)), device) for i in range(0, n, B)]
        return []

    def _epoch_shard(self, epoch: int) -> torch.Tensor:
        """This rank's training rows for one epoch: a shuffle seeded by (seed, epoch), the same on every
        rank, dealt round-robin; every rank keeps the same number (the remainder waits for the next shuffle)."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n = self.rows["input_ids"].shape[0]
            order = torch.randperm(n, generator=_generator("epoch", self.seed, epoch))
            per_rank = n // self.world_size
            self._epoch_cache = (epoch, order[self.rank:: self.world_size][:per_rank])
        return self._epoch_cache[1]

    def _rows_batch(self, rows: dict, picks: torch.Tensor, device) -> dict:
        out = {"input_ids": rows["input_ids"][picks], "labels": rows["labels"][picks]}
        if "attention_mask" in rows:
            out["attention_mask"] = rows["attention_mask"][picks]
            return self._to(out, device)
        out["position_ids"] = rows["position_ids"][picks]
        out = self._to(out, device)
        out["attention_mask"] = packed_attention_mask(rows["segments"][picks].to(device))  # built on the device
        return out

    @staticmethod
    def _to(batch: dict, device) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    # ---- reporting ----
    def describe(self) -> str:
        B, T = self.batch_size, self.seq_len
        if self.kind == "synthetic":
            return f"synthetic: uniform random token ids in [0, {self.vocab_size}), {B} x {T} tokens per batch"
        if self.kind == "text":
            held = f", last {self.eval_tokens.numel():,} tokens held out for eval" if self.eval_tokens is not None else ""
            return (f"text {self.source}: {self.tokens.numel():,} training tokens ({self.tokenizer_name}), "
                    f"random windows of {T} tokens{held}")
        n_rows = self.rows["input_ids"].shape[0]
        if self.packing:
            filled = int((self.rows["segments"] >= 0).sum())
            layout = f"packed into {n_rows} rows of {T} tokens ({100.0 * filled / (n_rows * T):.1f} % of them examples)"
        else:
            filled = int(self.rows["attention_mask"].sum())
            layout = f"one example per row, right-padded to {T} tokens ({100.0 * filled / (n_rows * T):.1f} % not padding)"
        per_rank = n_rows // self.world_size
        unused = n_rows - per_rank * self.world_size + (per_rank - self.batches_per_epoch * B) * self.world_size
        return (f"dataset {self.report}; {layout}; {self.batches_per_epoch} batches of {B} per epoch per rank"
                + (f" ({unused} row{'s' if unused > 1 else ''} wait{'' if unused > 1 else 's'} for the next epoch's shuffle)" if unused else ""))


def _causal_batch(ids: torch.Tensor) -> dict:
    """A window of running text: every token is a label except the first of each row (nothing precedes it)."""
    labels = ids.clone()
    labels[:, 0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def _check_ids_fit(ids_max: int, pad_id: int | None, vocab_size: int, what: str) -> None:
    top = max(ids_max, pad_id if pad_id is not None else -1)
    if top >= vocab_size:
        raise ValueError(f"{what} produces token id {top}, but the model's vocabulary has {vocab_size} entries "
                         f"(ids 0 to {vocab_size - 1}); use the model's own tokenizer")


def make_data(source: str | None, kind: str, tokenizer, vocab_size: int, batch_size: int, seq_len: int, seed: int,
              rank: int = 0, world_size: int = 1, packing: bool = False, train_on_prompt: bool = False,
              eval_fraction: float = 0.0) -> TrainData:
    """Build the training data. See the module docstring for the kinds, the labels and the batch layout.

    source: None (synthetic), a text file (text), or a data file / Hugging Face dataset id (dataset).
    tokenizer: a Hugging Face tokenizer; for kind 'text' None means UTF-8 bytes.
    eval_fraction: the share held out for `eval_batches` (dataset: examples, at least 1 when there are
    2 or more; text: the last tokens of the file). Not for synthetic data.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown data kind '{kind}'; choose from {', '.join(KINDS)}")
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2), ("vocab_size", vocab_size, 1),
                             ("world_size", world_size, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if kind != "dataset" and (packing or train_on_prompt):
        raise ValueError(f"packing and train_on_prompt apply to kind 'dataset', not '{kind}'")
    if (source is None) != (kind == "synthetic"):
        raise ValueError(f"kind '{kind}' " + ("takes no source" if kind == "synthetic" else "needs a source"))
    if kind == "synthetic" and eval_fraction:
        raise ValueError("synthetic data has no eval split (eval_fraction must be 0)")
    report = DataReport(source=str(source) if source is not None else "synthetic")
    data = TrainData(kind, source, batch_size, seq_len, vocab_size, seed, rank, world_size, report)
    if kind == "text":
        _build_text(data, Path(source), tokenizer, eval_fraction)
    elif kind == "dataset":
        _build_dataset(data, str(source), tokenizer, packing, train_on_prompt, eval_fraction)
    return data


def _build_text(data: TrainData, path: Path, tokenizer, eval_fraction: float) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    ids = tokenizer(text)["input_ids"] if tokenizer is not None else list(text.encode("utf-8"))
    if tokenizer is not None:
        data.tokenizer_name = f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"
    tokens = torch.tensor(ids, dtype=torch.long)
    T, n = data.seq_len, tokens.numel()
    # A window of T tokens is a whole training row (its labels are the same tokens, shifted inside
    # the model), so T tokens are enough to train on, and the held-out tail needs T for one eval window.
    n_eval = math.ceil(eval_fraction * n) if eval_fraction else 0
    if not eval_fraction and n < T:
        raise ValueError(f"{path} has {n:,} tokens ({data.tokenizer_name}); seq_len {T} needs at least {T:,} "
                         "(one window)")
    if eval_fraction and min(n - n_eval, n_eval) < T:
        raise ValueError(f"{path} has {n:,} tokens ({data.tokenizer_name}); eval_fraction {eval_fraction} holds out "
                         f"{n_eval:,} and leaves {n - n_eval:,} to train on, but seq_len {T} needs at least {T:,} in each")
    _check_ids_fit(int(tokens.max()), None, data.vocab_size, f"tokenising {path}")
    data.tokens = tokens[: n - n_eval]
    data.eval_tokens = tokens[n - n_eval:] if n_eval else None
    data.report.tokens = data.report.trainable_tokens = n


def _build_dataset(data: TrainData, source: str, tokenizer, packing: bool, train_on_prompt: bool,
                   eval_fraction: float) -> None:
    if tokenizer is None:
        raise ValueError("kind 'dataset' needs a tokenizer (make_tokenizer(model, preset))")
    rows = load_rows(source)
    examples, report = encode_rows(rows, tokenizer, data.seq_len, train_on_prompt, source)
    if not examples:
        raise ValueError(f"no usable row in {source}: {report}")
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None))
    _check_ids_fit(max(max(ex.input_ids) for ex in examples), pad_id, data.vocab_size, f"the tokenizer on {source}")

    n = len(examples)
    n_eval = 0
    if eval_fraction:
        if n < 2:
            raise ValueError(f"eval_fraction needs at least 2 usable examples, {source} has {n}")
        n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    order = torch.randperm(n, generator=_generator("split", data.seed)).tolist()
    eval_examples = [examples[i] for i in sorted(order[:n_eval])]
    train_examples = [examples[i] for i in order[n_eval:]]  # shuffled once: packing mixes examples
    report.train_examples, report.eval_examples = len(train_examples), len(eval_examples)
    data.report = report

    build = pack_examples if packing else pad_examples
    data.packing = packing
    data.rows = build(train_examples, data.seq_len, pad_id)
    data.eval_rows = build(eval_examples, data.seq_len, pad_id) if eval_examples else None
    what = "packed rows" if packing else "training examples"
    n_rows = data.rows["input_ids"].shape[0]
    if n_rows // data.world_size < data.batch_size:
        raise ValueError(f"{source} gives {n_rows} {what}, {n_rows // data.world_size} per rank for "
                         f"{data.world_size} rank(s): fewer than batch_size {data.batch_size}")
