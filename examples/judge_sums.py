"""Judge a run's policy by the sums' hidden rule: its greedy answer to each of the 100 sums a+b= (examples/data/
sums.jsonl), scored by `flowrl.rewards.arith_exact` (1 for the exact sum). Prints the score (the fraction right).

    python examples/judge_sums.py RUN_DIR            # the run's last checkpoint
    python examples/judge_sums.py RUN_DIR --init     # the same policy before training (its step-0 weights)

RUN_DIR is a `flowrl run --out` directory: run.json names the flow (compiled again to rebuild the models) and
checkpoints/ holds the weights. `--model` picks the policy (default: the flow's first policy); `--json` prints
{"score", "right", "total", "step"} instead of a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import flowrl
from flowrl.rewards import arith_exact
from flowrl.runtime.batch import Batch
from flowrl.runtime.runner import last_checkpoint
from flowrl.runtime.worker import ModelWorker

SUMS = Path(__file__).parent / "data" / "sums.jsonl"


def judge(run_dir: Path, *, model: str | None = None, init: bool = False, sums: Path = SUMS) -> dict[str, Any]:
    """The score of `run_dir`'s policy (its last checkpoint, or with `init` its step-0 weights) on `sums`."""
    settings = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    graph = flowrl.load(settings["flow"], passes=False)
    name = model or next(m.name for m in graph.models if m.role == "policy")
    decl = graph.model(name)
    worker = ModelWorker([decl], list(graph.models), seed=int(settings.get("seed", 0)), device="cpu")
    step = 0
    if not init:
        ckpt = last_checkpoint(run_dir)
        if ckpt is None:
            raise SystemExit(f"no checkpoint in {run_dir}/checkpoints (run with checkpoint_every, or to the end)")
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        held = [g[name] for g in state["groups"].values() if name in g]
        if not held:
            raise SystemExit(f"{ckpt} holds no model `{name}`")
        worker.models[name].module.load_state_dict(held[0]["module"])
        step = int(state["step"])
    rows = [json.loads(line) for line in sums.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = Batch(len(rows), {}, {"prompt": [r["prompt"] for r in rows], "row": rows})
    out = worker.generate(name, prompts, {"n": 1, "max_tokens": 3, "temperature": 0.0}, step_seed=0)
    right = sum(arith_exact(r["prompt"], resp, r["answer"]) for r, resp in zip(rows, out.meta["response"], strict=True))
    return {"score": right / len(rows), "right": int(right), "total": len(rows), "step": step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--init", action="store_true", help="judge the policy's step-0 weights")
    p.add_argument("--sums", type=Path, default=SUMS)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    result = judge(a.run_dir, model=a.model, init=a.init, sums=a.sums)
    if a.json:
        print(json.dumps(result))
    else:
        print(f"step {result['step']}: {result['right']}/{result['total']} sums right ({result['score']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
