"""Distil a LLaMA teacher into a smaller LLaMA student, with the full logits (PyTorch) or without (fused).

    $ python distill.py                      # no GPU: llama-tiny (2 layers) -> a 1-layer, half-width student
    $ python distill.py --steps 12 --batch-size 4 --seq-len 2048    # GPU: LLaMA 3.1 8B -> LLaMA 3.2 1B shapes
    $ python distill.py --mode fused --teacher meta-llama/Llama-3.1-8B --student meta-llama/Llama-3.2-1B \
          --data notes.txt --steps 200 --lr 5e-5
    $ python distill.py --beta 0 --temperature 2 --alpha 0.1     # forward KL at temperature 2

One step: the teacher's forward pass under torch.no_grad() (it is frozen), the student's forward and
backward, one AdamW step on the student. The loss, both terms averaged over the same target tokens
(every token whose next token is a label):

    alpha * cross_entropy(student logits, next tokens)
      + (1 - alpha) * jsd_beta(log_softmax(student logits / T), log_softmax(teacher logits / T))

`distillation_kernel.py` explains the generalised JSD (beta = 0: forward KL(teacher || student);
beta = 1: reverse KL; 0.5: the symmetric JSD). Two modes compute the same loss:

    baseline  Hugging Face + PyTorch: both lm_heads' full [tokens, vocab] logits, upcast to fp32,
              F.cross_entropy and the plain JSD of distillation_kernel.jsd_ref
    fused     linear_cross_entropy and linear_jsd on the final hidden states: neither model's logits
              ever exist beyond one chunk of tokens

`--mode both` (the default) runs the baseline and then the fused mode from the same seed on the same
batches and compares them: tokens/s and peak GPU memory on a GPU; on a CPU, where the kernels run in
Triton's interpreter and the timings mean nothing, the losses (the two modes' first-step losses must
agree to rounding). Everything else (models, data, optimizer) is identical, so the difference is the
loss. The summary goes to results/<tag>.json.

The command line is the fine-tuning scripts' (playbook.config) plus a distillation section (--mode,
--teacher, --student, --alpha, --beta, --temperature, ...): --batch-size, --seq-len, --steps, --lr,
--optimizer, --seed, --tag and the rest mean what they mean there, and both models are prepared by
models.prepare_model, as every script's model is: --kernels on both, --fp8, --gradient-checkpointing
and --lora-r on the student (the teacher is frozen). Shared options with no meaning here
(--dataset, --grad-accum, --output-dir, ...) are refused, not ignored.

What each mode holds and computes, at the GPU default (8B teacher, 1.24B student, 4 x 2048 tokens):
the baseline's loss keeps 56 bytes per token and vocabulary entry alive at its peak (both models'
fp32 logits, the log-softmaxes, the JSD's intermediates saved for backward; counted op by op on a
CPU): 59 GB at 8192 x 128256. The fused mode holds two [chunk, V] buffers per loss, and pays for it
in matmuls: each fused loss multiplies the student's head itself (once for the cross-entropy, once for
the JSD), 12 N H_s V flops where the baseline spends 6. Per token that is 6 x 263 M more, 7% on top
of the teacher's forward pass (2 x 7.5 G) and the student's training step (6 x 1.24 G).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

from playbook.runtime import signals
from playbook.startup import start  # imports no torch: start() sets the handler below before torch loads

if __name__ == "__main__":  # Ctrl-C while torch and the kernels load (seconds): one line, exit code 130
    start("nothing was run")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from core.process import log  # noqa: E402
from playbook.runtime.common import describe_gpu, is_out_of_memory, synchronize, versions  # noqa: E402
from playbook.store.files import result_path, write_atomic  # noqa: E402
from cross_entropy_kernel import causal_targets  # noqa: E402
from distillation_kernel import jsd_ref, linear_jsd  # noqa: E402
from linear_cross_entropy_kernel import linear_cross_entropy  # noqa: E402
from playbook import config  # noqa: E402
from playbook.run.start import settle  # noqa: E402
from playbook.run.resume import check_output_folders  # noqa: E402
from playbook.model.models import count_params, load_model, prepare_model  # noqa: E402
from playbook.memory import options  # noqa: E402
from playbook.model.presets import PRESETS  # noqa: E402
from playbook.runtime.time_left import running  # noqa: E402
from playbook.config import positive_float, positive_int  # noqa: E402
from playbook.runtime.common import usage_error  # noqa: E402
from playbook.sections import RunConfig

MODES = ("baseline", "fused")

# Students built from a config with random weights, as presets.PRESETS builds the teachers.
STUDENTS = {
    # meta-llama/Llama-3.2-1B's architecture (the LLaMA 3 vocabulary, so the 8B can teach it)
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, attention_bias=False,
        mlp_bias=False, bos_token_id=128000, eos_token_id=128001, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    # llama-tiny's vocabulary, half its width, one layer: a student with another hidden size
    "llama-tiny-student": dict(PRESETS["llama-tiny"], hidden_size=32, intermediate_size=88, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ------------------------------------------------------------------------------------------------
# Command line: the shared options (playbook.config) and a distillation section
# ------------------------------------------------------------------------------------------------
def _unit(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in [0, 1]")
    return v


# Shared options this script has no use for: refused when given, rather than silently ignored.
UNUSED = {
    "model": "name the models with --teacher and --student", "num_layers": "use --teacher-layers / --student-layers",
    "compile": "the loss calls the student's decoder and head apart, which a compiled forward would skip",
    "dataset": "distillation reads --data (raw text) or synthetic tokens", "packing": None, "train_on_prompt": None,
    "drop_long": None, "eval_dataset": None,
    "eval_fraction": None, "eval_every": None, "epochs": None, "grad_accum": None, "lr_schedule": None,
    "lr_warmup_steps": None, "warmup_ratio": None, "optimizer_in_backward": None, "max_grad_norm": None,
    "output_dir": None, "save_every": None, "save_total_limit": None, "overwrite_output_dir": None, "resume": None, "merge_lora": None, "log_every": "every step is logged",
    "report_to": None, "sample_prompts": "the student and teacher are compared on losses, not answers",
    "load_best_model_at_end": "it keeps no checkpoints", "early_stopping_patience": "it holds out no eval rows",
    "early_stopping_threshold": None,
}


@dataclass(frozen=True, kw_only=True)
class DistillConfig(config.ExtraSection):
    """distill.py's own section of the RunConfig (`cfg.extra`): the two models and the loss."""

    refused_options = frozenset(UNUSED)  # the shared options refused above (the memory plan offers none of them)
    unused = UNUSED  # (config.unused_options: the flags the table of refusals expects refused)

    mode: str  # "baseline", "fused" or "both"
    teacher: str
    student: str
    teacher_layers: int | None
    student_layers: int | None
    dtype: str  # both models' dtype, a key of DTYPES
    alpha: float
    beta: float
    temperature: float

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        gpu = torch.cuda.is_available()
        # this script's own defaults for shared options: short CPU runs, a student's learning rate
        _default(parser, "steps", 12 if gpu else 3, "optimizer steps per mode")
        _default(parser, "warmup_steps", None,
                 "first steps left out of the timing (Triton compiles); default 2 on a GPU, 1 on a CPU")
        _default(parser, "lr", 1e-4, "AdamW learning rate of the student")
        _default(parser, "seed", 0, "the student's initial weights and the data")
        g = parser.add_argument_group("distillation")
        g.add_argument("--mode", choices=(*MODES, "both"), default="both", help="which loss computation to run")
        g.add_argument("--teacher", default=None, help="a preset (llama-3.1-8b, llama-tiny), Hugging Face id or local "
                                                      "directory; default llama-3.1-8b on a GPU, llama-tiny on a CPU")
        g.add_argument("--student", default=None, help=f"a student preset ({', '.join(STUDENTS)}), Hugging Face id or "
                                                      "local directory; default llama-3.2-1b on a GPU, "
                                                      "llama-tiny-student on a CPU")
        g.add_argument("--teacher-layers", type=positive_int, default=None, help="keep the teacher's first N layers")
        g.add_argument("--student-layers", type=positive_int, default=None, help="keep the student's first N layers")
        g.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                       help="both models' dtype (float32: exact comparisons of the two modes on a CPU)")
        g.add_argument("--alpha", type=_unit, default=0.5, help="weight of the cross-entropy; 1 - alpha weighs the JSD")
        g.add_argument("--beta", type=_unit, default=0.5, help="JSD beta: 0 forward KL, 1 reverse KL, 0.5 symmetric")
        g.add_argument("--temperature", type=positive_float, default=1.0,
                       help="divides both models' logits for the JSD")

    @classmethod
    def from_args(cls, a: argparse.Namespace, parser: argparse.ArgumentParser) -> "DistillConfig":
        config.refuse_unused(a, parser, "distill.py", UNUSED)
        if a.dtype == "float32" and (a.optimizer_rounding not in (None, "nearest") or a.master_weights != "none"):
            raise usage_error("--optimizer-rounding and --master-weights keep the updates that rounding to bf16 "
                              "loses; the student's weights are float32 (--dtype float32), which lose none")
        gpu = torch.cuda.is_available()
        teacher = a.teacher or ("llama-3.1-8b" if gpu else "llama-tiny")
        student = a.student or ("llama-3.2-1b" if gpu else "llama-tiny-student")
        for flag, name, layers in (("--teacher-layers", teacher, a.teacher_layers),
                                   ("--student-layers", student, a.student_layers)):
            has = (STUDENTS.get(name) or PRESETS.get(name) or {}).get("num_hidden_layers")  # a preset's; else on load
            if layers and has and layers > has:
                raise usage_error(f"{flag} {layers}: {name} has only {has} layer{'s' if has > 1 else ''}")
        return cls(mode=a.mode, teacher=teacher, student=student,
                   teacher_layers=a.teacher_layers, student_layers=a.student_layers, dtype=a.dtype,
                   alpha=a.alpha, beta=a.beta, temperature=a.temperature)

    def plan_models(self) -> list:
        """The models the memory plan counts (playbook/plan/runs.py): (name, layers, trains, config or None,
        loss) of the frozen teacher and the student; the loss of the mode that needs more ("full" logits in
        the baseline, "fused" chunks)."""
        loss = "distill-full" if self.mode in ("baseline", "both") else "distill-fused"
        return [(self.teacher, self.teacher_layers, False, STUDENTS.get(self.teacher), None),
                (self.student, self.student_layers, True, STUDENTS.get(self.student), loss)]


