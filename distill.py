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
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from playbook import kernel_utils  # noqa: F401  (selects Triton's interpreter on machines without a GPU)
from playbook.common import describe_gpu, is_out_of_memory, log, result_path, synchronize, versions, write_atomic
from cross_entropy_kernel import causal_targets
from distillation_kernel import jsd_ref, linear_jsd
from linear_cross_entropy_kernel import linear_cross_entropy
from playbook.models import PRESETS, build_preset, count_params, load_model
from playbook.config import TAG_PATTERN, nonnegative_int, positive_float, positive_int, usage_error

MODES = ("baseline", "fused")

# Students built from a config with random weights, as models.PRESETS builds the teachers.
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
# Command line
# ------------------------------------------------------------------------------------------------
def _unit(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in [0, 1]")
    return v


def _tag(text: str) -> str:
    if not TAG_PATTERN.match(text) or ".." in text:
        raise argparse.ArgumentTypeError(f"{text!r}: a tag names a file inside results/: letters, digits and "
                                         ". _ + = - only")
    return text


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it is a value (the defaults that depend on the machine say so)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    p.add_argument("--mode", choices=(*MODES, "both"), default="both", help="which loss computation to run")
    p.add_argument("--teacher", default=None, help="a preset (llama-3.1-8b, llama-tiny), Hugging Face id or local "
                                                  "directory; default llama-3.1-8b on a GPU, llama-tiny on a CPU")
    p.add_argument("--student", default=None, help=f"a student preset ({', '.join(STUDENTS)}), Hugging Face id or "
                                                  "local directory; default llama-3.2-1b on a GPU, "
                                                  "llama-tiny-student on a CPU")
    p.add_argument("--teacher-layers", type=positive_int, default=None, help="keep the teacher's first N layers")
    p.add_argument("--student-layers", type=positive_int, default=None, help="keep the student's first N layers")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="both models' dtype (float32: exact comparisons of the two modes on a CPU)")
    p.add_argument("--alpha", type=_unit, default=0.5, help="weight of the cross-entropy; 1 - alpha weighs the JSD")
    p.add_argument("--beta", type=_unit, default=0.5, help="JSD beta: 0 forward KL, 1 reverse KL, 0.5 symmetric")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="divides both models' logits for the JSD")
    p.add_argument("--data", type=Path, default=None, help="a raw text file, cut into windows (default: synthetic "
                                                          "tokens)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step; default 4 on a GPU, "
                                                                        "2 on a CPU")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence; default 2048 on a GPU, "
                                                                     "64 on a CPU")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps per mode; default 12 on a "
                                                                   "GPU, 3 on a CPU")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=None,
                   help="first steps left out of the timing (Triton compiles); default 2 on a GPU, 1 on a CPU")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate of the student")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the student's initial weights and the data")
    p.add_argument("--tag", type=_tag, default=None, help="name of the JSON summary under results/")
    p.add_argument("--overwrite", action="store_true", help="replace results/<tag>.json if it exists")
    return p


def parse_args(argv=None):
    a = make_parser().parse_args(argv)
    gpu = torch.cuda.is_available()
    a.device = torch.device("cuda") if gpu else torch.device("cpu")
    a.teacher = a.teacher or ("llama-3.1-8b" if gpu else "llama-tiny")
    a.student = a.student or ("llama-3.2-1b" if gpu else "llama-tiny-student")
    a.batch_size = a.batch_size or (4 if gpu else 2)
    a.seq_len = a.seq_len or (2048 if gpu else 64)
    a.steps = a.steps or (12 if gpu else 3)
    if a.warmup_steps is None:  # the default leaves at least one timed step
        a.warmup_steps = min(2 if gpu else 1, a.steps - 1)
    if a.warmup_steps >= a.steps:
        raise usage_error(f"--steps {a.steps} leaves no timed step after --warmup-steps {a.warmup_steps}")
    if a.data is not None and not a.data.is_file():
        raise usage_error(f"--data {a.data}: no such file")
    return a


# ------------------------------------------------------------------------------------------------
# Models and data
# ------------------------------------------------------------------------------------------------
def build_model(name: str, num_layers: int | None, device: torch.device, dtype: torch.dtype, seed: int):
    """A teacher preset (models.PRESETS), a student preset (STUDENTS), or a Hugging Face model."""
    if name in PRESETS:
        return build_preset(name, num_layers, device, dtype)
    if name in STUDENTS:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**{**STUDENTS[name], **({"num_hidden_layers": num_layers} if num_layers else {})})
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)  # the same initial student in every mode
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(old)
    model, _, _ = load_model(SimpleNamespace(model=name, num_layers=num_layers, device=device, model_explicit=True))
    return model.to(dtype)


