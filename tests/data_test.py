"""Tests of the data pipeline: prompt masking, packing without cross-example attention, bad rows, shards.

    $ PYTHONPATH=. python tests/data_test.py  # a readable report
    $ pytest tests/data_test.py

The expected token ids are written out by hand from the byte tokenizer's definition (id = byte value,
special tokens by name), not by calling data/dataset.py, so a masking or template mistake shows up as a
mismatch. Packing is checked in a tiny LLaMA (fp32, sdpa): an example's logits must not depend on the
other examples of its row, and the same check without the boundary handling must fail.
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import copy
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch

from playbook.data import dataset, files, rows
from playbook.data.dataset import BatchAttention
from playbook.model import tokenizer
from testkit import close_to_reference, exactly, expect_error, record, run_as_script

HERE = Path(__file__).resolve().parent.parent  # the repository root
EXAMPLES = HERE / "examples"
TOK = tokenizer.byte_tokenizer()
SPECIAL = {t: TOK.convert_tokens_to_ids(t) for t in tokenizer.BYTE_SPECIAL_TOKENS}
BOS, EOS, HS, HE, EOT = (SPECIAL[t] for t in (tokenizer.BOS, tokenizer.EOS, tokenizer.HEADER_START, tokenizer.HEADER_END, tokenizer.EOT))
M = rows.IGNORE_INDEX


def _b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@contextmanager
def _files(**named):
    """Temporary files: name=rows (written as JSONL) or name=str (written as is); yields their folder."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in named.items():
            path = Path(tmp) / name.replace("__", ".")
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            else:
                path.write_text("".join(json.dumps(r) + "\n" for r in content), encoding="utf-8")
        yield Path(tmp)


def _dataset(rows, **kw):
    args = dict(vocab_size=512, batch_size=1, seq_len=256, seed=0)
    args.update(kw)
    with _files(rows__jsonl=rows) as tmp:
        return dataset.make_data(str(tmp / "rows.jsonl"), "dataset", TOK, **args)


def _expected(segments, train_on_prompt=False):
    """(input_ids, labels) from [(token ids, trained?)] segments: the oracle for prompt masking."""
    ids = [t for seg, _ in segments for t in seg]
    labels = [t if (keep or train_on_prompt) else M for seg, keep in segments for t in seg]
    labels[0] = M  # nothing in the example precedes its first token
    return ids, labels


@contextmanager
def _one_cpu_thread():
    """The tiny model's ops are too small to split: on a busy machine 2 threads spin-waiting on each
    other made a step ~10x slower than 1 thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _header(role):
    return [HS] + _b(role) + [HE] + _b("\n\n")


# ------------------------------------------------------------------------------------------------
# The byte tokenizer
# ------------------------------------------------------------------------------------------------
def test_byte_tokenizer_fits_the_tiny_preset_and_round_trips():
    text = "Tokens: héllo, 日本, ✓ and tabs\tnewlines\n"
    ids = TOK(text)["input_ids"]
    exactly("ids = <|begin_of_text|> + UTF-8 bytes", torch.tensor(ids), torch.tensor([BOS] + _b(text)))
    assert TOK.decode(ids, skip_special_tokens=True) == text, "decode(encode(text)) must give the text back"
    assert len(TOK) == 262 and max(TOK.get_vocab().values()) < 512, "the vocabulary must fit llama-tiny's 512"
    record(f"vocabulary: {len(TOK)} ids, largest {max(TOK.get_vocab().values())} (< 512)", 0, 0, True)
    chat = TOK.apply_chat_template([{"role": "user", "content": " hi "}], tokenize=False, add_generation_prompt=True)
    assert chat == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"), chat
    assert tokenizer.make_tokenizer(None, preset=True).get_vocab() == TOK.get_vocab()
    expect_error(ValueError, tokenizer.make_tokenizer, None, False)


# ------------------------------------------------------------------------------------------------
# Prompt masking
# ------------------------------------------------------------------------------------------------
CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Capital of Peru?"},
                     {"role": "assistant", "content": "Lima."},
                     {"role": "user", "content": "And of Chile?"},
                     {"role": "assistant", "content": "Santiago."}]}
PROMPT_COMPLETION = {"prompt": "2 + 2 =", "completion": " 4"}
ALPACA = {"instruction": "Name the capital.", "input": "Kenya", "output": "Nairobi"}
ALPACA_NO_INPUT = {"instruction": "Say hello in French.", "output": "Bonjour"}
TEXT = {"text": "Plain text is trained on everywhere."}

ORACLES = {
    "chat": (CHAT, [([BOS] + _header("system") + _b("Be brief.") + [EOT] + _header("user") + _b("Capital of Peru?")
                     + [EOT] + _header("assistant"), False),
                    (_b("Lima.") + [EOT], True),
                    (_header("user") + _b("And of Chile?") + [EOT] + _header("assistant"), False),
                    (_b("Santiago.") + [EOT], True)]),
    "prompt/completion": (PROMPT_COMPLETION, [([BOS] + _b("2 + 2 ="), False), (_b(" 4") + [EOS], True)]),
    "Alpaca": (ALPACA, [([BOS] + _b("### Instruction:\nName the capital.\n\n### Input:\nKenya\n\n### Response:\n"), False),
                        (_b("Nairobi") + [EOS], True)]),
    "Alpaca without input": (ALPACA_NO_INPUT, [([BOS] + _b("### Instruction:\nSay hello in French.\n\n### Response:\n"),
                                                False), (_b("Bonjour") + [EOS], True)]),
    "text": (TEXT, [([BOS] + _b(TEXT["text"]) + [EOS], True)]),
}


@pytest.mark.parametrize("shape", list(ORACLES))
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_prompt_tokens_are_masked_exactly(shape, train_on_prompt):
    row, segments = ORACLES[shape]
    ids, labels = _expected(segments, train_on_prompt)
    batch = _dataset([row], seq_len=len(ids) + 7, train_on_prompt=train_on_prompt).batch(0, "cpu")
    n = len(ids)
    exactly(f"{shape}: input_ids", batch["input_ids"][0, :n], torch.tensor(ids))
    exactly(f"{shape}: labels (-100 on the prompt)" if not train_on_prompt else f"{shape}: labels (all but the first)",
            batch["labels"][0, :n], torch.tensor(labels))
    exactly(f"{shape}: padding: label -100, attention 0", torch.cat([batch["labels"][0, n:], batch["attention_mask"][0, n:]]),
            torch.tensor([M] * 7 + [0] * 7))
    assert batch["attention_mask"][0, :n].eq(1).all()


def test_hugging_face_loss_uses_exactly_the_labelled_tokens():
    """labels != -100 counts the terms of HF's shifted loss: the sum over them equals loss x count."""
    from transformers import LlamaForCausalLM

    batch = _dataset([CHAT, PROMPT_COMPLETION, ALPACA, TEXT], batch_size=4, seq_len=200).batch(0, "cpu")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config()).eval()
    with torch.no_grad(), _one_cpu_thread():
        out = model(**batch)
    logits = out.logits[:, :-1].reshape(-1, 512).double()
    targets = batch["labels"][:, 1:].reshape(-1)
    keep = targets != M
    summed = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    count = int((batch["labels"] != M).sum())
    assert count == int(keep.sum()), "a label that HF's shift never predicts would be counted"
    # HF averages in fp32 over `count` terms of size ~ln(512): a relative error of a few fp32 ulps.
    close_to_reference("HF loss x labelled tokens == sum of CE", out.loss.double() * count, summed, summed,
                       torch.float32, n=count)


