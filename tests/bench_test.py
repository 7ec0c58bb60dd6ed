"""benchmark_finetune.py (make bench) in its CPU form, and the pieces it stands on.

    $ python -m pytest -q tests/bench_test.py

The CPU form runs the README's rows on llama-tiny at tiny shapes (seconds a row); the test checks what a user
of the GPU form relies on: the table's rows and columns, a manifest per row, a row that does not fit and a
row whose peer is not installed said as such (never a traceback, never a gap), a run stopped mid-row that
records nothing for that row, and the next run starting after the finished rows instead of redoing them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmark_finetune as bench  # noqa: E402
from testkit import signals_as_from_a_shell  # noqa: E402

ROWS = "hf,liger,ours,fp8"  # a baseline, a peer (absent here), ours, and a row that needs a GPU


def bench_run(out: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmark_finetune.py", "--cpu", "--out", str(out), *args], cwd=ROOT,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=timeout)


def manifest(out: Path, row: str) -> dict | None:
    return bench.read_manifest(bench.manifest_path(out, row))


def test_cpu_form_stop_resume_table_and_manifests(tmp_path):
    """~40 s on a 2-core CPU (70 s with the cores shared): two rows run (hf, ours), each once, across a stopped
    run and two more."""
    out = tmp_path / "CPU"
    # 1. Ctrl-C while the first row runs: exit code 130, the row not recorded
    proc = subprocess.Popen([sys.executable, "benchmark_finetune.py", "--cpu", "--out", str(out), "--rows", ROWS],
                            cwd=ROOT, preexec_fn=signals_as_from_a_shell, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = ""
    for line in proc.stdout:
        seen += line
        if "hf: running" in line:
            time.sleep(1.0)  # inside the row's subprocess, not before it
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, seen + rest
    assert "stopped during hf: it is not recorded" in rest, seen + rest
    assert manifest(out, "hf") is None

    # 2. stopped after one row: that row is recorded, the next is not started
    done = bench_run(out, "--rows", ROWS, "--stop-after", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    first = manifest(out, "hf")
    assert first is not None and first["status"] == "ok", done.stdout
    assert manifest(out, "ours") is None

    # 3. the next run starts after it: hf kept as it was (same date, not rerun), the rest of the rows recorded
    done = bench_run(out, "--rows", ROWS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hf: done before (ok), kept" in done.stdout
    assert manifest(out, "hf") == first
    ours = manifest(out, "ours")
    assert ours["status"] == "ok"
    for key in ("command", "command_shown", "date", "machine", "versions", "commit", "figures"):
        assert key in ours, key
    assert ours["command"][0] == "finetune_optimized.py" and "--tag" in ours["command"]
    assert ours["machine"]["gpu"] == "CPU" and ours["versions"]["torch"] == importlib.metadata.version("torch")
    figures = ours["figures"]
    assert figures["tokens_per_s"] > 0 and figures["step_median_ms"] > 0 and figures["model_tflops"] > 0
    assert (out / "ours.log").is_file() and (out / "ours.json").is_file()
    liger = manifest(out, "liger")
    if importlib.util.find_spec("liger_kernel") is None:
        assert liger["status"] == "not installed" and "pip install liger-kernel" in liger["reason"]
    else:  # installed: the row ran, or failed with its reason (Liger's kernels on a CPU), and the run went on
        assert liger["status"] in ("ok", "failed")
    fp8 = manifest(out, "fp8")
    assert fp8["status"] == "needs a GPU" and "compute capability 8.9" in fp8["reason"]

    # the table: a header of every column, one line per row in the table's order
    lines = [ln for ln in (out / "bench.md").read_text().splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == list(bench.COLUMNS)
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]
    assert [r[0] for r in body] == ROWS.split(",")
    assert all(len(r) == len(header) for r in body)
    by_row = {r[0]: dict(zip(header, r)) for r in body}
    assert by_row["hf"]["vs baseline"] == "1.00x"
    assert float(by_row["ours"]["tokens/s"].replace(",", "")) > 0
    assert by_row["fp8"]["status"].startswith("needs a GPU")


def test_does_not_fit_row(tmp_path):
    """~5 s: the memory plan's figure against PLAYBOOK_FREE_MEMORY_GB's stand-in; nothing is run."""
    out = tmp_path / "CPU"
    done = bench_run(out, "--rows", "ours", env={"PLAYBOOK_FREE_MEMORY_GB": "0.0001"})
    assert done.returncode == 0, done.stdout + done.stderr
    row = manifest(out, "ours")
    assert row["status"] == "does not fit"
    # the figure is the plan's peak (llama-tiny at 2 x 64 tokens: a few MB; the stand-in 0.1 MB)
    assert re.search(r"needs \S+ GB, PLAYBOOK_FREE_MEMORY_GB=0.0001 gives \S+ GB free", row["reason"]), row["reason"]
    assert row["plan_peak_gb"] > 0.0001
    assert not (out / "ours.log").exists()


def test_a_row_its_script_refuses_by_its_plan_does_not_fit(tmp_path):
    """~10 s: a row that passed the bench's own check (nvidia-smi's free memory, without the script's CUDA context)
    and that its script then refused by its memory plan is "does not fit" with the script's figures, not "failed"."""
    row = next(r for r in bench.ROWS if r.name == "ours")
    env = dict(os.environ, PLAYBOOK_FREE_MEMORY_GB="0.0001", CPU_DEMO="1")
    outcome = bench.run_row(row, bench.command(row, on_gpu=False), tmp_path, env)
    assert outcome["status"] == "does not fit", outcome
    assert outcome["plan_peak_gb"] > 0 and "the script found 0.0001 GB free" in outcome["reason"], outcome
    (tmp_path / "other.log").write_text("error: something else\n")
    assert bench.plan_refusal(tmp_path / "other.log") is None


