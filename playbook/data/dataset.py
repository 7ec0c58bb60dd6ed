"""Data for the fine-tuning scripts: instruction and chat rows, prompt masking, packing.

    tokenizer = make_tokenizer(None, preset=True)  # playbook/model/tokenizer.py
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
                 ShareGPT           {"conversations": [{"from": "human", "value": ...}, ...]}, optional "system"
                 prompt/completion  {"prompt": ..., "completion": ...}
                 Alpaca             {"instruction": ..., "input": ... (optional), "output": ...}
                 plain text         {"text": ...}

Files are read as UTF-8; a byte that is not UTF-8 stops the build with its file and byte offset
(nothing is trained on replacement characters).

How a row becomes an example (its chat roles, its cut to seq_len, its masked labels): playbook/data/rows.py.

Batches
-------
Without packing, each example is one row, right-padded to seq_len (a fixed shape for every step,
which torch.compile and the step-time measurements prefer): `attention_mask` [B, T] is 1 on tokens,
0 on padding, and padding labels are -100.

`causal_padding=True` (finetune_optimized.py's default) leaves that mask out of the batches. Right
padding makes it redundant: under the causal mask, a token at position t attends to positions 0..t,
and in a right-padded row those are all tokens of its own example, never padding. So every real
token's output, and the loss (padding labels are -100), is the same with or without the mask; only
the padding positions' own outputs change, and nothing reads them. What leaving it out buys: given a
[B, T] mask, Hugging Face reads it on the host every step to choose the attention path (a GPU-to-host
copy that stalls the queue and rules out capturing the step as one CUDA graph); without it SDPA runs
its causal path (is_causal, no mask tensor), the step can be captured, and it costs nothing. The rows
keep the mask (`rows["attention_mask"]`) for the statistics.

With `packing=True` examples are concatenated into full rows of seq_len tokens. `position_ids`
restart at 0 at each example (RoPE then sees each example exactly as if it were alone) and
`attention_mask` is a 4-D boolean mask [B, 1, T, T], causal within each example and False across
examples. Why a 4-D mask and not position_ids alone: transformers 5.x (checked in 5.17 and 5.23,
masking_utils.find_packed_sequence_indices) infers example boundaries from position_ids, but only
when no 2-D attention_mask is passed AND no KV cache exists; LlamaConfig's default `use_cache=True`
makes the model create a cache even in a training forward, and then every token silently attends
across example boundaries. A 4-D mask is used as given by the sdpa attention implementation (the
one the scripts load), whatever the cache setting (data_test.py checks both behaviours). The eager
implementation adds a mask to the attention scores, so this boolean mask would mask nothing there: it
needs an additive float mask (0 where allowed, -inf elsewhere). flash_attention_2 needs position_ids
alone. Its memory is B x T x T bytes
(16 MiB at 4 x 2048), built on the device.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# reading the files (and hub datasets) rows come from, and DataError, the data errors (playbook/data/files.py)
from playbook.data.files import DataError, load_rows, read_utf8
# a row -> an example (token ids, masked labels), and the rows that cannot be used, counted (playbook/data/rows.py)
from playbook.data.rows import IGNORE_INDEX, BadRow, DataReport, Example, UnknownRole, check_row, encode_rows

from core.process import log


KINDS = ("synthetic", "text", "dataset")


def bad_data_exit(err: Exception) -> SystemExit:
    """What a script does with a data error from make_data: print the row counts when rows were read
    (the data line a run prints before training), then `error: <message>` on stderr; exit code 2."""
    if getattr(err, "report", None) is not None:
        log(f"Data: dataset {err.report}")
    print(f"error: {err}", file=sys.stderr, flush=True)
    return SystemExit(2)


# ------------------------------------------------------------------------------------------------
# Rows -> examples (token ids and masked labels)
# ------------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class BatchAttention:
    """How a run's batches carry attention, chosen before the data is built (run/start.py, batch_attention)."""

    causal_padding: bool = False  # right-padded rows without their [B, T] padding mask (module docstring)
    # packed rows: "mask", a dense [B, 1, T, T] mask; "boundaries", each example's offsets for
    # model/packed_attention.py (the model's attention must then be that module's)
    packed: str = "mask"
    packed_kernel: str | None = None  # with "boundaries": the fused kernel, None for the host-side fallback


