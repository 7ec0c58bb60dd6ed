"""Tests of what real data and real models need from the scripts: the fast path for padded chat rows, the
FP8 size rule, the eval loss before training and the sample answers in the run's summary, and throughput
that counts the tokens that are not padding.

    $ pytest tests/realdata_test.py
"""

import dataclasses
import json
import re
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from playbook.run import cuda_graph
from playbook.store.files import RESULTS_DIR
from playbook.config import make_parser, parse_config
from playbook.model.registry import DEFAULT_KERNELS
from testkit import record
from playbook.run.start import make_run_data, run_tokenizer

HERE = Path(__file__).resolve().parent.parent


def _cfg(script, *argv):
    parser = make_parser("test", kernels_default=DEFAULT_KERNELS if script != "finetune_baseline" else None)
    return parse_config(parser, script, list(argv))


def test_the_baseline_queues_eagerly_and_ours_captures_by_default():
    assert _cfg("finetune_baseline").training.cuda_graphs == "off"
    assert _cfg("finetune_optimized").training.cuda_graphs == "auto"
    assert _cfg("finetune_baseline", "--cuda-graphs", "auto").training.cuda_graphs == "auto"


def test_padded_rows_block_the_graph_only_with_their_mask():
    """graph_blocker on a GPU config: rows with a padding mask block the capture unless the data leaves
    the mask out (causal_padding), as finetune_optimized.py's data does and finetune_baseline.py's does not."""
    from playbook.data.dataset import BatchAttention
    from playbook.run import start

    cfg = _cfg("finetune_optimized").changed(device=torch.device("cuda"))

    def rows(causal_padding: bool):
        return types.SimpleNamespace(rows={"attention_mask": torch.ones(1, 4)}, packing=False,
                                     attention=BatchAttention(causal_padding=causal_padding))

    assert "right-padded rows" in cuda_graph.graph_blocker(cfg, rows(False))
    assert cuda_graph.graph_blocker(cfg, rows(True)) is None
    model = types.SimpleNamespace(config=None)  # (unpacked rows: the model is not asked)
    assert start.batch_attention(_cfg("finetune_optimized"), model).causal_padding is True
    assert start.batch_attention(_cfg("finetune_baseline"), model).causal_padding is False


def test_fp8_layers_needs_fp8_and_defaults_to_auto():
    assert _cfg("finetune_optimized", "--fp8").model.fp8_layers == "auto"
    assert _cfg("finetune_optimized", "--fp8", "--fp8-layers", "all").model.fp8_layers == "all"
    with pytest.raises(SystemExit) as err:
        _cfg("finetune_optimized", "--fp8-layers", "all")
    assert err.value.code == 2


def _llama(hidden, inter, heads, kv, head_dim):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_the_size_rule_keeps_narrow_projections_in_bf16(monkeypatch, capsys):
    """SmolLM2's widths (576) all stay bf16, named with their width; LLaMA 8B's convert, its k and v
    (4096 -> 1024, width 819 alone) judged with q, whose input they share. 'all' converts everything."""
    import fp8_linear_kernel as f8

    monkeypatch.setattr(f8, "check_fp8_device", lambda device, recipe=None: None)  # meta tensors: no device check
    small = _llama(576, 1536, 9, 3, 64)
    assert f8.patch_model(small, "rowwise", sizes="auto") == 0
    said = capsys.readouterr().out
    assert "7 projection(s) stay as they are" in said and "too small for FP8 to gain" in said
    assert "k_proj [192, 576] (with the projections sharing its input)" in said and "= 360" in said
    assert "down_proj [576, 1536]" in said and "= 419" in said
    assert f8.patch_model(_llama(576, 1536, 9, 3, 64), "rowwise", sizes="all") == 7
    big = _llama(4096, 14336, 32, 8, 128)
    assert f8.patch_model(big, "rowwise", sizes="auto") == 7
    assert f8.harmonic_width(4096, 1024) < f8.FP8_MIN_WIDTH < f8.harmonic_width(4096, 4096 + 2 * 1024)
    # the threshold lies between the widths that lost and gained in the measured crossover
    rows = json.loads((HERE / "results/runs/fp8_crossover_H100.json").read_text())["rows"]
    lost = max(r["width"] for r in rows if r["rowwise_us"] >= r["bf16_us"])
    gained = min(r["width"] for r in rows if r["rowwise_us"] < r["bf16_us"])
    assert lost < f8.FP8_MIN_WIDTH <= gained, (lost, f8.FP8_MIN_WIDTH, gained)


def test_real_models_train_in_float32_on_cpus_without_bf16_matmuls(monkeypatch):
    from playbook.model import presets  # weights_dtype asks presets.cpu_has_native_bf16

    cfg = _cfg("finetune_optimized").changed(device=torch.device("cpu"))
    monkeypatch.setattr(presets, "cpu_has_native_bf16", lambda: False)
    assert presets.weights_dtype(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                    model="smollm2-135m"))) == torch.float32
    assert presets.weights_dtype(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                    model="llama-tiny"))) == torch.bfloat16  # presets as before
    monkeypatch.setattr(presets, "cpu_has_native_bf16", lambda: True)
    assert presets.weights_dtype(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                    model="smollm2-135m"))) == torch.bfloat16
    gpu = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model="smollm2-135m"),
                              run=dataclasses.replace(cfg.run, device=torch.device("cuda")))
    monkeypatch.setattr(presets, "cpu_has_native_bf16", lambda: False)
    assert presets.weights_dtype(gpu) == torch.bfloat16  # a GPU trains in bf16 whatever the CPU


