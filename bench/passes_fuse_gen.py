"""fuse-gen-inference on vs off on the long-tail workloads (examples/longtail_*.flow), 1 and 2 workers.

    .venv/bin/python bench/passes_fuse_gen.py --steps 6

One worker: the local backend; generation and the chunk forwards interleave on the one worker (nothing runs
in parallel: what streaming buys there is that early chunks are only as wide as their own longest response).
Two workers: `flowrl.runtime.procs.ProcessBackend` (two spawned rank processes per worker group, each with
its own copy of the models, one torch thread each; data-parallel updates), where each rank scores its own
chunks between decode steps (the pass's `chunk_forwards = "own-rank"`). Both sides use the same backend; only
the pass differs. Split, 2 workers: the flow plus the `placement { }` block of LANGUAGE.md (generation on
pool `rollout`; the actor's other methods, the reference and, for PPO, critic and reward model on pool
`train`: the disaggregated layout of OpenRLHF and RLHFuse), one rank process per pool (`ProcessBackend(1)`),
new actor weights sent to the rollout pool after each update. Unfused, each pool idles while the other
works; fused, the train pool scores chunks while the rollout pool is still decoding. The affected stage is
generation plus the forwards over the rollout (GRPO: old_logp, ref_logp; PPO: also values, scores).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from passes_common import ROOT, cli, compile_pair, fmt, lockstep, make_side, save

from flowrl.backends.local import LocalBackend
from flowrl.runtime.procs import ProcessBackend

FLOWS = {  # flow -> the nodes of the fused stage, and the models the split placement trains beside the actor
    "longtail_grpo": (("rollout", "old_logp", "ref_logp"), "ref"),
    "longtail_ppo": (("rollout", "old_logp", "ref_logp", "values", "scores"), "ref, critic, rm"),
}
PLACEMENTS = (("colocated", 1), ("colocated", 2), ("split", 2))  # (placement, workers)


def split_flow(flow: str, others: str, folder: Path) -> str:
    """The example flow with generation on one pool, the rest on another (data path made absolute)."""
    text = (ROOT / "examples" / f"{flow}.flow").read_text()
    text = text.replace('jsonl("data/', f'jsonl("{ROOT / "examples" / "data"}/')
    path = folder / f"{flow}_split.flow"
    path.write_text(text + f"""
placement {{
    pool rollout {{ gpus = 1 }}
    pool train   {{ gpus = 1 }}
    actor.generate -> rollout
    actor.update, {others} -> train
}}
""")
    return str(path)


def backend(placement: str, world: int) -> Any:
    if placement == "split":
        return ProcessBackend(1)  # one rank process per group: two workers in all
    return LocalBackend() if world == 1 else ProcessBackend(world)


def measure(steps: int) -> list[dict[str, Any]]:
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="flowrl-bench-"))
    for (flow, (stage, others)), (placement, world) in ((f, p) for f in FLOWS.items() for p in PLACEMENTS):
        path = split_flow(flow, others, folder) if placement == "split" else str(ROOT / "examples" / f"{flow}.flow")
        on_g, off_g = compile_pair(path, [], "fuse-gen-inference")
        on, off = (make_side(name, g, backend(placement, world)) for name, g in (("on", on_g), ("off", off_g)))
        try:
            row = lockstep(on, off, stage, steps, extra=lambda r, _: {
                "migrated": r.metrics.get("fusion/migrated", 0.0),
                "overlap_frac": r.metrics.get("fusion/overlap_frac", 0.0),
                "chunks": r.metrics.get("fusion/chunks", 0.0)})
        finally:
            on.backend.shutdown()
            off.backend.shutdown()
        row = {"pass": "fuse-gen-inference", "workload": flow, "workers": world, "placement": placement, **row}
        print(f"fuse-gen-inference, {flow}, {placement}, {world} worker(s): {fmt(row)}; migrated {row['migrated']:.0f}, "
              f"overlap {row['overlap_frac']:.0%}, chunks {row['chunks']:.0f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    args = cli(__doc__ or "")
    save(args.json, measure(args.steps))


if __name__ == "__main__":
    main()