class TrainData:
    """Batches for step `index`: `batch(index, device)` -> dict of input_ids, labels [B, T] (long), and
    attention_mask / position_ids where the kind needs them. Built by `make_data`."""

    def __init__(self, kind: str, source: str | None, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                 rank: int, world_size: int, report: DataReport, attention: BatchAttention | None = None):
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
        self._epoch_cache: tuple[int, torch.Tensor] | None = None  # (epoch, its shuffle of every row)
        self._row_tokens: torch.Tensor | None = None  # each training row's tokens that are not padding
        self.repeat_batches: int | None = None  # batch(i) is batch(i mod N): the first N batches, cycled
        self.attention = attention or BatchAttention()  # how the batches carry attention, fixed for the run
        self._row_runs: dict[int, dict[int, list[int]]] = {}  # id(rows) -> row -> its examples' lengths
        self._bounds_size: int | None = None

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
        if self.repeat_batches:
            index %= self.repeat_batches
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

    def _epoch_shard(self, epoch: int, rank: int | None = None) -> torch.Tensor:
        """A rank's training rows for one epoch (this rank's by default): a shuffle seeded by (seed, epoch),
        the same on every rank, dealt round-robin; every rank keeps the same number (the remainder waits
        for the next shuffle)."""
        n = self.rows["input_ids"].shape[0]
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, torch.randperm(n, generator=_generator("epoch", self.seed, epoch)))
        rank = self.rank if rank is None else rank
        return self._epoch_cache[1][rank:: self.world_size][: n // self.world_size]

    def text_tokens(self, index: int) -> int:
        """The job's tokens in batch `index` that are not padding, summed over every rank's batch of that
        index: input tokens, prompts included (what the model reads; only padding is left out). Counted
        on the host from the rows, which every rank holds, so a step pays no device sync and no
        collective for it. Synthetic and text batches hold no padding: batch_size x seq_len a rank."""
        B, T = self.batch_size, self.seq_len
        if self.rows is None:
            return B * T * self.world_size
        if self._row_tokens is None:
            filled = self.rows["segments"] >= 0 if self.packing else self.rows["attention_mask"] > 0
            self._row_tokens = filled.sum(dim=1)
        if self.repeat_batches:
            index %= self.repeat_batches
        epoch, step = divmod(index, self.batches_per_epoch)
        return sum(int(self._row_tokens[self._epoch_shard(epoch, r)[step * B: (step + 1) * B]].sum())
                   for r in range(self.world_size))

    def _rows_batch(self, rows: dict, picks: torch.Tensor, device) -> dict:
        out = {"input_ids": rows["input_ids"][picks], "labels": rows["labels"][picks]}
        if "attention_mask" in rows:
            if not self.attention.causal_padding:
                out["attention_mask"] = rows["attention_mask"][picks]
            return self._to(out, device)
        out["position_ids"] = rows["position_ids"][picks]
        if self.attention.packed == "boundaries":
            from playbook.model import packed_attention

            lengths = [self._runs(rows, int(i)) for i in picks]
            bounds = packed_attention.boundaries(lengths, self.seq_len, self.boundaries_size())
            out["attention_mask"] = packed_attention.as_mask(bounds)
            return self._to(out, device)
        out = self._to(out, device)
        out["attention_mask"] = packed_attention_mask(rows["segments"][picks].to(device))  # built on the device
        return out

    def _runs(self, rows: dict, i: int) -> list[int]:
        """The lengths of the examples of packed row i, its padding tail as one more (they sum to seq_len)."""
        cache = self._row_runs.setdefault(id(rows), {})
        if i not in cache:
            cache[i] = torch.unique_consecutive(rows["segments"][i], return_counts=True)[1].tolist()
        return cache[i]

    def boundaries_size(self) -> int:
        """The length of every batch's boundaries: the most examples one batch can hold, plus one (fixed for
        the run, so that a CUDA graph replays every batch)."""
        if self._bounds_size is None:
            most = 1
            for rows in (self.rows, self.eval_rows):
                if rows is not None and rows["segments"].numel():
                    seg = rows["segments"]
                    starts = torch.ones_like(seg, dtype=torch.bool)
                    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
                    most = max(most, int(starts.sum(dim=1).max()))
            self._bounds_size = self.batch_size * most + 1
        return self._bounds_size

    @staticmethod
    def _to(batch: dict, device) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    # ---- reporting ----
    def describe(self) -> str:
        repeat = self.repeat_batches
        cycled = f"; only its first {repeat} batch{'es' if repeat > 1 else ''}, over and over" if repeat else ""
        return self._describe() + cycled

    def _describe(self) -> str:
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
            layout = (f"one example per row, right-padded to {T} tokens ({100.0 * filled / (n_rows * T):.1f} % not padding"
                      + ("; causal mask only: the padding mask is redundant after right padding" if self.attention.causal_padding
                         else "; with its padding mask") + ")")
        per_rank = n_rows // self.world_size
        unused = n_rows - per_rank * self.world_size + (per_rank - self.batches_per_epoch * B) * self.world_size
        return (f"dataset {self.report}; {layout}; {self.batches_per_epoch} batches of {B} per epoch per rank"
                + (f" ({unused} row{'s' if unused > 1 else ''} wait{'' if unused > 1 else 's'} for the next epoch's shuffle)" if unused else ""))


def _causal_batch(ids: torch.Tensor) -> dict:
    """A window of running text: every token is a label except the first of each row (nothing precedes it)."""
    labels = ids.clone()
    labels[:, 0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def check_ids(examples: list[Example], pad_id: int | None, vocab_size: int, source: str) -> None:
    """Every token id of every example (and the padding id) must be in [0, vocab_size): an id outside it
    reads past the embedding table, and as a target gives a NaN loss in the cross-entropy kernels.
    Raises DataError naming the first example that has one (a tokenizer that does not match the model)."""
    if pad_id is not None and not 0 <= pad_id < vocab_size:
        raise DataError(f"the tokenizer's padding id {pad_id} is outside the model's vocabulary (ids 0 to "
                        f"{vocab_size - 1}); use the model's own tokenizer")
    for ex in examples:
        low, high = min(ex.input_ids), max(ex.input_ids)
        if low < 0 or high >= vocab_size:
            raise DataError(f"{source}, row {ex.row}: token id {low if low < 0 else high} is outside the model's "
                            f"vocabulary (ids 0 to {vocab_size - 1}); the tokenizer does not match the model: use "
                            "the model's own tokenizer")


def check_source(source: str | None, kind: str, eval_source: str | None = None, train_on_prompt: bool = False) -> None:
    """What can be told of the data before the model is built (it needs only the files): a local file that
    leaves nothing to train on raises DataError naming the file and what it holds. Kind 'text': a file of no
    text (any file is raw text to it, a .jsonl file too). Kind 'dataset':
    a .json file that is not a list of rows, a file none of whose rows can be trained on (every assistant
    reply empty, no completion, ...: `check_row`), for `source` and `eval_source`. A hub id, and what needs the
    tokenizer (a chat template, the token counts), are make_data's to check, once the model is built."""
    if kind == "text" and source is not None and Path(source).is_file():
        path = Path(source)
        if not read_utf8(path).strip():
            raise DataError(f"{path} holds no text ({path.stat().st_size:,} bytes, blank): no tokens to train on; "
                            "--data needs a text file")
        return
    if kind != "dataset":
        return
    for label, name in (("", source), ("the eval file ", eval_source)):
        if name is None or not Path(name).expanduser().is_file():
            continue
        rows = load_rows(name, keep=True)  # (read once: make_data reads these rows)
        report = DataReport(source=str(name), rows=len(rows))
        usable = 0
        for row in rows:
            try:
                check_row(row, train_on_prompt)
                usable += 1
            except BadRow as bad:
                report.drop(bad.reason)
            except UnknownRole:  # (make_data stops on it, naming the row)
                usable += 1
        if usable:
            continue
        if not rows:
            raise DataError(f"no usable row in {label}{name}: it holds no rows")
        dropped = ", ".join(f"{reason}: {n}" for reason, n in sorted(report.dropped.items()))
        nothing = "nothing to evaluate on" if label else "nothing to train on"
        raise DataError(f"no usable row in {label}{name}: {len(rows)} row(s), every one dropped ({dropped}); "
                        f"{nothing}. {report.reasons()}")


def make_data(source: str | None, kind: str, tokenizer, vocab_size: int, batch_size: int, seq_len: int, seed: int,
              rank: int = 0, world_size: int = 1, packing: bool = False, train_on_prompt: bool = False,
              eval_fraction: float = 0.0, drop_long: bool = False, eval_source: str | None = None,
              repeat_batches: int | None = None, attention: BatchAttention | None = None) -> TrainData:
    """Build the training data. See the module docstring for the kinds, the labels and the batch layout.

    source: None (synthetic), a text file (text), or a data file / Hugging Face dataset id (dataset).
    tokenizer: a Hugging Face tokenizer; for kind 'text' None means UTF-8 bytes.
    eval_fraction: the share held out for `eval_batches` (dataset: examples, at least 1 when there are
    2 or more; text: the last tokens of the file). Not for synthetic data.
    drop_long: drop the dataset examples longer than seq_len instead of cutting them to seq_len.
    eval_source: a second dataset (same formats) to evaluate on instead of a held-out share.
    repeat_batches: N to train on the first N batches only, cycled (`batch(i)` is `batch(i % N)`), or None.
    attention: how the batches carry attention (BatchAttention; None: the padding mask kept, dense packed masks).
    Bad input raises ValueError (DataError, with the row counts in `.report` once rows were read),
    OSError for a missing file, MissingPackage (an ImportError) for a missing optional package.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown data kind '{kind}'; choose from {', '.join(KINDS)}")
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2), ("vocab_size", vocab_size, 1),
                             ("world_size", world_size, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if repeat_batches is not None and (not isinstance(repeat_batches, int) or repeat_batches < 1):
        raise ValueError(f"repeat_batches must be None or an integer >= 1, got {repeat_batches!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if kind != "dataset" and (packing or train_on_prompt or drop_long or eval_source is not None):
        raise ValueError(f"packing, train_on_prompt, drop_long and eval_source apply to kind 'dataset', not '{kind}'")
    if eval_source is not None and eval_fraction:
        raise ValueError("give one of eval_source (a separate eval file) and eval_fraction (a held-out share)")
    if (source is None) != (kind == "synthetic"):
        raise ValueError(f"kind '{kind}' " + ("takes no source" if kind == "synthetic" else "needs a source"))
    if kind == "synthetic" and eval_fraction:
        raise ValueError("synthetic data has no eval split (eval_fraction must be 0)")
    report = DataReport(source=str(source) if source is not None else "synthetic")
    data = TrainData(kind, source, batch_size, seq_len, vocab_size, seed, rank, world_size, report, attention)
    data.repeat_batches = repeat_batches
    if kind == "text":
        _build_text(data, Path(source), tokenizer, eval_fraction)
    elif kind == "dataset":
        _build_dataset(data, str(source), tokenizer, packing, train_on_prompt, eval_fraction, drop_long, eval_source)
    return data


def _build_text(data: TrainData, path: Path, tokenizer, eval_fraction: float) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    text = read_utf8(path)
    ids = tokenizer(text)["input_ids"] if tokenizer is not None else list(text.encode("utf-8"))
    if tokenizer is not None:
        data.tokenizer_name = f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"
    tokens = torch.tensor(ids, dtype=torch.long)
    T, n = data.seq_len, tokens.numel()
    # A window of T tokens is a whole training row (its labels are the same tokens, shifted inside
    # the model), so T tokens are enough to train on, and the held-out tail needs T for one eval window.
    n_eval = math.ceil(eval_fraction * n) if eval_fraction else 0
    if not eval_fraction and n < T:
        raise DataError(f"{path} has {n:,} tokens ({data.tokenizer_name}); seq_len {T} needs at least {T:,} "
                        "(one window)")
    if eval_fraction and min(n - n_eval, n_eval) < T:
        raise DataError(f"{path} has {n:,} tokens ({data.tokenizer_name}); eval_fraction {eval_fraction} holds out "
                        f"{n_eval:,} and leaves {n - n_eval:,} to train on, but seq_len {T} needs at least {T:,} in each")
    outside = ((tokens < 0) | (tokens >= data.vocab_size)).nonzero()
    if outside.numel():
        at = int(outside[0])
        raise DataError(f"{path}: token {at:,} of the file ({data.tokenizer_name}) has id {int(tokens[at])}, outside "
                        f"the model's vocabulary (ids 0 to {data.vocab_size - 1}); use the model's own tokenizer")
    data.tokens = tokens[: n - n_eval]
    data.eval_tokens = tokens[n - n_eval:] if n_eval else None
    data.report.tokens = data.report.trainable_tokens = n


def encode_dataset(source: str, tokenizer, seq_len: int, vocab_size: int, seed: int, train_on_prompt: bool = False,
                   eval_fraction: float = 0.0, drop_long: bool = False, eval_source: str | None = None,
                   min_train: int = 1) -> tuple[list[Example], list[Example], int, DataReport]:
    """Rows -> (training examples in a seeded shuffle, eval examples, padding id, report).

    The eval examples are `eval_source`'s rows, or a held-out share `eval_fraction` of `source`'s (at
    least 1 when there are 2 or more). Every id is checked against vocab_size. Raises DataError, with
    the report attached, when fewer than `min_train` training examples remain.
    """
    if tokenizer is None:
        raise ValueError("kind 'dataset' needs a tokenizer (playbook.model.tokenizer.make_tokenizer(model, preset))")
    examples, report = encode_rows(load_rows(source), tokenizer, seq_len, train_on_prompt, source, drop_long)
    if not examples:
        raise DataError(f"no usable row in {source} ({report.counts()}). {report.reasons()}", report)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None))
    check_ids(examples, pad_id, vocab_size, source)
    order = torch.randperm(len(examples), generator=_generator("split", seed)).tolist()
    if eval_source is not None:
        eval_examples, report.eval_source = encode_rows(load_rows(eval_source), tokenizer, seq_len, train_on_prompt,
                                                        str(eval_source), drop_long)
        if not eval_examples:
            raise DataError(f"no usable row in the eval file {eval_source} ({report.eval_source.counts()})", report)
        check_ids(eval_examples, pad_id, vocab_size, str(eval_source))
        n_eval = 0
    else:
        n_eval = 0
        if eval_fraction:
            if len(examples) < 2:
                raise DataError(few_for_eval(source, report), report)
            n_eval = min(len(examples) - 1, max(1, round(eval_fraction * len(examples))))
        eval_examples = [examples[i] for i in sorted(order[:n_eval])]
    train_examples = [examples[i] for i in order[n_eval:]]  # shuffled once: packing mixes examples
    report.train_examples, report.eval_examples = len(train_examples), len(eval_examples)
    if len(train_examples) < min_train:
        raise DataError(f"{source} gives {len(train_examples)} training example(s), fewer than the {min_train} needed",
                        report)
    return train_examples, eval_examples, pad_id, report


def few_for_eval(source: str, report: DataReport) -> str:
    """Why eval_fraction cannot hold out an example: one usable row, and what became of the others."""
    text = (f"eval_fraction (--eval-fraction) holds out part of the usable examples and needs at least 2; {source} "
            f"has 1 of its {report.rows} rows usable")
    if not report.dropped:
        return text + ": add rows, or --eval-fraction 0 to train on it alone"
    text += f" ({report.counts().split(': ', 1)[1]})"
    too_long = sum(n for reason, n in report.dropped.items() if "seq_len" in reason)
    if too_long:
        text += (f": {too_long} were dropped as too long for seq_len {report.seq_len}; a larger --seq-len keeps "
                 "them, or --eval-fraction 0 trains on the one left")
    else:
        text += f". {report.reasons()}"
    return text


def _build_dataset(data: TrainData, source: str, tokenizer, packing: bool, train_on_prompt: bool,
                   eval_fraction: float, drop_long: bool, eval_source: str | None) -> None:
    train_examples, eval_examples, pad_id, report = encode_dataset(
        source, tokenizer, data.seq_len, data.vocab_size, data.seed, train_on_prompt, eval_fraction, drop_long,
        eval_source)
    data.report = report
    build = pack_examples if packing else pad_examples
    data.packing = packing
    data.rows = build(train_examples, data.seq_len, pad_id)
    data.eval_rows = build(eval_examples, data.seq_len, pad_id) if eval_examples else None
    what = "packed rows" if packing else "training examples"
    n_rows = data.rows["input_ids"].shape[0]
    if n_rows // data.world_size < data.batch_size:
        raise DataError(f"{source} gives {n_rows} {what}, {n_rows // data.world_size} per rank for "
                        f"{data.world_size} rank(s): fewer than batch_size {data.batch_size}; lower the batch size "
                        "or give more rows", report)
