"""A compiled flow as the simulator sees it (flowrl.backends.sim): which model generates, which forwards and
updates run over the rollout, with what shapes, batch and lengths. Read from a graph's JSON (`flowrl compile
--json`, or a run directory's graph.json), so a flow file and a past run are read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowrl.backends.sim.shapes import ModelShape, from_decl
from flowrl.errors import Diagnostic, FlowError

FORWARD_OPS = ("logprobs", "values", "score")


@dataclass(frozen=True)
class Call:
    node: str
    op: str  # generate | logprobs | values | score | update
    model: str
    epochs: int = 1
    mini_batches: int = 1
    fusion: str | None = None  # updates of one intra-stage fusion group run as one call
    share_prefix: bool = False  # a prompt's samples share its prefix (pass share-prefix); generate: prompts' too
    stream: bool = False  # a forward fused with generation (pass fuse-gen-inference): it takes the chunks as they come


@dataclass(frozen=True)
class FlowWork:
    flow: str
    shapes: Mapping[str, ModelShape]
    generate: Call
    forwards: tuple[Call, ...]
    updates: tuple[Call, ...]
    prompts: int  # per step
    samples: int  # per prompt
    max_tokens: int
    controller: tuple[str, ...] = ()  # nodes the controller runs (rewards, functions, data)
    controller_s: float = 0.0  # their seconds per sample: user code, measured (`controller_times`), else 0

    def update_calls(self) -> list[tuple[Call, ...]]:
        """The updates as the calls that run them: one per update, or one for each intra-stage fusion group."""
        calls: dict[str, list[Call]] = {}
        for u in self.updates:
            calls.setdefault(u.fusion or u.node, []).append(u)
        return [tuple(c) for c in calls.values()]

    def describe(self) -> str:
        def p(name: str) -> str:
            return f"{name} {self.shapes[name].name} ({self.shapes[name].params / 1e9:.3g}B)"
        return (f"{self.flow}: generate {p(self.generate.model)}; forwards "
                f"{', '.join(f.node for f in self.forwards) or 'none'}; updates "
                f"{', '.join(p(u.model) for u in self.updates)}; {self.prompts} prompts x {self.samples} samples, "
                f"max_tokens {self.max_tokens}")


def flow_work(graph: Mapping[str, Any], overrides: Mapping[str, ModelShape] | None = None,
              prompts: int | None = None, samples: int | None = None, max_tokens: int | None = None) -> FlowWork:
    """What one step of `graph` computes; `prompts`, `samples` (per prompt) and `max_tokens` replace the flow's."""
    overrides = dict(overrides or {})
    models = {m["name"]: m for m in graph["models"]}
    unknown = set(overrides) - set(models)
    if unknown:
        raise FlowError(Diagnostic(f"--model {sorted(unknown)[0]}=...: the flow has no such model",
                                   hint=f"its models: {', '.join(models)}"))

    def shape(name: str) -> ModelShape:
        seen = name
        while seen not in overrides and str(models[seen]["source"]) in models and models[seen]["source"] != seen:
            seen = str(models[seen]["source"])  # a copy (`source = actor`) takes what its source was given
        return overrides[seen] if seen in overrides else from_decl(models[name], models)

    gens, fwds, ups, ctrl = [], [], [], []
    for n in graph["nodes"]:
        op, model, attrs = n["op"], n.get("model"), n.get("attrs", {})
        if n.get("worker_group") == "controller":
            ctrl.append(str(n["id"]))
        elif op == "generate":
            gens.append((Call(n["id"], op, model, share_prefix=bool(attrs.get("share_prefix"))), attrs))
        elif op in FORWARD_OPS and model:
            fwds.append(Call(n["id"], op, model, share_prefix=bool(attrs.get("share_prefix")),
                             stream=attrs.get("fusion_kind") == "inter-stage"))
        elif op == "update" and model:
            fused = attrs.get("fusion") if attrs.get("fusion_kind") == "intra-stage" else None
            ups.append(Call(n["id"], op, model, int(attrs.get("epochs", 1)), int(attrs.get("mini_batches", 1)),
                            str(fused) if fused else None, bool(attrs.get("share_prefix"))))
    if len(gens) != 1:
        raise FlowError(Diagnostic(f"{graph['flow']}: the simulator models flows with one generate call, this one "
                                   f"has {len(gens)}"))
    gen, gattrs = gens[0]
    batch = prompts or next((int(d["options"].get("batch", 0)) for d in graph.get("data", [])), 0)
    if batch < 1:
        raise FlowError(Diagnostic(f"{graph['flow']}: cannot tell the prompts per step", hint="pass --prompts N"))
    used = {c.model for c in [gen, *fwds, *ups]}
    return FlowWork(str(graph["flow"]), {m: shape(m) for m in sorted(used)}, gen, tuple(fwds), tuple(ups), batch,
                    samples or int(gattrs.get("n", 1)), max_tokens or int(gattrs.get("max_tokens", 64)),
                    tuple(ctrl))


def controller_times(work: FlowWork, metrics: Sequence[Mapping[str, Any]], samples: int) -> FlowWork:
    """`work` with the controller's seconds per sample measured in a run of the same flow (its metrics rows, the
    first step left out; `samples` a step): rewards and functions are the user's code, which no cost model
    knows."""
    rows = metrics[1:] if len(metrics) > 1 else metrics
    if not rows or samples < 1:
        return work
    per_step = sum(float(r.get(f"time/{n}", 0.0)) for r in rows for n in work.controller) / len(rows)
    return replace(work, controller_s=per_step / samples)
