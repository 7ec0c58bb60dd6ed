"""Ask a model something: a base model, a fine-tuned checkpoint, or a LoRA adapter, greedy decoding with
the model's chat template (playbook/model/generate.py).

    python chat.py --model smollm2-135m "What is the capital of France?"
    python chat.py --model out/smollm2/checkpoint-60 "What is a warp?"          # a full fine-tune's checkpoint
    python chat.py --model out/smollm2-lora/checkpoint-60 --prompt "What is a warp?"   # an adapter: its base is loaded first
    python chat.py --model smollm2-135m --prompts-file examples/prompts.txt

--model takes what the fine-tuning scripts take (a Hugging Face id, a local directory, a .gguf file,
smollm2-135m) and the directories they write (checkpoint-N/, merged/, or the --output-dir: its best checkpoint
where the run kept one with --load-best-model-at-end, else its latest; the "Model:" line names it). A LoRA adapter directory
names its base model in adapter_config.json; that base is loaded, then the adapter. The same
question to the same model always gets the same answer (greedy), so two checkpoints can be compared.
--prompts-file reads text (a question a line), JSON Lines ({"prompt": ...} a line) or a JSON array
of strings. Answers go to stdout, everything else to stderr. A question that is empty, not UTF-8, or
longer than the model's context is refused (never cut).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from playbook.runtime.signals import run_main
from playbook.startup import start  # imports no torch

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, exit code 130
    start("nothing was written", kernels=False)  # (no kernel runs here)

import torch  # noqa: E402

from playbook.model import saved_run  # noqa: E402


def refuse(message: str) -> SystemExit:
    """A bad argument: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def _not_utf8(text: str) -> str | None:
    """The first byte of an argument that was not UTF-8 (Python keeps such bytes as lone surrogates)."""
    bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
    return None if bad is None else f"0x{ord(bad) - 0xdc00:02x}"


