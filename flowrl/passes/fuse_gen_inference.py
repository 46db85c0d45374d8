"""Pass `fuse-gen-inference` (RLHFuse inter-stage fusion), after `share-prefix` in the pass pipeline.

Fuses a rollout's `generate` node with the forwards over that rollout (reference / policy `logprobs`, critic
`values`, reward-model `score`) when at least one of them is placed on another worker group than generation
(a `placement { }` block), so it can run there while generation decodes: all get `fusion =
"gen-infer:<rollout>"` and `fusion_kind = "inter-stage"`, and the generate node gets `stream_chunk` (samples per hand-off), `migrate_below` (the unfinished fraction
of the batch under which the long tail moves to the fewest generation workers that hold it, when forwards
are queued for the freed workers), `chunk_forwards` (which generating ranks run the chunk forwards placed on
their own group) and `flush_steps` (the decode steps after which finished samples go out even if the chunk is
not full, so the other group is not left idle in the long tail). A forward of the generating model placed on
another group (the policy's old log-probs on the train pool) gets `spill_to = <generation group>`: that group
holds the same weights during the stage, so once a generation rank is done it takes the chunks still queued
for that forward (RLHFuse: freed generation workers run the inference). At run time
(`flowrl.runtime.gen_infer`) generation hands finished samples downstream in chunks, the forwards run on each
chunk while the tail still decodes, and results are put back in sample order, so every number downstream is
the one the unfused step computes. A reward scored by workers of its own (`reward r = "..." { workers = 4 }` or
`http(...)`) joins the stage too: each chunk is handed to its workers as it arrives, so a slow reward is scored
while the tail still decodes (a stage of generation and such rewards alone fuses on any backend).

A multi-turn generate (`env = NAME`, flowrl.engines.turns) fuses with its forwards wherever they are placed,
colocated ones included: its decode loop hands out finished trajectories whenever every live one waits on its
environment, and the forwards over them run in that wait instead of after the rollout (issue 26).
"""

from __future__ import annotations

from collections.abc import Mapping

from flowrl.ir.attrs import GenerateAttrs
from flowrl.ir.graph import Graph, Node
from flowrl.passes.common import forwards_over, over_kept, position, rewards_over, rollouts, scored_beside
from flowrl.passes.registry import register

MIN_STREAM_TOKENS = 16  # shorter responses all finish within a few steps: nothing worth streaming
MIGRATE_BELOW = 0.2  # RLHFuse: migrate when about 20% of the samples are still decoding
CHUNKS = 4  # hand-offs per rollout when every sample finished at an even pace
MIN_CHUNK = 4  # samples: smaller forwards cost more per sample than they overlap
# Where a chunk's forwards run with several generation ranks: on the rank that generated it, between its
# decode steps ("own-rank": its prompts are cached there and no chunk waits for a free rank), or only on ranks
# whose generation is over ("free-rank", RLHFuse's split).
CHUNK_FORWARDS = "own-rank"
# Colocated stages (generation and every forward on one worker group) are not fused: chunked forwards on the
# generating ranks overlap nothing. Measured on this repo's 2-core CPU machine (bench/passes_all.py, 2026-11-24,
# lockstep against unfused, long-tail GRPO / PPO, forced): 1 worker 1.03x / 1.08x per step (the chunks' forwards
# are cheaper than one padded whole-batch forward, not overlapped), 2 rank processes 0.94x / 0.99x.
# The runtime still runs colocated fused stages (tests and hand-written graphs), migration included.
# Forwards on another worker group (split placement) get finished samples at least this often (decode steps):
# in the tail samples finish a few at a time, and without it the last chunk's forwards all start after the last
# sample. Chunks that pile up while that group is busy run together in one call, so a short flush costs little.
FLUSH_STEPS = 8


