"""Dynamic sampling's loop in the graph (step lowering, after `dsl.steps` orders the nodes): each
`kept = filter_groups(rollout, scores, ...)` with the nodes it re-runs when it draws more prompts.

The loop is the filter's ancestors: the data node the generation reads, the `generate`, the reward (and whatever
else lies between them). At run time (flowrl.runtime.refill) the filter runs them again, with new prompts, until
its kept groups fill `batch` or `max_gen_batches` draws were made. Here each filter is checked (its rollout a
generate's, its scores computed from it, nothing outside the loop reading a value the loop refills) and the loop
is written on the nodes, where `flowrl compile` prints it: the filter gets `refill` (the loop's nodes, in schedule
order) and `batch` (0 resolved to the data's prompts per draw), the generate `refilled_by` (the filter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flowrl.ir.graph import Node

from . import ast
from .diagnostics import Reporter, Source
from .values import DataB

FILTER = "filter_groups"
Written = Mapping[tuple[str, str], tuple[Source, ast.Located]]


def is_filter(node: Node) -> bool:
    return node.op == "fn" and node.attrs.get("fn") == FILTER


def mark_loops(rep: Reporter, src: Source, stmts: Sequence[ast.Stmt], env: Mapping[str, object],
               nodes: list[Node], written: Written) -> list[Node]:
    """`nodes` with each filter's loop written on it and its generate; every problem reported (located)."""
    by_id = {n.id: n for n in nodes}
    at = {(s.line, s.col): s for s in stmts}
    out = {n.id: n for n in nodes}
    claimed: dict[str, str] = {}  # generate id -> the filter that refills it
    for f in (n for n in nodes if is_filter(n)):
        stmt = at.get((f.loc.line, f.loc.col))
        if stmt is None:  # not this body's statement (cannot happen: one body per lowering)
            continue
        loop = _loop(rep, src, stmt, env, f, by_id, written, claimed)
        if loop is None:
            continue
        gen_id = str(f.input("rollout"))
        data = by_id[str(by_id[gen_id].input("prompts"))]
        _escapes(rep, src, stmts, env, nodes, f, loop)
        batch = int(str(f.attrs.get("batch") or 0)) or int(str(data.attrs.get("batch", 8)))
        rounds = int(str(f.attrs.get("max_gen_batches", 10)))
        per_draw = int(str(data.attrs.get("batch", 8)))
        if rounds * per_draw < batch:
            wsrc, where = written[(f.id, "max_gen_batches")]
            need = -(-batch // per_draw)
            rep.error(wsrc, f"`max_gen_batches = {rounds}` draws of {per_draw} prompts can never fill `batch = "
                            f"{batch}` groups", where,
                      hint=f"allow at least {need} draws (`max_gen_batches = {need}`), or lower `batch`")
        n = by_id[gen_id].attrs.get("n")
        if n == 1 and f.attrs.get("keep") == "mixed":
            wsrc, where = src, stmt.call.callee
            rep.warn(wsrc, f"`{gen_id}` samples one response per prompt (`n = 1`): every group is one sample, and "
                           "filter_groups keeps them all (verl keeps a group of one)", where,
                     hint="dynamic sampling compares the responses to one prompt: sample several (`n = 8`)")
        out[f.id] = f.with_attrs(batch=batch, refill=tuple(loop))
        out[gen_id] = out[gen_id].with_attrs(refilled_by=f.id)
    return [out[n.id] for n in nodes]


def _loop(rep: Reporter, src: Source, stmt: ast.Stmt, env: Mapping[str, object], f: Node,
          by_id: Mapping[str, Node], written: Written, claimed: dict[str, str]) -> list[str] | None:
    """The loop's node ids in schedule order, or None after reporting why `f` cannot have one."""
    rollout, scores = str(f.input("rollout")), str(f.input("scores"))
    gen = by_id.get(rollout)
    if gen is None or gen.op != "generate":
        what = f"a `{gen.op}`'s output" if gen is not None else "a data declaration"
        rep.error(src, f"`{FILTER}` filters the groups of a rollout, but `{rollout}` is {what}",
                  _arg(stmt, env, rollout), hint="pass a generate's result: `rollout = MODEL.generate(prompts, n = 8)`")
        return None
    ancestry = _ancestors(f, by_id)
    from_rollout = scores == rollout or (scores in by_id and rollout in _ancestors(by_id[scores], by_id))
    if not from_rollout:
        rep.error(src, f"`{scores}` is not computed from `{rollout}`: the filter compares the scores of each of its "
                       "groups", _arg(stmt, env, scores), hint=f"pass the reward of that rollout: `scores = "
                                                                  f"REWARD({rollout})`")
        return None
    others = [i for i in ancestry if by_id[i].op == "generate" and i != rollout]
    if others:
        rep.error(src, f"`{scores}` also reads the rollout `{others[0]}`: one draw of prompts would have to "
                       "generate twice", _arg(stmt, env, scores),
                  hint=f"score `{rollout}` alone")
        return None
    prompts = str(gen.input("prompts"))
    data = [i for i in ancestry if by_id[i].op == "data"]
    if by_id[prompts].op != "data" or data != [prompts]:
        extra = next((d for d in data if d != prompts), prompts)
        rep.error(src, f"`{FILTER}` draws more prompts from `{prompts}`, but its loop also reads `{extra}`"
                  if extra != prompts else f"`{FILTER}` draws more prompts, but `{rollout}`'s prompts `{prompts}` "
                                           "are computed in the step", stmt.call.callee,
                  hint="generate from a `data` declaration, and score with what that generation gives")
        return None
    if rollout in claimed:
        rep.error(src, f"`{rollout}` is already filtered by `{claimed[rollout]}`: a rollout is refilled by one "
                       "filter", _arg(stmt, env, rollout), hint=f"pass `{claimed[rollout]}` on instead")
        return None
    claimed[rollout] = f.id
    order = list(by_id)
    return sorted(ancestry, key=order.index)


def _escapes(rep: Reporter, src: Source, stmts: Sequence[ast.Stmt], env: Mapping[str, object], nodes: list[Node],
             f: Node, loop: list[str]) -> None:
    """A node outside the loop reading a value the loop refills would get every draw's samples, not the kept ones."""
    inside = set(loop) | {f.id}
    for n in nodes:
        if n.id in inside:
            continue
        for _, used in n.inputs:
            if used not in loop:
                continue
            stmt = next(s for s in stmts if (s.line, s.col) == (n.loc.line, n.loc.col))
            where = _arg(stmt, env, used)
            rep.error(src, f"`{used}` is refilled by `{f.id} = {FILTER}(...)`: each draw of prompts adds to it, "
                           f"and the samples trained on are the groups `{f.id}` keeps", where,
                      hint=f"pass `{f.id}` (it carries `{f.input('rollout')}`'s tensors and `{f.input('scores')}`'s "
                           "scores, for the kept groups)")
            break


def _ancestors(node: Node, by_id: Mapping[str, Node]) -> set[str]:
    seen: set[str] = set()
    todo = list(node.input_ids)
    while todo:
        cur = todo.pop()
        if cur in seen or cur not in by_id:
            continue
        seen.add(cur)
        todo.extend(by_id[cur].input_ids)
    return seen


def _arg(stmt: ast.Stmt, env: Mapping[str, object], node_id: str) -> ast.Located:
    """The argument of `stmt` that passes `node_id` (by the name written, or a template parameter bound to that
    data declaration); the callee when none does."""
    for a in stmt.call.args:
        v = a.value
        if isinstance(v, ast.Name):
            bound = env.get(v.name)
            if v.name == node_id or (isinstance(bound, DataB) and bound.name == node_id):
                return v
    return stmt.call.callee
