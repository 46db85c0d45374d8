"""Every example of LANGUAGE.md (tests/dsl/flows/) and every standard template compiles, verifies, and prints
as its golden text (tests/golden/NAME.txt; regenerate with `pytest --update-golden`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowrl.dsl
import flowrl.errors
from flowrl.ir import to_text, verify
from flowrl.ir.graph import Graph

FLOWS = Path(__file__).parent / "flows"
GOLDEN = Path(__file__).parent.parent / "golden"
EXAMPLES = sorted(FLOWS.glob("*.flow"))
SHIPPED = sorted((Path(__file__).parents[2] / "examples").glob("*.flow"))  # the project's runnable examples

# A flow around a standard template: every required parameter binds to the declaration of its name.
STDLIB_FLOW = """\
model actor : policy { source = "tiny:gpt2" }
model ref : reference { source = actor }
model critic : critic { source = actor }
reward reward = "flowrl.rewards.arith_exact"
data prompts = jsonl("data/arith.jsonl")
use NAME()
"""
# The preference templates' flow (sft, reward_model, dpo): demonstrations and pairs instead of prompts.
PREFERENCE_FLOW = """\
model actor : policy { source = "tiny:gpt2" }
model ref : reference { source = actor }
model rm : reward_model { source = actor }
data pairs = jsonl("../../../examples/data/sum_pairs.jsonl") { held_out = "held_out" }
data demos = jsonl("../../../examples/data/sum_demos.jsonl")
use NAME()
"""
PREFERENCE_TEMPLATES = ("dpo", "reward_model", "sft")


def check_golden(name: str, graph: Graph, update: bool) -> None:
    path = GOLDEN / f"{name}.txt"
    text = to_text(graph)
    if update:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; run pytest --update-golden"
    assert text == path.read_text(encoding="utf-8")


def test_examples_are_present() -> None:
    assert {p.stem for p in EXAMPLES} >= {"grpo_arith", "step_body", "template_grpo", "placement", "imports"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_compiles(path: Path, update_golden: bool) -> None:
    graph = flowrl.dsl.load(path)
    assert verify(graph) is graph
    check_golden(path.stem, graph, update_golden)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_example_compiles(path: Path, update_golden: bool) -> None:
    loaded = flowrl.dsl.load_any(path)
    if isinstance(loaded, Graph):
        assert verify(loaded) is loaded
        check_golden(f"example_{path.stem}", loaded, update_golden)
        return
    for stage in loaded.stages:  # a pipeline: each stage's graph has a golden text of its own
        assert verify(stage.graph) is stage.graph
        check_golden(f"example_{path.stem}_{stage.name}", stage.graph, update_golden)


@pytest.mark.parametrize("name", flowrl.dsl.stdlib_names())
def test_stdlib_template_compiles(name: str, update_golden: bool) -> None:
    flow = PREFERENCE_FLOW if name in PREFERENCE_TEMPLATES else STDLIB_FLOW
    graph = flowrl.dsl.compile_flow(flow.replace("NAME", name), str(FLOWS / f"stdlib_{name}.flow"))
    assert graph.template == name
    check_golden(f"stdlib_{name}", graph, update_golden)


def test_stdlib_names() -> None:
    assert flowrl.dsl.stdlib_names() == ["cispo", "dapo", "dpo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "reward_model", "rloo", "sft"]


def test_load_from_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths in a flow are relative to the flow file, not the cwd
    graph = flowrl.dsl.load(FLOWS / "grpo_arith.flow")
    assert graph.data[0].path == str(FLOWS / "data" / "arith.jsonl")
    assert graph.flow == "grpo_arith"


def test_load_missing_file() -> None:
    with pytest.raises(flowrl.errors.FlowError) as info:
        flowrl.dsl.load("no/such/file.flow")
    assert info.value.render() == "error: flow file not found: no/such/file.flow"