def test_rows_are_the_readme_commands():
    """Each row of README.md's 8B table is a row of the bench with the same script and options."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^\| [^|]+ \| `((?:finetune_baseline|finetune_optimized)\.py[^`]*)` \|", readme, re.M)
    assert len(commands) >= 9, commands
    bench_commands = {" ".join((r.script,) + r.options) for r in bench.ROWS if r.group == "8B"}
    for cmd in commands:
        assert cmd in bench_commands, f"README's `{cmd}` is no row of benchmark_finetune.py"


@pytest.mark.parametrize("device, short", [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
                                           ("NVIDIA GB300", "GB300"), ("NVIDIA B200", "B200"),
                                           ("NVIDIA H100 NVL", "H100"), ("Some New GPU 9", "Some_New_GPU_9")])
def test_short_name(device, short):
    assert bench.short_name(device) == short


def test_select_rows():
    assert [r.name for r in bench.select(None, quick=True)] == ["hf", "liger", "ours"]
    assert {r.group for r in bench.select("SmolLM2", quick=False)} == {"SmolLM2"}
    assert [r.name for r in bench.select("ours,hf", quick=False)] == ["hf", "ours"]  # the table's order
    with pytest.raises(ValueError, match="no row or group 'nope'"):
        bench.select("nope", quick=False)
    # --batch-size / --seq-len replace the group's, never add a second flag
    cmd = bench.command(bench.BY_NAME["ours"], on_gpu=True, batch_size=16, seq_len=4096)
    assert cmd.count("--batch-size") == 1 and cmd[cmd.index("--batch-size") + 1] == "16"
    assert cmd[cmd.index("--seq-len") + 1] == "4096"


def test_index_is_made_from_the_manifests():
    """results/README.md's generated section is what `python benchmark_finetune.py --index` makes today."""
    text = (ROOT / "results" / "README.md").read_text()
    assert bench.INDEX_BEGIN in text and bench.INDEX_END in text
    committed = text[text.index(bench.INDEX_BEGIN): text.index(bench.INDEX_END) + len(bench.INDEX_END)]
    assert committed == bench.index_section(), "run `make results-index` and commit results/README.md"