# ------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------
def _tiny_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=176, max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    return cfg


def _segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of positions counting up from 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist() + [position_ids.numel()]
    return list(zip(starts[:-1], starts[1:]))


def test_packing_layout():
    rows = [{"text": "x" * k} for k in (10, 30, 5, 50, 20, 40, 15)]  # 12 to 52 tokens each (BOS, EOS)
    d = _dataset(rows, seq_len=64, packing=True, batch_size=1)
    got = []
    for r in range(d.rows["input_ids"].shape[0]):
        b = d.batch(r, "cpu") if r < d.batches_per_epoch else None
        row = {k: d.rows[k][r] for k in ("input_ids", "labels", "position_ids")}
        for s, e in _segments(row["position_ids"]):
            ids = row["input_ids"][s:e]
            if ids[0] != BOS:  # the padding at the end of a row
                assert (row["labels"][s:e] == M).all(), "padding must carry no label"
                continue
            got.append(e - s)
            assert row["labels"][s] == M, "an example's first token must carry no label"
            exactly(f"segment at {s}: positions 0..{e - s - 1}", row["position_ids"][s:e], torch.arange(e - s))
        if b is not None:
            mask = b["attention_mask"][0, 0]
            seg = torch.zeros(64, dtype=torch.long)
            for i, (s, e) in enumerate(_segments(b["position_ids"][0])):
                seg[s:e] = i
            want = (seg[:, None] == seg[None, :]) & torch.ones(64, 64, dtype=torch.bool).tril()
            exactly(f"batch {r}: block-diagonal causal mask", mask, want)
    assert sorted(got) == sorted(k + 2 for k in (10, 30, 5, 50, 20, 40, 15)), "every example packed exactly once"
    assert d.rows["input_ids"].shape[0] < len(rows), "packing must share rows"


def _packed_pair(first: str, second: str):
    """One packed row holding the two texts (the shuffle decides the order, the same for equal lengths)."""
    d = _dataset([{"text": first}, {"text": second}], seq_len=96, packing=True)
    return d.batch(0, "cpu")


def _run(model, batch, **kw):
    with torch.no_grad(), _one_cpu_thread():
        return model(**batch, **kw).logits[0]


def test_packed_examples_do_not_attend_to_each_other():
    """Change the tokens of the earlier example in a packed row: the later example's logits stay those
    it has alone. Controls: without the boundary handling (continuous positions, plain causal mask)
    they change, and Hugging Face's own detection from position_ids fails when a KV cache exists."""
    from transformers import LlamaForCausalLM

    p, q = "The Nile flows north into the sea.", "Rice needs water and time."
    batch = _packed_pair(p, q)
    (s1, e1), (s2, e2) = _segments(batch["position_ids"][0])[:2]
    first = TOK.decode(batch["input_ids"][0, s1 + 1: e1 - 1])
    assert first in (p, q)
    # The same rows in the same order, the earlier one reversed (same length: the same packing).
    changed = _packed_pair(p[::-1], q) if first == p else _packed_pair(p, q[::-1])
    assert torch.equal(batch["input_ids"][0, s2:e2], changed["input_ids"][0, s2:e2]), "same later example"
    assert not torch.equal(batch["input_ids"][0, s1:e1], changed["input_ids"][0, s1:e1]), "different earlier one"

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config()).eval()  # config.use_cache is True, LlamaConfig's default
    model64 = copy.deepcopy(model).double()
    alone_ids = batch["input_ids"][:, s2:e2]
    alone = _run(model, {"input_ids": alone_ids})
    alone64 = _run(model64, {"input_ids": alone_ids})
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": batch["attention_mask"]}
    packed = _run(model, inputs)[s2:e2]
    packed_changed = _run(model, {**inputs, "input_ids": changed["input_ids"]})[s2:e2]
    # The testkit rule: the packed example may be at most 2x as far from the fp64 result as the
    # same example run alone in fp32 (+ rounding terms for reductions over the hidden size).
    close_to_reference("later example, packed == alone", packed, alone, alone64, torch.float32, n=64)
    close_to_reference("earlier example changed: later unchanged", packed_changed, alone, alone64, torch.float32, n=64)

    # Control 1: no boundary handling. The changed earlier tokens leak into the later logits; a leak
    # through 2 layers of random weights moves logits by ~0.1-1, far above fp32 noise (~1e-6).
    plain = {"input_ids": batch["input_ids"]}
    leak = (_run(model, plain)[s2:e2] - _run(model, {"input_ids": changed["input_ids"]})[s2:e2]).abs().max().item()
    record(f"control, no boundary handling: leak {leak:.2e} > 1e-2", leak, 1e-2, passed=leak > 1e-2)

    # Control 2, why data/dataset.py builds a 4-D mask: HF infers the boundaries from position_ids alone only
    # without a KV cache. With use_cache=False it isolates the examples; with the default cache it does not.
    by_positions = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    by_positions_changed = {**by_positions, "input_ids": changed["input_ids"]}
    no_cache = (_run(model, by_positions, use_cache=False)[s2:e2]
                - _run(model, by_positions_changed, use_cache=False)[s2:e2]).abs().max().item()
    cache = (_run(model, by_positions, use_cache=True)[s2:e2]
             - _run(model, by_positions_changed, use_cache=True)[s2:e2]).abs().max().item()
    record(f"HF position_ids detection, use_cache=False: change {no_cache:.1e} <= 1e-5", no_cache, 1e-5,
           passed=no_cache <= 1e-5)  # isolated: only fp32 rounding could differ
    record(f"HF position_ids detection, use_cache=True: leak {cache:.1e} > 1e-2", cache, 1e-2, passed=cache > 1e-2)


