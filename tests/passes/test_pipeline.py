"""The rewrite passes together: pipeline order, switching off, --explain, viz, and the long-tail examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.backends.threads import ThreadBackend
from flowrl.cli import main
from flowrl.compiler import compile_file
from flowrl.passes import REGISTRY, names, select
from flowrl.viz.views import draw

from .conftest import run_steps

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PASSES = ["on-policy-logp", "drop-reference", "async-rollout", "share-prefix", "fuse-gen-inference", "fuse-train"]


def test_registered_in_pipeline_order_and_on_by_default() -> None:
    assert names()[: len(PASSES) + 1] == [*PASSES[:5], "score-tail", PASSES[5]]
    assert [p.name for p in select()][: len(PASSES)] == PASSES
    assert all(p.default for p in REGISTRY if p.name in PASSES)


def test_a_pass_off_by_default_is_switched_on_with_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(EXAMPLES / "longtail_grpo.flow"), "--pass", "score-tail", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "partial_below=0.25" in out and "pass score-tail: changed the graph" in out
    assert "partial_below" not in str(compile_file(str(EXAMPLES / "longtail_grpo.flow")).nodes)


@pytest.mark.parametrize("off", PASSES)
def test_each_pass_switches_off(off: str) -> None:
    g = compile_file(str(EXAMPLES / "longtail_ppo.flow"), no_pass=[off])
    assert [p.name for p in g.passes] == [p for p in PASSES if p != off]
    attr = {"share-prefix": "share_prefix", "fuse-gen-inference": "stream_chunk", "fuse-train": "schedule",
            "on-policy-logp": "old_logp", "async-rollout": "phase", "drop-reference": None}[off]
    assert attr is None or not any(attr in n.attrs for n in g.nodes)  # drop-reference marks nothing (kl_coef > 0)
    assert g.has_node("ref_logp")


def test_explain_says_what_each_pass_did(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(EXAMPLES / "longtail_ppo.flow"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert ("rollout = actor.generate(prompts=prompts) {chunk_forwards=\"own-rank\", flush_steps=8, "
            "fusion=\"gen-infer:rollout\", fusion_kind=\"inter-stage\"") in out
    assert "pass share-prefix: changed the graph" in out
    assert ("  - rollout: streams chunks of 32 finished samples (or what finished within 8 decode steps) to old_logp, "
            "ref_logp, values, scores on worker group train, which score them while rollout decodes") in out
    assert "  - actor.update + critic.update: one training stage, interleave in worker group train" in out


def test_optimized_view_boxes_both_fused_stages() -> None:
    source = draw(compile_file(str(EXAMPLES / "longtail_ppo.flow")), "optimized").source
    assert source.count("subgraph cluster_fusion") == 2
    assert "inter-stage" in source and "intra-stage" in source


@pytest.mark.parametrize("flow", ["longtail_grpo", "longtail_ppo"])
def test_long_tail_examples_run(flow: str) -> None:
    """Their pools as thread ranks (the local backend would run the fused stage unfused: one process)."""
    g = compile_file(str(EXAMPLES / f"{flow}.flow"), {"prompts.batch": "2", "actor.dim": "32", "actor.layers": "1"})
    row = run_steps(g, steps=1, backend=ThreadBackend(1))[0].metrics
    assert row["fusion/chunks"] >= 1 and "fusion/fallback" not in row and "reward_mean" in row
