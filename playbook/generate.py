"""What a model answers: greedy decoding with the model's chat template (chat.py, --sample-prompts).

    >>> from playbook import generate
    >>> generate.answers(model, tokenizer, ["What is the capital of France?"], device)
    ['The capital of France is Paris.']

Greedy decoding: each new token is the most likely one, so the same model and prompt always give
the same answer, and a change in the answer comes from the weights. The model's forward is the one
it trains with (the kernels, FP8, LoRA adapters).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from playbook.common import log

MAX_NEW_TOKENS = 48


def read_prompts(path) -> list[str]:
    """Prompts from a text file (one per line; blank lines and lines starting with # skipped) or a .jsonl
    file of {"prompt": ...} objects."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"error: --sample-prompts {path}: cannot read it ({err})") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or (line.startswith("#") and path.suffix != ".jsonl"):
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except ValueError:
                raise SystemExit(f"error: --sample-prompts {path}, line {number}: not JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise SystemExit(f"error: --sample-prompts {path}, line {number}: needs a \"prompt\" string")
            line = row["prompt"]
        prompts.append(line)
    if not prompts:
        raise SystemExit(f"error: --sample-prompts {path}: no prompt in it")
    return prompts


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model was trained to read it: a user turn and the assistant's header when the
    tokenizer has a chat template, else the bare text."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def stop_ids(tokenizer, model) -> set[int]:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, device, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """One prompt's greedy answer. Hugging Face's generate with its KV cache (each new token runs only
    itself through the model); a model whose forward cannot take the cache runs the whole sequence at
    every token instead, which gives the same tokens, more slowly."""
    ids = torch.tensor([prompt_ids(tokenizer, prompt)], dtype=torch.long, device=device)
    stops = stop_ids(tokenizer, model)
    new = None
    if hasattr(model, "generate"):
        try:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, use_cache=True, eos_token_id=sorted(stops) or None,
                                 pad_token_id=getattr(tokenizer, "pad_token_id", None) or (min(stops) if stops else 0),
                                 temperature=None, top_p=None, top_k=None)
            new = out[0, ids.shape[1]:].tolist()
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as err:
            log(f"generate: the cached path failed ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                "decoding without a KV cache")
    if new is None:
        new = _greedy_uncached(model, ids, stops, max_new_tokens)
    new = [t for t in new if t not in stops]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def _greedy_uncached(model, tokens, stops, max_new_tokens):
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    new: list[int] = []
    for _ in range(max_new_tokens):
        if tokens.shape[1] >= limit:
            break
        token = int(model(input_ids=tokens).logits[0, -1].float().argmax())
        if token in stops:
            break
        new.append(token)
        tokens = torch.cat([tokens, tokens.new_tensor([[token]])], dim=1)
    return new


def answers(model, tokenizer, prompts: list[str], device, when: str = "",
            max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Each prompt's greedy answer, the model in eval mode meanwhile (dropout off), then back as it was."""
    if tokenizer is None:
        raise SystemExit("error: --sample-prompts needs the model's tokenizer (a preset has only the byte tokenizer "
                         "of --dataset runs)")
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        out = [greedy(model, tokenizer, p, device, max_new_tokens) for p in prompts]
    finally:
        model.train(was_training)
    log(f"Answered {len(prompts)} prompt(s){' ' + when if when else ''} in {time.perf_counter() - t0:.1f} s "
        f"(greedy, at most {max_new_tokens} new tokens each)")
    return out


def format_samples(samples: list[dict]) -> str:
    lines = ["Sample answers (greedy):"]
    for s in samples:
        lines.append(f"  prompt: {s['prompt']}")
        lines.append(f"    before: {s.get('before', '')}")
        if "after" in s:
            changed = "" if s["after"] != s.get("before") else "  (unchanged)"
            lines.append(f"    after:  {s['after']}{changed}")
    return "\n".join(lines)
