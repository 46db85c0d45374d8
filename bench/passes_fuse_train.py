"""fuse-train on vs off: PPO's actor and critic updates as one interleaved stage, one worker.

    .venv/bin/python bench/passes_fuse_train.py --steps 6

On examples/longtail_ppo.flow with one thread rank (`ThreadBackend(world=1)`: one worker group, so the schedule
is "interleave": actor micro-batch 1, critic micro-batch 1, ...; micro_batch = 32 gives 4 micro-batches per
update). With one CPU worker nothing can overlap: this measures that the interleaved schedule costs nothing. The
affected stage is actor.update + critic.update. (The local backend declines the interleave: its rank is the
controller's own thread, and the turn-taking threads slowed the controller's other work 2x.)
"""

from __future__ import annotations

from typing import Any

from passes_common import ROOT, cli, compile_pair, fmt, lockstep, make_side, save

from flowrl.backends.threads import ThreadBackend

FLOW = str(ROOT / "examples" / "longtail_ppo.flow")


def measure(steps: int) -> list[dict[str, Any]]:
    on_g, off_g = compile_pair(FLOW, [], "fuse-train")
    on_g, off_g = (g.with_nodes([n.with_attrs(micro_batch=32) if n.op == "update" else n for n in g.nodes])
                   for g in (on_g, off_g))
    on, off = make_side("on", on_g, ThreadBackend(world=1)), make_side("off", off_g, ThreadBackend(world=1))
    row = {"pass": "fuse-train", "workload": "longtail_ppo, micro_batch 32", "workers": 1,
           **lockstep(on, off, ("actor.update", "critic.update"), steps)}
    print(f"fuse-train (interleave, 4 micro-batches each): {fmt(row)}", flush=True)
    return [row]


def main() -> None:
    args = cli(__doc__ or "")
    save(args.json, measure(args.steps))


if __name__ == "__main__":
    main()