def _default(parser: argparse.ArgumentParser, dest: str, default, help: str) -> None:
    """This script's default for a shared option, and the help line that says so."""
    action = next(action for action in parser._actions if action.dest == dest)
    action.default, action.help = default, help


def make_parser() -> argparse.ArgumentParser:
    """The shared parser (playbook.config.make_parser) with the distillation section."""
    return config.make_parser(__doc__.splitlines()[0], kernels_default=(), extra=DistillConfig)


def parse_args(argv=None) -> config.RunConfig:
    """The run's RunConfig; its distillation section is `cfg.extra`. A bad value exits with code 2."""
    return config.parse_config(make_parser(), config.DISTILL, argv)


# ------------------------------------------------------------------------------------------------
# Models and data
# ------------------------------------------------------------------------------------------------
def build_model(cfg: RunConfig, name: str, num_layers: int | None, trains: bool):
    """A teacher (presets.PRESETS or a Hugging Face model) or a student (STUDENTS too), in --dtype,
    prepared by models.prepare_model as every script prepares its model: the kernels on both; FP8,
    gradient checkpointing, the saved-activation options and LoRA on the student alone, which `trains`."""
    d = cfg.extra
    dtype = DTYPES[d.dtype]
    role = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model=name, num_layers=num_layers,
                                                              model_explicit=True))
    if not trains:  # the frozen teacher: its forward pass with the kernels, nothing that serves training
        role = role.changed(fp8=False, lora_r=0, load_in_4bit=False, **options.FROZEN)
    if name in STUDENTS:
        from transformers import LlamaConfig, LlamaForCausalLM

        arch = LlamaConfig(**{**STUDENTS[name], **({"num_hidden_layers": num_layers} if num_layers else {})})
        arch._attn_implementation = "sdpa"
        torch.manual_seed(cfg.run.seed)  # the same initial student in every mode
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(cfg.run.device):
                model = LlamaForCausalLM(arch)
        finally:
            torch.set_default_dtype(old)
    else:
        model, _, _ = load_model(role, dtype, flag="--student" if trains else "--teacher")
    model, _, _, _ = prepare_model(role, model=model, shard=False)
    if not trains:
        model.requires_grad_(False)  # frozen: the distillation losses refuse a teacher that wants gradients
        model.eval()
    return model