def why_not_stream(graph: Graph, gen: Node) -> str | None:
    """None when `gen` can stream finished samples downstream, else why it cannot (one per condition)."""
    model = graph.model(str(gen.model))
    if gen.attrs.get("max_staleness"):
        # Pass async-rollout: generation runs ahead of training, and the forwards that read it run with the
        # newest weights, steps later.
        return "asynchronous rollout (pass async-rollout): generation overlaps the training of earlier steps instead"
    if model.engine != "torch":
        # Only flowrl's torch generation engine yields samples as they finish.
        return f"{model.name} uses engine {model.engine!r}, which cannot hand samples over as they finish"
    max_tokens = GenerateAttrs.of(gen.attrs).max_tokens
    if max_tokens < MIN_STREAM_TOKENS and not runs_env(gen):
        # Every response is done within a handful of steps: no long tail to hide anything behind (a trajectory's
        # turns, not max_tokens, set how long an env generate runs).
        return f"max_tokens = {max_tokens} < {MIN_STREAM_TOKENS}: samples finish too close together to stream"
    if not forwards_over(graph, gen) and not any(scored_beside(graph, r) for r in rewards_over(graph, gen)):
        # Nothing downstream to run while the tail decodes.
        return "no logprobs/values/score call reads it, nor a reward with workers of its own"
    return None


def runs_env(gen: Node) -> bool:
    """A multi-turn generate (`env = NAME`): its trajectories end at their environments' pace, and its decode
    loop has nothing to do while every live trajectory waits on its environment (flowrl.engines.turns)."""
    return isinstance(gen.attrs.get("env"), Mapping)


def why_not_fuse(graph: Graph, gen: Node, forward: Node) -> str | None:
    """None when `forward` can run on `gen`'s chunks during generation, else why not (one per condition)."""
    engine = graph.model(str(forward.model)).engine
    if engine != "torch":
        # The forward is run by an engine flowrl does not drive chunk by chunk.
        return f"{forward.model} uses engine {engine!r}"
    between = graph.nodes[position(graph, gen.id) + 1 : position(graph, forward.id)]
    update = next((n for n in between if n.op == "update" and n.model == forward.model), None)
    if update is not None:
        # It must see the weights after that update, which do not exist while generation runs.
        return f"{update.id} runs before it, so it needs the updated weights"
    if forward.attrs.get("fusion") not in (None, fusion_key(gen)):
        # Already part of another fused stage.
        return f"already fused in {forward.attrs.get('fusion')}"
    return None


def spills(gen: Node, forward: Node) -> bool:
    """Whether generation ranks may take `forward`'s queued chunks once done: it runs the generating model on
    another group, which holds the same weights during the stage (`why_not_fuse` refuses a forward behind an
    update of its model, and split placement syncs every holder after each update)."""
    return forward.model == gen.model and forward.worker_group != gen.worker_group


def fusion_key(gen: Node) -> str:
    return f"gen-infer:{gen.id}"


