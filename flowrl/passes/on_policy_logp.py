"""Pass `on-policy-logp`, first in the pass pipeline: drop the old-log-prob forward when the update is on-policy.

PPO's ratio exp(logp - old_logp) needs the log-probs of the weights that generated the rollout. When the update
takes exactly one optimizer step on the whole rollout (`epochs = 1`, `mini_batches = 1`) and nothing else
changes the model between the `logprobs` call and the update, those are the weights the update's own forward
runs with: `old_logp` is `logp.detach()`, the same numbers (the ratio is 1 and the gradient is A * grad logp).
The pass removes the `old_logp = actor.logprobs(rollout)` node and its forward over the whole rollout, and the
update uses its own detached log-probs (`old_logp = "detached"` on the node). TRL's GRPOTrainer and verl skip
the same pass in the same case. The step's KL to the reference (`kl_mean`) is then measured by the update.
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.ir.attrs import UpdateAttrs
from flowrl.ir.graph import Graph, Node
from flowrl.passes.registry import register


def why_not_reuse(graph: Graph, update: Node, src: Node) -> str | None:
    """None when `update` can use its own detached log-probs in place of `src`'s, else why not."""
    if src.op != "logprobs":
        # Another kind of value (a function's output, say) is not the policy's log-probs of this rollout.
        return f"old_logp comes from `{src.id}`, a {src.op} node, not a logprobs forward"
    if src.model != update.model:
        # Log-probs of another model are not this model's weights at update time.
        return f"old_logp is computed by {src.model}, not by {update.model}, the model being trained"
    if src.input("rollout") != update.input("rollout"):
        return f"old_logp scores `{src.input('rollout')}`, but the update trains on `{update.input('rollout')}`"
    steps = UpdateAttrs.of(update.attrs)
    for key, value in (("epochs", steps.epochs), ("mini_batches", steps.mini_batches)):
        if value != 1:
            # After the first optimizer step the weights have moved: the old log-probs must be kept.
            return f"{key} = {update.attrs[key]}: later optimizer steps need the log-probs from before the first"
    # A flow updates a model once per step (the language checks it), so nothing else moves the weights
    # between the forward and the update; another reader of the forward still needs it computed.
    readers = [n.id for n in graph.nodes if src.id in n.input_ids and n.id != update.id]
    if readers:
        return f"`{src.id}` is also read by {', '.join(f'`{r}`' for r in readers)}"
    return None


@register("on-policy-logp", "drop the old-log-prob forward when the update takes one optimizer step on the "
          "rollout (epochs = 1, mini_batches = 1): the update's own log-probs, detached, are the same numbers")
def on_policy_logp(graph: Graph) -> tuple[Graph, list[str]]:
    notes: list[str] = []
    dropped: set[str] = set()
    rewritten: dict[str, Node] = {}
    for update in (n for n in graph.nodes if n.op == "update"):
        src_id = update.input("old_logp")
        if src_id is None or not graph.has_node(src_id):
            continue
        reason = why_not_reuse(graph, update, graph.node(src_id))
        if reason is not None:
            notes.append(f"{update.id}: keeps `{src_id}`: {reason}")
            continue
        inputs = tuple((p, i) for p, i in update.inputs if p != "old_logp")
        rewritten[update.id] = replace(update, inputs=inputs).with_attrs(old_logp="detached")
        dropped.add(src_id)
        notes.append(f"{update.id}: `{src_id}` removed: one optimizer step on the rollout, so the old log-probs "
                     f"are the update's own, detached (one forward over the rollout saved)")
    if not rewritten:
        if not notes:
            notes.append("nothing to do: no update reads an old_logp")
        return graph, notes
    nodes = [rewritten.get(n.id, n) for n in graph.nodes if n.id not in dropped]
    return graph.with_nodes(nodes), notes