def base_model(model):
    """The Hugging Face model under peft's wrapper (LoRA adapts its layers in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def make_batches(cfg: RunConfig, vocab_size: int):
    from playbook.data.dataset import bad_data_exit, make_data
    from playbook.model.tokenizer import make_tokenizer

    teacher = cfg.extra.teacher
    tokenizer = make_tokenizer(teacher, preset=teacher in PRESETS) if cfg.data.data else None
    try:  # --data is read as strict UTF-8, as --dataset is: a byte that is not UTF-8 is an error
        return make_data(str(cfg.data.data) if cfg.data.data else None, "text" if cfg.data.data else "synthetic",
                         tokenizer,
                         vocab_size, cfg.data.batch_size, cfg.data.seq_len, cfg.run.seed)
    except (ValueError, OSError, ImportError) as err:  # bad input: one line, exit code 2
        raise bad_data_exit(err) from None


# ------------------------------------------------------------------------------------------------
# The loss, two ways
# ------------------------------------------------------------------------------------------------
def head_weight(model) -> torch.Tensor:
    """The lm_head's weight, which the fused losses multiply by (LLaMA heads have no bias)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise SystemExit(f"error: {type(model).__name__} has a biased lm_head; the fused losses compute x @ W.T")
    return head.weight


def distillation_loss(mode: str, teacher, student, batch: dict, alpha: float, beta: float, temperature: float):
    """(alpha * CE + (1 - alpha) * JSD, CE, JSD) of one batch; differentiable for the student."""
    ids = batch["input_ids"]
    targets = causal_targets(batch["labels"])  # labels[t + 1] for position t, the last one ignored
    teacher, student = base_model(teacher), base_model(student)
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=ids).last_hidden_state
    hidden = student.model(input_ids=ids).last_hidden_state
    if mode == "baseline":
        with torch.no_grad():
            teacher_logits = teacher.lm_head(teacher_hidden).float()  # [B, T, V]
        logits = student.lm_head(hidden).float()  # [B, T, V], upcast as Hugging Face does for its loss
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        kd = jsd_ref(F.log_softmax(logits / temperature, dim=-1), F.log_softmax(teacher_logits / temperature, dim=-1),
                     beta, shift_labels=targets)
    else:
        weight = head_weight(student)  # the tied embedding for LLaMA 3.2: autograd adds both uses
        ce = linear_cross_entropy(hidden, weight, targets)
        kd = linear_jsd(hidden, weight, teacher_hidden, head_weight(teacher), targets, beta, temperature)
    return alpha * ce + (1 - alpha) * kd, ce, kd


