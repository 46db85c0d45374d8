"""examples/math_eval.flow, the example a user copies (issue 33 item 6): its held-out split is what its generator makes
and is never trained on, and two steps of it evaluate, track and export as the README shows: the figures `flowrl
eval` prints for each eval block are the run's own, and the exported model, loaded by transformers in a Python that
cannot import flowrl, gives the greedy held-out answers the run scored (the same texts, so the same mean@1)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import flowrl
from flowrl.rewards.math import math_equal
from tests.models.hf_elsewhere import load_elsewhere

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLOW = EXAMPLES / "math_eval.flow"
TRAIN = EXAMPLES / "data" / "math_eval_train.jsonl"
TEST = EXAMPLES / "data" / "math_eval_test.jsonl"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_math_eval", EXAMPLES / "data" / "make_math_eval.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_held_out_split_is_never_trained_on() -> None:
    train, test = _rows(TRAIN), _rows(TEST)
    assert (train, test) == _generator().splits()
    assert (len(train), len(test)) == (200, 80)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    # each held-out sum is trained on in other words: the same (answer, kind) pairs, five sentences to two
    pairs = {(r["answer"], r["data_source"]) for r in test}
    assert pairs <= {(r["answer"], r["data_source"]) for r in train}
    graph = flowrl.load(str(FLOW))
    charset = graph.model("actor").config["charset"]
    assert _generator().CHARSET == charset
    assert all(set(r["prompt"]) <= set(charset) for r in train + test)
    assert {e.name: (e.data, e.n, e.temperature) for e in graph.evals} == {
        "greedy": ("test", 1, 0.0), "sampled": ("test", 8, 1.0)}
    assert [n.id for n in graph.nodes if n.op == "data"] == ["train"]  # the step reads `train` only


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example as it ships, two steps: step 0 evaluated (at_start), then step 2 (the last)."""
    out = tmp_path_factory.mktemp("math_eval") / "run"
    flowrl.run(flowrl.load(str(FLOW), {"run.steps": 2}), out_dir=out)
    return out


def test_two_steps_evaluate_track_and_export(two_steps: Path) -> None:
    rows = _rows(two_steps / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in (rows[0], rows[2]):
        for key in ("eval/greedy/mean@1", "eval/sampled/mean@8", "eval/sampled/pass@1", "eval/sampled/pass@8",
                    "eval/sampled/maj@8", "eval/sampled/add/mean@8", "eval/sampled/sub/pass@8"):
            assert 0.0 <= row[key] <= 1.0, key
    assert not any(k.startswith("eval/") for k in rows[1])
    kinds = [json.loads(line)["kind"] for line in (two_steps / "samples.jsonl").read_text().splitlines()]
    assert {k: kinds.count(k) for k in set(kinds)} == {"train": 2 * 4, "eval/greedy": 2 * 80, "eval/sampled": 2 * 640}
    assert any((two_steps / "tb").glob("events.out.tfevents.*"))
    assert {p.name for p in (two_steps / "hf" / "actor").iterdir()} >= {"config.json", "model.safetensors",
                                                                       "tokenizer.json", "generation_config.json"}


def test_flowrl_eval_gives_each_blocks_figures(two_steps: Path) -> None:
    last = _rows(two_steps / "metrics.jsonl")[-1]
    greedy = flowrl.evaluate(str(two_steps), data=str(TEST))
    assert greedy.name == "greedy" and greedy.step == 2
    assert greedy.metrics == {k.removeprefix("eval/greedy/"): v for k, v in last.items() if k.startswith("eval/greedy/")}
    # the README's `flowrl eval ... --n 8 --temperature 1`: the sampled block's seeds, so its figures
    sampled = flowrl.evaluate(str(two_steps), data=str(TEST), n=8, temperature=1.0)
    assert sampled.name == "sampled"
    assert sampled.metrics == {k.removeprefix("eval/sampled/"): v for k, v in last.items()
                               if k.startswith("eval/sampled/")}


def test_the_exported_policy_answers_as_the_run_scored(two_steps: Path, tmp_path: Path) -> None:
    test = _rows(TEST)
    [got] = load_elsewhere([{"dir": str(two_steps / "hf" / "actor"), "kind": "causal",
                             "prompts": [r["prompt"] for r in test], "max_new_tokens": 2}], tmp_path)
    run_answers = {s["row_id"]: s["response"] for s in map(json.loads, (two_steps / "samples.jsonl").read_text()
                                                           .splitlines()) if s["kind"] == "eval/greedy" and s["step"] == 2}
    assert got["answer_texts"] == [run_answers[i] for i in range(len(test))]
    scores = [math_equal(r["prompt"], text, r["answer"]) for r, text in zip(test, got["answer_texts"], strict=True)]
    last = _rows(two_steps / "metrics.jsonl")[-1]
    assert sum(scores) / len(scores) == pytest.approx(last["eval/greedy/mean@1"])
