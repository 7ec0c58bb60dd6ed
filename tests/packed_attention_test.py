"""Packed rows attended per example (playbook/model/packed_attention.py): the same loss and gradients as the
examples one per row, no attention across an example's boundary, no [T, T] mask at any length, every model
family, and the data and command-line defaults that choose it.

On a CPU the attention is the fallback (SDPA once per example, fp32); on a GPU the models run in bf16 and
the attention is FlashAttention-2's varlen kernel, the path a training run takes there.
"""

import pytest
import torch

from playbook.model import packed_attention as pa
from playbook.data.dataset import BatchAttention, TrainData, pack_examples, pad_examples
from playbook.data.rows import IGNORE_INDEX, Example
from core.kernel_utils import DEVICE
from testkit import FAMILIES, VOCAB, tiny_model

GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32  # the dtype a run trains in on this machine
T = 48  # tokens per packed row


def _examples(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[Example]:
    """Examples of random lengths; the first token of each and a short random prompt carry no label."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (k,), generator=g).tolist()
        prompt = int(torch.randint(1, max(2, k // 2), (1,), generator=g))
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _packed_batch(examples: list[Example], seq_len: int = T) -> dict:
    rows = pack_examples(examples, seq_len, pad_id=0)
    lengths = [torch.unique_consecutive(s, return_counts=True)[1].tolist() for s in rows["segments"]]
    bounds = pa.boundaries(lengths, seq_len, size=sum(map(len, lengths)) + 3)  # 2 empty entries at the end
    return {"input_ids": rows["input_ids"].to(DEVICE), "labels": rows["labels"].to(DEVICE),
            "position_ids": rows["position_ids"].to(DEVICE), "attention_mask": pa.as_mask(bounds).to(DEVICE)}


def _padded_batch(examples: list[Example]) -> dict:
    rows = pad_examples(examples, T, pad_id=0)
    return {k: v.to(DEVICE) for k, v in rows.items()}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def _model(kind: str, dtype, packed: bool):
    model = tiny_model(kind).to(dtype)
    model.config.use_cache = False  # as the training scripts set it
    if packed:
        pa.install(model)
    else:
        model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("kind", FAMILIES)
def test_packed_loss_and_gradients_equal_one_example_per_row(kind):
    """The loss and every gradient of packed rows against the same examples one per row (right-padded, with
    their padding mask), both in this machine's training dtype, each measured against the one-per-row model in
    float64: the packed error may be at most twice the one-per-row error plus fp32 rounding (what reordering
    the sums can add). Attention across examples, or positions that do not restart, change the loss by O(1)."""
    examples = _examples(9, seed=1)
    if pa.unsupported(tiny_model(kind).config):
        pytest.skip(f"{kind}: {pa.unsupported(tiny_model(kind).config)}; packed rows keep the dense mask there "
                    "(test_families_the_boundaries_cannot_serve_are_named)")
    ref_loss, ref = _loss_and_grads(_model(kind, torch.float64, packed=False).to(torch.float64), _padded_batch(examples))
    pad_loss, pad = _loss_and_grads(_model(kind, DTYPE, packed=False), _padded_batch(examples))
    pk_loss, pk = _loss_and_grads(_model(kind, DTYPE, packed=True), _packed_batch(examples))
    floor = 2.0**-20  # fp32's rounding of a sum of a few hundred terms, relative
    assert (pk_loss - ref_loss).abs() <= 2 * (pad_loss - ref_loss).abs() + floor * ref_loss.abs(), \
        (kind, float(pk_loss), float(pad_loss), float(ref_loss))
    assert pk.keys() == ref.keys()
    for name, g in ref.items():
        scale = g.norm()
        err_packed, err_padded = (pk[name] - g).norm(), (pad[name] - g).norm()
        assert err_packed <= 2 * err_padded + floor * scale, (kind, name, float(err_packed), float(err_padded), float(scale))


def test_no_token_attends_across_an_example_boundary():
    """Change every token of the first example of a row: the outputs at the other examples' tokens stay the
    same (exactly on a CPU; on a GPU within 1e-3 of their size, far below what a leak changes)."""
    examples = _examples(6, seed=2)
    model = _model("llama", DTYPE, packed=True)
    batch = _packed_batch(examples)
    first = len(examples[0].input_ids)
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][0, :first] = (other["input_ids"][0, :first] + 7) % VOCAB
    with torch.no_grad():
        a = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        b = model(**{k: v for k, v in other.items() if k != "labels"}).logits.float()
    assert not torch.equal(a[0, :first], b[0, :first]), "the change reaches the example it was made in"
    diff = (a[0, first:] - b[0, first:]).abs().max()
    assert diff <= (1e-3 * a.abs().max() if GPU else 0.0), float(diff)
    assert torch.equal(a[1:], b[1:])


def test_a_131072_token_row_needs_no_square_mask():
    """One packed row of 131,072 tokens: the batch's attention input is the boundaries (a few hundred bytes,
    not the 17 GB of a [T, T] mask), and attention over it matches each example attended alone."""
    seq_len = 131072
    g = torch.Generator().manual_seed(3)
    lengths, left = [], seq_len
    while left:
        n = min(left, int(torch.randint(200, 6000, (1,), generator=g)))
        lengths.append(n)
        left -= n
    mask = pa.as_mask(pa.boundaries([lengths], seq_len, len(lengths) + 1)).to(DEVICE)
    assert mask.numel() == len(lengths) + 1 < 1000
    heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(seq_len, heads, dim, generator=g).to(DEVICE, DTYPE)
    k, v = (torch.randn(seq_len, kv_heads, dim, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    if GPU:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out = pa.document_attention(q, k, v, mask.view(-1), seq_len)
    if GPU:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        assert extra < 64 << 20, f"{extra / 2**20:.0f} MiB above the inputs: more than linear in the tokens"
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    for i in (0, len(lengths) // 2, len(lengths) - 1):  # the first, a middle and the last example, alone
        a, e = starts[i], starts[i + 1]
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[a:e].transpose(0, 1)[None].float(), k[a:e].transpose(0, 1)[None].float().repeat_interleave(2, 1),
            v[a:e].transpose(0, 1)[None].float().repeat_interleave(2, 1), is_causal=True)[0].transpose(0, 1)
        tol = 2e-2 if GPU else 1e-5  # bf16 outputs (8 bits of mantissa) on a GPU; fp32 reordering on a CPU
        assert (out[a:e].float() - alone).abs().max() <= tol, i


def test_families_the_boundaries_cannot_serve_are_named():
    """Logit softcapping (Gemma 2) and a sliding window shorter than the model's positions keep the dense
    mask, with the reason; the families without either take the boundaries."""
    assert "softcapping" in pa.unsupported(tiny_model("gemma2").config)
    assert "sliding window" in pa.unsupported(tiny_model("mistral", sliding_window=16).config)
    for kind in ("llama", "qwen2", "qwen3", "gemma"):
        assert pa.unsupported(tiny_model(kind).config) is None, kind


def test_boundaries_have_one_length_for_every_batch():
    """TrainData's packed batches: the same boundaries length every batch (a CUDA graph replays them), each
    row's examples where its segments say, the unused entries at B x T."""
    examples = _examples(40, seed=4)
    data = TrainData("dataset", None, batch_size=2, seq_len=T, vocab_size=VOCAB, seed=0, rank=0, world_size=1,
                     report=None, attention=BatchAttention(packed="boundaries"))
    data.rows, data.packing = pack_examples(examples, T, 0), True
    size = data.boundaries_size()
    for i in range(data.batches_per_epoch):
        batch = data.batch(i, "cpu")
        bounds = batch["attention_mask"].view(-1)
        assert pa.is_boundaries(batch["attention_mask"]) and bounds.numel() == size
        assert bounds[0] == 0 and bounds[-1] == 2 * T and bool((bounds[1:] >= bounds[:-1]).all())
        segments = torch.cat([data.rows["segments"][r] + 1000 * j for j, r in enumerate(data._epoch_shard(0)[2 * i: 2 * i + 2])])
        starts = torch.nonzero(torch.cat([torch.tensor([True]), segments[1:] != segments[:-1]])).view(-1)
        assert bounds.unique().tolist() == starts.tolist() + [2 * T]
    with pytest.raises(ValueError, match="sum to"):
        pa.boundaries([[3, 4]], 8, 4)
    with pytest.raises(ValueError, match="more than the 1 its boundaries hold"):
        pa.boundaries([[3, 5]], 8, 2)


