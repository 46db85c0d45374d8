"""Pass `share-prefix` (RLHFless's pre-computed shared prefixes), first in the pass pipeline.

Marks a rollout's `generate` node, every forward over that rollout (`logprobs`, `values`, `score`) and every
update that trains on it with `share_prefix = true` and `prefix_min_len`; likewise an update on preference
pairs read from a data node (dpo, bradley_terry) and every forward over that data, since a pair's chosen and
rejected rows hold one prompt. At run time generation prefills each unique prompt once and decodes its n
samples from copies of that KV cache, and each forward runs each prompt prefix once (`flowrl.engines.prefix`):
identical prompts (the n samples of one prompt, a pair's two rows) and prompts whose first `prefix_min_len`
tokens agree (a system prompt; found with a token trie) share one computation. An update's
forward (with autograd) runs each prompt once with its samples packed after it, so the prompt's gradient is
the sum over its samples, as in the unshared forward.
"""

from __future__ import annotations

from flowrl.data.tables import prompt_plain, read_data
from flowrl.errors import DataError
from flowrl.ir.attrs import GenerateAttrs
from flowrl.ir.graph import Graph, Node
from flowrl.passes.common import FORWARD_OPS, DataPrompts, forwards_over, over_kept, rollouts, updates_over
from flowrl.passes.registry import register

PAIR_LOSSES = ("dpo", "bradley_terry")  # losses on preference pairs (flowrl.runtime.preference_update)
MIN_LEN = 16  # tokens: below this a shared prefix saves less than the extra cache pass costs
SCAN_ROWS = 10_000  # rows of a data file read to find shared prefixes


def prompts_of(graph: Graph, gen: Node) -> DataPrompts | None:
    """The prompts a generate node samples from, when they come straight from a `data` declaration."""
    src = gen.input("prompts")
    if src is None or not graph.has_node(src) or graph.node(src).op != "data":
        return None
    return data_prompts(graph, src)


def data_prompts(graph: Graph, src: str) -> DataPrompts | None:
    """The prompts of data declaration `src` (None when it cannot be read here)."""
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


def pair_updates(graph: Graph) -> list[Node]:
    """The updates that train on preference pairs straight from a data node (dpo, bradley_terry), in order."""
    return [n for n in graph.nodes if n.op == "update" and n.attrs.get("loss") in PAIR_LOSSES
            and graph.has_node(str(n.input("rollout"))) and graph.node(str(n.input("rollout"))).op == "data"]


def why_not_share_pairs(graph: Graph, data: str, min_len: int = MIN_LEN) -> str | None:
    """None when the pairs of data node `data` can share their prompts, else why not. A pair's chosen and
    rejected rows always hold the same prompt; the one refusal is the generation's: prompts too short."""
    prompts = data_prompts(graph, data)
    if prompts is not None and prompts.max_tokens() < min_len:
        # Every prompt is shorter than the minimum: a second cache pass would cost more than it saves.
        return f"every prompt in `{data}` is at most {prompts.max_tokens()} tokens, under prefix_min_len = {min_len}"
    return None


def _mark(graph: Graph, users: list[Node], marked: dict[str, Node], notes: list[str]) -> list[str]:
    """Mark `users` to share their prompts (torch-engine models only: another engine is noted) and return the ids
    marked."""
    for node in users:
        engine = graph.model(str(node.model)).engine
        if engine != "torch":
            notes.append(f"{node.id}: not shared: {node.model} uses engine {engine!r}")
            continue
        marked[node.id] = node.with_attrs(share_prefix=True, prefix_min_len=MIN_LEN)
    return [n.id for n in users if n.id in marked]


def _share_pairs(graph: Graph, marked: dict[str, Node], notes: list[str]) -> None:
    """Preference pairs: each pair's prompt once in the updates' forwards (the policy's for DPO, the reward
    model's for Bradley-Terry) and in every forward over the same data (the reference's log-probs)."""
    for data in dict.fromkeys(str(n.input("rollout")) for n in pair_updates(graph)):
        reason = why_not_share_pairs(graph, data)
        if reason is not None:
            notes.append(f"{data}: not shared: {reason}")
            continue
        users = [n for n in graph.nodes if n.input("rollout") == data
                 and (n.op in FORWARD_OPS or (n.op == "update" and n.attrs.get("loss") in PAIR_LOSSES))]
        shared = _mark(graph, users, marked, notes)
        notes.append(f"{data}: chosen and rejected share each pair's prompt: computed once in {', '.join(shared)}")


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
        # the kept groups of a dynamic-sampling filter are the rollout's samples: their forwards share alike
        users = [gen, *forwards_over(graph, gen), *updates_over(graph, gen), *over_kept(graph, gen)]
        shared = _mark(graph, users, marked, notes)
        notes.append(f"{gen.id}: {_reason(graph, gen, prompts_of(graph, gen))}: prefixes computed once in "
                     f"{', '.join(shared)}")
    _share_pairs(graph, marked, notes)
    return graph.with_nodes([marked.get(n.id, n) for n in graph.nodes]), notes
