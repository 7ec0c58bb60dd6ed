"""One loader of saved runs, for chat.py and export.py: a checkpoint-N/ folder, an --output-dir (its `latest`
checkpoint), a merged/ folder, a LoRA adapter folder with its base model, a Hugging Face directory or id, a
.gguf file, smollm2-135m.

    model, tokenizer, what = saved_run.load("out/smollm2-lora/checkpoint-60", dtype="auto", as_trained=True)

What the two scripts do differently is a parameter: `hub` (names and ids besides folders), `follow_latest`,
`base` (another base for an adapter), `preset_base` (a random-weight preset as an adapter's base), `as_trained`
(cut the base to the layers the run kept, check the base weights' fingerprint, merge the adapter), `dtype`,
`device`, `memory` (a check the caller runs before each model is built) and `words`: every refusal is a
Refusal whose message is one line, worded by `words` (Words: export.py's wording; chat.py words its own).

The scripts import this module (and torch with it) where they load, after their Ctrl-C guard.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM

from core.tensors import fingerprint
from playbook.model import pretrained
from playbook.model.lora import load_adapter
from playbook.model.models import build_preset, looks_like_path
from playbook.model.presets import PRESETS
from playbook.model.tokenizer import make_tokenizer
from playbook.store.checkpoint import BEST_FILE, FINAL_STEP_FILE, LATEST_FILE, STATE_FILE


class Refusal(Exception):
    """A saved run that cannot be loaded: the message is the one line the user sees."""


class Words:
    """How each refusal is worded (export.py's wording); a script that words them otherwise overrides the methods
    (chat.py). Each returns the Refusal to raise, or None where that script lets the load go on."""

    load_errors: tuple = (OSError, ValueError, RuntimeError, SafetensorError)  # what a failed from_pretrained raises
    base_flag = "--base"  # the option a converted base model is named by in the model cache's errors

    def missing(self, name):
        return Refusal(f"{name}: no such folder; give a checkpoint-N/ folder, a merged/ folder or a LoRA adapter "
                       "folder")

    def a_file(self, name):
        return Refusal(f"{name} is a file, not a run; give the folder a fine-tuning script wrote (checkpoint-N/, "
                       "merged/)")

    def preset(self, name):
        return None

    def no_model(self, name, folder):
        return Refusal(f"{name} is not a run: it has no config.json (a checkpoint or merged model) nor "
                       "adapter_config.json (a LoRA adapter)")

    def unreadable(self, name, path, err):
        if isinstance(err, OSError):
            return Refusal(f"{path} cannot be read ({err.strerror or err}); make it readable, or export another "
                           "checkpoint")
        return Refusal(f"{path} is not JSON ({str(err).splitlines()[0][:120]}): the file is damaged; restore it, "
                       "or export another checkpoint")  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)

    def not_object(self, name, path, saved):
        return Refusal(f"{path} holds {json.dumps(saved)[:40]}, not the object of settings it should: the file is "
                       "damaged; restore it, or export another checkpoint")

    def no_adapter_weights(self, name, folder):
        return Refusal(f"{folder} is a LoRA adapter without its weights (adapter_model.safetensors); export the "
                       "checkpoint folder the run wrote")

    def damaged(self, name, folder, damage):
        return Refusal(f"{folder}/{damage}: the weights cannot be read; restore the file, or export another "
                       "checkpoint")

    def base_not_a_name(self, name, where, base):
        return Refusal(f"{where}: base_model_name_or_path is {json.dumps(base)[:40]}, not a model's name; pass the "
                       "base model with --base")

    def no_base(self, name, where):
        return Refusal(f"{name} is a LoRA adapter whose adapter_config.json names no base model; pass it with --base")

    def preset_base(self, name, base):
        return None

    def base_missing(self, name, base, where):
        return Refusal(f"{name} is a LoRA adapter and its base {base} is not there (nor a model folder); pass the "
                       "base model with --base")

    def base_failed(self, name, base, note, err):
        why = f" ({note})" if note else f" ({str(err).splitlines()[0][:160]})"
        return Refusal(f"{name} is a LoRA adapter and its base model {base} could not be loaded{why}; pass the base "
                       "model with --base")

    def failed(self, name, err):
        return Refusal(f"{name}: transformers could not load it ({str(err).splitlines()[0][:200]})")

    def adapter_mismatch(self, name, base, err, record):
        trained = f" (the run's --model was {record['model']})" if record and record.get("model") else ""
        return Refusal(f"{name}: the adapter does not fit the base {base}: {mismatch(err)}{trained}; pass the base "
                       "it was trained on with --base")

    def tokenizer(self, name, err):
        return Refusal(f"{name}: {err}")


WORDS = Words()


def best_checkpoint(folder: Path):
    """(the checkpoint, what it is) where the run in `folder` (an --output-dir) kept a best checkpoint and ended
    with its weights (--load-best-model-at-end: the `best` file, checkpoint.mark_best), saying which step it is
    and which is the last; None where it kept none. A `best` that names no checkpoint folder is said, and the
    last checkpoint taken."""
    pointer = folder / BEST_FILE
    if not pointer.is_file():
        return None
    named = pointer.read_text(errors="replace").strip()
    latest = (folder / LATEST_FILE).read_text(errors="replace").strip() if (folder / LATEST_FILE).is_file() else ""
    if not named or not (folder / named).is_dir():
        print(f"note: {pointer} names {named[:60]!r}, which is not a checkpoint folder in {folder} (deleted?): "
              "taking the last checkpoint instead", flush=True)
        return None
    step = named.removeprefix("checkpoint-")
    last = f"; the last, {latest}, holds the weights of the last step" if latest and latest != named else ""
    what = f"{folder / named} (the run's best checkpoint, step {step}, kept by --load-best-model-at-end{last})"
    return folder / named, what


def final_step(folder: Path) -> str:
    """' (the run's final weights, step N)' for the final/ folder a Trainer run's `latest` names
    (finetune_trainer.py: FINAL_STEP_FILE holds the step); '' for a checkpoint-N folder, whose name says it."""
    try:
        step = json.loads((folder / FINAL_STEP_FILE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return ""
    return f" (the run's final weights, step {step})" if isinstance(step, int) else ""


def find(name: str, words: Words = WORDS, hub: bool = False, follow_latest: bool = False):
    """(the folder holding the model, None for a Hugging Face id; what it is). `hub`: smollm2-135m, a .gguf file
    and Hugging Face ids are taken besides folders; `follow_latest`: an --output-dir stands for the checkpoint
    its `latest` file names."""
    folder = Path(name).expanduser()
    if hub and (name in PRESETS or name.lower() in PRESETS) and words.preset(name):
        raise words.preset(name)
    if hub and pretrained.is_pretrained_name(name):
        folder = pretrained.local_directory(name)
        return folder, pretrained.describe(name, folder)
    if not folder.exists():
        if hub and not looks_like_path(name):
            return None, name  # a Hugging Face id
        raise words.missing(name)
    if not folder.is_dir():
        raise words.a_file(name)
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        latest = folder / LATEST_FILE
        best = best_checkpoint(folder) if follow_latest else None
        if best is not None:
            return best
        if follow_latest and latest.is_file():
            named = latest.read_text(errors="replace").strip()
            if named and (folder / named).is_dir():
                return folder / named, str(folder / named) + final_step(folder / named)
            raise Refusal(f"{latest} names {named[:60]!r}, which is not a checkpoint folder in {name}; export one of "
                          "its checkpoint-N folders")
        raise words.no_model(name, folder)
    return folder, str(folder)


def read_json(path: Path, name: str = "", words: Words = WORDS) -> dict:
    """A config file of a run (config.json, adapter_config.json) as a dict, or one line saying what is wrong."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise words.unreadable(name, path, err) from None
    if not isinstance(saved, dict):
        raise words.not_object(name, path, saved)
    return saved