def test_packing_is_the_default_with_a_dataset():
    from playbook.model import registry as ak
    from playbook.config import make_parser, parse_config

    def cfg(*args):
        return parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_optimized",
                            ["--model", "llama-tiny", *args])

    assert cfg("--dataset", "examples/chat.jsonl").data.packing is True
    assert cfg("--dataset", "examples/chat.jsonl", "--no-packing").data.packing is False
    assert cfg().data.packing is False
    with pytest.raises(SystemExit) as info:
        cfg("--no-packing")
    assert info.value.code == 2


def test_the_trainer_refuses_packing_it_would_not_do():
    """finetune_trainer.py pads one example per row (the Trainer's collator): an explicit --packing is refused in
    one line, not ignored; without it the Trainer's rows stay padded."""
    from playbook.model import registry as ak
    from playbook.config import make_parser, parse_config

    with pytest.raises(SystemExit) as info:
        parse_config(make_parser("test", kernels_default=ak.DEFAULT_KERNELS), "finetune_trainer",
                     ["--model", "llama-tiny", "--dataset", "examples/chat.jsonl", "--packing"])
    assert info.value.code == 2



def test_the_attention_runs_as_written_under_torch_compile():
    """`--compile` on packed rows: Inductor cannot compile the fallback's data-dependent shapes (the boundaries
    read on the host): a compiled training step failed with "NameError: name 's29' is not defined" in its
    generated code until the attention was left out of the compiled graph. Checked by the marker
    torch.compiler.disable leaves (a compiled step is too slow a test here: about a minute on two cores)."""
    assert getattr(pa.document_attention, "_torchdynamo_disable", False)
