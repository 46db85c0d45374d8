"""`flowrl timeline`: a Gantt chart of a run's node spans, one row per worker group, from RUN_DIR/trace.json.

The trace holds Chrome "X" events (microseconds) named by node id, with `cat` = op, `tid` = worker group
(named by thread_name metadata) and `args.step`; this draws the last few steps of it with matplotlib.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError
from flowrl.viz.style import OP_COLORS, OTHER_OP_COLOR

FORMATS = ("png", "svg", "pdf")


@dataclass(frozen=True)
class Bar:
    node: str
    op: str
    row: int  # the tid
    step: int
    start: float  # seconds since the first drawn span
    dur: float


def load_spans(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The span events of RUN_DIR/trace.json and the track names (tid -> worker group)."""
    path = Path(run_dir) / "trace.json"
    if not Path(run_dir).is_dir():
        raise FlowError(Diagnostic(f"timeline: no run directory {run_dir}",
                                   hint="pass the --out folder of a `flowrl run`"))
    if not path.is_file():
        raise FlowError(Diagnostic(f"timeline: {run_dir} has no trace.json",
                                   hint="a run writes trace.json at each checkpoint and at its last step"))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FlowError(f"timeline: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
             and isinstance(e.get("args"), dict) and "step" in e["args"]]
    names = {int(e["tid"]): str(e["args"]["name"]) for e in events
             if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"}
    if not spans:
        raise FlowError(Diagnostic(f"timeline: {path} has no spans",
                                   hint="run at least one step (`flowrl run FILE --steps 3`)"))
    return spans, names


def bars(spans: list[dict[str, Any]], last_steps: int) -> list[Bar]:
    """The spans of the last `last_steps` steps, with times in seconds from the first of them."""
    steps = sorted({int(e["args"]["step"]) for e in spans})[-last_steps:]
    kept = [e for e in spans if int(e["args"]["step"]) in steps]
    t0 = min(float(e["ts"]) for e in kept)
    return sorted((Bar(str(e["name"]), str(e.get("cat", "")), int(e.get("tid", 0)), int(e["args"]["step"]),
                       (float(e["ts"]) - t0) / 1e6, float(e.get("dur", 0.0)) / 1e6) for e in kept),
                  key=lambda b: (b.start, b.row, b.node))


def timeline(run_dir: str | Path, output: str | Path, last_steps: int = 3) -> Path:
    """Draw the last `last_steps` steps of RUN_DIR/trace.json into OUT (.png, .svg or .pdf)."""
    out = Path(output)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise FlowError(Diagnostic(f"cannot draw a timeline to '{output}': the output must end in "
                                   f"{', '.join('.' + f for f in FORMATS)}", hint="for example `-o timeline.png`"))
    if last_steps < 1:
        raise FlowError(f"timeline: --steps must be at least 1, got {last_steps}")
    spans, names = load_spans(run_dir)
    drawn = bars(spans, last_steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot(drawn, names, out, Path(run_dir).name or str(run_dir))
    return out


def _plot(drawn: list[Bar], names: dict[int, str], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted({b.row for b in drawn})
    y = {tid: i for i, tid in enumerate(reversed(rows))}  # the first track (the controller) on top
    end = max(b.start + b.dur for b in drawn) or 1.0
    fig_w = 12.0
    fig, ax = plt.subplots(figsize=(fig_w, 1.4 + 0.55 * len(rows)), dpi=110)
    min_w = end * 0.002  # a 1 ms data node would be invisible; draw it as a sliver
    for b in drawn:
        ax.barh(y[b.row], max(b.dur, min_w), left=b.start, height=0.6,
                color=OP_COLORS.get(b.op, OTHER_OP_COLOR), edgecolor="white", linewidth=0.5)
    first: dict[int, float] = {}  # step -> where its first span starts
    for b in drawn:
        first.setdefault(b.step, b.start)
    for step, start in sorted(first.items()):
        ax.axvline(start, color="#495057", alpha=0.25, lw=1, ls="--", zorder=0)
        ax.text(start, len(rows) - 0.45, f" step {step}", fontsize=8, color="#495057", va="bottom")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([names.get(tid, f"track {tid}") for tid in reversed(rows)])
    ax.set_ylim(-0.6, len(rows) - 0.1)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds (from the first span drawn)")
    steps = sorted(first)
    shown = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    ax.set_title(f"{title}: node spans per worker group, {shown}", loc="left", fontsize=11)
    ax.grid(axis="x", alpha=0.25)
    ax.spines[["top", "right"]].set_visible(False)
    ops = sorted({b.op for b in drawn}, key=lambda op: (list(OP_COLORS).index(op) if op in OP_COLORS else 99, op))
    ax.legend(handles=[Patch(color=OP_COLORS.get(op, OTHER_OP_COLOR), label=op) for op in ops],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, title="op",
              title_fontsize=8)
    fig.tight_layout()
    _label_bars(fig, ax, drawn, y)
    fig.savefig(out)
    plt.close(fig)


def _label_bars(fig: Any, ax: Any, drawn: list[Bar], y: dict[int, int]) -> None:
    """Write each node id inside its bar, only where the rendered text fits (measured, not guessed)."""
    renderer = fig.canvas.get_renderer()
    for b in drawn:
        color = OP_COLORS.get(b.op, OTHER_OP_COLOR)
        (x0, _), (x1, _) = ax.transData.transform([(b.start, 0), (b.start + b.dur, 0)])
        for size in (8, 6.5):  # a smaller font before giving up on a narrow bar
            text = ax.text(b.start + b.dur / 2, y[b.row], b.node, ha="center", va="center", fontsize=size,
                           color="black" if _light(color) else "white")
            if text.get_window_extent(renderer).width + 4 <= x1 - x0:
                break
            text.remove()


def _light(hex_color: str) -> bool:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b > 150