def check_weights(folder: Path, adapter: bool, name: str = "", words: Words = WORDS) -> None:
    """Refuse weight files that cannot be read (empty, truncated, not safetensors), before anything is loaded."""
    index = folder / "model.safetensors.index.json"
    if adapter:
        files = [folder / "adapter_model.safetensors"]
        if not files[0].is_file():
            refusal = words.no_adapter_weights(name, folder)
            if refusal:
                raise refusal
            return
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        weight_map = read_json(index, name, words).get("weight_map")
        if not isinstance(weight_map, dict):
            raise Refusal(f"{index} lists no weight_map: the file is damaged; restore it, or export another checkpoint")
        files = [folder / str(f) for f in sorted(set(map(str, weight_map.values())))]
    else:
        return  # (weights in another format, or none: transformers says what it finds)
    for f in files:
        damage = pretrained.safetensors_damage(f) if f.is_file() else f"{f.name} is missing"
        if damage:
            raise words.damaged(name, folder, damage)


def recorded(folder: Path) -> dict | None:
    """What a checkpoint of the fine-tuning scripts records of the run that trained the adapter, from its
    trainer_state.pt (playbook/store/checkpoint.py): {"model": its --model, "num_layers": its --num-layers (None: all),
    "load_in_4bit", "fingerprint": name -> (sum, norm) of each frozen base weight}; None for an adapter saved
    without one (playbook.model.lora.save_adapter, the Trainer's checkpoints)."""
    file = folder / STATE_FILE
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        extra = state.get("extra") or {}
        settings = extra.get("settings") or extra.get("config") or {}
        record = {"model": settings.get("model"), "num_layers": settings.get("num_layers"),
                  "load_in_4bit": bool(settings.get("load_in_4bit")), "fingerprint": state.get("base_fingerprint"),
                  "device": str((extra.get("config") or {}).get("device") or "")}
        layers = record["num_layers"]
        if layers is not None and (type(layers) is not int or layers < 1):
            raise ValueError(f"num_layers {layers!r}")
        if not isinstance(record["fingerprint"], (dict, type(None))):
            raise ValueError(f"base_fingerprint of type {type(record['fingerprint']).__name__}")
    except Exception as err:  # noqa: BLE001  (a truncated zip, another format, a disallowed type, odd values)
        raise Refusal(f"{file} cannot be read ({str(err).splitlines()[0][:160]}); it records the layers and the "
                      "base model the adapter was trained on: restore it, or export another checkpoint") from None
    return record


