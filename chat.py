"""Ask a model something: a base model, a fine-tuned checkpoint, or a LoRA adapter, greedy decoding with
the model's chat template (playbook/generate.py).

    python chat.py --model smollm2-135m "What is the capital of France?"
    python chat.py --model out/smollm2/checkpoint-60 "What is a warp?"          # a full fine-tune's checkpoint
    python chat.py --model out/smollm2-lora/checkpoint-60 --prompt "What is a warp?"   # an adapter: its base is loaded first
    python chat.py --model smollm2-135m --prompts-file examples/prompts.txt

--model takes what the fine-tuning scripts take (a Hugging Face id, a local directory, a .gguf file,
smollm2-135m) and the directories they write (checkpoint-N/, merged/). A LoRA adapter directory
names its base model in adapter_config.json; that base is loaded, then the adapter. The same
question to the same model always gets the same answer (greedy), so two checkpoints can be compared.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse(argv=None):
    intro, _, rest = __doc__.partition("\n\n")  # the first paragraph whole, then the examples and notes
    p = argparse.ArgumentParser(description=intro, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    p.add_argument("question", nargs="*", help="the question (several words are joined)")
    p.add_argument("--model", required=True, help="model id, directory, .gguf file, smollm2-135m, checkpoint or adapter")
    p.add_argument("--prompt", action="append", default=[], help="a question (may be given several times)")
    p.add_argument("--prompts-file", type=Path, default=None, help="questions, one per line (or .jsonl of {\"prompt\"})")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length limit in tokens (default 48)")
    p.add_argument("--json", action="store_true", help="print [{\"prompt\", \"answer\"}] as JSON")
    a = p.parse_args(argv)
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        p.error(f"--max-new-tokens {a.max_new_tokens}: give a positive number")
    if a.prompts_file is not None and not a.prompts_file.is_file():
        p.error(f"--prompts-file {a.prompts_file}: no such file")
    if not (a.question or a.prompt or a.prompts_file):
        p.error("ask something: a question after the options, --prompt, or --prompts-file")
    return a


def load(name: str, device):
    """(model, tokenizer, description) for a model name, a checkpoint, a merged folder or an adapter."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from playbook import pretrained
    from playbook.data import make_tokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = Path(name).expanduser()
    if pretrained.is_pretrained_name(name):
        folder, what = pretrained.local_directory(name), pretrained.describe(name, pretrained.local_directory(name))
    elif folder.is_dir():
        what = str(folder)
    elif name.startswith(("/", "./", "../", "~")):
        raise SystemExit(f"error: --model {name}: no such directory")
    else:
        folder, what = None, name  # a Hugging Face id
    adapter = folder is not None and (folder / "adapter_config.json").is_file()
    try:
        if adapter:
            saved = json.loads((folder / "adapter_config.json").read_text())
            base = saved.get("base_model_name_or_path")
            if not base or not (Path(base).is_dir() or "/" in base):
                raise SystemExit(f"error: --model {name}: the adapter names no loadable base model "
                                 f"(base_model_name_or_path {base!r}; {saved.get('base_model_note', '')})".rstrip("; )") + ")")
            from playbook.lora import load_adapter

            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
            model = load_adapter(model, folder)
            what = f"{folder} (LoRA adapter on {base})"
            tok_source = folder if (folder / "tokenizer_config.json").is_file() else base
        else:
            model = AutoModelForCausalLM.from_pretrained(folder or name, dtype=dtype)
            tok_source = folder or name
    except OSError as err:
        raise SystemExit(f"error: --model {name}: could not be loaded ({str(err).splitlines()[0][:300]})") from None
    try:
        tokenizer = make_tokenizer(str(tok_source), preset=False)
    except RuntimeError as err:
        raise SystemExit(f"error: --model {name}: {err}") from None
    return model.to(device).eval(), tokenizer, what


def main(argv=None) -> int:
    a = parse(argv)
    from playbook import exit_on_ctrl_c_while_importing

    with exit_on_ctrl_c_while_importing("nothing was written"):  # torch's import can swallow a KeyboardInterrupt
        import torch
        import transformers  # noqa: F401  (loaded here, under the guard, for load() below)

    from playbook import generate
    from playbook.common import log

    prompts = ([" ".join(a.question)] if a.question else []) + a.prompt
    if a.prompts_file is not None:
        prompts += generate.read_prompts(a.prompts_file)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    t0 = time.perf_counter()
    model, tokenizer, what = load(a.model, device)
    log(f"Model: {what}, on {device.type.upper()}, loaded in {time.perf_counter() - t0:.1f} s")
    limit = a.max_new_tokens or generate.MAX_NEW_TOKENS
    replies = generate.answers(model, tokenizer, prompts, device, max_new_tokens=limit)
    if a.json:
        print(json.dumps([{"prompt": p, "answer": r} for p, r in zip(prompts, replies)], indent=1))
    else:
        for p, r in zip(prompts, replies):
            print(f"> {p}\n{r}\n")
    return 0


if __name__ == "__main__":
    from playbook import run_main

    sys.exit(run_main(main, "nothing was written"))