def run_mode(mode: str, cfg: RunConfig, teacher, data) -> dict:
    """Train a fresh student for cfg.steps steps with one loss computation; its losses and timings."""
    from playbook.optim.optimizer import make_optimizer

    d = cfg.extra
    student = build_model(cfg, d.student, d.student_layers, trains=True)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise usage_error(f"the student ({d.student}) has a vocabulary of {student.config.vocab_size}, the "
                          f"teacher ({d.teacher}) {teacher.config.vocab_size}: distillation needs one vocabulary")
    optimizer = make_optimizer(student, cfg.training, cfg.run)  # --optimizer, --weight-decay as in the fine-tuning scripts
    out = dict(losses=[], ce=[], jsd=[], step_times_s=[], tokens_per_s=None, peak_memory_gb=None, error=None)
    tokens = cfg.data.batch_size * cfg.data.seq_len  # text windows or synthetic ids: no padding, every token is text
    try:
        for step in range(cfg.training.steps):
            if step == cfg.training.warmup_steps and cfg.run.device.type == "cuda":
                synchronize(cfg.run.device)
                torch.cuda.reset_peak_memory_stats(cfg.run.device)  # peak counted after warm-up
            batch = data.batch(step, cfg.run.device)
            synchronize(cfg.run.device)
            t0 = time.perf_counter()
            recent = out["step_times_s"][-20:]  # (a step that runs long says so: time_left.running)
            with running(f"{mode} step {step + 1} of {cfg.training.steps}",
                         expected_s=statistics.median(recent) if recent else None, unknown="no step time measured yet"):
                loss, ce, kd = distillation_loss(mode, teacher, student, batch, d.alpha, d.beta, d.temperature)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                synchronize(cfg.run.device)
            dt = time.perf_counter() - t0
            values = [v.item() for v in (loss, ce, kd)]  # sync points (already synchronised above)
            for key, v in zip(("losses", "ce", "jsd"), values):
                out[key].append(v)
            if step >= cfg.training.warmup_steps:
                out["step_times_s"].append(dt)
            log(f"{mode:8} step {step + 1:3d}/{cfg.training.steps}  loss {values[0]:.6f}  (CE {values[1]:.6f}, JSD "
                f"{values[2]:.6f})  {dt * 1e3:8.1f} ms  {tokens / dt:,.0f} tokens/s")
            if not math.isfinite(values[0]):
                raise SystemExit(f"error: the {mode} loss is {values[0]} at step {step + 1}; try a lower --lr")
    except RuntimeError as err:  # OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
        peak = torch.cuda.max_memory_allocated(cfg.run.device) / 1e9 if cfg.run.device.type == "cuda" else float("nan")
        out["error"] = (f"out of GPU memory at batch {cfg.data.batch_size} x {cfg.data.seq_len} tokens (peak allocated "
                        f"{peak:.1f} GB): {str(err).splitlines()[0][:200]}")
        log(f"{mode}: {out['error']}; the next mode still runs. Try a smaller --batch-size or --seq-len, "
            "--student-layers / --teacher-layers, or --mode fused alone.")
    if out["step_times_s"]:
        out["tokens_per_s"] = tokens / statistics.median(out["step_times_s"])
    if cfg.run.device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(cfg.run.device) / 1e9
    out["params"] = count_params(student)
    del student, optimizer
    if cfg.run.device.type == "cuda":
        torch.cuda.empty_cache()  # the next mode starts from the teacher alone
    return out