def adapter_layers(folder: Path, saved: dict) -> int | None:
    """For an adapter without a trainer_state.pt: the number of decoder layers it was trained on, k when its
    weights are those of layers 0 to k-1 (a run with --num-layers k; the project's adapters cover every layer
    of the model they were trained on), or None when they do not say."""
    if saved.get("layers_to_transform") is not None:
        return None  # an adapter on chosen layers: its layers say nothing of the model's
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        found = {int(m.group(1)) for k in f.keys() for m in [re.search(r"\.layers\.(\d+)\.", k)] if m}
    return max(found) + 1 if found and found == set(range(max(found) + 1)) else None



#####


def mismatch(err: Exception) -> str:
    """peft's (torch's) error on an adapter that does not fit its base, in a few words."""
    found = re.search(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^]]*\])\) from "
                      r"checkpoint, the shape in current model is torch\.Size\((\[[^]]*\])\)", str(err))
    if found:
        name = found.group(1).removeprefix("base_model.model.").replace(".default", "")
        return f"{name} is {found.group(2)} in the adapter and {found.group(3)} in the base"
    return " ".join(str(err).split())[:200]


def same_base(run: str, model, base: str, record: dict) -> str:
    """Refuse a base other than the weights the adapter was trained on, by the fingerprint its checkpoint
    records (float64 sum and norm of each frozen weight, playbook/store/checkpoint.py). A run that held a float32
    or float16 base in bf16 (a bf16 run on a preset or a converted GGUF) recorded their bf16 rounding: then
    the base is rounded so before the merge, and the note returned says so ("" when the weights are the same)."""
    saved = record["fingerprint"]
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    if record["load_in_4bit"]:  # the run's projections were NF4 codes: only the weights kept as they are compare
        saved = {n: v for n, v in saved.items() if not n.endswith("base_layer.weight")}
        frozen = {n: p for n, p in frozen.items() if not n.endswith("base_layer.weight")}
    trained = f"; the run's --model was {record['model']}" if record.get("model") else ""
    if saved.keys() != frozen.keys():
        differ = sorted(saved.keys() ^ frozen.keys())
        where = "the checkpoint's record" if differ[0] in saved else "the base"
        raise Refusal(f"{run}: the base {base} does not have the weights the adapter was trained on "
                      f"({differ[0].removeprefix('base_model.model.')} is in {where} only{trained}); pass the base it "
                      "was trained on with --base")

    def close(a, b) -> bool:  # the same weights give the same float64 sums up to the order of summation (~1e-12
        return all(abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))  # relative, checkpoint.py)

    exact = {n: close(fingerprint(p), saved[n]) for n, p in frozen.items()}
    if all(exact.values()):
        return ""
    as_bf16 = {n: exact[n] if p.dtype == torch.bfloat16 else close(fingerprint(p.detach().to(torch.bfloat16)), saved[n])
               for n, p in frozen.items()}
    if all(as_bf16.values()):
        with torch.no_grad():
            for p in frozen.values():
                p.copy_(p.to(torch.bfloat16))
        return "its weights rounded to bf16"
    name = next((n for n in frozen if not exact[n] and not as_bf16[n]), next(n for n in frozen if not as_bf16[n]))
    raise Refusal(f"{run}: the base {base} does not have the weights the adapter was trained on "
                  f"({name.removeprefix('base_model.model.')} differs from the checkpoint's record{trained}); pass the "
                  "base it was trained on with --base")


