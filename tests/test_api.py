"""The public Python surface: what `import flowrl` offers, kept small and deliberate, and light to import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import flowrl
import flowrl.runtime
from flowrl.runtime.batch import Batch

PUBLIC = ["Batch", "DataError", "Diagnostic", "ExecutionError", "FlowError", "RewardError", "compile_flow",
          "evaluate", "function", "load", "reward", "run"]


def test_the_public_names_are_these_and_all_resolve() -> None:
    assert sorted(flowrl.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(flowrl, name) is not None


def test_batch_is_one_class_from_both_public_homes() -> None:
    from flowrl import Batch as top
    from flowrl.runtime import Batch as runtime

    assert top is runtime is Batch and flowrl.runtime.__all__ == ["Batch"]
    with pytest.raises(AttributeError, match="has no attribute 'Bacth'"):
        flowrl.Bacth  # noqa: B018 - a misspelling is an AttributeError, not a lazy import
    with pytest.raises(AttributeError, match="has no attribute 'Bacth'"):
        flowrl.runtime.Bacth  # noqa: B018


def test_importing_flowrl_or_the_runtime_package_does_not_import_torch() -> None:
    """`flowrl check` starts fast: Batch (and torch) load on first use only."""
    code = ("import sys, flowrl, flowrl.runtime, flowrl.runtime.protocol; assert 'torch' not in sys.modules; "
            "flowrl.Batch; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_flow_applies_overrides() -> None:
    text = ('model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=" }\n'
            "model ref : reference { source = actor }\n"
            'reward correct = "flowrl.rewards.arith_exact"\n'
            'data prompts = jsonl("examples/data/arith.jsonl") { batch = 4 }\n'
            "use grpo(reward = correct, group = 2, max_tokens = 2)\n"
            "run { steps = 3 }\n")
    root = Path(__file__).resolve().parents[1]
    graph = flowrl.compile_flow(text, str(root / "inline.flow"), {"run.steps": "7", "use.group": "4"})
    assert graph.run["steps"] == 7
    assert dict(graph.node("rollout").attrs)["n"] == 4


def test_overrides_take_python_values_as_the_flow_writes_them() -> None:
    root = Path(__file__).resolve().parents[1]
    graph = flowrl.load(str(root / "examples" / "grpo_arith.flow"),
                        {"run.steps": 20, "actor.lr": 1e-5, "prompts.shuffle": False, "use.kl_coef": 0,
                         "use.max_tokens": "3"})
    assert graph.run["steps"] == 20 and graph.model("actor").lr == 1e-5
    assert dict(graph.data[0].options)["shuffle"] is False
    assert dict(graph.node("actor.update").attrs)["kl_coef"] == 0
    assert dict(graph.node("rollout").attrs)["max_tokens"] == 3
    with pytest.raises(flowrl.FlowError) as err:
        flowrl.load(str(root / "examples" / "grpo_arith.flow"), {"run.steps": [20]})  # type: ignore[dict-item]
    assert err.value.render() == ("error: override `run.steps`: a list is not a flow value\n"
                                  "hint: a number, a bool, None, or flow literal text as a string")
