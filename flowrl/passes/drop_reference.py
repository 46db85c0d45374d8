"""Pass `drop-reference`, after on-policy-logp in the pass pipeline: a KL-free graph holds no reference model.

`ref_logp = ref.logprobs(rollout)` exists for the KL to the reference: in the policy loss (an update's
`kl_coef`), in the rewards (`reinforce_pp_advantage`'s `kl_coef`), or in DPO's loss. With every `kl_coef` 0 (GSPO,
Dr. GRPO, CISPO and DAPO train so) nothing reads it but the step's `kl_mean` metric, yet the reference model is
built (a second copy of the policy's weights) and runs a forward over every rollout. The pass removes the forward
and the edges into its readers and, when the reference model has no other node, takes it out of its worker
group (a group left with no model goes too): no backend builds it, so it has no weights in memory and no
forward time. Its declaration stays in the graph: a model declared with `source = ref` is built through it, and
in a pipeline a later stage that reads the reference starts from the weights it would have had
(flowrl.runtime.pipeline carries them). The update's loss is unchanged (the KL term was 0), so a run computes the
same numbers; `kl_mean` is then not reported: there is no reference to measure against.
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.ir.attrs import UpdateAttrs
from flowrl.ir.graph import Graph, Node
from flowrl.ir.signatures import ROLLOUT_LOSSES
from flowrl.passes.registry import register

KL_FUNCTIONS = ("reinforce_pp_advantage",)  # step functions whose `kl_coef` turns ref_logp into rewards


def _kl_coef(node: Node) -> float:
    return float(str(node.attrs.get("kl_coef", 0.0) or 0.0))


def why_kept(graph: Graph, fwd: Node, reader: Node) -> str | None:
    """None when `reader` does not use `fwd`'s log-probs (it reads them as `ref_logp` for a KL term weighted 0),
    else what it uses them for."""
    params = [p for p, src in reader.inputs if src == fwd.id]
    if params != ["ref_logp"]:
        # Read as anything but a reference's log-probs (old_logp, say): only its reader knows what for.
        return f"`{reader.id}` reads it as {', '.join(f'`{p}`' for p in params)}"
    if reader.op == "update":
        loss = str(reader.attrs.get("loss", "ppo_clip"))
        if loss not in ROLLOUT_LOSSES:
            # DPO's loss is the policy's log-ratio against the reference: the reference is the loss itself.
            return f"`{reader.id}` (loss \"{loss}\") compares the policy with the reference's log-probs"
        if UpdateAttrs.of(reader.attrs).kl_coef > 0:
            return f"`{reader.id}` has kl_coef = {reader.attrs['kl_coef']}: its KL penalty reads it"
        return None
    if reader.op == "fn" and reader.attrs.get("fn") in KL_FUNCTIONS:
        if _kl_coef(reader) > 0:
            return f"`{reader.id}` puts kl_coef = {reader.attrs['kl_coef']} x the KL to the reference into the rewards"
        return None
    # A user's step function (or any other node) may compute anything from it.
    return f"`{reader.id}` ({reader.attrs.get('fn', reader.op)}) reads it"


def why_not_drop(graph: Graph, fwd: Node) -> str | None:
    """None when the reference forward `fwd` can go, else the first reader that uses its log-probs."""
    readers = graph.consumers(fwd.id)
    for reader in readers:
        reason = why_kept(graph, fwd, reader)
        if reason is not None:
            return reason
    return None


def _readers_note(graph: Graph, fwd: Node) -> str:
    readers = graph.consumers(fwd.id)
    if not readers:
        return "nothing reads it"
    return " and ".join(f"`{r.id}`" for r in readers) + (" read" if len(readers) > 1 else " reads") + \
        " it with kl_coef = 0"


@register("drop-reference", "remove the reference model's forward, and the model itself, when nothing uses its "
          "log-probs (every kl_coef reading them is 0): no weights built, no forward run")
def drop_reference(graph: Graph) -> tuple[Graph, list[str]]:
    notes: list[str] = []
    dropped: dict[str, str] = {}  # node id -> its model
    for fwd in graph.nodes:
        if fwd.op != "logprobs" or graph.model(str(fwd.model)).role != "reference":
            continue
        reason = why_not_drop(graph, fwd)
        if reason is not None:
            notes.append(f"{fwd.id}: kept: {reason}")
            continue
        notes.append(f"{fwd.id}: removed: {_readers_note(graph, fwd)}, so nothing uses {fwd.model}'s log-probs "
                     "(the step's kl_mean is not reported)")
        dropped[fwd.id] = str(fwd.model)
    if not dropped:
        if not notes:
            notes.append("nothing to do: no reference model's forward in the step")
        return graph, notes
    nodes = [replace(n, inputs=tuple((p, i) for p, i in n.inputs if i not in dropped))
             for n in graph.nodes if n.id not in dropped]
    used = {n.model for n in nodes if n.model}
    gone = {m for m in dropped.values() if m not in used}
    for model in sorted(set(dropped.values()) - gone):
        users = ", ".join(f"`{n.id}`" for n in nodes if n.model == model)
        notes.append(f"{model}: still built: {users} uses it")
    for model in sorted(gone):
        notes.append(f"{model}: not built (no weights, no forward): no node of the step uses it")
    groups = tuple(replace(g, models=tuple(m for m in g.models if m not in gone)) for g in graph.worker_groups)
    return replace(graph, nodes=tuple(nodes), worker_groups=tuple(g for g in groups if g.models)), notes
