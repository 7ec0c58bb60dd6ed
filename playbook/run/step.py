"""How each training step is queued: eagerly, or replayed from one CUDA graph, and eager again when the graph
cannot go on.

    eager      every step while the run cannot be captured (cuda_graph.graph_blocker says why), and the first
               step of a run that can: its kernels run on the capture's side stream, as a capture asks
    captured   the steps after the first: the step recorded once (cuda_graph.GraphedStep) and replayed
    fallback   eager again, for the rest of the run, after a capture that failed or batches whose shapes
               differ from the captured ones; the run says why in one line and in its summary's step mode

The step itself is the caller's (training.training_step bound to the model and optimizer); this module
decides how it is queued and times it.
"""

from __future__ import annotations

import time

from core.process import log
from playbook.run import cuda_graph
from playbook.runtime.common import synchronize


class StepRunner:
    """Runs the steps of one training run, captured where it can.

    step_fn(micro_batches, grad_norm=False, zero_grad=True) -> (loss, grad norm or None): one eager step.
    norm_fn() -> the gradients' norm, for a logged replayed step (a replay leaves its gradients behind).
    blocker: why the run's step cannot be captured (cuda_graph.graph_blocker), or None.
    `mode` is the summary's "step mode": "", "replayed from step N" (with when that ended) or "off (why)".
    """

    def __init__(self, step_fn, norm_fn, optimizer, device, blocker: str | None, compiled: bool = False):
        self.step_fn, self.norm_fn, self.optimizer, self.device = step_fn, norm_fn, optimizer, device
        self.blocker, self.compiled = blocker, compiled
        self.graphed = None  # the step to capture (cuda_graph.GraphedStep); captured after the first step of the run
        self.mode = "" if blocker is None else f"off ({blocker})"

    @property
    def captured(self) -> bool:
        return self.graphed is not None and self.graphed.graph is not None

    def run(self, step: int, batches: list[dict], log_now: bool):
        """Step `step` (0-based) on its micro-batches. Returns (loss, grad norm or None, seconds the host took
        to queue the step, seconds of the whole step); the norm is computed when log_now (or clipping gives it)."""
        if self.blocker is None and self.graphed is None:
            self.graphed = cuda_graph.GraphedStep(lambda mb: self.step_fn(mb, zero_grad=False), batches,
                                                  compiled=self.compiled)
        if self.captured and not self.graphed.matches(batches):
            log(f"CUDA graphs: step {step + 1}'s batches differ in shape from the captured ones; the rest "
                "of the run is queued eagerly")
            self.mode += f", eager from step {step + 1} (the batches changed shape)"
            self.graphed, self.blocker = None, "the batches changed shape"
            self.optimizer.zero_grad(set_to_none=True)  # the graph's gradients are not this step's to add to

        def eager(mb):
            return self.step_fn(mb, grad_norm=log_now)

        synchronize(self.device)
        t0 = time.perf_counter()
        loss, norm = self.graphed.run(batches, eager) if self.graphed is not None else eager(batches)
        queued = time.perf_counter() - t0  # the host's time to queue the step (no sync inside it)
        synchronize(self.device)
        seconds = time.perf_counter() - t0
        if log_now and norm is None and self.captured:
            norm = self.norm_fn()  # the replay left this step's gradients; outside the timing
        return loss, norm, queued, seconds

    def after(self, step: int, steps: int) -> None:
        """After step `step` (0-based) is done and saved: the first step of the run is captured here, for the
        steps after it to replay (none when it was the last); a failed capture leaves the run eager."""
        if self.graphed is None or self.graphed.graph is not None or step + 1 >= steps:
            return
        failed = self.graphed.capture(self.optimizer)
        if failed is not None:
            log(f"CUDA graphs: the capture failed ({failed}); each step is queued eagerly")
            self.graphed, self.blocker = None, failed
            self.mode = f"off ({failed})"
        else:
            self.mode = f"replayed from step {step + 2}"

    def peak_bytes(self) -> int:
        """The peak allocated GPU memory since the last reset, the captured step's own footprint included."""
        return cuda_graph.peak_bytes(self.graphed)
