"""Run outputs: metrics.jsonl, Chrome trace events (trace.json), the headline curve (reward.png, or a preference
stage's accuracy.png / sft_loss.png / dpo_loss.png), TensorBoard when present (or asked for: `run { log =
["tensorboard"] }`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.runtime.controller import Span
from flowrl.runtime.progress import headline_key, held_out

TRACE_PID = 1


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows after `last_step` (a resumed run recomputes them)."""
    rows = [r for r in read_metrics(path) if int(r["step"]) <= last_step]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def trace_events(spans: Iterable[Span], groups: Sequence[str],
                 prior: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Chrome trace events ("X" complete events, microseconds): one span per node per step, one track
    (tid) per worker group, named with thread_name metadata so Perfetto shows the group names. `prior`
    holds the span events of the steps before a resume."""
    tids = {g: i + 1 for i, g in enumerate(groups)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": TRACE_PID, "tid": 0, "args": {"name": "flowrl"}}
    ]
    events += [{"ph": "M", "name": "thread_name", "pid": TRACE_PID, "tid": t, "args": {"name": g}}
               for g, t in tids.items()]
    events += list(prior)
    for e in prior:  # tracks a resumed run's earlier steps had (an elastic pool's instances)
        tids.setdefault(str(e.get("args", {}).get("group")), int(e["tid"]))
    for s in spans:
        tid = tids.setdefault(s.group, len(tids) + 1)
        events.append({"name": s.node, "cat": s.op, "ph": "X", "pid": TRACE_PID, "tid": tid,
                       "ts": round(s.start * 1e6, 1), "dur": round(s.dur * 1e6, 1),
                       "args": {"step": s.step, "group": s.group}})
    named = {g for g in groups}
    events[1:1] = [{"ph": "M", "name": "thread_name", "pid": TRACE_PID, "tid": t, "args": {"name": g}}
                   for g, t in tids.items() if g not in named]  # tracks found in the spans (instances)
    return events


def write_trace(path: Path, events: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")


def load_trace(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8")).get("traceEvents", [])
    return events


# The curve a run draws, by its headline (flowrl.runtime.progress.headline_key): the file it is written to.
PLOTS = {"reward": "reward.png", "acc": "accuracy.png", "sft_loss": "sft_loss.png", "dpo_loss": "dpo_loss.png",
         "loss": "loss.png"}


@dataclass(frozen=True)
class Plot:
    """What `plot_headline` drew: the file, the metric and its points, and the held-out scores beside it."""

    path: Path
    key: str
    steps: list[int]
    values: list[float]
    held_out: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # name -> (step, value)


def plot_headline(metrics: list[dict[str, Any]], out_dir: Path, title: str) -> Plot | None:
    """The run's headline over its steps (`reward_mean` to reward.png for an RL run; a preference stage's
    training accuracy to accuracy.png, its SFT or DPO loss to sft_loss.png / dpo_loss.png), with the held-out
    scores of the same kind as points where it measured them. None when no row has a headline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = next((f for f in map(headline_key, reversed(metrics)) if f is not None), None)
    if found is None:
        return None
    key, name = found
    points = [(int(r["step"]), float(r[key])) for r in metrics if key in r]
    want = "eval_loss" if name.endswith("loss") else "eval_acc"
    evals = [(int(r["step"]), v) for r in metrics for n, v in held_out(r).items() if n == want]
    plot = Plot(out_dir / PLOTS[name], key, [s for s, _ in points], [v for _, v in points],
                {want: evals} if evals and name != "reward" else {})
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(plot.steps, plot.values, lw=1, alpha=0.5, label=key)
    if len(plot.values) >= 5:
        k = max(1, len(plot.values) // 20)
        smooth = [sum(plot.values[max(0, i - k):i + 1]) / len(plot.values[max(0, i - k):i + 1])
                  for i in range(len(plot.values))]
        ax.plot(plot.steps, smooth, lw=2, label=f"moving mean ({k + 1})")
    for label, pts in plot.held_out.items():
        ax.plot([s for s, _ in pts], [v for _, v in pts], "o-", lw=1.5, label=f"{label} (held-out rows)")
    ax.set_xlabel("step")
    ax.set_ylabel({"reward": "reward", "acc": "accuracy"}.get(name, name))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right" if name.endswith("loss") else "lower right")
    fig.tight_layout()
    fig.savefig(plot.path)
    plt.close(fig)
    return plot


class TensorBoard:
    """Writes scalars when `tensorboard` is installed; a no-op otherwise, unless `required` (`run { log =
    ["tensorboard"] }`, whose extra `tracking.require` checked before the run started). Also the run's files and
    its samples as text."""

    def __init__(self, logdir: Path, required: bool = False):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard is an optional extra
            if required:
                raise
            self.writer = None
        else:
            self.writer = SummaryWriter(str(logdir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and k != "step":
                self.writer.add_scalar(k, v, step)

    def text(self, tag: str, text: str, step: int) -> None:
        """`text` shown as is (TensorBoard renders markdown: indented, it stays preformatted)."""
        if self.writer is not None:
            self.writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)

    def samples(self, kind: str, rows: Sequence[dict[str, Any]], step: int) -> None:
        """Sample rows as a markdown table under `samples/KIND`."""
        if self.writer is None or not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        cell = lambda v: json.dumps(v) if not isinstance(v, str) else v  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(r.get(c)).replace("|", "\\|").replace("\n", "⏎") for c in columns) + " |"
                  for r in rows]
        self.writer.add_text(f"samples/{kind}", "\n".join(lines), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
