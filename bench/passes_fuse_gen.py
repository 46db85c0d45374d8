"""fuse-gen-inference on vs off on the long-tail workloads (examples/longtail_*.flow).

    .venv/bin/python bench/passes_fuse_gen.py --steps 6

split, 2 workers: the examples as written, with LANGUAGE.md's placement (generation on pool `rollout`; the
actor's other methods, the reference and, for PPO, critic and reward model on pool `train`: the disaggregated
layout of OpenRLHF and RLHFuse), one spawned rank process per pool (`flowrl.backends.process.ProcessBackend(1)`,
one torch thread each), the new actor weights sent to the rollout pool after each update. Unfused, each pool
idles while the other works; fused, the train pool scores chunks while the rollout pool is still decoding.

split, tail scored as it grows: the split stage with the score-tail pass (`--pass score-tail`: unfinished
samples' tokens go to the train pool as they are decoded) against the same fused stage without it: what
scoring the long tail while it decodes adds on top of streaming finished samples.

colocated (forced): the same flows without the placement block, where the pass declines (every forward would
run on the generating ranks); the fused stage is forced onto the graph as the pass would have written it, to
measure that decision: 1 and 2 rank processes holding every model, each rank scoring its own chunks between
decode steps. The affected stage is generation plus the forwards over the rollout (GRPO: old_logp, ref_logp;
PPO: also values, scores).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from passes_common import ROOT, cli, compile_pair, fmt, lockstep, make_side, save

from flowrl.backends.process import ProcessBackend
from flowrl.compiler import compile_file
from flowrl.ir.graph import Graph
from flowrl.passes.common import forwards_over
from flowrl.passes.fuse_gen_inference import CHUNK_FORWARDS, MIGRATE_BELOW, chunk_size, fusion_key

FLOWS = {  # flow -> the nodes of the fused stage
    "longtail_grpo": ("rollout", "old_logp", "ref_logp"),
    "longtail_ppo": ("rollout", "old_logp", "ref_logp", "values", "scores"),
}
PLACEMENTS = (("split", 2), ("split, tail scored as it grows", 2), ("colocated (forced)", 1),
              ("colocated (forced)", 2))  # (placement, workers)


def colocated_flow(flow: str, folder: Path) -> str:
    """The example without its placement block (data path made absolute)."""
    text = (ROOT / "examples" / f"{flow}.flow").read_text()
    text = re.sub(r"\nplacement \{.*?\n\}\n", "\n", text, flags=re.S)
    text = text.replace('jsonl("data/', f'jsonl("{ROOT / "examples" / "data"}/')
    path = folder / f"{flow}_colocated.flow"
    path.write_text(text)
    return str(path)


def forced(graph: Graph) -> Graph:
    """`graph` with its rollout fused as the pass fuses a split stage (what it declines to do when colocated)."""
    gen = graph.node("rollout")
    key, forwards = fusion_key(gen), {f.id for f in forwards_over(graph, gen)}
    attrs = dict(fusion=key, fusion_kind="inter-stage", stream_chunk=chunk_size(graph, gen),
                 migrate_below=MIGRATE_BELOW, chunk_forwards=CHUNK_FORWARDS)
    return graph.with_nodes([n.with_attrs(**attrs) if n.id == gen.id else
                             n.with_attrs(fusion=key, fusion_kind="inter-stage") if n.id in forwards else n
                             for n in graph.nodes])


def measure(steps: int, only: str = "") -> list[dict[str, Any]]:
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="flowrl-bench-"))
    for (flow, stage), (placement, world) in ((f, p) for f in FLOWS.items() for p in PLACEMENTS):
        if only and not (flow.startswith(only) or placement.startswith(only)):
            continue
        if placement.startswith("split"):
            on_g, off_g = compile_pair(str(ROOT / "examples" / f"{flow}.flow"), [], "fuse-gen-inference")
            assert on_g.node("rollout").attrs.get("fusion"), "the pass should fuse the split example"
            if placement != "split":  # the fused stage with the score-tail pass vs without it
                on_g, off_g = compile_file(str(ROOT / "examples" / f"{flow}.flow"), with_pass=["score-tail"]), on_g
                assert on_g.node("rollout").attrs.get("partial_below"), "score-tail should apply to the split example"
            backend = 1
        else:
            _, off_g = compile_pair(colocated_flow(flow, folder), [], "fuse-gen-inference")
            on_g, backend = forced(off_g), world
        on, off = (make_side(name, g, ProcessBackend(backend)) for name, g in (("on", on_g), ("off", off_g)))
        try:
            row = lockstep(on, off, stage, steps, extra=lambda r, _: {
                "migrated": r.metrics.get("fusion/migrated", 0.0),
                "overlap_frac": r.metrics.get("fusion/overlap_frac", 0.0),
                "chunks": r.metrics.get("fusion/chunks", 0.0), "grown": r.metrics.get("fusion/grown", 0.0)})
        finally:
            on.backend.shutdown()
            off.backend.shutdown()
        row = {"pass": "fuse-gen-inference", "workload": flow, "workers": world, "placement": placement, **row}
        print(f"fuse-gen-inference, {flow}, {placement}, {world} worker(s): {fmt(row)}; migrated "
              f"{row['migrated']:.0f}, overlap {row['overlap_frac']:.0%}, chunks {row['chunks']:.0f}, scored while "
              f"decoding {row['grown']:.0f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    args = cli(__doc__ or "", only=True)
    save(args.json, measure(args.steps, args.only))


if __name__ == "__main__":
    main()
