"""Placement during lowering: `placement { }` pools and pins -> worker groups, and each node's group.

Without a placement block every model shares one worker group, "colocated" (verl's hybrid engine: all
models on the same ranks, switching between generation and training). With one, each pool gets a group
holding the models that have a node (or a whole-model pin) there. A method without a pin follows its
model's whole-model pin, else its `update` pin, else its first pin (so a model is split over as few
groups as possible); a model with no pin at all goes to a group named "default", created only if
needed. Nodes that are not model calls (data, functions, rewards) run on the controller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from flowrl.ir.graph import GroupDecl, ModelDecl, Node, PoolDecl, Range, Value, frozen
from flowrl.ir.signatures import METHODS

from . import ast
from .diagnostics import Reporter, Source, did_you_mean, one_of
from .values import KindError, coerce, describe, to_value

COLOCATED = "colocated"
DEFAULT = "default"
POOL_KEYS = ("gpus", "elastic", "gpu_fraction", "keep_warm")
KEEP_WARM = ("host", "device")  # serverless: where an instance's models wait between tasks


@dataclass(frozen=True)
class ReplicasAt:
    """Where a model's `replicas` was written (for the colocation conflict error)."""

    src: Source
    where: ast.Located


class Placer:
    def __init__(self, rep: Reporter, models: Sequence[ModelDecl], replicas_at: Mapping[str, ReplicasAt]) -> None:
        self.rep = rep
        self.models = {m.name: m for m in models}
        self.order = [m.name for m in models]
        self.replicas_at = replicas_at

    def place(self, decls: Sequence[ast.PlacementDecl], src: Source, nodes: Sequence[Node]
              ) -> tuple[tuple[PoolDecl, ...], tuple[GroupDecl, ...], list[Node]]:
        for extra in decls[1:]:
            self.rep.error(src, "a flow has at most one `placement` block", extra,
                           hint=f"merge it into the one on line {decls[0].line}")
        if not decls:
            group = self._group(COLOCATED, list(self.order), None)
            placed = [replace(n, worker_group=COLOCATED) if n.model else n for n in nodes]
            return (), (group,) if group.models else (), placed
        pools = self._pools(decls[0], src)
        pins = self._pins(decls[0], src, {p.name for p in pools})

        fallback: dict[str, str] = {}  # where a model's unpinned methods go: with its update, else its first pin
        for (model, method), pool in pins.items():
            if method == "update" or model not in fallback:
                fallback[model] = pool

        def group_of(model: str, method: str | None) -> str:
            return pins.get((model, method)) or pins.get((model, None)) or fallback.get(model) or DEFAULT

        members: dict[str, set[str]] = {}
        for n in nodes:
            if n.model:
                members.setdefault(group_of(n.model, n.method), set()).add(n.model)
        pinned = {m for m, _ in pins}
        for (model, method), pool in pins.items():
            if method is None:
                members.setdefault(pool, set()).add(model)
        for name in self.order:
            if name not in pinned:
                members.setdefault(DEFAULT, set()).add(name)
        pool_names = [p.name for p in pools]
        names = [p for p in pool_names if p in members] + [g for g in members if g not in pool_names]
        groups = tuple(self._group(g, [m for m in self.order if m in members[g]], g if g in pool_names else None)
                       for g in names)
        placed = [replace(n, worker_group=group_of(n.model, n.method)) if n.model else n for n in nodes]
        return pools, groups, placed

    def _group(self, name: str, models: list[str], pool: str | None) -> GroupDecl:
        """Colocated models share ranks, so they must agree on `replicas` (1 is the default and yields)."""
        chosen: tuple[str, int | str | Range] | None = None
        for m in models:
            r = self.models[m].replicas
            if r == 1:
                continue
            if chosen is None:
                chosen = (m, r)
            elif chosen[1] != r:
                at = self.replicas_at.get(m)
                if at is not None:
                    self.rep.error(at.src, f"models in worker group `{name}` ask for different replicas: "
                                           f"`{chosen[0]}` has {chosen[1]}, `{m}` has {r}", at.where,
                                   hint="give them the same `replicas`, or pin them to different pools "
                                        "in a `placement { }` block")
        return GroupDecl(name, tuple(models), pool, chosen[1] if chosen else 1)

    def _pools(self, decl: ast.PlacementDecl, src: Source) -> tuple[PoolDecl, ...]:
        out: dict[str, PoolDecl] = {}
        for p in decl.pools:
            name = p.name.name
            if name in out:
                self.rep.error(src, f"pool `{name}` is declared twice", p.name)
                continue
            gpus: int | float | Range | None = None
            elastic = False
            options: dict[str, Value] = {}  # the serverless backend's keys (gpu_fraction, keep_warm)
            for e in p.entries:
                key = e.key.name
                if key not in POOL_KEYS:
                    self.rep.error(src, f"unknown pool key `{key}`", e.key,
                                   hint=did_you_mean(key, POOL_KEYS) or f"pool keys: {one_of(POOL_KEYS)}")
                    continue
                value = to_value(e.value)
                if key in ("gpu_fraction", "keep_warm"):
                    self._option(src, e, key, value, options)
                elif key == "elastic":
                    try:
                        elastic = bool(coerce("bool", value))
                    except KindError:
                        self.rep.error(src, f"`elastic` must be true or false, got {describe(value)}", e.value)
                elif isinstance(value, (Range, int, float)) and not isinstance(value, bool):
                    gpus = value
                else:
                    self.rep.error(src, f"`gpus` must be a number or a range such as 8..32, got {describe(value)}",
                                   e.value)
            if gpus is None and not any(e.key.name == "gpus" for e in p.entries):
                self.rep.error(src, f"pool `{name}` needs `gpus`", p.name, hint=f"write `pool {name} {{ gpus = 8 }}`")
            out[name] = PoolDecl(name, gpus if gpus is not None else 0, src.loc(p), elastic, frozen(options))
        return tuple(out.values())

    def _option(self, src: Source, e: ast.Entry, key: str, value: Value, options: dict[str, Value]) -> None:
        """`gpu_fraction`: the share of a GPU each serverless instance asks for, in (0, 1]; `keep_warm`: where
        its models wait between tasks, "host" (the device given back) or "device" (kept, and held)."""
        if key == "gpu_fraction":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                self.rep.error(src, f"`gpu_fraction` must be a number in (0, 1], got {describe(value)}", e.value,
                               hint="the share of one GPU each instance asks for, e.g. `gpu_fraction = 0.5`")
                return
            options[key] = float(value)
        elif not isinstance(value, str) or value not in KEEP_WARM:
            self.rep.error(src, f"`keep_warm` must be \"host\" or \"device\", got {describe(value)}", e.value,
                           hint=did_you_mean(str(value), KEEP_WARM) or 'write `keep_warm = "host"` (models wait in '
                           'host memory) or `keep_warm = "device"` (they stay on the device, held)')
        else:
            options[key] = value

    def _pins(self, decl: ast.PlacementDecl, src: Source, pools: set[str]) -> dict[tuple[str, str | None], str]:
        pins: dict[tuple[str, str | None], str] = {}
        first: dict[tuple[str, str | None], int] = {}
        for a in decl.assigns:
            pool = a.pool.name
            if pool not in pools:
                self.rep.error(src, f"unknown pool `{pool}`", a.pool,
                               hint=did_you_mean(pool, pools) or (f"pools: {one_of(sorted(pools))}" if pools else
                                                                  f"declare it: `pool {pool} {{ gpus = 8 }}`"))
            for t in a.targets:
                key = self._target(t, src)
                if key is None:
                    continue
                if key in pins:
                    shown = key[0] + (f".{key[1]}" if key[1] else "")
                    self.rep.error(src, f"`{shown}` is placed twice", t,
                                   hint=f"it is first placed on line {first[key]}")
                    continue
                if pool in pools:
                    pins[key], first[key] = pool, t.line
        return pins

    def _target(self, t: ast.Target, src: Source) -> tuple[str, str | None] | None:
        model = self.models.get(t.model.name)
        if model is None:
            self.rep.error(src, f"unknown name `{t.model.name}`", t.model,
                           hint=did_you_mean(t.model.name, self.models) or f"models: {one_of(self.order)}")
            return None
        if t.method is None:
            return model.name, None
        methods = METHODS.get(model.role, {})
        if methods and t.method.name not in methods:
            self.rep.error(src, f"model `{model.name}` ({model.role}) has no method `{t.method.name}`", t.method,
                           hint=did_you_mean(t.method.name, methods) or f"a {model.role} model has {one_of(methods)}")
            return None
        return model.name, t.method.name

