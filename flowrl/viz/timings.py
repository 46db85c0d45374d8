"""Per-node mean times from a run directory's metrics.jsonl, for `flowrl viz --timings RUN_DIR`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flowrl.errors import Diagnostic, FlowError

PREFIX = "time/"


@dataclass(frozen=True)
class Timings:
    """Mean seconds per node over the measured steps, and the mean step time they are a share of."""

    node_s: dict[str, float]
    step_s: float
    steps: tuple[int, ...]  # the steps averaged (step 1 is left out as warm-up when there are >= 3)

    def share(self, node_id: str) -> float | None:
        if node_id not in self.node_s or self.step_s <= 0:
            return None
        return self.node_s[node_id] / self.step_s

    def caption(self) -> str:
        n = len(self.steps)
        span = f"steps {self.steps[0]}..{self.steps[-1]}" if n > 1 else f"step {self.steps[0]}"
        return f"mean step {self.step_s:.3g} s over {n} step{'s' if n != 1 else ''} ({span})"


def _rows(path: Path) -> list[dict[str, object]]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlowError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def load_timings(run_dir: str | Path) -> Timings:
    """Read RUN_DIR/metrics.jsonl; mean of each `time/<node id>`; the step time is the mean `step_time_s`
    (or the sum of the node times where a row has none)."""
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not run.is_dir():
        raise FlowError(Diagnostic(f"--timings: no run directory {run}",
                                   hint="pass the --out folder of a `flowrl run`"))
    if not path.is_file():
        raise FlowError(Diagnostic(f"--timings: {run} has no metrics.jsonl",
                                   hint="pass the --out folder of a `flowrl run` that finished a step"))
    rows = sorted(_rows(path), key=lambda r: int(str(r["step"])))
    if len(rows) >= 3:
        rows = [r for r in rows if int(str(r["step"])) != 1]  # step 1 pays for warm-up (compilation, caches)
    if not rows:
        raise FlowError(f"--timings: {path} has no steps")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    step_total = 0.0
    for r in rows:
        node_times = {k[len(PREFIX):]: float(v) for k, v in r.items()
                      if k.startswith(PREFIX) and isinstance(v, (int, float))}
        for node, s in node_times.items():
            sums[node] = sums.get(node, 0.0) + s
            counts[node] = counts.get(node, 0) + 1
        step = r.get("step_time_s")
        step_total += float(step) if isinstance(step, (int, float)) else sum(node_times.values())
    if not sums:
        raise FlowError(f"--timings: {path} has no time/<node> entries")
    means = {node: sums[node] / counts[node] for node in sorted(sums)}
    return Timings(means, step_total / len(rows), tuple(int(str(r["step"])) for r in rows))
