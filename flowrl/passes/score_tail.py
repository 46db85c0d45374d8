"""Pass `score-tail` (off by default; `--pass score-tail`), after `fuse-gen-inference` in the pass pipeline.

On a rollout that fuse-gen-inference streams to forwards placed on another worker group, it sets
`partial_below`: once at most that fraction of a generation rank's samples is still decoding, their tokens so
far go out with every flush too, and that group scores them as they grow (`ModelWorker.score_growing`, which
keeps each sample's KV cache), so when the last sample finishes only its last tokens are left to score.
Streaming finished samples alone leaves the tail's own forwards after generation: on the long-tail workload
its slowest 20% of samples hold 44-52% of the response tokens. Same numbers as unfused (float rounding).

Off by default because it measured slower where this repo is measured (the 2-core CPU machine, one rank
process per pool, `bench/passes_all.py`, the fused stage with it vs without it, 2026-11-24): long-tail GRPO
0.82x stage / 0.91x step, long-tail PPO 0.79x / 0.90x. Since the finished tail's chunks are scored on copies
of their prompts' cache rather than packed rows (flowrl.engines.prefix), scoring them after they finish costs
little, and each incremental call costs the train process about what a chunk's does. It is for pools on
separate devices, where a decode step is slow and the train pool idles while the tail decodes.
"""

from __future__ import annotations

from flowrl.ir.graph import Graph, Node
from flowrl.passes.common import rollouts
from flowrl.passes.registry import register

PARTIAL_BELOW = 0.25  # RLHFuse migrates at 20% unfinished; start a little earlier so the tail's head is covered


def why_not(graph: Graph, gen: Node) -> str | None:
    """None when `gen`'s unfinished samples can be scored as they grow, else why not (one per condition)."""
    key = gen.attrs.get("fusion")
    if not str(key or "").startswith("gen-infer:"):
        # Nothing is streamed: the forwards run after generation on the whole rollout.
        return "not fused with its forwards (fuse-gen-inference did not stream it)"
    members = [n for n in graph.nodes if n.attrs.get("fusion") == key and n.id != gen.id]
    if not any(n.worker_group != gen.worker_group for n in members):
        # Only forwards on another group take live samples; the generating ranks score finished chunks only.
        return "none of its forwards runs on another worker group"
    return None


@register("score-tail", "score unfinished samples' tokens on the forwards' own worker group while they decode",
          default=False)
def score_tail(graph: Graph) -> tuple[Graph, list[str]]:
    notes: list[str] = []
    rewritten: dict[str, Node] = {}
    for gen in rollouts(graph):
        reason = why_not(graph, gen)
        if reason is not None:
            notes.append(f"{gen.id}: tail not scored while decoding: {reason}")
            continue
        partial = float(str(gen.attrs.get("partial_below", PARTIAL_BELOW)))
        rewritten[gen.id] = gen.with_attrs(partial_below=partial)
        notes.append(f"{gen.id}: below {partial:.0%} of samples unfinished, their tokens so far also go out every "
                     f"{gen.attrs.get('flush_steps')} decode steps and are scored as they grow")
    return graph.with_nodes([rewritten.get(n.id, n) for n in graph.nodes]), notes