def test_padding_free_peer_matches_the_dense_mask():
    """benchmarks/peers.py feeds Hugging Face packed rows with position_ids and no mask; transformers must then keep
    each example to itself, as the scripts' dense per-example mask does. A random 2-layer LLaMA, fp32 (<1 s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from playbook.data.dataset import pack_examples, packed_attention_mask
    from playbook.data.rows import Example

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).eval()
    g = torch.Generator().manual_seed(1)
    examples = []
    for n in (7, 11, 5, 9, 13):  # odd lengths: several examples per row and a padding tail
        ids = torch.randint(1, 97, (n,), generator=g).tolist()
        examples.append(Example(input_ids=ids, labels=[-100] + ids[1:]))
    rows = pack_examples(examples, 24, pad_id=0)
    with torch.no_grad():
        dense = model(input_ids=rows["input_ids"], labels=rows["labels"], position_ids=rows["position_ids"],
                      attention_mask=packed_attention_mask(rows["segments"])).loss
        # use_cache=False as the peer runs it: transformers looks for packed rows only where there is no cache
        free = model(input_ids=rows["input_ids"], labels=rows["labels"], position_ids=rows["position_ids"],
                     use_cache=False).loss
        leaky = model(input_ids=rows["input_ids"], labels=rows["labels"]).loss  # no boundaries at all
    # the same attention in fp32: only summation order differs (1e-5 is ~100 ulps of a loss near 4.6)
    assert abs(float(dense) - float(free)) < 1e-5
    assert abs(float(dense) - float(leaky)) > 1e-3  # the check can fail: attention across examples changes the loss


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="reads the GPU through nvidia-smi and measures its matmul rate")
def test_this_gpu_and_its_matmul_rate(tmp_path):
    """On a GPU: nvidia-smi's name, memory and compute capability agree with torch's, and the bf16 matmul rate
    is measured once and kept (ceiling.json)."""
    machine = bench.this_machine()
    assert machine.on_gpu and machine.name == torch.cuda.get_device_name(0)
    assert machine.capability == torch.cuda.get_device_capability(0)
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    assert abs(machine.memory_gb - total_gb) < 0.02 * total_gb  # nvidia-smi counts MiB; torch bytes: the same card
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rate = bench.bf16_ceiling(tmp_path, machine, env)
    # TFLOP/s: any tensor-core GPU of this decade, even shared with the suite's other workers (make test: 16)
    assert rate is not None and 1 < rate < 10_000
    assert json.loads((tmp_path / "ceiling.json").read_text())["bf16_matmul_tflops"] == rate


def test_an_h100_as_nvidia_smi_reports_it(tmp_path, monkeypatch):
    """The GPU side of the checks, on any machine: a stand-in nvidia-smi reports an H100 (80 GB, sm_90). The 8B
    Hugging Face baseline does not fit it by the memory plan (its peak on the H200 was 113.8 GB: README.md), the
    MXFP8 row needs Blackwell, the emulated MXFP8 memorization row does not fit this H100's 83.9 GB free (its plan:
    84.5 GB) and the NVFP4 one does (82.3 GB), LoRA fits and runs (< 1 s: arithmetic on the commands, nothing is
    run)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559, 80000, 580.159.04, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PLAYBOOK_FREE_MEMORY_GB", raising=False)
    machine = bench.this_machine()
    assert (machine.gpu, machine.capability, machine.driver) == ("H100", (9, 0), "580.159.04")
    assert abs(machine.free_gb - 80000 * 2**20 / 1e9) < 1e-9  # MiB as nvidia-smi counts, GB (10^9 bytes) as the plan
    outcome = {name: bench.precheck(bench.BY_NAME[name], bench.command(bench.BY_NAME[name], on_gpu=True), machine)
               for name in ("hf", "mxfp8", "lora", "memo-mxfp8", "memo-nvfp4")}
    assert outcome["hf"]["status"] == "does not fit"
    assert outcome["memo-mxfp8"]["status"] == "does not fit", outcome["memo-mxfp8"]
    assert 83.9 < outcome["memo-mxfp8"]["plan_peak_gb"] < 139, outcome["memo-mxfp8"]  # this H100's free, an H200's
    assert outcome["memo-nvfp4"] is None, outcome["memo-nvfp4"]  # it runs
    assert re.fullmatch(r"needs 1\d\d\.\d GB, this GPU has 83\.9 GB free \(the memory plan, .*\)",
                        outcome["hf"]["reason"]), outcome["hf"]["reason"]
    assert outcome["mxfp8"] == {"status": "needs a newer GPU",
                                "reason": "needs Blackwell (sm_100 or newer) for MXFP8 block scales; this GPU is sm_90"}
    assert outcome["lora"] is None or outcome["lora"]["status"] == "not installed"  # (peft absent: said so)


