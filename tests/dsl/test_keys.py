"""Keys' ranges and choices, declared once (flowrl.ir.signatures: KEY_LIMITS, KEY_CHOICES, each parameter's
`limit`): every one is enforced at check time with a located error, and docs/language.md lists every one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from flowrl.ir.graph import Graph
from flowrl.ir.signatures import FUNCTIONS, KEY_CHOICES, KEY_LIMITS, METHODS, MODEL_KEYS, Limit

DOCS = Path(__file__).resolve().parents[2] / "docs" / "language.md"
BASE = {
    "model": 'model actor : policy {{ source = "tiny:gpt2", {entry} }}\nmodel ref : reference {{ source = actor }}\n'
             'reward correct = "flowrl.rewards.arith_exact"\ndata prompts = jsonl("data/arith.jsonl")\n',
    "data": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
            'reward correct = "flowrl.rewards.arith_exact"\ndata prompts = jsonl("data/arith.jsonl") {{ {entry} }}\n',
    "run": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
           'reward correct = "flowrl.rewards.arith_exact"\ndata prompts = jsonl("data/arith.jsonl")\n'
           'run {{ {entry} }}\n',
    "reward": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
              'reward correct = "flowrl.rewards.arith_exact" {{ {entry} }}\ndata prompts = jsonl("data/arith.jsonl")\n',
    "http reward": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
                   'reward correct = http("http://127.0.0.1:9/score") {{ {entry} }}\n'
                   'data prompts = jsonl("data/arith.jsonl")\n',
    "env": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
           'reward correct = "flowrl.rewards.arith_exact"\ndata prompts = jsonl("data/arith.jsonl")\n'
           'env e = "dsl_envs.Countdown" {{ {entry} }}\n',
    "tool": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
            'reward correct = "flowrl.rewards.arith_exact"\ndata prompts = jsonl("data/arith.jsonl")\n'
            'tool t = "dsl_envs.add" {{ call = "<", end = ">", {entry} }}\n',
    "eval": 'model actor : policy {{ source = "tiny:gpt2" }}\nmodel ref : reference {{ source = actor }}\n'
            'reward correct = "flowrl.rewards.arith_exact"\ndata prompts = jsonl("data/arith.jsonl")\n'
            'data held = jsonl("data/arith.jsonl")\neval held {{ data = held, {entry} }}\n',
}
USE = "use grpo(reward = correct, group = 4, max_tokens = 2)\n"


def outside(limit: Limit) -> float:
    """A number just outside `limit`."""
    if limit.lo is not None:
        return limit.lo if limit.above else limit.lo - 1
    assert limit.hi is not None
    return limit.hi + 1


def literal(kind: str, x: float) -> str:
    return str(int(x)) if kind == "int" or float(x).is_integer() and kind != "float" else repr(float(x))


DECLARED = [(block, key, limit) for block, keys in KEY_LIMITS.items() for key, limit in keys.items()]


@pytest.mark.parametrize(("block", "key", "limit"), DECLARED, ids=[f"{b}.{k}" for b, k, _ in DECLARED])
def test_a_key_outside_its_range_is_a_located_error(compile_error: Callable[..., str], block: str, key: str,
                                                    limit: Limit) -> None:
    from flowrl.ir.signatures import (
        DATA_KEYS,
        ENV_KEYS,
        EVAL_KEYS,
        HTTP_REWARD_KEYS,
        REWARD_KEYS,
        RUN_KEYS,
        TOOL_KEYS,
    )

    kinds = {"model": MODEL_KEYS, "data": DATA_KEYS, "run": RUN_KEYS, "reward": REWARD_KEYS,
             "http reward": HTTP_REWARD_KEYS, "env": ENV_KEYS, "tool": TOOL_KEYS, "eval": EVAL_KEYS}[block]
    value = literal(kinds[key][0], outside(limit))
    text = BASE[block].format(entry=f"{key} = {value}") + USE
    rendered = compile_error(text)
    first = rendered.splitlines()[0]
    assert first.endswith(f"error: `{key}` must be {limit}"), rendered
    line = next(i for i, t in enumerate(text.splitlines(), 1) if f"{key} = {value}" in t)
    col = text.splitlines()[line - 1].index(f"{key} = {value}") + len(f"{key} = ") + 1
    assert first.startswith(f"t.flow:{line}:{col}: ")


def test_a_key_at_its_bound_is_accepted(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(BASE["run"].format(entry="steps = 1, cost_weight = 1, migrate_at = 1, max_staleness = 0") + USE)
    assert (g.run["steps"], g.run["cost_weight"], g.run["migrate_at"]) == (1, 1.0, 1.0)
    g = compile_ok(BASE["model"].format(entry="lr = 1e-9, dropout = 0.0, zero_stage = 3") + USE)
    assert g.models[0].lr == 1e-9


CHOSEN = [(block, key, choices) for block, keys in KEY_CHOICES.items() for key, choices in keys.items()]


@pytest.mark.parametrize(("block", "key", "choices"), CHOSEN, ids=[f"{b}.{k}" for b, k, _ in CHOSEN])
def test_a_string_outside_its_choices_is_a_located_error(compile_error: Callable[..., str], block: str, key: str,
                                                         choices: tuple[str, ...]) -> None:
    text = BASE[block].format(entry=f'{key} = "{choices[0]}x"') + USE
    rendered = compile_error(text)
    assert f"error: `{key}` must be one of {', '.join(choices)}" in rendered.splitlines()[0]
    assert f"hint: did you mean `{choices[0]}`?" in rendered


def _documented() -> list[str]:
    items = [f"`{k}` {lim}" for keys in KEY_LIMITS.values() for k, lim in keys.items()]
    items += [f"`{k}` one of {', '.join(c)}" for keys in KEY_CHOICES.values() for k, c in keys.items()]
    sigs = [s for methods in METHODS.values() for s in methods.values()] + list(FUNCTIONS.values())
    items += [f"`{p.name}` {p.limit}" for s in sigs for p in s.params if p.limit is not None]
    return items


def test_the_docs_list_every_range() -> None:
    text = DOCS.read_text(encoding="utf-8")
    missing = [item for item in _documented() if item not in text]
    assert not missing, f"docs/language.md does not list {missing}"


def test_limits_read_as_written() -> None:
    assert (str(Limit(1)), str(Limit(0, above=True)), str(Limit(0, 1)), str(Limit(0, 1, above=True))) == (
        "at least 1", "above 0", "between 0 and 1", "above 0 and at most 1")
    assert Limit(0, above=True).holds(1e-9) and not Limit(0, above=True).holds(0.0)
    assert Limit(0, 3).holds(3) and not Limit(0, 3).holds(3.5) and not Limit(0, 3).holds(-1)
