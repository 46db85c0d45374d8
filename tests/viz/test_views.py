"""The three `flowrl viz` views, drawn to SVG from hand-built graphs and read back as XML."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flowrl.ir.graph import Graph, GroupDecl, PassRecord, PoolDecl, Range
from flowrl.viz import render_graph, style
from flowrl.viz.views import STAGES, draw

SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")


def svg(g: Graph, stage: str, tmp_path: Path) -> ET.Element:
    out = render_graph(g, tmp_path / f"{g.flow}_{stage}.svg", stage)
    return ET.parse(out).getroot()


def texts(root: ET.Element) -> list[str]:
    return [t.text.strip() for t in root.iter(f"{SVG}text") if t.text and t.text.strip()]


def clusters(root: ET.Element) -> list[str]:
    return [g.findtext(f"{SVG}title") or "" for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"]


@needs_dot
@pytest.mark.parametrize("stage", STAGES)
def test_every_node_id_is_drawn(any_graph: Graph, stage: str, tmp_path: Path) -> None:
    words = texts(svg(any_graph, stage, tmp_path))
    for n in any_graph.nodes:
        assert n.id in words, f"{n.id} missing from the {stage} view"


@needs_dot
def test_parsed_labels_calls_and_edges(graphs: Any, tmp_path: Path) -> None:
    words = texts(svg(graphs.grpo(), "parsed", tmp_path))
    for call in ("actor.generate", "actor.logprobs", "ref.logprobs", "fn: group_advantage", "reward: correct",
                 "update \u00b7 ppo_clip", "jsonl(arith.jsonl)"):
        assert call in words
    # edges carry the parameter they feed
    for param in ("prompts", "rollout", "old_logp", "ref_logp", "advantages", "scores"):
        assert param in words
    assert words.count("rollout") == 1 + 4  # the node, and its four out-edges


def test_parsed_ignores_pass_results(graphs: Any) -> None:
    source = draw(graphs.optimized(graphs.grpo()), "parsed").source
    assert "cluster_fusion" not in source
    assert style.SHARED_PREFIX not in source and "peripheries" not in source


@needs_dot
def test_optimized_draws_fusion_share_prefix_and_pass_legend(graphs: Any, tmp_path: Path) -> None:
    root = svg(graphs.optimized(graphs.grpo()), "optimized", tmp_path)
    words = texts(root)
    assert clusters(root) == ["cluster_fusion_0"]
    assert "inter-stage fusion" in words
    assert "fuses old_logp + ref_logp" in words
    assert style.SHARED_PREFIX in words
    assert "pass fuse-logprobs" in words and "pass share-prefix" in words and "pass colocate" in words
    joined = " ".join(words)
    assert "fused old_logp + ref_logp" in joined
    assert "no change: refused: only one trainable model" in joined
    assert "no passes changed the graph" not in joined
    # both fused nodes sit inside the fusion box
    box = next(g for g in root.iter(f"{SVG}g") if g.findtext(f"{SVG}title") == "cluster_fusion_0")
    x0, x1 = _xrange(box)
    for node in ("old_logp", "ref_logp"):
        nx0, nx1 = _xrange(_node(root, node))
        assert x0 <= nx0 and nx1 <= x1


def test_optimized_marks_shared_prefix_with_a_double_border(graphs: Any) -> None:
    source = draw(graphs.optimized(graphs.grpo()), "optimized").source
    line = next(ln for ln in source.splitlines() if ln.strip().startswith("rollout "))
    assert "peripheries=2" in line


@needs_dot
def test_optimized_without_passes_is_parsed_plus_a_note(graphs: Any, tmp_path: Path) -> None:
    g = graphs.grpo()
    parsed, opt = texts(svg(g, "parsed", tmp_path)), texts(svg(g, "optimized", tmp_path))
    assert "no passes changed the graph" in opt
    assert [w for w in opt if w not in ("passes", "no passes changed the graph")] == \
        [w.replace("parsed", "optimized") for w in parsed]
    unchanged = replace(g, passes=(PassRecord("share-prefix", False, ("n=1: nothing to share",)),))
    words = texts(svg(unchanged, "optimized", tmp_path))
    assert "no passes changed the graph" in words and "pass share-prefix" in words


@needs_dot
def test_placed_has_one_cluster_per_worker_group(any_graph: Graph, tmp_path: Path) -> None:
    g = any_graph
    found = clusters(svg(g, "placed", tmp_path))
    for w in g.worker_groups:
        assert found.count(f"cluster_{w.name}") == 1
    assert found.count("cluster_controller") == 1


@needs_dot
def test_placed_labels_groups_pools_and_dispatch(graphs: Any, tmp_path: Path) -> None:
    root = svg(graphs.grpo(), "placed", tmp_path)
    joined = " ".join(texts(root))
    assert "group rollout" in joined and "models actor" in joined
    assert "pool rollout (gpus 2..16, elastic)" in joined
    assert "pool train (gpus 8)" in joined
    assert "controller" in texts(root)
    ppo_words = texts(svg(graphs.ppo(), "placed", tmp_path))
    assert {"split", "broadcast", "rank0"} <= set(ppo_words)


def test_placed_dispatches_and_collects_each_model_call(graphs: Any) -> None:
    g = graphs.ppo()
    source = draw(g, "placed").source
    calls = [n for n in g.nodes if n.op in ("generate", "logprobs", "values", "update")]
    for n in calls:
        edges = [ln for ln in source.splitlines() if re.match(rf'\s*"\[controller\]" -> "?{re.escape(n.id)}"? ', ln)]
        assert len(edges) == 2, n.id
        assert any(f"label={n.dispatch}" in e for e in edges)  # dispatch, labelled with the mode
        assert any("dir=back" in e and "style=dashed" in e for e in edges)  # collect, back to the controller
    for n in g.nodes:
        if n.op in ("data", "reward", "fn"):
            assert not re.search(rf'"\[controller\]" -> "?{re.escape(n.id)}"? ', source)


def test_placed_draws_a_group_without_calls(graphs: Any) -> None:
    g = graphs.grpo()
    g = replace(g, worker_groups=(*g.worker_groups, GroupDecl("spare", ("ref",))))
    source = draw(g, "placed").source
    assert "subgraph cluster_spare" in source and "ref: no calls" in source


def test_roles_have_one_colour_in_every_view(graphs: Any) -> None:
    g = graphs.optimized(graphs.ppo())
    for n in g.nodes:
        fills = set()
        for stage in STAGES:
            line = next(ln for ln in draw(g, stage).source.splitlines()
                        if re.match(rf'\s*"?{re.escape(n.id)}"? \[', ln))
            fills.add(re.search(r"fillcolor=\"?(#[0-9a-f]{6})", line).group(1))  # type: ignore[union-attr]
        assert fills == {style.PALETTE[style.role_of(g, n)].fill}, n.id


def test_drawing_is_deterministic(graphs: Any) -> None:
    for stage in STAGES:
        assert draw(graphs.optimized(graphs.ppo()), stage).source == draw(graphs.optimized(graphs.ppo()), stage).source


def test_readable_defaults(graphs: Any) -> None:
    source = draw(graphs.grpo(), "parsed").source
    assert "rankdir=LR" in source and "labelfloat=false" in source


def _node(root: ET.Element, node_id: str) -> ET.Element:
    return next(g for g in root.iter(f"{SVG}g") if g.get("class") == "node" and g.findtext(f"{SVG}title") == node_id)


def _xrange(el: ET.Element) -> tuple[float, float]:
    xs = [float(x) for p in el.iter() for x in re.findall(r"(-?[\d.]+),-?[\d.]+", p.get("points", "") + " "
                                                            + p.get("d", "").replace("M", " ").replace("C", " "))]
    return min(xs), max(xs)


def test_placed_lists_an_unused_pool(graphs: Any) -> None:
    g = graphs.grpo()
    g = replace(g, pools=(*g.pools, PoolDecl("spare", Range(1, 4), g.pools[0].loc, elastic=True)))
    source = draw(g, "placed").source
    assert "pool spare (gpus 1..4, elastic) \u2014 no group placed on it" in source
    assert "pool train (gpus 8) \u2014 no group" not in source