def load(name: str, *, words: Words = WORDS, hub: bool = False, follow_latest: bool = False, base: str | None = None,
         preset_base: bool = True, as_trained: bool = False, dtype="auto", device=None, memory=None):
    """(model, tokenizer, what it is) of a saved run. An adapter's base is the one its adapter_config.json names
    (or `base`); `as_trained`: built as the run that trained it held it (its layers, the base weights its checkpoint
    records) and the adapter merged in. `memory(what, kind, source, layers, config)`: the caller's check before a
    model is built (kind: "run", "preset", "pretrained", "folder", "hub"; config: its config.json when read)."""
    folder, what = find(name, words, hub, follow_latest)
    # what find says of the checkpoint it chose for a run folder ("(the run's best checkpoint, step 5, ...)"), kept
    # whatever the weights turn out to be
    chosen = what[len(str(folder)):] if folder is not None and what != str(folder) and what.startswith(str(folder)) \
        else ""
    if folder is not None and (folder / "adapter_config.json").is_file():
        where = folder / "adapter_config.json"
        saved = read_json(where, name, words)
        check_weights(folder, True, name, words)
        record = recorded(folder) if as_trained else None
        note = None if base else saved.get("base_model_note")  # (what the adapter says of the base it names)
        base = base or saved.get("base_model_name_or_path")
        if base is not None and not isinstance(base, str):
            raise words.base_not_a_name(name, where, base)
        if not base:
            raise words.no_base(name, where)
        layers = (record["num_layers"] if record is not None else adapter_layers(folder, saved)) if as_trained else None
        model, cut = load_base(name, base, note, layers, words, preset_base, as_trained, dtype, memory, where,
                               record["device"] if record else "")
        model, rounded = fit_adapter(name, folder, model, base, record, words, as_trained)
        if as_trained:
            held = " and ".join(n for n in (cut, rounded) if n)
            what = f"{folder} (LoRA adapter merged into {base}" + (f": {held}, as the run held it)" if held else ")")
        else:
            what = f"{folder} (LoRA adapter on {base})"
        tok_source = folder if (folder / "tokenizer_config.json").is_file() else base
    else:
        if folder is not None:
            config = read_json(folder / "config.json", name, words) if memory else None
            check_weights(folder, False, name, words)
            if memory:
                memory(str(name), "run", folder, None, config)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder or name, dtype=dtype)
        except words.load_errors as err:
            raise words.failed(name, err) from None
        tok_source = folder or name
    try:
        tokenizer = make_tokenizer(str(tok_source), preset=False)
    except RuntimeError as err:
        raise words.tokenizer(name, err) from None
    if chosen and chosen not in what:
        what += chosen
    return (model if device is None else model.to(device)).eval(), tokenizer, what


