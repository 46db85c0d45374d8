"""DAPO's overlong reward shaping keys against the generation they shape (step lowering, after `dsl.steps` orders
the nodes): `scores = reward(rollout, overlong_buffer = L, overlong_penalty = P)` punishes a response's length
within the last L tokens before its generation's `max_tokens`, so the rollout must be a single-turn generate's
and L below its `max_tokens` (flowrl.runtime.shaping applies it; flowrl.algos.dapo.overlong_penalty is the math).
"""

from __future__ import annotations

from collections.abc import Mapping

from flowrl.ir.graph import Node

from . import ast
from .diagnostics import Reporter, Source

Written = Mapping[tuple[str, str], tuple[Source, ast.Located]]


def check_overlong(rep: Reporter, nodes: list[Node], written: Written) -> None:
    by_id = {n.id: n for n in nodes}
    for n in nodes:
        buffer = n.attrs.get("overlong_buffer")
        if n.op != "reward" or not isinstance(buffer, int) or buffer == 0:
            continue
        src, where = written[(n.id, "overlong_buffer")]
        gen = by_id.get(str(n.input("rollout")))
        if gen is None or gen.op != "generate":
            rep.error(src, f"`overlong_buffer` punishes a response's length against its generation's max_tokens, "
                           f"but `{n.input('rollout')}` is not a generate's output", where,
                      hint="score the rollout straight from `MODEL.generate(...)`")
            continue
        if gen.attrs.get("env"):
            rep.error(src, f"`overlong_buffer` on the multi-turn rollout `{gen.id}`: its `max_tokens` is each "
                           "turn's, not the trajectory's", where,
                      hint="leave it out for an `env` generation (its `max_total` bounds a trajectory)")
            continue
        max_tokens = gen.attrs.get("max_tokens")
        if isinstance(max_tokens, int) and buffer >= max_tokens:
            rep.error(src, f"`overlong_buffer = {buffer}` is not below `max_tokens = {max_tokens}` of `{gen.id}`: "
                           "every response would be punished from its first token", where,
                      hint=f"the buffer is the last tokens before max_tokens: at most {max_tokens - 1} (DAPO: 4096 "
                           "of 20480)")