def test_right_padded_rows_train_the_same_without_their_padding_mask():
    """causal_padding: the batches of right-padded rows leave the [B, T] mask out. The padded eager step's
    loss and every gradient must be those of the same batch with its mask: under the causal mask a token
    sees only earlier positions, which right padding never fills. Control: left padding (the padding
    before the tokens) is not covered by that argument, and there leaving the mask out changes the loss."""
    from transformers import LlamaForCausalLM

    rows = [{"text": "The Nile flows north into the sea."}, {"text": "Rice."}, {"text": "Bread needs an oven."}]
    d = _dataset(rows, seq_len=64, batch_size=3)
    masked = d.batch(0, "cpu")
    d.attention = BatchAttention(causal_padding=True)
    plain = d.batch(0, "cpu")
    assert "attention_mask" in masked and "attention_mask" not in plain
    assert (masked["attention_mask"] == 0).any(), "the batch must hold padding for the test to mean anything"
    assert "causal mask only" in d.describe()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config())

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        with _one_cpu_thread():
            loss = model(**batch).loss
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_m, grads_m = loss_and_grads(masked)
    loss_p, grads_p = loss_and_grads(plain)
    # the same sums over the same tokens, through SDPA's masked and causal kernels: fp32 rounding only
    # (a few ulps of the values summed; 1e-5 relative is ~100 ulps, and a wrong token shifts it by ~1e-2)
    assert torch.allclose(loss_m, loss_p, rtol=1e-5, atol=0), (loss_m, loss_p)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(grads_m, grads_p))
    assert worst < 1e-4, f"largest relative gradient difference {worst:.2e}"

    # control: the same rows padded on the left, mask left out: the real tokens now see the padding
    left = {k: v.clone() for k, v in masked.items()}
    for r in range(left["input_ids"].shape[0]):
        n = int(masked["attention_mask"][r].sum())
        for key in ("input_ids", "labels", "attention_mask"):
            left[key][r] = torch.roll(masked[key][r], masked[key].shape[1] - n)
    loss_left, _ = loss_and_grads({k: v for k, v in left.items() if k != "attention_mask"})
    loss_left_masked, _ = loss_and_grads({**left, "position_ids": (left["attention_mask"].cumsum(-1) - 1).clamp_min(0)})
    assert not torch.allclose(loss_left, loss_left_masked, rtol=1e-3), "left padding needs its mask"


# ------------------------------------------------------------------------------------------------
# Bad rows
# ------------------------------------------------------------------------------------------------
BAD_ROWS = [
    (5, "not an object"),
    ({"question": "?", "answer": "!"}, "unknown shape"),
    ({"prompt": "only a prompt"}, "missing field"),
    ({"instruction": "no output"}, "missing field"),
    ({"messages": [{"role": "user"}]}, "missing field"),
    ({"messages": "hello"}, "bad field type"),
    ({"text": 3}, "bad field type"),
    ({"messages": [{"role": "user", "content": 7}]}, "bad field type"),
    ({"text": "   "}, "empty"),
    ({"prompt": "a", "completion": ""}, "empty"),
    ({"messages": []}, "empty"),
    ({"prompt": "p" * 80, "completion": "c"}, "prompt longer than seq_len"),
    ({"messages": [{"role": "user", "content": "no reply"}]}, "no trainable token"),
]


def test_bad_rows_are_counted_by_reason():
    good = [{"text": "fine"}, {"prompt": "a", "completion": "b"}]
    d = _dataset(good + [row for row, _ in BAD_ROWS], seq_len=64)
    want = {}
    for _, reason in BAD_ROWS:
        want[reason] = want.get(reason, 0) + 1
    assert d.report.dropped == want, f"{d.report.dropped} != {want}"
    assert (d.report.rows, d.report.kept, d.report.train_examples) == (len(BAD_ROWS) + 2, 2, 2)
    line = d.describe()
    assert "\n" not in line and "13 dropped" in line and "prompt longer than seq_len: 1" in line and "missing field: 3" in line
    record(f"{len(BAD_ROWS)} bad rows, {len(want)} reasons, one line", 0, 0, True)
    message = expect_error(ValueError, lambda: _dataset([row for row, _ in BAD_ROWS], seq_len=64))
    assert "no usable row" in message and "unknown shape: 1" in message


def test_openai_content_parts_and_assistant_first_conversations():
    """Chat content as OpenAI's parts ([{"type": "text", "text": ...}]) trains as the same text; a part that is
    not text, and a conversation that starts with the assistant, are dropped under reasons that say what
    is wrong, which the error repeats when no row is left."""
    parts = {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                          for m in CHAT["messages"]]}
    same = _dataset([CHAT, parts])
    assert same.report.kept == 2 and torch.equal(same.rows["input_ids"][0], same.rows["input_ids"][1])
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    greeting = {"messages": [{"role": "assistant", "content": "Hello!"}, *CHAT["messages"][1:]]}
    d = _dataset([CHAT, image, greeting])
    assert d.report.dropped == {"non-text content": 1, "starts with the assistant": 1}, d.report.dropped
    message = expect_error(ValueError, lambda: _dataset([greeting]))
    assert "starts with the assistant: 1" in message and "start with the user message it answers" in message
    record("content parts trained as text; image parts and assistant-first rows dropped by name", 0, 0, True)


def test_a_template_that_is_not_prefix_stable_is_reported():
    odd = copy.deepcopy(TOK)
    odd.chat_template = "{{ messages | length }}" + tokenizer.LLAMA3_CHAT_TEMPLATE  # the prefix changes with length
    with _files(rows__jsonl=[CHAT, TEXT]) as tmp:
        d = dataset.make_data(str(tmp / "rows.jsonl"), "dataset", odd, 512, 1, 256, 0)
    assert d.report.dropped == {"chat template mismatch": 1}, d.report.dropped
    bare = copy.deepcopy(TOK)
    bare.chat_template = None
    with _files(rows__jsonl=[CHAT]) as tmp:
        assert "chat template" in expect_error(ValueError, dataset.make_data, str(tmp / "rows.jsonl"), "dataset", bare,
                                                512, 1, 256, 0)


# ------------------------------------------------------------------------------------------------
# Order, shards, eval split
# ------------------------------------------------------------------------------------------------
ROWS = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(40)]


def _seen(d, epoch=0):
    """The examples (as token tuples) of one epoch's batches on this rank, in order."""
    out = []
    for i in range(epoch * d.batches_per_epoch, (epoch + 1) * d.batches_per_epoch):
        ids = d.batch(i, "cpu")["input_ids"]
        out += [tuple(r[r != TOK.pad_token_id].tolist()) for r in ids]
    return out


