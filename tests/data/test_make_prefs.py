"""The preference examples' data (examples/data/make_prefs.py): the committed files are what the generator
writes, they load as pairs/demos rows, and the hidden rule holds (chosen is the correct sum, rejected not)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from flowrl.data.tables import ROW_KINDS, read_data

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_prefs", DATA / "make_prefs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_files_are_the_generators() -> None:
    gen = _generator()
    few = [r for r in gen.demos() if int(str(r["prompt"])[0]) < 5]
    sums = [{"prompt": r["prompt"], "answer": r["answer"]} for r in gen.demos()]
    for name, rows in [("sum_pairs.jsonl", gen.pairs()), ("sum_demos.jsonl", gen.demos()),
                       ("sum_demos_few.jsonl", few), ("sums.jsonl", sums)]:
        lines = (DATA / name).read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in lines] == rows, f"regenerate {name}: python examples/data/make_prefs.py"


def test_pairs_follow_the_hidden_rule_and_load_as_pairs() -> None:
    rows = read_data("jsonl", DATA / "sum_pairs.jsonl", columns=ROW_KINDS["pairs"])
    for row in rows:
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert int(row["chosen"]) == a + b == row["answer"] and int(row["rejected"]) != a + b
    assert sum(bool(r["held_out"]) for r in rows) == 200
    # every sum over each of its 18 wrong answers once: no answer is preferred or rejected for itself
    assert sorted((r["prompt"], int(r["rejected"])) for r in rows) == sorted(
        (f"{a}+{b}=", w) for a in range(10) for b in range(10) for w in range(19) if w != a + b)
    demos = read_data("jsonl", DATA / "sum_demos.jsonl", columns=ROW_KINDS["demos"])
    assert len(demos) == 100 and all(int(d["response"]) == d["answer"] for d in demos)