def make_batches(args, vocab_size: int):
    from playbook.data import make_data, make_tokenizer

    tokenizer = make_tokenizer(args.teacher, preset=args.teacher in PRESETS) if args.data else None
    try:
        return make_data(str(args.data) if args.data else None, "text" if args.data else "synthetic", tokenizer,
                         vocab_size, args.batch_size, args.seq_len, args.seed)
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from None


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


def run_mode(mode: str, args, teacher, data) -> dict:
    """Train a fresh student for args.steps steps with one loss computation; its losses and timings."""
    dtype = DTYPES[args.dtype]
    student = build_model(args.student, args.student_layers, args.device, dtype, args.seed)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise usage_error(f"the student ({args.student}) has a vocabulary of {student.config.vocab_size}, the "
                          f"teacher ({args.teacher}) {teacher.config.vocab_size}: distillation needs one vocabulary")
    student.config.use_cache = False
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr,
                                  **({"fused": True} if args.device.type == "cuda" else {"foreach": True}))
    out = dict(losses=[], ce=[], jsd=[], step_times_s=[], tokens_per_s=None, peak_memory_gb=None, error=None)
    tokens = args.batch_size * args.seq_len
    try:
        for step in range(args.steps):
            if step == args.warmup_steps and args.device.type == "cuda":
                synchronize(args.device)
                torch.cuda.reset_peak_memory_stats(args.device)  # peak counted after warm-up
            batch = data.batch(step, args.device)
            synchronize(args.device)
            t0 = time.perf_counter()
            loss, ce, kd = distillation_loss(mode, teacher, student, batch, args.alpha, args.beta, args.temperature)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(args.device)
            dt = time.perf_counter() - t0
            values = [v.item() for v in (loss, ce, kd)]  # sync points (already synchronised above)
            for key, v in zip(("losses", "ce", "jsd"), values):
                out[key].append(v)
            if step >= args.warmup_steps:
                out["step_times_s"].append(dt)
            log(f"{mode:8} step {step + 1:3d}/{args.steps}  loss {values[0]:.6f}  (CE {values[1]:.6f}, JSD "
                f"{values[2]:.6f})  {dt * 1e3:8.1f} ms  {tokens / dt:,.0f} tokens/s")
            if not math.isfinite(values[0]):
                raise SystemExit(f"error: the {mode} loss is {values[0]} at step {step + 1}; try a lower --lr")
    except RuntimeError as err:  # OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
        peak = torch.cuda.max_memory_allocated(args.device) / 1e9 if args.device.type == "cuda" else float("nan")
        out["error"] = (f"out of GPU memory at batch {args.batch_size} x {args.seq_len} tokens (peak allocated "
                        f"{peak:.1f} GB): {str(err).splitlines()[0][:200]}")
        log(f"{mode}: {out['error']}; the next mode still runs. Try a smaller --batch-size or --seq-len, "
            "--student-layers / --teacher-layers, or --mode fused alone.")
    if out["step_times_s"]:
        out["tokens_per_s"] = tokens / statistics.median(out["step_times_s"])
    if args.device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(args.device) / 1e9
    out["params"] = count_params(student)
    del student, optimizer
    if args.device.type == "cuda":
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
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    teacher = build_model(args.teacher, args.teacher_layers, args.device, dtype, args.seed)
    teacher.requires_grad_(False)  # frozen: the distillation losses refuse a teacher that wants gradients
    teacher.eval()
    teacher.config.use_cache = False
    data = make_batches(args, teacher.config.vocab_size)
    modes = MODES if args.mode == "both" else (args.mode,)
    log(f"Teacher: {args.teacher} ({count_params(teacher) / 1e6:,.1f} M parameters, frozen); student: "
        f"{args.student}; {args.dtype} on {describe_gpu(args.device)}")
    log(f"Data: {data.describe()}; loss = {args.alpha:g} * CE + {1 - args.alpha:g} * JSD(beta {args.beta:g}, "
        f"temperature {args.temperature:g}); {args.steps} steps per mode ({args.warmup_steps} untimed), "
        f"AdamW lr {args.lr:g}")
    results = {mode: run_mode(mode, args, teacher, data) for mode in modes}
    print(summary_table(results, args.device.type == "cuda"))
    tag = args.tag or (f"distill_{args.teacher}_to_{args.student}_b{args.batch_size}_s{args.seq_len}"
                       .replace("/", "_"))
    path = result_path(tag, ".json", args.overwrite)
    payload = dict(script="distill", teacher=args.teacher, student=args.student, gpu=describe_gpu(args.device),
                   config={k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()},
                   teacher_params=count_params(teacher), modes=results, versions=versions())
    write_atomic(path, json.dumps(payload, indent=2))
    print(f"Saved {path}")
    payload["path"] = str(path)
    return payload


if __name__ == "__main__":
    from playbook.setup_check import check_or_exit

    check_or_exit()
    main()
