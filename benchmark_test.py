"""The benchmark harness runs end to end (`--smoke`: tiny sizes, CPU-friendly) and writes its files."""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_benchmark_smoke_writes_tables_and_plots():
    out = subprocess.run([sys.executable, "benchmark_kernels.py", "--smoke", "--kernel", "all"], cwd=HERE,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "fwd+bwd us" in out.stdout
    data = json.loads((HERE / "results" / "benchmark_smoke.json").read_text())
    impls = {(r["kernel"], r["impl"]) for r in data["rows"]}
    assert {("rmsnorm", "ours"), ("rmsnorm", "eager"), ("cross_entropy", "ours"), ("cross_entropy", "eager")} <= impls
    assert ("swiglu", "ours") in impls
    for kernel in ("rmsnorm", "cross_entropy", "swiglu"):
        assert (HERE / "results" / f"benchmark_{kernel}_smoke.png").stat().st_size > 10_000
