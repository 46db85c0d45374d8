"""`flowrl timeline`: a Gantt chart PNG from a run's trace.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

import flowrl.cli
from flowrl.errors import FlowError
from flowrl.runtime.controller import Span
from flowrl.runtime.report import trace_events, write_trace
from flowrl.viz.timeline import bars, figure, load_spans, timeline, tracks

DUR = {"prompts": 0.002, "rollout": 0.8, "old_logp": 0.12, "ref_logp": 0.11, "scores": 0.03, "adv": 0.004,
       "actor.update": 0.35}


def write_run(run: Path, graph: Any, steps: int = 5) -> Path:
    """A trace like the runner writes: the nodes run one after another, step after step."""
    spans, t = [], 2.0
    for step in range(1, steps + 1):
        for n in graph.nodes:
            spans.append(Span(n.id, n.op, n.worker_group, step, t, DUR[n.id]))
            t += DUR[n.id] + 0.001
    run.mkdir(parents=True, exist_ok=True)
    write_trace(run / "trace.json", trace_events(spans, ["controller", *[w.name for w in graph.worker_groups]]))
    return run


def test_timeline_png(graphs: Any, tmp_path: Path) -> None:
    out = timeline(write_run(tmp_path / "run", graphs.grpo()), tmp_path / "t.png")
    assert out.stat().st_size > 0
    h, w = matplotlib.image.imread(out).shape[:2]
    assert 800 < w < 2500 and 150 < h < 1000 and w > h


def test_last_steps_are_drawn_from_zero(graphs: Any, tmp_path: Path) -> None:
    spans, names = load_spans(write_run(tmp_path / "run", graphs.grpo(), steps=5))
    assert names == {1: "controller", 2: "rollout", 3: "train"}
    drawn = bars(spans, 2)
    assert {b.step for b in drawn} == {4, 5}
    assert len(drawn) == 2 * len(DUR)
    assert drawn[0].node == "prompts" and drawn[0].start == 0.0
    assert {b.row for b in drawn if b.node == "rollout"} == {2}
    assert drawn[-1].node == "actor.update" and drawn[-1].dur == pytest.approx(0.35)
    assert len(bars(spans, 99)) == 5 * len(DUR)


def test_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(FlowError, match="has no trace.json"):
        timeline(tmp_path, tmp_path / "t.png")
    with pytest.raises(FlowError, match="no run directory"):
        timeline(tmp_path / "nope", tmp_path / "t.png")


def test_empty_trace(tmp_path: Path) -> None:
    write_trace(tmp_path / "trace.json", trace_events([], ["controller"]))
    with pytest.raises(FlowError, match="has no spans"):
        timeline(tmp_path, tmp_path / "t.png")


def test_bad_output_and_steps(graphs: Any, tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", graphs.grpo())
    with pytest.raises(FlowError, match="must end in .png, .svg, .pdf"):
        timeline(run, tmp_path / "t.jpg")
    with pytest.raises(FlowError, match="--steps must be at least 1"):
        timeline(run, tmp_path / "t.png", last_steps=0)


def test_cli_timeline_verb(graphs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", graphs.grpo())
    out = tmp_path / "t.png"
    assert flowrl.cli.main(["timeline", str(run), "-o", str(out), "--steps", "1"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n" and out.stat().st_size > 0


def span(name: str, tid: int, start: float, dur: float, op: str = "instance", step: int = 1) -> dict[str, Any]:
    return {"name": name, "cat": op, "ph": "X", "pid": 1, "tid": tid, "ts": start * 1e6, "dur": dur * 1e6,
            "args": {"step": step}}


def test_overlapping_spans_of_a_track_take_lanes() -> None:
    drawn = bars([span("a", 1, 0, 2), span("b", 1, 0, 1), span("c", 2, 0, 1), span("d", 1, 1, 2),
                  span("e", 1, 2.5, 1.5)], 1)
    # d starts as b ends (lane 1 is free again); e starts after a ends (lane 0)
    assert [(b.node, b.row, b.lane) for b in drawn] == [("a", 1, 0), ("b", 1, 1), ("c", 2, 0), ("d", 1, 1),
                                                       ("e", 1, 0)]
    layout = tracks(drawn)
    assert (layout[2].bottom, layout[2].height, layout[2].lanes) == (0.0, 1.0, 1)  # the last track at the bottom
    assert (layout[1].bottom, layout[1].height, layout[1].lanes) == (1.0, pytest.approx(1.1), 2)
    assert layout[1].lane(0)[0] > layout[1].lane(1)[0]  # lane 0 on top
    many = tracks(bars([span(f"i{k}", 1, 0, 1) for k in range(26)], 1))
    assert many[1].lanes == 26 and many[1].height == 4.0


def test_labels_of_instances_started_together_do_not_overlap(tmp_path: Path) -> None:
    """A pool's instances start at once and end close together (as the simulator's pipe-rlhf draws them): each
    label sits inside its own bar, none over another (drawn on one lane, their labels crossed)."""
    spans = [span("rollout", 1, 0, 1.0, op="generate"),
             *[span(f"instance {k}", 2, 0, d) for k, d in enumerate((0.9, 0.95, 1.0))]]
    drawn = bars(spans, 1)
    fig = figure(drawn, {1: "rollout", 2: "rollout instances"}, "pipe")
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts if t.get_text() in
              {b.node for b in drawn}}
    assert sorted(labels) == ["instance 0", "instance 1", "instance 2", "rollout"]
    boxes = list(labels.values())
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    bars_px = [p.get_window_extent(renderer) for p in ax.patches]
    assert all(any(p.x0 <= box.x0 and box.x1 <= p.x1 and p.y0 <= box.y0 and box.y1 <= p.y1 for p in bars_px)
               for box in boxes)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rollout", "rollout instances\n(up to 3 at once)"]


def test_a_generate_with_environments_shows_its_turns_and_waits(graphs: Any, tmp_path: Path) -> None:
    """Steps whose metrics have env/* (issue 26) label their generate with its turns and hatch its wait share;
    other steps and other nodes are drawn as before."""
    import json

    from flowrl.viz.timeline import env_steps, with_envs

    run = write_run(tmp_path / "run", graphs.grpo(), steps=2)
    rows = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "env/turns_mean": 2.5, "env/idle_frac": 0.25}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = with_envs(bars(load_spans(run)[0], 2), env_steps(run))
    envs = [(b.node, b.step, b.turns, b.env_wait) for b in drawn if b.turns is not None]
    assert envs == [("rollout", 2, 2.5, 0.25)]
    assert timeline(run, tmp_path / "t.png").exists()
