"""The same seed gives the same metrics on every backend, before and after the backends moved under backends/.

`tests/golden/metrics_before_move.json` was recorded before the move (issue 14), with the thread and process
ranks of the time (`ThreadedLocalBackend(2)`, `ProcessBackend(2)`): each case's flow, steps and overrides, and
its metrics without timings and fusion counters (which depend on thread timing). The same runs now go through
the backend registry by name, with the ranks from each model's `replicas`; they must give the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import flowrl

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "metrics_before_move.json").read_text())
# How each recorded case runs now: backend name and the overrides that give every group two ranks.
NOW = {
    "grpo_arith/local": ("local", {}),
    "ppo_arith/local": ("local", {}),
    "longtail_grpo/threads2": ("threads", {"actor.replicas": "2", "ref.replicas": "2"}),
    "longtail_ppo/process2": ("process", {m + ".replicas": "2" for m in ("actor", "ref", "critic", "rm")}),
}
TOL = 1e-4  # two recordings of the thread and process cases differed by <= 2e-6 (reduction order)
# Metrics added since the recording, by their ending; every other key must be exactly the recorded set.
ADDED_SINCE = ("/length_spearman",)


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items()
            if not k.startswith(("time/", "fusion/", "cost/")) and k not in ("step_time_s", "tokens_per_s")
            and not k.endswith(ADDED_SINCE)}


@pytest.mark.parametrize("case", sorted(NOW))
def test_a_short_run_gives_the_metrics_recorded_before_the_move(case: str, tmp_path: Path) -> None:
    recorded = GOLDEN[case]
    backend, replicas = NOW[case]
    graph = flowrl.load(str(ROOT / recorded["flow"]), overrides={**recorded["set"], **replicas})
    if backend != "local":
        assert {w.ranks for w in graph.worker_groups} == {2}
    rows = [_clean(r) for r in flowrl.run(graph, out_dir=tmp_path, backend=backend, steps=recorded["steps"]).metrics]
    assert len(rows) == len(recorded["metrics"])
    for got, want in zip(rows, recorded["metrics"], strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (case, got["step"], key)