# ------------------------------------------------------------------------------------------------
# The run and its summary
# ------------------------------------------------------------------------------------------------
def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def summary_table(results: dict, on_gpu: bool) -> str:
    from tabulate import tabulate

    first = lambda r, k: r[k][0] if r[k] else None  # noqa: E731
    rows = [("first loss", ".6f", lambda r: first(r, "losses")), ("first CE", ".6f", lambda r: first(r, "ce")),
            ("first JSD", ".6f", lambda r: first(r, "jsd")),
            ("final loss", ".6f", lambda r: r["losses"][-1] if r["losses"] else None),
            ("tokens/s (median)", ",.0f", lambda r: r["tokens_per_s"]),
            ("peak GPU memory (GB)", ".1f", lambda r: r["peak_memory_gb"])]
    body = [[name] + [_fmt(get(r), spec) for r in results.values()] for name, spec, get in rows]
    table = tabulate(body, headers=[""] + list(results), tablefmt="github", disable_numparse=True)
    notes = []
    if set(results) == set(MODES) and all(results[m]["losses"] for m in MODES):
        a, b = results["baseline"]["losses"][0], results["fused"]["losses"][0]
        notes.append(f"first-step losses: |fused - baseline| = {abs(a - b):.2e} ({abs(a - b) / abs(a):.1e} relative)")
        base, fused = results["baseline"], results["fused"]
        if on_gpu and base["tokens_per_s"] and fused["tokens_per_s"]:
            notes.append(f"fused: {fused['tokens_per_s'] / base['tokens_per_s']:.2f}x the baseline's tokens/s, "
                         f"{base['peak_memory_gb'] - fused['peak_memory_gb']:+.1f} GB less peak memory")
    notes += [f"{mode}: {r['error']}" for mode, r in results.items() if r["error"]]
    if not on_gpu:
        notes.append("(CPU run: the kernels ran in Triton's interpreter; the timings say nothing about a GPU)")
    return "\n".join([table, *notes])


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    d = cfg.extra
    check_output_folders(cfg)  # results/ can be written (where not, one line naming PLAYBOOK_RESULTS_DIR), before
    # any model is built, not after the run
    cfg = settle(cfg)  # --data, and the memory plan of the teacher beside the student, before either is built
    teacher = build_model(cfg, d.teacher, d.teacher_layers, trains=False)
    data = make_batches(cfg, teacher.config.vocab_size)
    modes = MODES if d.mode == "both" else (d.mode,)
    log(f"Teacher: {d.teacher} ({count_params(teacher) / 1e6:,.1f} M parameters, frozen); student: "
        f"{d.student}; {d.dtype} on {describe_gpu(cfg.run.device)}")
    log(f"Data: {data.describe()}; loss = {d.alpha:g} * CE + {1 - d.alpha:g} * JSD(beta {d.beta:g}, "
        f"temperature {d.temperature:g}); {cfg.training.steps} steps per mode ({cfg.training.warmup_steps} untimed), "
        f"AdamW lr {cfg.training.lr:g}")
    results = {mode: run_mode(mode, cfg, teacher, data) for mode in modes}
    print(summary_table(results, cfg.on_gpu))
    tag = cfg.output.tag or (f"distill_{d.teacher}_to_{d.student}_b{cfg.data.batch_size}_s{cfg.data.seq_len}"
                      .replace("/", "_"))
    path = result_path(tag, ".json", cfg.output.overwrite)
    payload = dict(script="distill", teacher=d.teacher, student=d.student, gpu=describe_gpu(cfg.run.device),
                   config=cfg.as_dict(), teacher_params=count_params(teacher), modes=results, versions=versions())
    write_atomic(path, json.dumps(payload, indent=2))
    print(f"Saved {path}")
    payload["path"] = str(path)
    return payload


if __name__ == "__main__":
    from playbook.runtime.setup_check import check_or_exit

    check_or_exit()
    signals.run_main(main, "the run stopped before its summary; nothing was written")
