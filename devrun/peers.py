"""Two peers of the training scripts on SmolLM2-135M-Instruct and examples/chat.jsonl, on one GPU, in text tokens
per second (padding not counted), with the scripts' tokenization, prompt masking and examples:

  hf_longest   Hugging Face eager (SDPA), each batch padded to its longest row (DataCollatorWithPadding's way),
               PyTorch's fused AdamW
  hf_compiled  the same model under torch.compile(mode="reduce-overhead") (CUDA graphs by Inductor), on rows
               padded to --seq-len (one shape, so one graph)

    PYTHONPATH=$PWD python results/runs/defaults_H200/peers.py [--steps 60] [--seq-len 512] [--batch-size 8]
"""
import argparse
import json
import time

import torch

from playbook import pretrained
from playbook.data import make_data, make_tokenizer


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--peers", default="hf_longest,hf_compiled")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    folder = pretrained.local_directory("smollm2-135m")
    tok = make_tokenizer(str(folder), preset=False)
    results = {}
    for name in a.peers.split(","):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").to(a.device)
        model.config.use_cache = False
        model.train()
        data = make_data("examples/chat.jsonl", "dataset", tok, model.config.vocab_size, a.batch_size, a.seq_len, 0,
                         packing=False, eval_fraction=0.05)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=a.device == "cuda")
        step_model = torch.compile(model, mode="reduce-overhead") if name == "hf_compiled" else model
        t_compile = time.perf_counter()
        text, times = 0, []
        for i in range(a.steps):
            b = data.batch(i, a.device)
            if name == "hf_longest":
                longest = int(b["attention_mask"].sum(dim=1).max())
                b = {k: v[:, :longest] for k, v in b.items()}
            sync(a.device)
            t0 = time.perf_counter()
            loss = step_model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(a.device)
            dt = time.perf_counter() - t0
            if i == a.warmup - 1:
                first_steps = time.perf_counter() - t_compile
            if i >= a.warmup:
                times.append(dt)
                text += int(b["attention_mask"].sum())
        ms = 1e3 * sum(times) / len(times)
        results[name] = {"step_ms_mean": ms, "text_tokens_per_s": text / sum(times), "timed_steps": len(times),
                         "warmup_s": first_steps, "final_loss": float(loss)}
        print(f"{name}: {ms:.1f} ms per step, {text / sum(times):,.0f} text tokens/s over {len(times)} steps "
              f"(the first {a.warmup} steps, compilation included: {first_steps:.1f} s); loss {float(loss):.4f}",
              flush=True)
        del model, opt, step_model
    print(json.dumps({"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "args": vars(a), "results": results}))


if __name__ == "__main__":
    main()