def load_base(run: str, base: str, note: str | None, layers: int | None, words: Words = WORDS,
              preset_base: bool = True, as_trained: bool = False, dtype="auto", memory=None, where=None,
              trained_on: str = ""):
    """(the base model an adapter was trained on, how its layers were cut): a preset of this project,
    smollm2-135m or a .gguf, a local folder, or a Hugging Face id; `layers`: the decoder layers the run kept
    (its --num-layers), None for all; `trained_on`: the run's device ("cuda:0", "cpu"), where a preset's random
    weights were drawn (a GPU's generator draws other numbers than the CPU's from the same seed). `memory` checks
    the memory it needs first, from its config."""
    said = f"the base {base}"
    check = memory or (lambda *_: None)
    if preset_base and base not in PRESETS and base.lower() in PRESETS:
        raise Refusal(f"--base {base}: the preset is spelled --base {base.lower()}")
    if base in PRESETS:
        if not preset_base:
            raise words.preset_base(run, base)
        full = PRESETS[base]["num_hidden_layers"]
        if layers and layers > full:
            raise Refusal(f"{run}: the adapter was trained on {layers} decoder layers and {said} has {full}; pass the "
                          "base it was trained on with --base")
        check(f"{run}: {said}", "preset", base, layers, None)
        # built with the run's layer count: the preset's weights are drawn in order, and with fewer layers the
        # output layer's are other ones than in the full model
        # drawn as the scripts draw it for a run, in bf16 on the run's kind of device (a GPU's generator and a
        # float32 draw rounded to bf16 give other weights under some torch versions), then held in float32
        drawn = "cuda" if trained_on.startswith("cuda") and torch.cuda.is_available() else "cpu"
        model = build_preset(base, layers, torch.device(drawn), torch.bfloat16).float().to("cpu")
        return model, (f"its first {layers} of {full} layers" if layers and layers < full else "")
    local = Path(base).expanduser()
    if pretrained.is_pretrained_name(base):
        if as_trained and pretrained.is_gguf(base) and local.is_file():
            with open(local, "rb") as f:
                if f.read(4) != b"GGUF":  # (before the model cache sets out to convert it)
                    raise Refusal(f"--base {base} is not a GGUF file (it does not start with GGUF's magic bytes); pass "
                                  "the base model the adapter was trained on")
        check(f"{run}: {said}", "pretrained", base, layers, None)  # (converted in bf16)
        try:
            source = pretrained.local_directory(base, words.base_flag) if words.base_flag else \
                pretrained.local_directory(base)
        except SystemExit as err:  # (its one line, "error: --base ...", with a refusal's exit code)
            raise Refusal(str(err).removeprefix("error: ")) from None
    elif as_trained and local.is_dir():
        if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
            raise Refusal(f"{run}: the base {base} is a LoRA adapter itself; pass the model it was trained on with "
                          "--base")
        config = read_json(local / "config.json", run, words) if (local / "config.json").is_file() else None
        if config is not None:
            check_weights(local, False, run, words)
            check(f"{run}: {said}", "folder", local, layers, config)
        source = local
    elif (looks_like_path(base) or (local.exists() if as_trained else Path(base).is_absolute())) \
            and not local.is_dir():
        raise words.base_missing(run, base, where)
    else:  # a local folder, or a Hugging Face id
        if not local.is_dir():
            check(f"{run}: {said}", "hub", base, layers, None)
        source = base
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except words.load_errors as err:
        raise words.base_failed(run, base, note, err) from None
    if not as_trained:
        return model, ""
    full = model.config.num_hidden_layers
    if layers and layers > full:
        raise Refusal(f"{run}: the adapter was trained on {layers} decoder layers and {said} has {full}; pass the "
                      "base it was trained on with --base")
    if layers and layers < full:  # as playbook.model.models.load_model keeps the first --num-layers
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
        return model, f"its first {layers} of {full} layers"
    return model, ""


def fit_adapter(run: str, folder: Path, model, base: str, record: dict | None, words: Words = WORDS,
                merge: bool = False):
    """(the base with the adapter of `folder` on it, a note on its weights). `merge`: the base is first checked
    against the fingerprint the checkpoint recorded of the weights it was trained on, and the adapter merged in."""
    with warnings.catch_warnings():  # (peft on the project's own key in adapter_config.json, and on transformers)
        warnings.filterwarnings("ignore", message=r"Unexpected keyword arguments \['base_model_note'\]")
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            # trainable (merge): the adapter's weights require grad and the base's do not, as in the run that saved
            # the fingerprint (which counts the frozen weights only)
            model = load_adapter(model, folder, trainable=True) if merge else load_adapter(model, folder)
        except (RuntimeError, ValueError, KeyError) as err:
            raise words.adapter_mismatch(run, base, err, record) from None
    if not merge:
        return model, ""
    rounded = same_base(run, model, base, record) if record and record["fingerprint"] else ""
    with torch.no_grad():
        return model.merge_and_unload(), rounded
