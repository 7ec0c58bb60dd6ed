"""What a model answers: greedy decoding with the model's chat template (chat.py, --sample-prompts).

    >>> from playbook.model import generate
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

from core.process import log
from playbook.runtime.common import usage_error

MAX_NEW_TOKENS = 48
PROGRESS_EVERY_S = 5  # with several prompts: a line with the count and the time left, this often


def prompts_format(path: Path, text: str) -> str:
    """How a prompts file is read: "text" (a prompt a line), "jsonl" (a {"prompt": ...} object a line) or
    "json" (an array of strings). The suffix decides, in any case (.txt, .jsonl / .ndjson, .json); without
    one of those, the content: a whole file that parses as a JSON array is one, a first line that parses as
    a JSON object starts JSON Lines, anything else is text."""
    suffix = path.suffix.lower()
    if suffix in (".txt", ".jsonl", ".ndjson", ".json"):
        return {".txt": "text", ".json": "json"}.get(suffix, "jsonl")
    body = text.lstrip()
    if body.startswith("["):
        try:
            if isinstance(json.loads(body), list):
                return "json"
        except ValueError:
            pass
    if body.startswith("{"):
        try:
            if isinstance(json.loads(body.splitlines()[0]), dict):
                return "jsonl"
        except ValueError:
            pass
    return "text"


def read_prompts(path, flag: str = "--sample-prompts") -> list[str]:
    """Prompts from a file, read by what it is (`prompts_format`): text, one prompt a line (blank lines and
    lines starting with # skipped); JSON Lines of {"prompt": ...}; or a JSON array of strings. Text that is
    not UTF-8, an empty prompt or a file without one is refused in one line naming `flag`, the option that
    named the file."""
    path = Path(path)
    where = f"{flag} {path}"
    if path.is_dir():
        raise usage_error(f"{where} is a directory: give a file of prompts")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise usage_error(f"{where}: cannot read it ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise usage_error(f"{where}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x}); convert the file, "
                     f"e.g. iconv -f latin1 -t utf-8 {path}") from None
    kind = prompts_format(path, text)
    prompts = []
    if kind == "json":
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise usage_error(f"{where}: not JSON ({err}); a .json prompts file is an array of strings "
                         "([\"First?\", \"Second?\"]); .jsonl holds a {\"prompt\": ...} object a line") from None
        if not isinstance(rows, list):
            raise usage_error(f"{where}: a JSON {type(rows).__name__}, not an array; a .json prompts file is an array "
                         "of strings ([\"First?\", \"Second?\"])")
        for number, row in enumerate(rows, 1):
            prompt = row.get("prompt") if isinstance(row, dict) else row
            if not isinstance(prompt, str):
                raise usage_error(f"{where}, item {number}: {json.dumps(row)[:60]} is not a string (nor a "
                             "{\"prompt\": ...} object)")
            if not prompt.strip():
                raise usage_error(f"{where}, item {number}: an empty prompt")
            prompts.append(prompt.strip())
    else:
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or (line.startswith("#") and kind == "text"):
                continue
            if kind == "jsonl":
                try:
                    row = json.loads(line)
                except ValueError:
                    raise usage_error(f"{where}, line {number}: not JSON (a JSON Lines file holds one "
                                 "{\"prompt\": ...} object a line)") from None
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise usage_error(f"{where}, line {number}: needs a \"prompt\" string")
                if not row["prompt"].strip():
                    raise usage_error(f"{where}, line {number}: an empty prompt")
                line = row["prompt"].strip()
            prompts.append(line)
    if not prompts:
        raise usage_error(f"{where}: no prompt in it")
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


def context_length(model) -> int | None:
    """The most positions the model reads (prompt and answer together), from its config; None: unknown."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


@torch.no_grad()
def greedy(model, tokenizer, prompt: str | list, device, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """One prompt's greedy answer (`prompt`: the text, or its `prompt_ids`). Hugging Face's generate with
    its KV cache (each new token runs only itself through the model); a model whose forward cannot take
    the cache runs the whole sequence at every token instead, which gives the same tokens, more slowly.
    The answer stops at the model's context length."""
    ids = prompt_ids(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    limit = context_length(model)
    if limit is not None:
        max_new_tokens = min(max_new_tokens, limit - len(ids))
    if max_new_tokens < 1:
        return ""
    ids = torch.tensor([ids], dtype=torch.long, device=device)
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
    limit = context_length(model) or 1 << 30
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


def checked_prompt_ids(model, tokenizer, prompts: list[str], sources: list[str] | None = None) -> list[list[int]]:
    """Each prompt's `prompt_ids`, after refusing (one line, exit code 2) an empty prompt and one that
    leaves no room for an answer in the model's context: a prompt is never cut, and the model never
    runs past its positions. `sources`: where each prompt came from, as the errors name it."""
    sources = sources or [f"--sample-prompts, prompt {i + 1}" for i in range(len(prompts))]
    limit = context_length(model)
    out = []
    for prompt, where in zip(prompts, sources):
        if not prompt.strip():
            raise usage_error(f"{where}: an empty prompt; ask something")
        ids = prompt_ids(tokenizer, prompt)
        if limit is not None and len(ids) >= limit:
            raise usage_error(f"{where}: the prompt is {len(ids):,} tokens (with the chat template) and the model reads "
                         f"at most {limit:,} positions, prompt and answer together; shorten it to at most "
                         f"{limit - 1:,} tokens (it is not cut)")
        out.append(ids)
    return out


def answers(model, tokenizer, prompts: list[str], device, when: str = "",
            max_new_tokens: int = MAX_NEW_TOKENS, sources: list[str] | None = None) -> list[str]:
    """Each prompt's greedy answer, the model in eval mode meanwhile (dropout off), then back as it was.
    Every prompt is checked before the first is answered (`checked_prompt_ids`); with several, a line
    every few seconds gives the count and the time left."""
    if tokenizer is None:
        raise SystemExit("error: --sample-prompts needs the model's tokenizer (a preset has only the byte tokenizer "
                         "of --dataset runs)")
    all_ids = checked_prompt_ids(model, tokenizer, prompts, sources)
    was_training = model.training
    model.eval()
    t0 = last = time.perf_counter()
    out = []
    try:
        for done, ids in enumerate(all_ids, 1):
            out.append(greedy(model, tokenizer, ids, device, max_new_tokens))
            now = time.perf_counter()
            if done < len(all_ids) and (done == 1 or now - last >= PROGRESS_EVERY_S):
                left = (now - t0) / done * (len(all_ids) - done)
                log(f"  answered {done} of {len(all_ids)} prompts, about {left:.0f} s left")
                last = now
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
