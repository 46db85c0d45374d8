"""Where each finished step's row goes, one sink after another: metrics.jsonl, lengths.jsonl and TensorBoard.

`runtime.runner` sends every step's row here (`write`) and closes them at the end of the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl.runtime import report
from flowrl.runtime.controller import StepResult

METRICS, LENGTHS, TRACE = "metrics.jsonl", "lengths.jsonl", "trace.json"


class StepSinks:
    """The run directory's per-step outputs."""

    def __init__(self, out: Path):
        self.metrics_path, self.lengths_path = out / METRICS, out / LENGTHS
        self.tb = report.TensorBoard(out / "tb")
        self.closed = False

    def resume_at(self, step: int) -> None:
        """A resumed run recomputes the steps after its checkpoint's: their rows go."""
        report.truncate_metrics(self.metrics_path, step)
        report.truncate_metrics(self.lengths_path, step)

    def write(self, step: int, row: dict[str, Any], result: StepResult) -> None:
        report.append_metrics(self.metrics_path, row)
        for trace_row in result.lengths:
            report.append_metrics(self.lengths_path, trace_row)
        self.tb.log(step, row)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.tb.close()