def chunk_size(graph: Graph, gen: Node) -> int:
    """Samples per hand-off: a quarter of the rollout (prompts per step x n), at least MIN_CHUNK."""
    src = gen.input("prompts")
    decl = next((d for d in graph.data if d.name == src), None)
    prompts = int(str(decl.options.get("batch", 8))) if decl is not None else 8
    samples = prompts * GenerateAttrs.of(gen.attrs).n
    return max(MIN_CHUNK, -(-samples // CHUNKS))


@register("fuse-gen-inference", "stream finished samples from generation into the forwards over the rollout "
          "and migrate the long tail to few workers (RLHFuse inter-stage fusion)")
def fuse_gen_inference(graph: Graph) -> tuple[Graph, list[str]]:
    notes: list[str] = []
    rewritten: dict[str, Node] = {}
    for gen in rollouts(graph):
        for forward in (n for n in over_kept(graph, gen) if n.op != "update"):
            # Dynamic sampling: which groups it reads is known once the whole draw is generated and scored.
            notes.append(f"{forward.id}: not fused with {gen.id}: it reads {forward.input('rollout')}, the groups "
                         f"filter_groups keeps, known only once every sample of a draw is generated and scored")
        reason = why_not_stream(graph, gen)
        if reason is not None:
            notes.append(f"{gen.id}: not fused: {reason}")
            continue
        key = fusion_key(gen)
        fused: list[Node] = []
        for forward in forwards_over(graph, gen):
            refusal = why_not_fuse(graph, gen, forward)
            if refusal is not None:
                notes.append(f"{forward.id}: not fused with {gen.id}: {refusal}")
                continue
            fused.append(forward)
        beside = [r for r in rewards_over(graph, gen) if scored_beside(graph, r)]
        if not fused and not beside:
            notes.append(f"{gen.id}: not fused: no forward over it can run during generation")
            continue
        if beside and all(f.worker_group == gen.worker_group for f in fused) and not runs_env(gen):
            # Only the rewards run beside generation: colocated forwards stay unfused (measured above).
            fused = []
        elif all(f.worker_group == gen.worker_group for f in fused) and not runs_env(gen):
            # Colocated: every forward would run on the generating ranks, between their decode steps, so nothing
            # runs beside generation; the chunked calls only cost more than whole ones (measured above).
            notes.append(f"{gen.id}: not fused: {', '.join(f.id for f in fused)} run on worker group "
                         f"{gen.worker_group}, which generates, so nothing would run beside generation (place them "
                         f"on another pool in a `placement {{ }}` block to overlap them with it)")
            continue
        chunk = int(str(gen.attrs.get("stream_chunk", chunk_size(graph, gen))))
        flush = int(str(gen.attrs.get("flush_steps", FLUSH_STEPS)))
        rewritten[gen.id] = gen.with_attrs(fusion=key, fusion_kind="inter-stage", stream_chunk=chunk,
                                           flush_steps=flush, migrate_below=MIGRATE_BELOW,
                                           chunk_forwards=CHUNK_FORWARDS)
        for forward in fused:
            spill = {"spill_to": gen.worker_group} if spills(gen, forward) else {}
            rewritten[forward.id] = forward.with_attrs(fusion=key, fusion_kind="inter-stage", **spill)
        for reward in beside:
            rewritten[reward.id] = reward.with_attrs(fusion=key, fusion_kind="inter-stage")
        notes.append(_note(gen, fused, beside, chunk, flush))
    return graph.with_nodes([rewritten.get(n.id, n) for n in graph.nodes]), notes


def _note(gen: Node, fused: list[Node], beside: list[Node], chunk: int, flush: int) -> str:
    if runs_env(gen):
        env = gen.attrs["env"]
        name = env.get("name") if isinstance(env, Mapping) else env
        targets = [f"{f.id} on worker group {f.worker_group}" for f in fused]
        targets += [f"{r.id} (reward {r.attrs.get('fn')}) on its own workers" for r in beside]
        return (f"{gen.id}: hands out finished trajectories whenever every live one waits on its environment "
                f"({name}), and at the end; " + ", ".join(targets) + " run on them during those waits")
    elsewhere: dict[str, list[str]] = {}
    for f in fused:
        if f.worker_group != gen.worker_group:
            elsewhere.setdefault(str(f.worker_group), []).append(f.id)
    targets = [f"{', '.join(ids)} on worker group {g}" for g, ids in elsewhere.items()]
    targets += [f"{r.id} (reward {r.attrs.get('fn')}) on its own workers" for r in beside]
    note = (f"{gen.id}: streams chunks of {chunk} finished samples (or what finished within {flush} decode steps) to "
            + "; ".join(targets) + f", which score them while {gen.worker_group} decodes")
    spilled = [f.id for f in fused if spills(gen, f)]
    if spilled:
        note += (f"; once done generating, {gen.worker_group} takes the chunks still queued for "
                 f"{', '.join(spilled)} (it holds the same {gen.model} weights)")
    here = [f.id for f in fused if f.worker_group == gen.worker_group]
    if here:
        note += (f"; {', '.join(here)} run on each generating rank between its decode steps ({CHUNK_FORWARDS}), the "
                 f"tail migrating below {MIGRATE_BELOW:.0%} unfinished when forwards are queued for freed ranks")
    return note
