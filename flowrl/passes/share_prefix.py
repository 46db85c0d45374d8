"""Pass `share-prefix` (RLHFless's pre-computed shared prefixes), first in the pass pipeline.

Marks a rollout's `generate` node, every forward over that rollout (`logprobs`, `values`, `score`) and every
update that trains on it with `share_prefix = true` and `prefix_min_len`. At run time generation prefills each unique prompt once and decodes
its n samples from copies of that KV cache, and each forward runs each prompt prefix once
(`flowrl.engines.prefix`): identical prompts (the n samples of one prompt) and prompts whose first
`prefix_min_len` tokens agree (a system prompt; found with a token trie) share one computation. An update's
forward (with autograd) runs each prompt once with its samples packed after it, so the prompt's gradient is
the sum over its samples, as in the unshared forward.
"""

from __future__ import annotations

from flowrl.data.tables import prompt_plain, read_data
from flowrl.errors import DataError
from flowrl.ir.attrs import GenerateAttrs
from flowrl.ir.graph import Graph, Node
from flowrl.passes.common import DataPrompts, forwards_over, rollouts, updates_over
from flowrl.passes.registry import register

MIN_LEN = 16  # tokens: below this a shared prefix saves less than the extra cache pass costs
SCAN_ROWS = 10_000  # rows of a data file read to find shared prefixes


def prompts_of(graph: Graph, gen: Node) -> DataPrompts | None:
    """The prompts a generate node samples from, when they come straight from a `data` declaration."""
    src = gen.input("prompts")
    if src is None or not graph.has_node(src) or graph.node(src).op != "data":
        return None
    decl = next((d for d in graph.data if d.name == src), None)
    if decl is None:
        return None
    try:
        rows = read_data(decl.kind, decl.path, str(decl.options.get("prompt_key", "prompt")))
    except DataError:
        return None
    limit = int(str(decl.options.get("limit", 0) or 0))
    texts = [prompt_plain(r[str(decl.options.get("prompt_key", "prompt"))]) for r in rows[: limit or SCAN_ROWS]]
    return DataPrompts(decl.name, texts)


def why_not_share(graph: Graph, gen: Node, min_len: int = MIN_LEN) -> str | None:
    """None when `gen`'s rollout can share prompt prefixes, else the reason it cannot (one per condition)."""
    model = graph.model(str(gen.model))
    if model.engine != "torch":
        # vLLM and other engines keep their own prefix cache; flowrl's sharing is for the torch engines.
        return f"{model.name} uses engine {model.engine!r}, which manages its own prefix cache"
    n = GenerateAttrs.of(gen.attrs).n
    data = prompts_of(graph, gen)
    if data is not None and data.max_tokens() < min_len:
        # Every prompt is shorter than the minimum: a second cache pass would cost more than it saves.
        return (f"every prompt in `{data.name}` is at most {data.max_tokens()} tokens, under "
                f"prefix_min_len = {min_len}")
    if n <= 1 and data is None:
        # One sample per prompt, and prompts made in the step: nothing is known to repeat.
        return "n = 1 and the prompts are not read from a data file, so no prefix is known to repeat"
    if n <= 1 and data is not None and not data.share_prefix(min_len):
        # One sample per prompt and no two prompts open alike: every prefix would run once anyway.
        return f"n = 1 and no two prompts in `{data.name}` share their first {min_len} tokens"
    return None


def _reason(graph: Graph, gen: Node, data: DataPrompts | None) -> str:
    n = GenerateAttrs.of(gen.attrs).n
    parts = [f"n = {n} samples share each prompt"] if n > 1 else []
    if data is not None and data.share_prefix(MIN_LEN):
        parts.append(f"prompts in `{data.name}` share prefixes of >= {MIN_LEN} tokens")
    return " and ".join(parts)


@register("share-prefix", "compute each shared prompt prefix once and reuse its KV cache "
          "(generation, every forward over the rollout, and the updates' forwards)")
def share_prompt_prefix(graph: Graph) -> tuple[Graph, list[str]]:
    notes: list[str] = []
    marked: dict[str, Node] = {}
    for gen in rollouts(graph):
        reason = why_not_share(graph, gen)
        if reason is not None:
            notes.append(f"{gen.id}: not shared: {reason}")
            continue
        users = [gen, *forwards_over(graph, gen), *updates_over(graph, gen)]
        for node in users:
            engine = graph.model(str(node.model)).engine
            if engine != "torch":
                notes.append(f"{node.id}: not shared: {node.model} uses engine {engine!r}")
                continue
            marked[node.id] = node.with_attrs(share_prefix=True, prefix_min_len=MIN_LEN)
        shared = [n.id for n in users if n.id in marked]
        notes.append(f"{gen.id}: {_reason(graph, gen, prompts_of(graph, gen))}: prefixes computed once in "
                     f"{', '.join(shared)}")
    return graph.with_nodes([marked.get(n.id, n) for n in graph.nodes]), notes