def parse(argv=None):
    intro, _, rest = __doc__.partition("\n\n")  # the first paragraph whole, then the examples and notes
    p = argparse.ArgumentParser(description=intro, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    p.add_argument("question", nargs="*", help="the question (several words are joined)")
    p.add_argument("--model", required=True, help="model id, directory, .gguf file, smollm2-135m, checkpoint or adapter")
    p.add_argument("--prompt", action="append", default=[], help="a question (may be given several times)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="questions: text, one per line; .jsonl of {\"prompt\": ...}; or a .json array of strings")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length limit in tokens (default 48)")
    p.add_argument("--json", action="store_true", help="print [{\"prompt\", \"answer\"}] as JSON")
    a = p.parse_args(argv)
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        p.error(f"--max-new-tokens {a.max_new_tokens}: give a positive number")
    if a.prompts_file is not None and not a.prompts_file.exists():
        p.error(f"--prompts-file {a.prompts_file}: no such file")
    if not (a.question or a.prompt or a.prompts_file):
        p.error("ask something: a question after the options, --prompt, or --prompts-file")
    if not a.model.strip():
        raise refuse("--model '': no model named (an unset shell variable?); give a checkpoint, a model directory, "
                     "a .gguf file, smollm2-135m or a Hugging Face id")
    for where, text in ([("the question", " ".join(a.question))] if a.question else []) + \
            [(f"--prompt {i + 1}" if len(a.prompt) > 1 else "--prompt", t) for i, t in enumerate(a.prompt)]:
        byte = _not_utf8(text)
        if byte is not None:
            raise refuse(f"{where} is not UTF-8 text (byte {byte}); write it in UTF-8 (a file of questions can be "
                         "converted: iconv -f latin1 -t utf-8 FILE, then --prompts-file)")
        if not text.strip():
            raise refuse(f"{where} is empty; ask something")
    return a


class ChatWords(saved_run.Words):
    """chat.py's wording of what cannot be loaded: one line naming --model (exit code 2, through refuse)."""

    load_errors = (Exception,)  # (a hub id that cannot be reached, a directory transformers refuses)
    base_flag = None  # (the model cache names the adapter's base as it names --model)

    def missing(self, name):
        return saved_run.Refusal(f"--model {name}: no such directory")

    def a_file(self, name):
        return saved_run.Refusal(f"--model {name} is not a directory or a .gguf file: --model takes a checkpoint-N "
                                 "folder, a model directory, a .gguf file, smollm2-135m or a Hugging Face id")

    def preset(self, name):
        return saved_run.Refusal(f"--model {name} is a random-weight preset (for timing and memory runs): it has "
                                 "nothing to say; ask a model with real weights: --model smollm2-135m, a fine-tuned "
                                 "checkpoint-N folder, or a Hugging Face id")

    def no_model(self, name, folder):
        return saved_run.Refusal(f"--model {name}: no model in this directory (neither config.json nor "
                                 "adapter_config.json); give a checkpoint-N folder, a merged/ folder or a Hugging "
                                 "Face model directory")

    def unreadable(self, name, path, err):
        return saved_run.Refusal(f"--model {name}: {path} cannot be read as JSON ({err}); the adapter folder is "
                                 "damaged: give another checkpoint, or restore the file")

    def not_object(self, name, path, saved):
        return self.no_base(name, path)

    def no_adapter_weights(self, name, folder):
        return None  # (the adapter then does not fit its base, below)

    def damaged(self, name, folder, damage):
        return saved_run.Refusal(f"--model {name}: {damage}; the folder is damaged: give another checkpoint")

    def base_not_a_name(self, name, where, base):
        return self.no_base(name, where)

    def no_base(self, name, where):
        return saved_run.Refusal(f"--model {name}: {where} names no base model (base_model_name_or_path); set it to "
                                 "the model the adapter was trained on")

    def preset_base(self, name, base):
        return saved_run.Refusal(f"--model {name}: the adapter was trained on {base}, a random-weight preset: it has "
                                 "nothing to say; chat with an adapter trained on real weights (--model smollm2-135m, "
                                 "a Hugging Face id)")

    def base_missing(self, name, base, where):
        return saved_run.Refusal(f"--model {name}: the adapter's base model {base} (base_model_name_or_path in "
                                 f"{where}) no longer exists; restore it, or point base_model_name_or_path at a copy "
                                 "of it")

    def base_failed(self, name, base, note, err):
        return self.failed(name, err, f"its base model {base} ")

    def failed(self, name, err, what=""):
        said = " ".join(str(err).split())[:300]
        return saved_run.Refusal(f"--model {name}: {what}could not be loaded ({type(err).__name__}: {said})")

    def adapter_mismatch(self, name, base, err, record):
        said = " ".join(str(err).split())[:200]
        return saved_run.Refusal(f"--model {name}: the adapter does not fit its base model {base} (trained on "
                                 f"another model? {type(err).__name__}: {said})")

    def tokenizer(self, name, err):
        return saved_run.Refusal(f"--model {name}: {err}")


def load(name: str, device):
    """(model, tokenizer, description) for a model name, a checkpoint, a merged folder or an adapter. Anything
    that cannot be loaded is one line naming --model and exit code 2."""
    try:
        return saved_run.load(name, words=ChatWords(), hub=True, follow_latest=True, preset_base=False, device=device,
                              dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    except saved_run.Refusal as err:
        raise refuse(str(err)) from None


def _write(text: str) -> int:
    """The answers to stdout, guarded by playbook.runtime.output. The answers are what chat.py is run for: a reader
    that went away (`| head`) ends the run quietly with exit code 141 (128 + SIGPIPE), as Unix tools do; a full
    disk or another write error is one line on stderr and exit code 1."""
    from playbook.runtime import output

    output.guard("the answers", after=None)  # (start() guarded the output; the line names what was lost)
    sys.stdout.write(text)
    sys.stdout.flush()
    return {output.CLOSED: 141, output.FAILED: 1}.get(output.lost(), 0)


def main(argv=None) -> int:
    a = parse(argv)
    from playbook.runtime.signals import exit_on_ctrl_c_while_importing

    with exit_on_ctrl_c_while_importing("nothing was written"):  # torch's import can swallow a KeyboardInterrupt
        import torch
        import transformers  # noqa: F401  (loaded here, under the guard, for load() below)

    from playbook.model import generate

    prompts = ([" ".join(a.question).strip()] if a.question else []) + [p.strip() for p in a.prompt]
    sources = (["the question"] if a.question else []) + \
        [f"--prompt {i + 1}" if len(a.prompt) > 1 else "--prompt" for i in range(len(a.prompt))]
    if a.prompts_file is not None:
        from_file = generate.read_prompts(a.prompts_file, flag="--prompts-file")
        prompts += from_file
        sources += [f"--prompts-file {a.prompts_file}, prompt {i + 1}" for i in range(len(from_file))]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the log to stderr: stdout holds only the answers
            model, tokenizer, what = load(a.model, device)
            print(f"Model: {what}, on {device.type.upper()}, loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            limit = a.max_new_tokens or generate.MAX_NEW_TOKENS
            replies = generate.answers(model, tokenizer, prompts, device, max_new_tokens=limit, sources=sources)
    except SystemExit as err:
        if isinstance(err.code, str):  # the model cache's errors (playbook/model/pretrained.py): a bad --model here
            raise refuse(err.code.removeprefix("error: ")) from None
        raise
    if a.json:
        return _write(json.dumps([{"prompt": p, "answer": r} for p, r in zip(prompts, replies)], indent=1) + "\n")
    return _write("".join(f"> {p}\n{r}\n\n" for p, r in zip(prompts, replies)))


if __name__ == "__main__":
    sys.exit(run_main(main, "nothing was written"))
