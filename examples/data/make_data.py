"""Regenerate the example datasets (deterministic): `python examples/data/make_data.py`."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def write(name: str, rows: list[dict[str, object]]) -> None:
    with (HERE / name).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def arith(max_operand: int) -> list[dict[str, object]]:
    """Every `a+b=` with 0 <= a, b <= max_operand, answer a+b."""
    rows: list[dict[str, object]] = [{"prompt": f"{a}+{b}=", "answer": a + b}
                                     for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(0).shuffle(rows)
    return rows


if __name__ == "__main__":
    write("arith.jsonl", arith(4))
    write("arith_wide.jsonl", arith(9))