def test_batches_are_deterministic_and_reshuffled_each_epoch():
    a, b = _dataset(ROWS, batch_size=4, seq_len=32), _dataset(ROWS, batch_size=4, seq_len=32)
    for i in (0, 7, 23):
        for key in ("input_ids", "labels", "attention_mask"):
            exactly(f"batch({i}) {key}, two builds", a.batch(i, "cpu")[key], b.batch(i, "cpu")[key])
    assert not torch.equal(a.batch(0, "cpu")["input_ids"], a.batch(1, "cpu")["input_ids"])
    other_seed = _dataset(ROWS, batch_size=4, seq_len=32, seed=1)
    assert not torch.equal(a.batch(0, "cpu")["input_ids"], other_seed.batch(0, "cpu")["input_ids"])
    epoch0, epoch1 = _seen(a, 0), _seen(a, 1)
    assert a.batches_per_epoch == 10 and len(set(epoch0)) == 40 == len(set(epoch1)), "each example once per epoch"
    assert epoch0 != epoch1, "a new order each epoch"
    record("batches_per_epoch 10; every example once per epoch; new order each epoch", 0, 0, True)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("packing", [False, True])
def test_rank_shards_are_disjoint(world_size, packing):
    shards = [_dataset(ROWS, batch_size=2, seq_len=40, rank=r, world_size=world_size, packing=packing)
              for r in range(world_size)]
    assert len({d.batches_per_epoch for d in shards}) == 1, "every rank must run the same number of steps"
    seen = [set(_seen(d)) for d in shards]
    for r in range(world_size):
        for s in range(r + 1, world_size):
            assert not seen[r] & seen[s], f"ranks {r} and {s} share rows"
    record(f"{world_size} ranks, {shards[0].batches_per_epoch} batches each, disjoint", 0, 0, True)


@pytest.mark.parametrize("packing", [False, True])
def test_text_tokens_are_every_rank_s_tokens_that_are_not_padding(packing):
    """TrainData.text_tokens(i), what the throughput figures count: the tokens of batch i that are not
    padding, summed over every rank's batch i (each rank counts all of them alone: no collective), in
    a later epoch's shuffle too. The oracle: the byte tokenizer's padding id, which no example holds."""
    shards = [_dataset(ROWS, batch_size=2, seq_len=40, rank=r, world_size=2, packing=packing) for r in range(2)]
    for i in (0, 3, shards[0].batches_per_epoch + 1):
        want = sum(int((d.batch(i, "cpu")["input_ids"] != TOK.pad_token_id).sum()) for d in shards)
        assert 0 < want < 2 * 2 * 40, "the batches must hold padding for the test to mean anything"
        assert [d.text_tokens(i) for d in shards] == [want, want], (i, want)
    synthetic = dataset.make_data(None, "synthetic", None, 300, 3, 50, 7, rank=1, world_size=2)
    assert synthetic.text_tokens(4) == 2 * 3 * 50, "synthetic batches hold no padding"
    record(f"packing={packing}: text_tokens = every rank's tokens that are not padding", 0, 0, True)


def test_eval_split_is_held_out():
    d = _dataset(ROWS, batch_size=4, seq_len=32, eval_fraction=0.1)
    train = set(_seen(d, 0)) | set(_seen(d, 1)) | set(_seen(d, 2))
    held = [tuple(r[r != TOK.pad_token_id].tolist()) for b in d.eval_batches("cpu") for r in b["input_ids"]]
    assert len(held) == 4 == d.report.eval_examples and d.report.train_examples == 36
    assert not train & set(held), "an eval example was trained on"
    assert len(train | set(held)) == 40
    assert [len(b["input_ids"]) for b in d.eval_batches("cpu")] == [4]
    tiny = _dataset(ROWS[:3], eval_fraction=0.01)
    assert tiny.report.eval_examples == 1, "at least one eval example when there are 2 or more"
    assert _dataset(ROWS[:3]).eval_batches("cpu") == []
    other_rank = _dataset(ROWS, batch_size=4, seq_len=32, eval_fraction=0.1, rank=1, world_size=2)
    exactly("eval batches, rank 0 == rank 1", d.eval_batches("cpu")[0]["input_ids"],
            other_rank.eval_batches("cpu")[0]["input_ids"])
    record("4 of 40 held out (eval_fraction 0.1), never trained on", 0, 0, True)


# ------------------------------------------------------------------------------------------------
# Raw text and synthetic tokens
# ------------------------------------------------------------------------------------------------
def test_text_windows_and_how_many_tokens_a_file_needs():
    T = 16
    with _files(exact__txt="a" * T, short__txt="b" * (T - 1), two__txt="0123456789abcdefg") as tmp:
        d = dataset.make_data(str(tmp / "exact.txt"), "text", None, 512, 2, T, 0)
        exactly(f"a file of exactly seq_len={T} bytes is one window", d.batch(3, "cpu")["input_ids"],
                torch.full((2, T), ord("a")))
        message = expect_error(ValueError, dataset.make_data, str(tmp / "short.txt"), "text", None, 512, 2, T, 0)
        assert f"has {T - 1} tokens" in message and f"needs at least {T} " in message, message
        message = expect_error(ValueError, lambda: dataset.make_data(str(tmp / "exact.txt"), "text", None, 512, 1, 8, 0,
                                                                  eval_fraction=0.25))
        assert "holds out 4 and leaves 12" in message, message
        two = dataset.make_data(str(tmp / "two.txt"), "text", None, 512, 4, T, 0)  # 17 bytes: window starts 0 and 1
        stream = torch.tensor(_b("0123456789abcdefg"))
        starts = []
        for i in range(16):
            b = two.batch(i, "cpu")
            for row in b["input_ids"]:
                s = int(row[0] - stream[0])  # "0" starts the window at 0, "1" at 1
                assert s in (0, 1) and torch.equal(row, stream[s: s + T]), "a window is a contiguous slice"
                starts.append(s)
            assert torch.equal(b["labels"][:, 1:], b["input_ids"][:, 1:]) and (b["labels"][:, 0] == M).all()
        # 64 draws: the chance that a reachable start never shows up is 2^-63.
        record(f"17-byte file, seq_len 16: window starts 0 and 1 drawn {starts.count(0)} and {starts.count(1)} times",
               0, 0, passed=set(starts) == {0, 1})
        with_tok = dataset.make_data(str(tmp / "exact.txt"), "text", TOK, 512, 1, T + 1, 0)  # BOS + 16 bytes
        exactly("with the byte tokenizer: BOS + bytes", with_tok.batch(0, "cpu")["input_ids"][0],
                torch.tensor([BOS] + [ord("a")] * T))
        held = dataset.make_data(str(tmp / "two.txt"), "text", None, 512, 1, 8, 0, eval_fraction=0.5)
        exactly("eval: the file's tail in windows", held.eval_batches("cpu")[0]["input_ids"][0],
                torch.tensor(_b("89abcdef")))  # ceil(0.5 x 17) = 9 held out
        assert held.tokens.numel() == 8 and "held out" in held.describe()


