"""Deterministic text and JSON views of a `Graph` (what `flowrl compile` prints; golden tests compare them)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flowrl.ir.graph import EvalDecl, Graph, ModelDecl, Node, Range, Ref, Value
from flowrl.ir.signatures import MODEL_KEYS
from flowrl.models.lora_spec import base_of, family_of, lora_spec, shares_base


def format_value(v: Value) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _kv(mapping: Mapping[str, Value]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in sorted(mapping.items()))


def env_label(attrs: Mapping[str, Any]) -> str | None:
    """A generate's environment as `flowrl compile` and `flowrl viz` name it, `calc (tool, max_turns=4)`; None
    for a generate without one. (Its whole spec is in the JSON view.)"""
    spec = attrs.get("env")
    if not isinstance(spec, Mapping):
        return None
    total = attrs.get("max_total") or 0
    extra = f", max_total={total}" if total else ""
    extra += f", decode_batch={spec['decode_batch']}" if spec.get("decode_batch") else ""
    return f"{spec.get('name')} ({spec.get('kind', 'env')}, max_turns={spec.get('max_turns')}{extra})"


def format_node(n: Node, model_lr: float | None = None) -> str:
    """One node's line; an update whose `lr` is 0 (the model's own) shows `model_lr`, the rate it trains at."""
    call = f"{n.model}.{n.method}" if n.model else n.op
    if n.op in ("fn", "reward"):
        call = f"{n.op}:{n.attrs.get('fn')}"
    args = ", ".join(f"{p}={i}" for p, i in n.inputs)
    attrs = {k: v for k, v in n.attrs.items() if not (n.op in ("fn", "reward") and k == "fn")
             and k not in ("env", "max_total", "env_at")}
    if n.op == "update" and attrs.get("lr") == 0 and model_lr is not None:
        attrs["lr"] = model_lr
    env = env_label(n.attrs)
    shown = ", ".join(x for x in (f"env={env}" if env else "", _kv(attrs)) if x)
    tail = f" {{{shown}}}" if shown else ""
    where = f"@{n.worker_group}/{n.dispatch}"
    # a node from a standard template names the template's file: its line is the template's, not the flow's
    line = f"{n.loc.path}:{n.loc.line}:{n.loc.col}" if n.loc.path.startswith("<stdlib>/") else f"{n.loc.line}:{n.loc.col}"
    return f"  {n.id} = {call}({args}){tail}  {where}  # {line}"


def format_eval(e: EvalDecl) -> str:
    """`eval held {data=held, model=actor, reward=correct, n=4, temperature=1.0, max_tokens=8, every=10}`: every key
    as the run applies it (the defaults taken from the flow's generate, reward and run filled in)."""
    start = ", at_start=true" if e.at_start else ""
    return (f"eval {e.name} {{data={e.data}, model={e.model}, reward={e.reward}, n={e.n}, "
            f"temperature={e.temperature!r}, max_tokens={e.max_tokens}, every={e.every}{start}}}")


def to_text(g: Graph) -> str:
    """A stable, line-oriented rendering: declarations, worker groups, nodes in schedule order, passes."""
    lines = [f"flow {g.flow}" + (f"  (use {g.template})" if g.template else "")]
    grouped = {name for w in g.worker_groups for name in w.models}
    for m in g.models:
        src = m.source_model or m.source
        extra: dict[str, Value] = {"trainable": m.trainable, "engine": m.engine,
                                   **({"lr": m.lr} if m.lr is not None else {})}
        extra.update(m.config)
        # declared, but in no worker group (pass drop-reference): no backend builds it
        unbuilt = "  # not built: no worker group holds it" if g.worker_groups and m.name not in grouped else ""
        lines.append(f"model {m.name} : {m.role} <- {src} {{{_kv(extra)}}}{_lora_label(g, m)}{unbuilt}")
    for r in g.rewards:
        source = f'http("{r.target}")' if r.kind == "http" else r.target
        opts = ", ".join(f"{k} = {json.dumps(_json_value(v))}" for k, v in r.options.items())
        lines.append(f"reward {r.name} = {source}" + (" (batched)" if r.batched else "") + (f" {{ {opts} }}" if opts else ""))
    for d in g.data:
        lines.append(f"data {d.name} = {d.kind}({d.path.rsplit('/', 1)[-1]}) {{{_kv(d.options)}}}")
    for p in g.pools:
        keys = f", {_kv(p.options)}" if p.options else ""  # the serverless keys: gpu_fraction, keep_warm
        lines.append(f"pool {p.name} {{gpus={p.gpus}, elastic={format_value(p.elastic)}{keys}}}")
    for w in g.worker_groups:
        pool = f" on {w.pool}" if w.pool else ""
        lines.append(f"group {w.name}{pool}: {', '.join(w.models)} x{w.replicas}")
    lines.append("step {")
    # the rate each model trains at: its `lr`, else the default its optimizer is built with (a reward model
    # made trainable by being updated has no `lr` of its own)
    lrs = {m.name: m.lr if m.lr is not None else float(str(MODEL_KEYS["lr"][1])) for m in g.models}
    lines.extend(format_node(n, lrs.get(str(n.model))) for n in g.nodes)
    lines.append("}")
    if g.run:
        lines.append(f"run {{{_kv(g.run)}}}")
    lines.extend(format_eval(e) for e in g.evals)  # none in a flow without `eval`: its text is as before
    for rec in g.passes:
        lines.append(f"pass {rec.name}: {'changed' if rec.changed else 'unchanged'}")
    return "\n".join(lines) + "\n"


def _lora_label(g: Graph, m: ModelDecl) -> str:
    """` lora {rank=8, ...}` for a model with adapters; for a reference on a LoRA policy, whose base it is and
    whether it shares that policy's weights (flowrl.models.lora_spec.shares_base); "" otherwise."""
    spec = lora_spec(m.options)
    if spec is not None:
        return f" lora {{{spec.label(family_of(m.source))}}}"
    src = base_of(m, {d.name: d for d in g.models})
    if src is None:
        return ""
    if shares_base(g, m):
        return f"  # ref: base of {src} (adapters off), sharing its weights"
    return f"  # ref: base of {src} (adapters off), a copy of its own: not in {src}'s worker group"


def _lora_json(g: Graph, m: ModelDecl) -> dict[str, Any]:
    """graph.json's LoRA entries of a model (none for a model without): what `flowrl export` rebuilds it from."""
    spec = lora_spec(m.options)
    dtype = str(m.options.get("dtype", "float32"))
    if spec is not None:
        return {"lora": {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
                         "targets": "all-linear" if spec.all_linear else list(spec.targets)}, "dtype": dtype}
    src = base_of(m, {d.name: d for d in g.models})
    return {"base_of": src, "shares_base": shares_base(g, m), "dtype": dtype} if src is not None else {}


def _json_value(v: Any) -> Any:
    if isinstance(v, (Range, Ref)):
        return str(v)
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def to_json(g: Graph) -> dict[str, Any]:
    return {
        "flow": g.flow,
        "path": g.path,
        "template": g.template,
        "imports": list(g.imports),
        "models": [
            {
                "name": m.name, "role": m.role, "source": m.source_model or m.source,
                "trainable": m.trainable, "lr": m.lr, "engine": m.engine, "gpus": m.gpus,
                "replicas": _json_value(m.replicas), "config": _json_value(m.config),
                "options": _json_value(m.options), "base_source": m.source, "loc": str(m.loc), **_lora_json(g, m),
            }
            for m in g.models
        ],
        "rewards": [{"name": r.name, "target": r.target, "batched": r.batched, "kind": r.kind,
                     "options": _json_value(r.options)} for r in g.rewards],
        "data": [{"name": d.name, "kind": d.kind, "path": d.path, "options": _json_value(d.options)}
                 for d in g.data],
        "nodes": [
            {
                "id": n.id, "op": n.op, "model": n.model, "method": n.method,
                "inputs": list(n.input_ids), "params": [p for p, _ in n.inputs],
                "attrs": _json_value(n.attrs), "worker_group": n.worker_group, "dispatch": n.dispatch,
                "loc": str(n.loc),
            }
            for n in g.nodes
        ],
        "worker_groups": [{"name": w.name, "models": list(w.models), "pool": w.pool,
                           "replicas": _json_value(w.replicas)} for w in g.worker_groups],
        "pools": [{"name": p.name, "gpus": _json_value(p.gpus), "elastic": p.elastic,
                   **{k: _json_value(v) for k, v in sorted(p.options.items())}} for p in g.pools],
        "run": _json_value(g.run),
        "evals": [{"name": e.name, "data": e.data, "model": e.model, "reward": e.reward, "n": e.n,
                   "temperature": e.temperature, "max_tokens": e.max_tokens, "every": e.every,
                   "at_start": e.at_start, "loc": str(e.loc)} for e in g.evals],
        "passes": [{"name": p.name, "changed": p.changed, "notes": list(p.notes)} for p in g.passes],
    }


def to_json_text(g: Graph) -> str:
    return json.dumps(to_json(g), indent=2, sort_keys=False)