def test_the_table_beside_the_committed_h200_figures():
    """A GPU's rows beside the committed H200 figures (results/runs/ until results/H200/ holds manifests): the
    ratio of each, the group's baseline ratio and the share of the measured matmul rate (figures made up)."""
    def row(name, tps, tflops):
        return {"row": name, "group": "8B", "baseline": "hf", "status": "ok", "command_shown": f"python {name}",
                "machine": {"gpu": "GB300", "name": "NVIDIA GB300"},
                "figures": {"tokens_per_s": tps, "model_tflops": tflops, "step_median_ms": 8192 / tps * 1e3}}

    manifests = [row("hf", 20_252.0, 300.0), row("ours", 37_308.0, 1_000.0)]
    lines = bench.table(manifests, 2_000.0, bench.RESULTS / "H200", "GB300").splitlines()
    cells = {ln.split("|")[1].strip(): dict(zip(bench.COLUMNS, [c.strip() for c in ln.strip("|").split("|")]))
             for ln in lines if ln.startswith("| hf") or ln.startswith("| ours")}
    # README.md: Hugging Face 10,126 and ours 12,436 tokens/s on the H200
    assert cells["hf"]["H200 tokens/s"] == "10,126" and cells["hf"]["vs H200"] == "2.00"
    assert cells["ours"]["H200 tokens/s"] == "12,436" and cells["ours"]["vs H200"] == "3.00"
    assert cells["ours"]["vs baseline"] == "1.84x" and cells["ours"]["% of bf16 matmul"] == "50 %"
    # other commands (the CPU form, --batch-size): no H200 column, and the table says why
    other = bench.table(manifests, 2_000.0, bench.RESULTS / "H200", "GB300", comparable=False)
    assert "10,126" not in other and "not the committed ones" in other


def test_emulated_rows_show_a_loss_and_no_speed_and_the_table_is_made_again(tmp_path):
    """An emulated format (dequantized bf16 matmuls) gives its loss, never a speed: in bench.md, made again by
    --table from the manifests of a folder gathered from two runs, and in the index (figures made up)."""
    folder = tmp_path / "GB300"
    folder.mkdir()
    (folder / "ceiling.json").write_text(json.dumps({"gpu": "NVIDIA GB300", "bf16_matmul_tflops": 2000.0}))
    for name, emulated, tps in (("fmt-bf16", False, 251_234.0), ("fmt-nvfp4", True, 9_876.0)):
        row = bench.BY_NAME[name]
        (folder / f"{name}.manifest.json").write_text(json.dumps({
            "row": name, "group": row.group, "title": row.title, "baseline": None, "emulated": emulated,
            "command": bench.command(row, True)[1:], "command_shown": bench.shown(bench.command(row, True)),
            "date": "2026-12-07T00:00:00+00:00", "machine": {"gpu": "GB300", "name": "NVIDIA GB300"},
            "commit": {"commit": "0123456789abcdef", "dirty": False}, "status": "ok", "reason": None,
            "figures": {"tokens_per_s": tps, "step_median_ms": 12.5, "model_tflops": 111.0, "eval_before": 3.5591,
                        "eval_after": 3.9133, "final_loss": 3.6416}}))
    assert bench.main(["--table", str(folder)]) == 0
    text = (folder / "bench.md").read_text()
    emulated = next(ln for ln in text.splitlines() if ln.startswith("| fmt-nvfp4"))
    plain = next(ln for ln in text.splitlines() if ln.startswith("| fmt-bf16"))
    assert "emulated: accuracy only, no speed" in emulated and "3.5591 -> 3.9133" in emulated
    assert "9,876" not in emulated and "12.5" not in emulated and "111" not in emulated
    assert "251,234" in plain and "6 %" in plain  # 111 of the ceiling's 2,000 TFLOP/s
    index = bench.index_section(tmp_path)
    assert "ok (emulated: no speed)" in index and "9,876" not in index and "251,234" in index