def test_a_run_reports_eval_loss_before_and_after_and_the_sample_answers(tmp_path):
    """One short CPU run (llama-tiny, plain PyTorch) on right-padded chat rows: the summary has the eval
    loss before the first step and after the last, and each sample prompt's answer before and after
    training; every throughput figure counts the tokens that are not padding, the padded one is named."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is a warp?\n")
    rows = tmp_path / "short.jsonl"  # chats of about 34 tokens: about half of each 64-token row is padding
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} + 1?"},
                                                     {"role": "assistant", "content": f"{i + 1}."}]}) + "\n"
                            for i in range(40)))
    tag = "test_realdata_summary"
    argv = ["--model", "llama-tiny", "--dataset", str(rows), "--no-packing", "--seq-len", "64", "--steps", "3",
            "--lr", "1e-2"]
    out = subprocess.run([sys.executable, "finetune_baseline.py", *argv,
                          "--sample-prompts", str(prompts), "--tag", tag, "--overwrite"],
                         cwd=HERE, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    path = RESULTS_DIR / f"{tag}.json"
    try:
        payload = json.loads(path.read_text())
        steps = [json.loads(line) for line in path.with_suffix(".metrics.jsonl").read_text().splitlines()]
    finally:
        for p in RESULTS_DIR.glob(f"{tag}*"):
            p.unlink()
    _throughput_counts_text(argv, payload, steps, out.stdout)
    summary = payload["summary"]
    assert summary["eval loss before"] is not None and summary["final eval loss"] is not None
    assert payload["eval_losses"][0][0] == 0 and payload["eval_losses"][-1][0] == 3
    assert summary["eval loss before"] != summary["final eval loss"]
    (sample,) = payload["samples"]
    assert sample["prompt"] == "What is a warp?" and "before" in sample and "after" in sample
    assert "eval loss before training" in out.stdout and "Sample answers (greedy):" in out.stdout


def _throughput_counts_text(argv, payload, steps, stdout):
    """The run's tokens/s against its batches rebuilt here: the tokens of step i that are not padding are
    the sum of its batch's attention mask (the baseline keeps the mask), the padded ones batch x seq."""
    from playbook.run import training

    cfg = _cfg("finetune_baseline", *argv)
    model = type("Model", (), {"config": type("Config", (), {"vocab_size": 512})()})()  # llama-tiny's vocabulary
    data = make_run_data(cfg, model, run_tokenizer(cfg, cfg.model.model))
    text = [int(data.batch(i, "cpu")["attention_mask"].sum()) for i in range(len(steps))]
    padded = cfg.data.batch_size * cfg.data.seq_len
    assert all(0 < n < padded for n in text), (text, "the rows must hold padding for the test to mean anything")
    # each figure is tokens / the same step time: equal to a float division's rounding (1e-9 relative)
    for row, n in zip(steps, text):
        assert row["tokens_per_s"] * row["step_ms"] / 1e3 == pytest.approx(n, rel=1e-9), (row, n)
        assert row["padded_tokens_per_s"] * row["step_ms"] / 1e3 == pytest.approx(padded, rel=1e-9), row
    summary, timed = payload["summary"], text[cfg.training.warmup_steps:]
    assert payload["text_tokens"] == timed
    median = statistics.median(payload["step_times_s"])
    assert summary["tokens/s (job)"] == pytest.approx(statistics.fmean(timed) / median, rel=1e-9), summary
    assert summary["tokens/s with padding (job)"] == pytest.approx(padded / median, rel=1e-9), summary
    assert summary["padding (% of tokens)"] == pytest.approx(100 * (1 - statistics.fmean(timed) / padded), rel=1e-9)
    last = next(line for line in stdout.splitlines() if f"step {len(steps):5d}/" in line)
    said = re.search(r"([\d,]+) tokens/s \(text\), ([\d,]+) with padding", last)
    assert said is not None, last
    for figure, key in zip(said.groups(), ("tokens_per_s", "padded_tokens_per_s")):  # one value, printed to the unit
        assert abs(float(figure.replace(",", "")) - steps[-1][key]) <= 0.5, (last, steps[-1])
    assert "| tokens/s with padding (job)" in stdout and "| padding (% of tokens)" in stdout
    record(f"padded chat rows: tokens/s counts {sum(text)} of {padded * len(text)} tokens, the padded figure named",
           0.0, 0.0, True)


def test_batches_without_padding_print_one_throughput_figure():
    """Synthetic batches hold no padding: one tokens/s figure in the step line and in the table, where a
    padded batch names its padded figure beside the text one."""
    from playbook.run import report

    assert report.throughput(4096, 4096, 0.5) == "8,192 tokens/s"
    assert report.throughput(1024, 4096, 0.5) == "2,048 tokens/s (text), 8,192 with padding"
    result = report.RunResult(script="s", model="m", kernels=[], gpu="g", world_size=2, batch_size=4, seq_len=512,
                                grad_accum=1, steps=3, optimizer="o", params=1, trainable_params=1,
                                step_times_s=[0.5, 0.25, 1.0], text_tokens=[4096] * 3)
    full = result.summary(None, 1.0)
    assert full["tokens/s (job)"] == full["tokens/s with padding (job)"] == 8192 and full["padding (% of tokens)"] == 0
    assert [k for k, _ in report.table_rows(full, True) if "tokens/s" in k] == ["tokens/s (job)", "tokens/s per GPU"]
    result.text_tokens = [1024, 2048, 3072]  # half of them padding on average
    half = result.summary(None, 1.0)
    assert half["tokens/s (job)"] == 4096 and half["tokens/s per GPU"] == 2048 and half["padding (% of tokens)"] == 50
    assert half["model TFLOP/s per GPU"] == 2048 / 1e12, "FLOPs count the tokens that are not padding"
    shown = dict(report.table_rows(half, True))
    assert shown["tokens/s with padding (job)"] == "8,192" and shown["padding (% of tokens)"] == "50.0"