def test_synthetic_tokens():
    d = dataset.make_data(None, "synthetic", None, 300, 3, 50, 7)
    b = d.batch(4, "cpu")
    assert b["input_ids"].shape == (3, 50) and b["input_ids"].dtype == torch.long
    assert 0 <= int(b["input_ids"].min()) and int(b["input_ids"].max()) < 300
    assert torch.equal(b["labels"][:, 1:], b["input_ids"][:, 1:]) and (b["labels"][:, 0] == M).all()
    exactly("synthetic batch(4), two builds", b["input_ids"], dataset.make_data(None, "synthetic", None, 300, 3, 50, 7).batch(4, "cpu")["input_ids"])
    rank1 = dataset.make_data(None, "synthetic", None, 300, 3, 50, 7, rank=1, world_size=2)
    assert not torch.equal(b["input_ids"], rank1.batch(4, "cpu")["input_ids"]), "each rank its own tokens"
    assert d.batches_per_epoch is None and d.eval_batches("cpu") == [] and "synthetic" in d.describe()


def test_repeat_batches_cycles_the_first_n():
    """--repeat-batches N: step i trains on batch i mod N, for synthetic tokens and for text windows,
    and the data line says so; N must be a positive integer."""
    plain = dataset.make_data(None, "synthetic", None, 300, 3, 50, 7)
    cycled = dataset.make_data(None, "synthetic", None, 300, 3, 50, 7, repeat_batches=3)
    for i in range(7):  # the first 3 batches are the plain ones, then they come round again
        exactly(f"synthetic batch {i} is plain batch {i % 3}", cycled.batch(i, "cpu")["input_ids"],
                plain.batch(i % 3, "cpu")["input_ids"])
    assert not torch.equal(cycled.batch(0, "cpu")["input_ids"], cycled.batch(1, "cpu")["input_ids"])
    assert "first 3 batches, over and over" in cycled.describe() and "over and over" not in plain.describe()
    with _files(text__txt="abcdefghijklmnopqrstuvwxyz" * 4) as tmp:
        text = dataset.make_data(str(tmp / "text.txt"), "text", None, 512, 2, 8, 0, repeat_batches=2)
        exactly("text: batch 5 is batch 1", text.batch(5, "cpu")["input_ids"], text.batch(1, "cpu")["input_ids"])
    for bad in (0, -1, 1.5):
        expect_error(ValueError, lambda: dataset.make_data(None, "synthetic", None, 300, 3, 50, 7, repeat_batches=bad))


def test_repeat_batches_flag(capsys):
    from playbook.model import registry
    from playbook.config import make_parser, parse_config

    def cfg(*argv):
        return parse_config(make_parser("test", kernels_default=registry.DEFAULT_KERNELS), "finetune_optimized",
                            list(argv))

    assert cfg().data.repeat_batches is None and cfg("--repeat-batches", "4").data.repeat_batches == 4
    expect_error(SystemExit, cfg, "--repeat-batches", "0")
    expect_error(SystemExit, cfg, "--repeat-batches", "2", "--dataset", str(EXAMPLES / "chat.jsonl"), "--epochs", "1")
    assert "no epochs" in capsys.readouterr().err
    record("--repeat-batches N: RunConfig.repeat_batches; 0 and --epochs refused", 0, 0, True)


# ------------------------------------------------------------------------------------------------
# File formats and errors
# ------------------------------------------------------------------------------------------------
FORMAT_ROWS = [CHAT, PROMPT_COMPLETION, ALPACA, TEXT]


@pytest.mark.parametrize("fmt", ["jsonl", "json list", "json data", "parquet"])
def test_file_formats(fmt):
    with tempfile.TemporaryDirectory() as tmp:
        if fmt == "jsonl":
            path = Path(tmp) / "rows.jsonl"
            path.write_text("\n".join(json.dumps(r) for r in FORMAT_ROWS) + "\n\n")  # blank lines are skipped
        elif fmt.startswith("json"):
            path = Path(tmp) / "rows.json"
            path.write_text(json.dumps(FORMAT_ROWS if fmt == "json list" else {"data": FORMAT_ROWS}))
        else:
            pq = pytest.importorskip("pyarrow.parquet")
            import pyarrow as pa

            path = Path(tmp) / "rows.parquet"
            rows = [PROMPT_COMPLETION, {"prompt": "b", "completion": "c"}]  # one schema per parquet table
            pq.write_table(pa.Table.from_pylist(rows), path)
            assert files.load_rows(str(path)) == rows
            record("parquet", 0, 0, True)
            return
        assert files.load_rows(str(path)) == FORMAT_ROWS
        d = dataset.make_data(str(path), "dataset", TOK, 512, 4, 256, 0)
        assert d.report.kept == 4 and not d.report.dropped
    record(f"{fmt}: 4 rows, 4 kept", 0, 0, True)


def test_clear_errors_for_files_and_sources():
    with _files(bad__jsonl='{"text": "ok"}\n\n{"text": oops}\n', rows__csv="text\nhello\n",
                weird__json='"just a string"', x__parquet="not parquet") as tmp:
        assert "line 3" in expect_error(ValueError, files.load_rows, str(tmp / "bad.jsonl"))
        assert ".csv" in expect_error(ValueError, files.load_rows, str(tmp / "rows.csv"))
        expect_error(ValueError, files.load_rows, str(tmp / "weird.json"))
        assert "missing.jsonl" in expect_error(FileNotFoundError, files.load_rows, str(tmp / "missing.jsonl"))
        with mock.patch.dict(sys.modules, {"pyarrow": None, "pyarrow.parquet": None, "pandas": None}):
            assert "pip install pyarrow" in expect_error(files.MissingPackage, files.load_rows, str(tmp / "x.parquet"))
        expect_error(FileNotFoundError, dataset.make_data, str(tmp / "missing.txt"), "text", None, 512, 1, 8, 0)
    with mock.patch.dict(sys.modules, {"datasets": None}):  # as if `datasets` were not installed
        assert "pip install datasets" in expect_error(files.MissingPackage, files.load_rows, "someone/some-dataset")


