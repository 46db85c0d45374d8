"""fuse-gen-inference on vs off on the long-tail workloads (examples/longtail_*.flow), 1 and 2 workers.

    .venv/bin/python bench/passes_fuse_gen.py --steps 6

One worker: the local backend; generation and the chunk forwards interleave on the one worker (nothing runs
in parallel: what streaming buys there is that early chunks are only as wide as their own longest response).
Two workers: `flowrl.runtime.procs.ProcessBackend` (two spawned rank processes per worker group, each with
its own copy of the models, one torch thread each; data-parallel updates), where each rank scores its own
chunks between decode steps (the pass's `chunk_forwards = "own-rank"`). Both sides use the same backend; only
the pass differs. The affected stage is generation plus the forwards over the rollout (GRPO: old_logp,
ref_logp; PPO: also values, scores).
"""

from __future__ import annotations

from typing import Any

from passes_common import ROOT, cli, compile_pair, fmt, lockstep, make_side, save

from flowrl.backends.local import LocalBackend
from flowrl.runtime.procs import ProcessBackend

FLOWS = {  # flow -> the nodes of the fused stage
    "longtail_grpo": ("rollout", "old_logp", "ref_logp"),
    "longtail_ppo": ("rollout", "old_logp", "ref_logp", "values", "scores"),
}


def measure(steps: int) -> list[dict[str, Any]]:
    rows = []
    for (flow, stage), world in ((f, w) for f in FLOWS.items() for w in (1, 2)):
        on_g, off_g = compile_pair(str(ROOT / "examples" / f"{flow}.flow"), [], "fuse-gen-inference")
        on, off = (make_side(name, g, LocalBackend() if world == 1 else ProcessBackend(world))
                   for name, g in (("on", on_g), ("off", off_g)))
        try:
            row = lockstep(on, off, stage, steps, extra=lambda r, _: {
                "migrated": r.metrics.get("fusion/migrated", 0.0),
                "overlap_frac": r.metrics.get("fusion/overlap_frac", 0.0),
                "chunks": r.metrics.get("fusion/chunks", 0.0)})
        finally:
            on.backend.shutdown()
            off.backend.shutdown()
        row = {"pass": "fuse-gen-inference", "workload": flow, "workers": world, **row}
        print(f"fuse-gen-inference, {flow}, {world} worker(s): {fmt(row)}; migrated {row['migrated']:.0f}, "
              f"overlap {row['overlap_frac']:.0%}, chunks {row['chunks']:.0f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    args = cli(__doc__ or "")
    save(args.json, measure(args.steps))


if __name__ == "__main__":
    main()
