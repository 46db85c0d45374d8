"""Graph queries shared by the rewrite passes (flowrl.passes): rollouts, their forwards, what a step updates."""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.ir.graph import Graph, Node

FORWARD_OPS = ("logprobs", "values", "score")


def rollouts(graph: Graph) -> list[Node]:
    """The generate nodes, in schedule order."""
    return [n for n in graph.nodes if n.op == "generate"]


def forwards_over(graph: Graph, gen: Node) -> list[Node]:
    """The logprobs/values/score calls that read `gen`'s rollout, in schedule order."""
    return [n for n in graph.nodes if n.op in FORWARD_OPS and n.input("rollout") == gen.id]


def rewards_over(graph: Graph, gen: Node) -> list[Node]:
    """The reward calls that score `gen`'s rollout, in schedule order."""
    return [n for n in graph.nodes if n.op == "reward" and n.input("rollout") == gen.id]


def scored_beside(graph: Graph, reward: Node) -> bool:
    """Whether a reward call is scored by workers of its own (`workers >= 1` or `http(...)`), not on the
    controller's thread: then it can score finished samples while generation goes on."""
    decl = next((r for r in graph.rewards if r.target == reward.attrs.get("fn")), None)
    if decl is None:
        return False
    return decl.kind == "http" or int(str(decl.options.get("workers", 0) or 0)) > 0


def filters_over(graph: Graph, gen: Node) -> list[Node]:
    """The dynamic-sampling filters (`filter_groups`, dsl.refill) of `gen`'s rollout: their output is some of its
    groups, the same samples with the same prompts."""
    return [n for n in graph.nodes if n.op == "fn" and n.attrs.get("fn") == "filter_groups"
            and n.input("rollout") == gen.id]


def over_kept(graph: Graph, gen: Node) -> list[Node]:
    """The forwards and updates that read a filter of `gen`'s rollout (its kept groups), in schedule order."""
    kept = {f.id for f in filters_over(graph, gen)}
    return [n for n in graph.nodes if n.op in (*FORWARD_OPS, "update") and n.input("rollout") in kept]


def updates_over(graph: Graph, gen: Node) -> list[Node]:
    """The update nodes that train on `gen`'s rollout, in schedule order."""
    return [n for n in graph.nodes if n.op == "update" and n.input("rollout") == gen.id]


def ancestors(graph: Graph, node: Node) -> set[str]:
    """Ids of every node `node` depends on, directly or not."""
    seen: set[str] = set()
    todo = list(node.input_ids)
    while todo:
        cur = todo.pop()
        if cur in seen or not graph.has_node(cur):
            continue
        seen.add(cur)
        todo.extend(graph.node(cur).input_ids)
    return seen


def position(graph: Graph, node_id: str) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n.id == node_id)


@dataclass(frozen=True)
class DataPrompts:
    """Prompt texts of a data file, with upper bounds on their token counts (any tokenizer flowrl builds
    spends at least one byte per token, plus BOS), so a refusal based on them is never wrong."""

    name: str
    texts: list[str]

    def max_tokens(self) -> int:
        return max((len(t.encode("utf-8")) + 1 for t in self.texts), default=0)

    def share_prefix(self, min_len: int) -> bool:
        """Whether two prompts may share `min_len` leading tokens: neighbours in sorted order share the
        longest prefixes (the same answer a trie over all prompts gives)."""
        encoded = sorted({t.encode("utf-8") for t in self.texts})
        for a, b in zip(encoded, encoded[1:], strict=False):
            common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            if common + 1 >= min_len:
                return True
        return False