EMPTY_REPLY = {"messages": [{"role": "user", "content": "What is a GPU?"}, {"role": "assistant", "content": " "}]}


def test_data_that_leaves_nothing_to_train_on_is_refused_naming_the_file_and_what_it_holds():
    """dataset.check_source, which needs only the files (the scripts call it before the model is built): a chat
    file whose every assistant reply is empty (it trained, on end-of-turn tokens only), a .json file of one
    object or of none, a file of no usable row and a blank --data text file are refused, each naming the file
    and what it found; the encoder drops such a row for the same reason. (Any file is raw text to --data: the
    tests train on examples/chat.jsonl as text.)"""
    with _files(empty__jsonl=[EMPTY_REPLY] * 3, one__json=json.dumps(CHAT), nothing__json="{}",
                mixed__jsonl=[EMPTY_REPLY, {"prompt": "a", "completion": ""}, {"messages": [CHAT["messages"][0]]}],
                blank__txt=" \n\n", fine__jsonl=[EMPTY_REPLY, CHAT]) as tmp:
        cases = {  # (source, kind, eval source) -> what the message must hold
            (tmp / "empty.jsonl", "dataset", None): f"no usable row in {tmp / 'empty.jsonl'}: 3 row(s), every one "
                                                   "dropped (empty replies: 3); nothing to train on",
            (tmp / "one.json", "dataset", None): f"{tmp / 'one.json'} holds one JSON object (keys: messages), not a "
                                                 "list of rows",
            (tmp / "nothing.json", "dataset", None): "holds an empty JSON object, not a list of rows",
            (tmp / "mixed.jsonl", "dataset", None): "(empty: 1, empty replies: 1, no trainable token: 1)",
            (tmp / "fine.jsonl", "dataset", tmp / "empty.jsonl"): f"no usable row in the eval file "
                                                                   f"{tmp / 'empty.jsonl'}: 3 row(s)",
            (tmp / "blank.txt", "text", None): f"{tmp / 'blank.txt'} holds no text (3 bytes, blank): no tokens",
        }
        for (source, kind, eval_source), says in cases.items():
            with pytest.raises(files.DataError) as refused:
                dataset.check_source(str(source), kind, eval_source and str(eval_source))
            assert says in str(refused.value), (source, str(refused.value))
        dataset.check_source(str(tmp / "fine.jsonl"), "dataset")  # one usable row is enough here
        assert _dataset([EMPTY_REPLY, CHAT], seq_len=256).report.dropped == {"empty replies": 1}
    record(f"{len(cases)} sources that leave nothing to train on: refused, naming the file and what it holds",
           0, 0, True)


def test_the_scripts_refuse_such_data_before_the_model_is_built(monkeypatch, capsys):
    from playbook.model import registry
    from playbook.run import start, training
    from playbook.config import make_parser, parse_config

    def build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(start, "build", build)
    with _files(empty__jsonl=[EMPTY_REPLY] * 2) as tmp:
        cfg = parse_config(make_parser("t", kernels_default=registry.DEFAULT_KERNELS), "finetune_optimized",
                           ["--model", "llama-tiny", "--dataset", str(tmp / "empty.jsonl"), "--steps", "3"])
        with pytest.raises(SystemExit) as stop:
            training.train(cfg)
    said = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(said) == 1 and said[0].startswith(f"error: no usable row in {tmp}"), said
    record("a chat file of empty replies: one line, exit 2, before the model is built", 0, 0, True)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        pytest.param(dict(kind="tokens"), ValueError, id="unknown kind"),
        pytest.param(dict(tokenizer=None), ValueError, id="dataset without a tokenizer"),
        pytest.param(dict(vocab_size=200), ValueError, id="token ids past the vocabulary"),
        pytest.param(dict(batch_size=5), ValueError, id="more rows per batch than examples"),
        pytest.param(dict(batch_size=0), ValueError, id="batch_size 0"),
        pytest.param(dict(rank=2, world_size=2), ValueError, id="rank outside world_size"),
        pytest.param(dict(eval_fraction=1.0), ValueError, id="eval_fraction 1"),
        pytest.param(dict(source=None), ValueError, id="dataset without a source"),
        pytest.param(dict(kind="synthetic", packing=True, source=None), ValueError, id="packing synthetic tokens"),
    ],
)
def test_bad_arguments_give_clear_errors(kwargs, error):
    with _files(rows__jsonl=FORMAT_ROWS) as tmp:
        args = dict(source=str(tmp / "rows.jsonl"), kind="dataset", tokenizer=TOK, vocab_size=512, batch_size=4,
                    seq_len=256, seed=0)
        args.update(kwargs)
        expect_error(error, lambda: dataset.make_data(**args))


# ------------------------------------------------------------------------------------------------
# The data users bring: ShareGPT rows, odd roles, long examples, encodings, an eval file, token ids,
# missing packages
# ------------------------------------------------------------------------------------------------
def _write_rows(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _run_cfg(dataset=None, text=None, **kw):
    """The fields of a RunConfig that start.make_run_data reads (the scripts' path into data/dataset.py)."""
    from types import SimpleNamespace

    fields = dict(dataset=dataset, data=text, batch_size=1, seq_len=256, seed=0, packing=False, train_on_prompt=False,
                  eval_fraction=0.0, drop_long=False, eval_dataset=None, repeat_batches=None, device="cpu",
                  defaults=SimpleNamespace(huggingface_attention=False))
    fields.update(kw)
    from playbook.sections import FIELD_SECTIONS

    extra = fields.pop("extra", None)  # (beside the sections, as in the RunConfig)
    sections = {}  # each field in its section, as the RunConfig holds it (cfg.data.seq_len, cfg.run.seed)
    for name, value in fields.items():
        sections.setdefault(FIELD_SECTIONS[name], {})[name] = value
    return SimpleNamespace(**{name: SimpleNamespace(**values) for name, values in sections.items()}, extra=extra)


def _script_exit(capsys, call, *args) -> tuple[str, str]:
    """`call` must stop as a script does on bad input: exit code 2, one `error:` line on stderr, no
    traceback. Returns (stdout, the error line)."""
    with pytest.raises(SystemExit) as info:
        call(*args)
    out, err = capsys.readouterr()
    assert info.value.code == 2, f"exit code {info.value.code}, want 2"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    record(f"exit 2: {lines[0][:60]}...", 0, 0, True)
    return out, lines[0]


TINY_MODEL = type("Model", (), {"config": type("Config", (), {"vocab_size": 512})()})()  # what make_run_data reads


SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."},
                              {"from": "human", "value": "Capital of Peru?"},
                              {"from": "gpt", "value": "Lima."},
                              {"from": "human", "value": "And of Chile?"},
                              {"from": "gpt", "value": "Santiago."}]}


