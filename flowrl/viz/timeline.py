"""`flowrl timeline`: a Gantt chart of a run's node spans, one row per worker group, from RUN_DIR/trace.json.

The trace holds Chrome "X" events (microseconds) named by node id, with `cat` = op, `tid` = worker group
(named by thread_name metadata) and `args.step`; this draws the last few steps of it with matplotlib.
Spans of one track that overlap in time (a pool's instances, all started at once) are drawn in lanes, one
above the other, so no bar hides another and each label sits inside its own bar or is left out.
A generate that ran environments (issue 26; RUN_DIR/metrics.jsonl has its step's `env/*`) is labelled with its
mean turns, and a hatched strip along its bottom is the share of the call spent waiting on environments with
nothing to decode (`env/idle_frac`: a share, not where in the call those waits fell).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError
from flowrl.viz.style import OP_COLORS, OTHER_OP_COLOR

FORMATS = ("png", "svg", "pdf")
ENV_WAIT_COLOR = "#2b8a3e"


@dataclass(frozen=True)
class Bar:
    node: str
    op: str
    row: int  # the tid
    step: int
    start: float  # seconds since the first drawn span
    dur: float
    lane: int = 0  # 0 for the track's first lane; overlapping spans of one track take the next free lane
    turns: float | None = None  # a generate with environments: mean turns per trajectory in its step
    env_wait: float = 0.0  # ... and the share of its call spent waiting on environments


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


def env_steps(run_dir: str | Path) -> dict[int, tuple[float, float]]:
    """step -> (env/turns_mean, env/idle_frac) from RUN_DIR/metrics.jsonl, for the steps that ran environments."""
    path = Path(run_dir) / "metrics.jsonl"
    out: dict[int, tuple[float, float]] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a run still writing it
        if isinstance(row, dict) and "env/turns_mean" in row and "step" in row:
            out[int(row["step"])] = (float(row["env/turns_mean"]), float(row.get("env/idle_frac", 0.0)))
    return out


def with_envs(drawn: list[Bar], envs: dict[int, tuple[float, float]]) -> list[Bar]:
    """Generate bars of steps that ran environments, with their turns and wait share."""
    return [replace(b, turns=envs[b.step][0], env_wait=envs[b.step][1]) if b.op == "generate" and b.step in envs
            else b for b in drawn]


def bars(spans: list[dict[str, Any]], last_steps: int) -> list[Bar]:
    """The spans of the last `last_steps` steps, with times in seconds from the first of them."""
    steps = sorted({int(e["args"]["step"]) for e in spans})[-last_steps:]
    kept = [e for e in spans if int(e["args"]["step"]) in steps]
    t0 = min(float(e["ts"]) for e in kept)
    return in_lanes([Bar(str(e["name"]), str(e.get("cat", "")), int(e.get("tid", 0)), int(e["args"]["step"]),
                         (float(e["ts"]) - t0) / 1e6, float(e.get("dur", 0.0)) / 1e6) for e in kept])


def in_lanes(drawn: list[Bar]) -> list[Bar]:
    """The bars by start time, each in the lowest lane of its track free when it starts (greedy interval
    partitioning: a track gets as many lanes as it has spans open at one time). Bars that touch share a lane."""
    ends: dict[int, list[float]] = {}  # track -> when each of its lanes is free again
    out = []
    for b in sorted(drawn, key=lambda b: (b.start, b.row, b.node)):
        lanes = ends.setdefault(b.row, [])
        free = next((i for i, end in enumerate(lanes) if end <= b.start + 1e-9), len(lanes))
        if free == len(lanes):
            lanes.append(0.0)
        lanes[free] = b.start + b.dur
        out.append(replace(b, lane=free))
    return out


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
    drawn = with_envs(bars(spans, last_steps), env_steps(run_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(drawn, names, Path(run_dir).name or str(run_dir))
    fig.savefig(out)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


@dataclass(frozen=True)
class Track:
    """Where a track's bars go on the y axis: its lanes share the band [bottom + PAD, bottom + height - PAD]."""

    bottom: float
    height: float
    lanes: int

    def lane(self, lane: int) -> tuple[float, float]:
        """(centre, bar height) of a lane; lane 0 on top."""
        band = self.height - 2 * PAD
        step = band / self.lanes
        top = self.bottom + self.height - PAD
        return top - (lane + 0.5) * step, (step * 0.85 if self.lanes > 1 else band)


PAD = 0.2  # between a track's bars and the next track, in y units (a one-lane track is 1 unit, bars 0.6)


