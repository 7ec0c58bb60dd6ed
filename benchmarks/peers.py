"""The Hugging Face peer of the training scripts on a real model: its own model, loss and optimizer, padding-free.

    $ python benchmark_finetune.py --peer --model smollm2-135m --dataset examples/chat.jsonl --batch-size 8 \
          --seq-len 512 --steps 60 --compile --tag smol-hf-compile
    $ python benchmark_finetune.py --peer --steps 2            # no GPU: slow (SmolLM2 in fp32 on the CPU), works

benchmark_finetune.py's row `smol-hf-compile` runs the first command; the entry point is that script's, this
module holds the peer.

What a user who knows Hugging Face would run without this playbook: AutoModelForCausalLM with PyTorch's SDPA
attention and its own loss (the logits upcast to fp32), PyTorch's AdamW (fused on a GPU), optionally under
`torch.compile` (default mode). It is fed padding-free: the same packed rows as the scripts' default (the
scripts' tokenization, prompt masking, packing and shuffle, from the same seed: playbook/data/dataset.py), with
`position_ids` restarting at each example and no attention mask, from which transformers builds the mask
that keeps each example to itself (masking_utils.find_packed_sequence_indices). So the peer and ours
(benchmark_finetune.py's SmolLM2 rows) see the same tokens in the same order, and tokens/s counts the same
tokens: those that are not padding.

The eval before the first step and after the last is the scripts' own (training.evaluate, mean loss over the
held-out target tokens, the same held-out rows with their dense per-example mask), and the summary is written
as the scripts write theirs (results/<tag>.json, "summary": tokens/s (job), step time median (ms), peak GPU
memory (GB), eval loss before, final eval loss, model TFLOP/s per GPU), so benchmark_finetune.py reads both
the same way. Steps are timed from the host with a device sync around each (a sync point per step: the peer's
own loop has one at `loss.item()` too); the first --timing-warmup-steps (compilation) are not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from core.process import log
from playbook.config import FULL_LR
from playbook.runtime.common import usage_error
from playbook.store.files import result_path, write_atomic


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="a packaged model name or a .gguf file (the scripts' --model)")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (the scripts')")
    p.add_argument("--dataset", default="examples/chat.jsonl")
    p.add_argument("--batch-size", type=int, default=8, help="rows of --seq-len tokens per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timing-warmup-steps", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--lr", type=float, default=FULL_LR, help=f"AdamW's learning rate (the scripts' default, {FULL_LR})")
    p.add_argument("--lr-schedule", choices=["constant"], default="constant",
                   help="the peer's rate is constant (the scripts' --lr-schedule constant)")
    p.add_argument("--eval-fraction", type=float, default=0.05,
                   help="share of examples held out (the scripts' default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default mode)")
    p.add_argument("--tag", default="hf-peer", help="the summary's name: results/<tag>.json")
    p.add_argument("--overwrite", action="store_true", help="replace results/<tag>.json rather than add -2, -3, ...")
    a = p.parse_args(argv)
    for flag, value, low in (("--num-layers", 1 if a.num_layers is None else a.num_layers, 1), ("--batch-size", a.batch_size, 1),
                             ("--seq-len", a.seq_len, 2), ("--steps", a.steps, 1),
                             ("--timing-warmup-steps", a.timing_warmup_steps, 0)):
        if value < low:
            raise usage_error(f"{flag} must be {low} or more, got {value}")
    if a.timing_warmup_steps >= a.steps:
        raise usage_error(f"--steps {a.steps} leaves no timed step after --timing-warmup-steps {a.timing_warmup_steps}")
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # a sync point: the step's time is the GPU's


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM

    from playbook.data.dataset import make_data
    from playbook.model import pretrained
    from playbook.model.models import count_params
    from playbook.model.tokenizer import make_tokenizer
    from playbook.run.training import evaluate

    a = parse(argv)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    folder = pretrained.local_directory(a.model)
    tokenizer = make_tokenizer(str(folder), preset=False)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if a.num_layers is not None:  # as the scripts' --num-layers: the first N decoder layers, the rest dropped
        model.model.layers = model.model.layers[: a.num_layers]
        model.config.num_hidden_layers = len(model.model.layers)
    data = make_data(a.dataset, "dataset", tokenizer, model.config.vocab_size, a.batch_size, a.seq_len, a.seed,
                     packing=True, eval_fraction=a.eval_fraction)
    log(f"Peer: Hugging Face {type(model).__name__} (SDPA, its own loss), padding-free packed rows, "
        f"{'torch.compile' if a.compile else 'eager'}, PyTorch AdamW{' (fused)' if on_gpu else ''}, lr {a.lr:g}; "
        f"data {data.describe()}")
    eval_before = evaluate(model, data.eval_batches(device))
    if eval_before is not None:
        log(f"eval loss before training: {eval_before:.4f}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, fused=on_gpu)
    step_model = torch.compile(model) if a.compile else model
    model.train()
    times, tokens, losses = [], [], []
    began = time.perf_counter()
    for i in range(a.steps):
        batch = data.batch(i, device)
        batch.pop("attention_mask", None)  # padding-free: position_ids alone say where each example starts
        sync(device)
        t0 = time.perf_counter()
        loss = step_model(**batch, use_cache=False).loss  # no cache: transformers then reads packed rows
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # a sync point, as in the peer's own loop
        sync(device)
        if i >= a.timing_warmup_steps:
            times.append(time.perf_counter() - t0)
            tokens.append(data.text_tokens(i))
        if (i + 1) % 10 == 0 or i + 1 == a.steps:
            log(f"step {i + 1:>5}/{a.steps}  loss {losses[-1]:.4f}  {1e3 * (time.perf_counter() - t0):8.1f} ms")
    warmup_s = time.perf_counter() - began - sum(times)
    eval_after = evaluate(model, data.eval_batches(device))
    tps = sum(tokens) / sum(times)
    emb = model.get_input_embeddings().weight.numel()
    matmul_params = count_params(model) - emb + (emb if model.config.tie_word_embeddings else 0)
    cfg = model.config
    flops_per_token = 6 * matmul_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * a.seq_len  # models.py's count
    summary = {
        "step time median (ms)": 1e3 * statistics.median(times),
        "tokens/s (job)": tps,
        "model TFLOP/s per GPU": tps * flops_per_token / 1e12,
        "peak GPU memory (GB)": torch.cuda.max_memory_allocated() / 1e9 if on_gpu else None,
        "first loss": losses[0], "final loss": losses[-1],
        "eval loss before": eval_before, "final eval loss": eval_after,
        "untimed warm-up (s)": warmup_s,
    }
    out = {"script": "benchmarks/peers", "model": a.model, "gpu": torch.cuda.get_device_name() if on_gpu else "CPU",
           "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "compile": a.compile,
           "params": count_params(model), "trainable_params": count_params(model, trainable_only=True),
           "losses": losses, "step_times_s": times, "text_tokens": tokens, "summary": summary, "config": vars(a)}
    path = result_path(a.tag, overwrite=a.overwrite)
    write_atomic(path, json.dumps(out, indent=1, default=str) + "\n")
    log(f"{tps:,.0f} tokens/s (text), median step {summary['step time median (ms)']:.1f} ms over {len(times)} steps "
        f"(the first {a.timing_warmup_steps}, compilation included: {warmup_s:.1f} s); eval loss "
        f"{eval_before if eval_before is not None else float('nan'):.4f} -> "
        f"{eval_after if eval_after is not None else float('nan'):.4f}")
    log(f"Saved {path}")
    return out
