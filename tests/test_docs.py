"""The docs keep up with the code: docs/architecture.md's picture names every backend and only real modules; the
README's first snippet is the example it trains; the README's Python API block and docs/language.md's user
function example run as printed."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl import backends, registry

ROOT = Path(__file__).resolve().parents[1]


def _picture_source() -> str:
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "docs" / "architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["architecture"] = module
    spec.loader.exec_module(module)
    return str(module.draw().source)


def test_the_picture_shows_every_backend_and_names_real_modules() -> None:
    source = _picture_source()
    for name in backends.names():
        assert f"backends/{name}" in source
    named = set(re.findall(r"\b(?:flowrl|runtime)\.([a-z_]+)", source))
    assert named, "the picture names no module"
    for module in sorted(named):
        if module in flowrl.__all__:  # a function of the package (`flowrl.run`)
            continue
        try:
            importlib.import_module(f"flowrl.runtime.{module}")
        except ModuleNotFoundError:
            importlib.import_module(f"flowrl.{module}")  # fails for a module that is gone or renamed


def test_the_architecture_page_links_its_picture() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert "img/architecture.svg" in page and (ROOT / "docs" / "img" / "architecture.svg").exists()


def _blocks(text: str, heading: str) -> list[tuple[str, str]]:
    """The fenced code blocks (language, body) of the section that starts at `heading`, up to the next heading
    of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading):]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, flags=re.MULTILINE)]
    section = rest[:ends[0]] if ends else rest
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


def _copy_example(into: Path) -> None:
    """examples/grpo_arith.flow and its data under `into`/examples/, so relative paths in the docs resolve."""
    (into / "examples" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "grpo_arith.flow", into / "examples" / "grpo_arith.flow")
    shutil.copy(ROOT / "examples" / "data" / "arith.jsonl", into / "examples" / "data" / "arith.jsonl")


def test_the_readme_opens_with_the_example_it_runs() -> None:
    """The README's first snippet is examples/grpo_arith.flow (what `make run` trains), comments and all."""
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^```\w*\n(.*?)^```$", readme, flags=re.MULTILINE | re.DOTALL)
    assert first is not None
    assert first.group(1) == (ROOT / "examples" / "grpo_arith.flow").read_text()


def test_the_readme_python_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The README's Python API block, run as printed from a folder holding the example."""
    (lang, code), *_ = _blocks((ROOT / "README.md").read_text(), "## Python API")
    assert lang == "python"
    _copy_example(tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    printed = capsys.readouterr().out
    assert re.fullmatch(r"10 steps: reward 0\.\d\d -> [01]\.\d\d, \d+ tokens/s, outputs in runs/api\n", printed), printed
    lines = (tmp_path / "runs" / "api" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 10 and "reward_mean" in json.loads(lines[-1])


def test_the_user_function_example_runs(tmp_path: Path) -> None:
    """docs/language.md's user function and its flow, written next to each other, check and train two steps;
    the function gives the advantages the page states."""
    blocks = _blocks((ROOT / "docs" / "language.md").read_text(), "### User functions")
    (module_lang, module), (_, flow) = blocks[0], blocks[1]
    assert module_lang == "python"
    name = re.search(r'^import "(\w+)"', flow, flags=re.MULTILINE)
    assert name is not None
    (tmp_path / f"{name.group(1)}.py").write_text(module)
    (tmp_path / "median.flow").write_text(flow)
    (tmp_path / "data").mkdir()
    shutil.copy(ROOT / "examples" / "data" / "arith.jsonl", tmp_path / "data" / "arith.jsonl")

    graph = flowrl.load(str(tmp_path / "median.flow"), {"prompts.batch": "4"})
    assert [n.id for n in graph.nodes if n.op == "fn"] == ["adv"]
    result = flowrl.run(graph, out_dir=tmp_path / "run", steps=2)
    assert len(result.metrics) == 2 and "time/adv" in result.metrics[-1]

    fn = registry.FUNCTIONS["median_advantage"]
    scores = flowrl.Batch(8, {"scores": torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1]),
                              "group_id": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])}, primary="scores")
    out = fn(scores)
    assert out.primary == "advantages" and out["advantages"].tolist() == [1, 0, 0, 0, 0, 0, -1, 0]
