"""`flowrl viz --timings RUN_DIR`: mean node times from metrics.jsonl, drawn as a white-to-red fill."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from flowrl.errors import FlowError
from flowrl.viz import render_graph, style
from flowrl.viz.timings import load_timings
from flowrl.viz.views import STAGES, draw

NODE_S = {"prompts": 0.01, "rollout": 0.5, "old_logp": 0.1, "ref_logp": 0.1, "scores": 0.05, "adv": 0.04,
          "actor.update": 0.2}  # sums to 1.0 s


def write_metrics(run: Path, steps: int, warmup: float = 10.0) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        scale = warmup if step == 1 else 1.0  # step 1 is slow (warm-up)
        times = {f"time/{k}": v * scale for k, v in NODE_S.items()}
        rows.append({"step": step, "reward_mean": 0.5, **times, "step_time_s": 1.0 * scale})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run


def test_means_skip_the_warmup_step(tmp_path: Path) -> None:
    t = load_timings(write_metrics(tmp_path / "run", 4))
    assert t.steps == (2, 3, 4)
    assert t.step_s == pytest.approx(1.0)
    assert t.node_s["rollout"] == pytest.approx(0.5)
    assert t.share("actor.update") == pytest.approx(0.2)
    assert t.share("no_such_node") is None


def test_fewer_than_three_steps_keep_step_one(tmp_path: Path) -> None:
    t = load_timings(write_metrics(tmp_path / "run", 2, warmup=3.0))
    assert t.steps == (1, 2)
    assert t.node_s["rollout"] == pytest.approx((1.5 + 0.5) / 2)


def test_nodes_are_filled_by_their_share(graphs: Any, tmp_path: Path) -> None:
    t = load_timings(write_metrics(tmp_path / "run", 5))
    g = graphs.grpo()
    for stage in STAGES:
        source = draw(g, stage, t).source
        for node, seconds in NODE_S.items():
            line = next(ln for ln in source.splitlines() if re.match(rf'\s*"?{re.escape(node)}"? \[', ln))
            assert f"fillcolor=\"{style.heat(seconds)}\"" in line, (stage, node)
            assert f"{style.seconds(seconds)} \u00b7 {style.percent(seconds)}" in line
        assert "mean step 1 s over 4 steps (steps 2..5)" in source


def test_heat_runs_white_to_red() -> None:
    assert style.heat(0.0) == "#ffffff"
    assert style.heat(1.0) == "#c92a2a"
    reds = [int(style.heat(s)[3:5], 16) for s in (0.0, 0.01, 0.1, 0.5, 1.0)]
    assert reds == sorted(reds, reverse=True)  # green channel falls: whiter to redder


def test_untimed_nodes_are_white(graphs: Any, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/rollout": 0.5, "step_time_s": 1.0}) + "\n",
                                       encoding="utf-8")
    source = draw(graphs.grpo(), "parsed", load_timings(run)).source
    line = next(ln for ln in source.splitlines() if ln.strip().startswith("adv ["))
    assert 'fillcolor=white' in line and "no timing" in line


def test_render_graph_takes_a_run_dir(graphs: Any, tmp_path: Path) -> None:
    out = render_graph(graphs.grpo(), tmp_path / "t.dot", "optimized", timings=write_metrics(tmp_path / "run", 3))
    assert style.heat(0.5) in out.read_text(encoding="utf-8")


def test_missing_run_dir(tmp_path: Path) -> None:
    with pytest.raises(FlowError, match="--timings: no run directory"):
        load_timings(tmp_path / "nope")


def test_missing_metrics(tmp_path: Path) -> None:
    with pytest.raises(FlowError, match="has no metrics.jsonl"):
        load_timings(tmp_path)


def test_metrics_without_times(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.1}\n', encoding="utf-8")
    with pytest.raises(FlowError, match="no time/<node> entries"):
        load_timings(tmp_path)


def test_broken_metrics_line_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(FlowError, match=r"metrics.jsonl:2: not valid JSON"):
        load_timings(tmp_path)
