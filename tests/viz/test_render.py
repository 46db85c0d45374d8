"""`flowrl.viz.render`: output formats, the missing-graphviz message, stage handling, the CLI verb."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import flowrl.compiler
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph
from flowrl.viz import render, render_graph

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")


@pytest.fixture
def no_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if graphviz were not installed: no `dot` on PATH."""
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    monkeypatch.setenv("PATH", "")


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch, graphs: Any) -> list[dict[str, Any]]:
    """Stand in for the front end: `compile_any` returns the hand-built GRPO graph and records its calls."""
    calls: list[dict[str, Any]] = []

    def fake(path: str, overrides: Any = None, *, passes: Any = None, no_pass: Any = (), with_pass: Any = ()) -> Graph:
        calls.append({"path": path, "sets": dict(overrides or {}), "passes": passes})
        return graphs.optimized(graphs.grpo()) if passes is None else graphs.grpo()

    monkeypatch.setattr(flowrl.compiler, "compile_any", fake)
    return calls


def test_dot_output_needs_no_binary(no_dot: None, graphs: Any, tmp_path: Path) -> None:
    out = render_graph(graphs.grpo(), tmp_path / "g.dot", "placed")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("digraph grpo_arith {")
    assert "subgraph cluster_rollout" in text and "subgraph cluster_train" in text


@pytest.mark.parametrize("fmt", ["svg", "png", "pdf"])
def test_missing_binary_says_how_to_install(no_dot: None, graphs: Any, tmp_path: Path, fmt: str) -> None:
    with pytest.raises(FlowError) as e:
        render_graph(graphs.grpo(), tmp_path / f"g.{fmt}")
    assert e.value.render() == (
        f"error: drawing .{fmt} needs the graphviz `dot` program, which is not on PATH\n"
        "hint: install graphviz (`apt-get install graphviz` or `brew install graphviz`), "
        "or write DOT source with `-o NAME.dot`, which needs no binary"
    )
    assert not (tmp_path / f"g.{fmt}").exists()


@pytest.mark.parametrize("name", ["g.jpg", "g", "g.svgz"])
def test_unknown_suffix_is_a_flow_error(graphs: Any, tmp_path: Path, name: str) -> None:
    with pytest.raises(FlowError) as e:
        render_graph(graphs.grpo(), tmp_path / name)
    assert e.value.render() == (f"error: cannot draw to '{tmp_path / name}': the output must end in "
                                ".svg, .png, .pdf, .dot\nhint: for example `-o graph.svg`")


def test_unknown_stage(graphs: Any, tmp_path: Path) -> None:
    with pytest.raises(FlowError, match="unknown stage 'lowered' \\(stages: parsed, optimized, placed\\)"):
        render_graph(graphs.grpo(), tmp_path / "g.dot", "lowered")


@needs_dot
@pytest.mark.parametrize("fmt", ["svg", "png", "pdf"])
def test_binary_formats(graphs: Any, tmp_path: Path, fmt: str) -> None:
    out = render_graph(graphs.ppo(), tmp_path / "sub" / f"g.{fmt}", "optimized")
    head = out.read_bytes()[:8]
    assert {"svg": b"<?xml", "png": b"\x89PNG", "pdf": b"%PDF"}[fmt] in head


def test_render_compiles_without_passes_for_the_parsed_stage(compiled: list[dict[str, Any]],
                                                             tmp_path: Path) -> None:
    render("flows/x.flow", tmp_path / "p.dot", stage="parsed", sets=["actor.lr=1e-3"])
    render("flows/x.flow", tmp_path / "o.dot", stage="optimized")
    assert compiled == [{"path": "flows/x.flow", "sets": {"actor.lr": "1e-3"}, "passes": []},
                        {"path": "flows/x.flow", "sets": {}, "passes": None}]
    assert "cluster_fusion" not in (tmp_path / "p.dot").read_text(encoding="utf-8")
    assert "cluster_fusion" in (tmp_path / "o.dot").read_text(encoding="utf-8")


def test_render_checks_the_output_before_compiling(compiled: list[dict[str, Any]], tmp_path: Path) -> None:
    with pytest.raises(FlowError, match="must end in"):
        render("flows/x.flow", tmp_path / "g.txt")
    assert compiled == []


def test_cli_viz_verb(compiled: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.dot"
    assert flowrl.cli.main(["viz", "x.flow", "-o", str(out), "--stage", "placed"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert "cluster_controller" in out.read_text(encoding="utf-8")


def test_cli_viz_reports_errors_without_traceback(compiled: list[dict[str, Any]], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert flowrl.cli.main(["viz", "x.flow", "-o", str(tmp_path / "g.gif")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot draw to") and "Traceback" not in err