def test_sharegpt_rows_load_as_chat(tmp_path):
    """ShareGPT's from/value turns (human, gpt, system) give exactly the tokens and labels of the same
    conversation in messages form; a top-level "system" string is the system message; tool aliases map to tool."""
    want = _dataset([CHAT], seq_len=200).rows
    top_system = {"system": "Be brief.", "conversations": SHAREGPT["conversations"][1:]}
    for row in (SHAREGPT, top_system):
        path = _write_rows(tmp_path / "sharegpt.jsonl", [row])
        got = dataset.make_data(path, "dataset", TOK, 512, 1, 200, 0).rows
        for key in ("input_ids", "labels"):
            exactly(f"ShareGPT == messages: {key}", got[key], want[key])
    tool = {"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "x"}]}
    assert rows._chat_messages({"conversations": [{"from": "observation", "value": "sunny"}]})[0]["role"] == "tool"
    with pytest.raises(rows.UnknownRole):
        rows._chat_messages(tool)  # function_call is no alias: refused, not guessed
    example = dataset.make_data(str(EXAMPLES / "sharegpt.jsonl"), "dataset", TOK, 512, 2, 512, 0)
    assert example.report.rows >= 4 and not example.report.dropped, example.describe()


def test_unknown_roles_are_refused_with_the_row_and_the_accepted_roles(tmp_path):
    wizard = {"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra."}]}
    path = _write_rows(tmp_path / "odd.jsonl", [CHAT, CHAT, wizard])
    message = expect_error(files.DataError, dataset.make_data, path, "dataset", TOK, 512, 1, 256, 0)
    assert "row 3" in message and "message 2" in message and "'wizard'" in message, message
    assert "system, user, assistant, tool" in message and "human -> user" in message, message
    sharegpt_odd = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "narrator", "value": "..."}]}
    path = _write_rows(tmp_path / "odd_sharegpt.jsonl", [sharegpt_odd])
    assert "'narrator'" in expect_error(files.DataError, dataset.make_data, path, "dataset", TOK, 512, 1, 256, 0)
    # Aliases and case are accepted in messages rows too: "Human"/"GPT" render as user/assistant.
    aliased = {"messages": [{"role": m["role"].upper(), "content": m["content"]} for m in CHAT["messages"]]}
    same = _dataset([aliased], seq_len=200).rows["input_ids"]
    exactly("upper-case roles == roles", same, _dataset([CHAT], seq_len=200).rows["input_ids"])


def test_long_examples_are_truncated_and_counted(tmp_path, capsys):
    """Longer than seq_len: cut to the first seq_len tokens (the prompt whole, the completion's end
    cut, no EOS); a prompt that fills seq_len leaves nothing to train on and is dropped with its own
    reason; drop_long drops every long example. The counts line says which happened to how many."""
    T = 64
    short = {"prompt": "Q?", "completion": " A."}
    long = {"prompt": "Say it:", "completion": " " + "la " * 40}
    prompt_too_long = {"prompt": "p" * 80, "completion": "c"}
    rows = [short, long, prompt_too_long]
    d = _dataset(rows, seq_len=T, batch_size=2)
    assert (d.report.kept, d.report.truncated, d.report.dropped) == (2, 1, {"prompt longer than seq_len": 1})
    full_ids, full_labels = _expected([([BOS] + _b(long["prompt"]), False), (_b(long["completion"]) + [EOS], True)])
    at = [r for r in range(2) if d.rows["attention_mask"][r].sum() == T]
    assert len(at) == 1, "the long example fills its row exactly"
    exactly("truncated: the first seq_len ids", d.rows["input_ids"][at[0]], torch.tensor(full_ids[:T]))
    exactly("truncated: the first seq_len labels (the prompt masked)", d.rows["labels"][at[0]], torch.tensor(full_labels[:T]))
    line = d.describe()
    assert f"3 rows: 1 kept whole, 1 truncated to {T} tokens, 1 dropped (prompt longer than seq_len: 1)" in line, line
    old = _dataset(rows, seq_len=T, drop_long=True)
    assert old.report.dropped == {"longer than seq_len": 2} and old.report.truncated == 0, old.describe()
    # Too few examples for the batch: the counts line is printed before the error, by the scripts' path.
    from playbook.run.start import make_run_data

    path = _write_rows(tmp_path / "long.jsonl", rows)
    out, error = _script_exit(capsys, make_run_data, _run_cfg(path, seq_len=T, batch_size=4), TINY_MODEL, TOK)
    assert "fewer than batch_size 4" in error, error
    assert f"Data: dataset {path}: 3 rows: 1 kept whole, 1 truncated to {T} tokens, 1 dropped" in out, out
    out, error = _script_exit(capsys, make_run_data, _run_cfg(path, seq_len=T, drop_long=True, batch_size=2), TINY_MODEL, TOK)
    assert "no usable row" not in error and "longer than seq_len: 2" in out, (out, error)


def test_files_that_are_not_utf8_are_refused_with_the_byte_offset(tmp_path, capsys):
    latin1 = "caf\xe9 au lait\n".encode("latin-1")  # 0xe9 at byte 3: a Latin-1 'é', not UTF-8
    (tmp_path / "notes.txt").write_bytes(b"line one\n" + latin1 * 20)
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "' + latin1.strip() + b'"}\n')
    for name, kind, tok in (("notes.txt", "text", None), ("notes.txt", "text", TOK), ("rows.jsonl", "dataset", TOK)):
        message = expect_error(files.DataError, dataset.make_data, str(tmp_path / name), kind, tok, 512, 1, 8, 0)
        where = "byte 12 (line 2, value 0xe9)" if name == "notes.txt" else "byte 28 (line 2, value 0xe9)"
        assert where in message and "iconv" in message and name in message, message
    import distill

    cfg = _run_cfg(text=tmp_path / "notes.txt", seq_len=8, extra=type("Extra", (), {"teacher": "llama-tiny"})())
    _, error = _script_exit(capsys, distill.make_batches, cfg, 512)
    assert "is not UTF-8" in error and "iconv" in error, error


