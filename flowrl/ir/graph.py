"""The graph IR: frozen nodes plus the flow's declarations; what lowering produces and passes rewrite.

A `Graph` is the single source of truth between the language front end (`flowrl.dsl`), the passes
(`flowrl.passes`) and the backends. Placement (worker groups), dispatch modes and fusion decisions are
plain attributes here so that `flowrl compile` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Union

from flowrl.errors import Diagnostic, Loc

OPS = ("data", "generate", "logprobs", "values", "score", "reward", "fn", "update")
ROLES = ("policy", "reference", "critic", "reward_model")
DISPATCH_MODES = ("controller", "broadcast", "split", "rank0")
CONTROLLER = "controller"  # the worker group name of nodes that run on the single controller


@dataclass(frozen=True)
class Range:
    """An inclusive integer range such as `2..16` (elastic sizes)."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}"


@dataclass(frozen=True)
class Ref:
    """A name used as a value (e.g. `source = actor`), resolved during lowering."""

    name: str

    def __str__(self) -> str:
        return self.name


Value = Union[int, float, str, bool, None, Range, Ref, tuple["Value", ...]]  # noqa: UP007 (recursive alias)


def frozen(mapping: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """A read-only copy of `mapping` (node attrs and declaration options are never mutated in place)."""
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class ModelDecl:
    """`model NAME : ROLE { ... }`. `source` is "tiny:gpt2", "hf:/abs/path", or another model's name
    (`source_model` is then set and weights are copied from it at step 0)."""

    name: str
    role: str
    source: str
    loc: Loc
    config: Mapping[str, Value] = field(default_factory=frozen)  # layers, dim, heads, vocab, context, ...
    source_model: str | None = None
    trainable: bool = False
    lr: float | None = None
    engine: str = "torch"
    gpus: float = 0.0
    replicas: int | str | Range = 1
    options: Mapping[str, Value] = field(default_factory=frozen)  # any other keys, kept for engines


@dataclass(frozen=True)
class RewardDecl:
    """`reward NAME = "dotted.path"` or a registered name (`kind` "python": `target` is what it resolved to), or
    `reward NAME = http("url")` (`kind` "http": `target` is the URL). `options`: its block's keys, checked
    (workers, timeout, on_error; for http also batch, retries, concurrency)."""

    name: str
    target: str
    loc: Loc
    batched: bool = False
    kind: str = "python"
    options: Mapping[str, Value] = field(default_factory=frozen)


@dataclass(frozen=True)
class DataDecl:
    """`data NAME = jsonl("path") { batch = 32, ... }`; `path` is absolute (relative to the flow file)."""

    name: str
    kind: str
    path: str
    loc: Loc
    options: Mapping[str, Value] = field(default_factory=frozen)


@dataclass(frozen=True)
class EvalDecl:
    """`eval NAME { data = D, ... }`: generate with `model` on data set `data` every `every` steps (0: at the end
    only; a run's last step always evaluates), score with reward declaration `reward` (flowrl.runtime.evaluation).
    Every key resolved: the flow's generate and reward give the defaults the block leaves out."""

    name: str
    data: str  # a data declaration's name (never one the step trains on)
    model: str
    reward: str  # a reward declaration's name
    loc: Loc
    n: int = 1
    temperature: float = 0.0  # 0: greedy
    max_tokens: int = 256
    every: int = 0
    at_start: bool = False


@dataclass(frozen=True)
class PoolDecl:
    """`pool NAME { gpus = 8..32, elastic = true }` inside `placement { }`."""

    name: str
    gpus: int | float | Range
    loc: Loc
    elastic: bool = False
    options: Mapping[str, Value] = field(default_factory=frozen)


@dataclass(frozen=True)
class GroupDecl:
    """A worker group as the compiler declares it: models that share ranks (colocated in one process per rank),
    the pool they run on and how many ranks. (What runs it is a backend's `flowrl.runtime.protocol.WorkerGroup`.)"""

    name: str
    models: tuple[str, ...]
    pool: str | None = None
    replicas: int | str | Range = 1

    @property
    def ranks(self) -> int:
        """Ranks a fixed-size backend starts: `replicas`; `auto` is 1; a range (an elastic pool, which the
        serverless backend scales) starts at its low end."""
        if isinstance(self.replicas, Range):
            return max(1, self.replicas.lo)
        if isinstance(self.replicas, int):
            return max(1, self.replicas)
        return 1


@dataclass(frozen=True)
class Node:
    """One call in the iteration. `inputs` pairs each parameter with the node id bound to it, in call order.

    `id` is the bound name (`rollout`, `adv`) or `MODEL.update` for an update. For `fn` and `reward` nodes
    `attrs["fn"]` names the function. `worker_group` and `dispatch` are the placement and dispatch decisions.
    `text` is the statement as written (for run-time errors: "while executing old_logp = actor.logprobs(...)").
    """

    id: str
    op: str
    loc: Loc
    model: str | None = None
    method: str | None = None
    inputs: tuple[tuple[str, str], ...] = ()
    attrs: Mapping[str, Value] = field(default_factory=frozen)
    worker_group: str = CONTROLLER
    dispatch: str = "controller"
    text: str = ""
    via: Loc | None = None  # a template's node: the flow's `use` it was expanded from (run-time errors name both)

    @property
    def input_ids(self) -> tuple[str, ...]:
        return tuple(node for _, node in self.inputs)

    def input(self, param: str) -> str | None:
        for name, node in self.inputs:
            if name == param:
                return node
        return None

    def with_attrs(self, **updates: Value) -> Node:
        return replace(self, attrs=frozen({**self.attrs, **updates}))


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: shown by `flowrl compile --explain` and exported in JSON."""

    name: str
    changed: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Graph:
    """A compiled flow. Nodes are kept in a topological order (the controller's schedule)."""

    flow: str
    path: str
    models: tuple[ModelDecl, ...]
    nodes: tuple[Node, ...]
    rewards: tuple[RewardDecl, ...] = ()
    data: tuple[DataDecl, ...] = ()
    run: Mapping[str, Value] = field(default_factory=frozen)
    pools: tuple[PoolDecl, ...] = ()
    worker_groups: tuple[GroupDecl, ...] = ()
    imports: tuple[str, ...] = ()
    passes: tuple[PassRecord, ...] = ()
    template: str | None = None  # the `use`d template, if any
    warnings: tuple[Diagnostic, ...] = ()  # what `flowrl check` and `flowrl run` print, located; the flow runs
    evals: tuple[EvalDecl, ...] = ()  # held-out evaluations between steps (`eval NAME { ... }`)

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def model(self, name: str) -> ModelDecl:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def has_node(self, node_id: str) -> bool:
        return any(n.id == node_id for n in self.nodes)

    def consumers(self, node_id: str) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if node_id in n.input_ids)

    def with_nodes(self, nodes: tuple[Node, ...] | list[Node]) -> Graph:
        return replace(self, nodes=tuple(nodes))