def tracks(drawn: list[Bar]) -> dict[int, Track]:
    """The y layout: the first track (the controller) on top; a track of n lanes is taller, up to 4 units."""
    lanes: dict[int, int] = {}
    for b in drawn:
        lanes[b.row] = max(lanes.get(b.row, 0), b.lane + 1)
    out, bottom = {}, 0.0
    for row in sorted(lanes, reverse=True):
        height = min(4.0, max(1.0, 0.4 + 0.35 * lanes[row]))  # labels fit lanes up to ~10
        out[row] = Track(bottom, height, lanes[row])
        bottom += height
    return out


def figure(drawn: list[Bar], names: dict[int, str], title: str) -> Any:
    """The chart as a matplotlib Figure (the caller saves and closes it): one track per worker group, each
    bar in its lane, node ids inside the bars they fit in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    layout = tracks(drawn)
    top = max(t.bottom + t.height for t in layout.values())
    end = max(b.start + b.dur for b in drawn) or 1.0
    fig, ax = plt.subplots(figsize=(12.0, 1.4 + 0.55 * top), dpi=110)
    min_w = end * 0.002  # a 1 ms data node would be invisible; draw it as a sliver
    for b in drawn:
        y, h = layout[b.row].lane(b.lane)
        ax.barh(y, max(b.dur, min_w), left=b.start, height=h, color=OP_COLORS.get(b.op, OTHER_OP_COLOR),
                edgecolor="white", linewidth=0.5)
        if b.env_wait > 0:
            ax.barh(y - h * 0.35, b.dur * b.env_wait, left=b.start, height=h * 0.3, fill=False, hatch="////",
                    edgecolor=ENV_WAIT_COLOR, linewidth=0)
    first: dict[int, float] = {}  # step -> where its first span starts
    for b in drawn:
        first.setdefault(b.step, b.start)
    for step, start in sorted(first.items()):
        ax.axvline(start, color="#495057", alpha=0.25, lw=1, ls="--", zorder=0)
        ax.text(start, top + 0.05, f" step {step}", fontsize=8, color="#495057", va="bottom")
    rows = sorted(layout)
    ax.set_yticks([layout[r].bottom + layout[r].height / 2 for r in rows])
    ax.set_yticklabels([names.get(r, f"track {r}") + (f"\n(up to {layout[r].lanes} at once)"
                                                      if layout[r].lanes > 1 else "") for r in rows])
    ax.set_ylim(-0.1, top + 0.4)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds (from the first span drawn)")
    steps = sorted(first)
    shown = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    ax.set_title(f"{title}: node spans per worker group, {shown}", loc="left", fontsize=11)
    ax.grid(axis="x", alpha=0.25)
    ax.spines[["top", "right"]].set_visible(False)
    ops = sorted({b.op for b in drawn}, key=lambda op: (list(OP_COLORS).index(op) if op in OP_COLORS else 99, op))
    handles = [Patch(color=OP_COLORS.get(op, OTHER_OP_COLOR), label=op) for op in ops]
    if any(b.env_wait > 0 for b in drawn):
        handles.append(Patch(fill=False, hatch="////", edgecolor=ENV_WAIT_COLOR, label="env wait (share)"))
    ax.legend(handles=handles,
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, title="op",
              title_fontsize=8)
    fig.tight_layout()
    _label_bars(fig, ax, drawn, layout)
    return fig


def _label_bars(fig: Any, ax: Any, drawn: list[Bar], layout: dict[int, Track]) -> None:
    """Write each node id inside its bar, only where the rendered text fits its width and height (measured,
    not guessed): bars of a lane never overlap, so neither do their labels."""
    renderer = fig.canvas.get_renderer()
    for b in drawn:
        color = OP_COLORS.get(b.op, OTHER_OP_COLOR)
        y, h = layout[b.row].lane(b.lane)
        (x0, y0), (x1, y1) = ax.transData.transform([(b.start, y - h / 2), (b.start + b.dur, y + h / 2)])
        for size in (8, 6.5):  # a smaller font before giving up on a narrow bar
            label = b.node if b.turns is None else f"{b.node} \u00b7 {b.turns:.1f} turns"
            text = ax.text(b.start + b.dur / 2, y, label, ha="center", va="center", fontsize=size,
                           color="black" if _light(color) else "white")
            box = text.get_window_extent(renderer)
            if box.width + 4 <= x1 - x0 and box.height + 1 <= y1 - y0:
                break
            text.remove()


def _light(hex_color: str) -> bool:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b > 150
