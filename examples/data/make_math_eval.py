"""Regenerate examples/math_eval.flow's train and held-out splits (deterministic): `python examples/data/make_math_eval.py`.

One-step word problems over 0..4, adding (`gets`, `finds`, `buys`) and taking away (`eats`, `loses`, `gives away`):
40 sums, each asked in 7 different sentences (names, things and verbs drawn from a seeded generator). For each sum
5 sentences go to math_eval_train.jsonl (200 rows) and the other 2 to math_eval_test.jsonl (80 rows): the held-out
prompts are never trained on, and score only if the policy has learnt to read the numbers and the verb rather than
to recall the sentences it was rewarded on. Every row has `answer` (what `flowrl.rewards.math_equal` compares with)
and `data_source` (`add` or `sub`: an `eval` block reports each on its own, as verl's data sources). Every
character is in `CHARSET`, the charset of examples/math_eval.flow.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # its sibling, also when loaded by file path (the tests)
from make_math import ADD, CHARSET, HERE, NAMES, TAKE, THINGS, count, write  # noqa: E402  math_word's words

TRAIN, HELD_OUT = 5, 2  # sentences per sum in each split


def sums() -> list[tuple[str, int, int]]:
    """(kind, a, b): a + b for a, b in 0..4, and a - b where a >= b."""
    return [(kind, a, b) for kind in ("add", "sub") for a, b in itertools.product(range(5), repeat=2)
            if kind == "add" or a >= b]


def sentence(rng: random.Random, kind: str, a: int, b: int) -> tuple[str, int]:
    """One way of asking `kind` (a, b), and its answer."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if kind == "add":
        return f"{name} has {count(a, thing)} and {rng.choice(ADD)} {b} more. how many now? ", a + b
    return f"{name} has {count(a, thing)} and {rng.choice(TAKE)} {b}. how many left? ", a - b


def splits(seed: int = 0) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(train, held_out): each sum's first HELD_OUT distinct sentences held out, its next TRAIN trained on."""
    rng = random.Random(seed)
    train: list[dict[str, object]] = []
    held: list[dict[str, object]] = []
    for kind, a, b in sums():
        asked: list[str] = []
        while len(asked) < TRAIN + HELD_OUT:
            prompt, answer = sentence(rng, kind, a, b)
            if prompt in asked:
                continue
            asked.append(prompt)
            row: dict[str, object] = {"prompt": prompt, "answer": str(answer), "data_source": kind}
            (held if len(asked) <= HELD_OUT else train).append(row)
    rng.shuffle(train)
    rng.shuffle(held)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(set(str(r["prompt"])) <= set(CHARSET) for r in train + held)
    return train, held


if __name__ == "__main__":
    train_rows, held_rows = splits()
    write(HERE / "math_eval_train.jsonl", train_rows)
    write(HERE / "math_eval_test.jsonl", held_rows)
