"""Property: whatever the text, compiling a flow either succeeds or raises FlowError whose diagnostics render.

Valid flows (the examples and the standard templates) are mutated: characters and tokens deleted, inserted
and replaced, lines swapped, the text truncated; sometimes with `--set` overrides. No other exception
(a Lark error, a KeyError, a GraphError from `verify`) may escape.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.dsl import compile_flow, template_source
from flowrl.errors import FlowError

FLOWS = Path(__file__).parent / "flows"
SEEDS = [p.read_text(encoding="utf-8") for p in sorted(FLOWS.glob("*.flow"))]
STDLIB_SEEDS = [template_source(n) + "\nuse ppo()\n" for n in ("grpo", "ppo")]
TOKENS = [
    "{", "}", "(", ")", "[", "]", ",", "=", ".", "..", "->", ":", "#", '"', "\\", "\n", " ", "\t",
    "flow", "import", "model", "reward", "data", "use", "step", "template", "run", "placement", "pool",
    "true", "false", "auto", "actor", "ref", "critic", "policy", "reward_model", "rollout", "prompts", "correct",
    "group", "update", "generate", "logprobs", "values", "gae", "1", "-1", "0", "2..16", "16..2", "1e-5", "0.2",
    '"x"', '"tiny:gpt2"', '"hf:nowhere"', '"data/arith.jsonl"', "@", ";", "é", "\x00", "\r", "\u2028",
]
WORD = re.compile(r"\w+|\S")


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(SEEDS + STDLIB_SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "insert", "replace", "token", "swap", "truncate"]))
        n = len(text)
        i = draw(st.integers(0, n))
        if kind == "delete":
            text = text[:i] + text[min(n, i + draw(st.integers(1, 8))):]
        elif kind in ("insert", "replace"):
            piece = draw(st.one_of(st.sampled_from(TOKENS), st.text(max_size=3)))
            end = i + (draw(st.integers(1, 4)) if kind == "replace" else 0)
            text = text[:i] + piece + text[end:]
        elif kind == "token":  # delete a whole token, or duplicate it
            tokens = list(WORD.finditer(text))
            if tokens:
                m = tokens[draw(st.integers(0, len(tokens) - 1))]
                keep = m.group() if draw(st.booleans()) else ""
                text = text[:m.start()] + keep * 2 + text[m.end():]
        elif kind == "swap":
            lines = text.split("\n")
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[a], lines[b] = lines[b], lines[a]
            text = "\n".join(lines)
        else:
            text = text[:i]
    return text


OVERRIDES = st.dictionaries(
    st.sampled_from(["actor.lr", "actor.layers", "prompts.batch", "run.steps", "use.group", "ref.source",
                     "critic.lr", "nobody.x", "bad", "run.", "actor.replicas"]),
    st.one_of(st.sampled_from(["1", "1e-4", "true", '"s"', "2..8", "auto", "actor", "[1, 2]", "", "{", '"']),
              st.text(max_size=4)),
    max_size=3,
)


def _compiles_or_reports(text: str, overrides: dict[str, str] | None) -> None:
    try:
        compile_flow(text, str(FLOWS / "fuzz.flow"), overrides)
    except FlowError as e:
        assert e.diagnostics
        for d in e.diagnostics:
            assert d.render()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=mutated(), overrides=st.one_of(st.none(), OVERRIDES))
def test_mutated_flows_compile_or_raise_flow_error(text: str, overrides: dict[str, str] | None) -> None:
    cwd = os.getcwd()
    try:
        _compiles_or_reports(text, overrides)
    finally:
        assert os.getcwd() == cwd