def test_a_byte_order_mark_is_read_past(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) is not part of the data: the first row parses,
    and a bad byte after it is still reported at its offset in the file."""
    rows = [{"text": "first row"}, {"text": "second row"}]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    assert files._read_jsonl(path) == rows
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbfcaf\xe9")
    message = expect_error(files.DataError, files.read_utf8, tmp_path / "bad.txt")
    assert "byte 6 (line 1, value 0xe9)" in message, message


def test_eval_dataset_replaces_the_held_out_share(tmp_path, capsys):
    train_path = _write_rows(tmp_path / "train.jsonl", ROWS[:10])
    eval_rows = [{"prompt": f"Held {i}?", "completion": f" Out {i}."} for i in range(3)] + [{"text": " "}]
    eval_path = _write_rows(tmp_path / "eval.jsonl", eval_rows)
    d = dataset.make_data(train_path, "dataset", TOK, 512, 2, 32, 0, eval_source=eval_path)
    assert d.report.train_examples == 10, "every training row is trained on: none held out"
    held = [TOK.decode(r[r != TOK.pad_token_id], skip_special_tokens=True) for b in d.eval_batches("cpu")
            for r in b["input_ids"]]
    assert held == [f"Held {i}? Out {i}." for i in range(3)], held  # the eval file's rows, in order
    assert f"; eval {eval_path}: 4 rows: 3 kept whole, 0 truncated to 32 tokens, 1 dropped (empty: 1)" in d.describe()
    expect_error(ValueError, lambda: dataset.make_data(train_path, "dataset", TOK, 512, 2, 32, 0, eval_fraction=0.1,
                                                    eval_source=eval_path))
    # The flag: refused beside an explicit --eval-fraction and without --dataset; it turns the default share off.
    from playbook.config import make_parser, parse_config

    parser = make_parser("test")
    cfg = parse_config(parser, "finetune_optimized", ["--dataset", train_path, "--eval-dataset", eval_path])
    assert (cfg.data.eval_dataset, cfg.data.eval_fraction) == (eval_path, 0.0)
    for argv in (["--dataset", train_path, "--eval-dataset", eval_path, "--eval-fraction", "0.1"],
                 ["--eval-dataset", eval_path]):
        _script_exit(capsys, parse_config, parser, "finetune_optimized", argv)
    # finetune_trainer.py builds its Trainer datasets through the same function.
    import finetune_trainer

    train_set, eval_set = finetune_trainer.build_datasets(
        _run_cfg(train_path, seq_len=32, eval_dataset=eval_path), TOK, 512)
    assert (len(train_set), len(eval_set)) == (10, 3)
    assert "Data: dataset" in capsys.readouterr().out


def test_token_ids_outside_the_vocabulary_name_the_example(tmp_path, capsys):
    """A tokenizer with an id past the model's vocabulary (a mismatched pair): the build stops naming
    the row, before any step; out-of-range targets would otherwise reach the loss as NaN."""
    odd = copy.deepcopy(TOK)
    odd.add_tokens(["<|wizard|>"])  # id 262: one past the byte tokenizer, and past a 262-entry model
    wizard = odd.convert_tokens_to_ids("<|wizard|>")
    path = _write_rows(tmp_path / "rows.jsonl", [TEXT, PROMPT_COMPLETION, {"text": "a <|wizard|> spell"}])
    message = expect_error(files.DataError, dataset.make_data, path, "dataset", odd, wizard, 1, 64, 0)
    assert "row 3" in message and f"token id {wizard}" in message and f"ids 0 to {wizard - 1}" in message, message
    (tmp_path / "spell.txt").write_text("x" * 20 + "<|wizard|>" + "y" * 20)
    message = expect_error(files.DataError, dataset.make_data, str(tmp_path / "spell.txt"), "text", odd, wizard, 1, 8, 0)
    assert f"token 21 of the file" in message and f"id {wizard}" in message, message  # BOS, then 20 bytes
    assert dataset.make_data(path, "dataset", odd, wizard + 1, 1, 64, 0).report.kept == 3  # fits: builds
    from playbook.run.start import make_run_data

    model = type("Model", (), {"config": type("Config", (), {"vocab_size": wizard})()})()
    _, error = _script_exit(capsys, make_run_data, _run_cfg(path, seq_len=64), model, odd)
    assert "row 3" in error


def test_missing_optional_packages_exit_2_with_one_line(tmp_path, capsys):
    from playbook.run.start import make_run_data

    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    with mock.patch.dict(sys.modules, {"pyarrow": None, "pyarrow.parquet": None, "pandas": None}):
        _, error = _script_exit(capsys, make_run_data, _run_cfg(str(tmp_path / "rows.parquet")), TINY_MODEL, TOK)
    assert "needs the pyarrow package: pip install pyarrow" in error, error
    with mock.patch.dict(sys.modules, {"datasets": None}):  # as if `datasets` were not installed
        _, error = _script_exit(capsys, make_run_data, _run_cfg("someone/some-dataset"), TINY_MODEL, TOK)
        assert "needs the datasets package: pip install datasets" in error, error
        import finetune_trainer

        _, error = _script_exit(capsys, finetune_trainer.build_datasets, _run_cfg("someone/some-dataset"), TOK, 512)
        assert "pip install datasets" in error, error


# ------------------------------------------------------------------------------------------------
# The example dataset
# ------------------------------------------------------------------------------------------------
def test_example_dataset_is_clean_and_licensed():
    chat = EXAMPLES / "chat.jsonl"
    d = dataset.make_data(str(chat), "dataset", TOK, 512, 4, 512, 0)
    assert 150 <= d.report.rows <= 300 and not d.report.dropped, d.describe()
    assert chat.stat().st_size < 300_000
    alpaca = dataset.make_data(str(EXAMPLES / "alpaca.jsonl"), "dataset", TOK, 512, 4, 512, 0)
    assert not alpaca.report.dropped, alpaca.describe()
    readme = (EXAMPLES / "README.md").read_text()
    assert "CC0-1.0" in readme
    record(f"chat.jsonl: {d.report.rows} conversations, {chat.stat().st_size / 1e3:.0f} KB, CC0-1.0", 0, 0, True)


def test_tiny_model_learns_the_example_dataset():
    """40 AdamW steps of the tiny LLaMA on packed chat rows: the loss must fall clearly."""
    from transformers import LlamaForCausalLM

    d = dataset.make_data(str(EXAMPLES / "chat.jsonl"), "dataset", TOK, 512, 4, 256, 0, packing=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with _one_cpu_thread():
        for step in range(40):
            loss = model(**d.batch(step, "cpu")).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # A uniform guess over 512 ids costs ln 512 = 6.24 nats per token; knowing only which bytes English
    # uses most already brings it near 3.3. A pipeline that feeds real, correctly labelled text falls
    # by about 2.6 nats in these 40 steps; 2.0 leaves room for other seeds and library versions.
    record(f"loss, first 5 steps {first:.2f} -> last 5 {last:.2f} nats (drop > 2.0)", first - last, 2.0,
           passed=first - last > 2.0)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "Data pipeline: test report"))
