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

from flowrl.compiler import compile_any
from flowrl.ir.graph import Graph
from flowrl.rewards import arith_exact
from flowrl.runtime.batch import Batch
from flowrl.runtime.runner import last_checkpoint
from flowrl.runtime.worker import ModelWorker

SUMS = Path(__file__).parent / "data" / "sums.jsonl"


class Judge:
    """A flow's policy rebuilt once (a staged flow's: from its first stage that has it); `score(state)` loads those
    weights (None: the step-0 weights) and answers the sums greedily."""

    def __init__(self, flow: str, *, model: str | None = None, seed: int = 0, sums: Path = SUMS) -> None:
        loaded = compile_any(flow, passes=[])
        graphs = [loaded] if isinstance(loaded, Graph) else [s.graph for s in loaded.stages]
        graph = next(g for g in graphs if any(m.role == "policy" for m in g.models))
        self.model = model or next(m.name for m in graph.models if m.role == "policy")
        self.worker = ModelWorker([graph.model(self.model)], list(graph.models), seed=seed, device="cpu")
        self.init = {k: v.clone() for k, v in self.worker.models[self.model].module.state_dict().items()}
        self.rows = [json.loads(line) for line in sums.read_text(encoding="utf-8").splitlines() if line.strip()]

    def answers(self, state: dict[str, Any] | None = None) -> list[float]:
        """arith_exact of the greedy answer to each sum, in the file's order."""
        self.worker.models[self.model].module.load_state_dict(state if state is not None else self.init)
        prompts = Batch(len(self.rows), {}, {"prompt": [r["prompt"] for r in self.rows], "row": self.rows})
        out = self.worker.generate(self.model, prompts, {"n": 1, "max_tokens": 3, "temperature": 0.0}, step_seed=0)
        return [arith_exact(r["prompt"], resp, r["answer"]) for r, resp in zip(self.rows, out.meta["response"],
                                                                                  strict=True)]

    def checkpoint(self, path: Path) -> dict[str, Any] | None:
        """The policy's weights in a checkpoint (None when it holds no such model: a reward model's stage)."""
        state = torch.load(path, map_location="cpu", weights_only=False)
        held = [g[self.model]["module"] for g in state["groups"].values() if self.model in g]
        return held[0] if held else None


def judge(run_dir: Path, *, model: str | None = None, init: bool = False, sums: Path = SUMS) -> dict[str, Any]:
    """The score of `run_dir`'s policy (its last checkpoint, or with `init` its step-0 weights) on `sums`; a
    pipeline stage's directory (OUT/stages/NAME) is judged by its stage's checkpoints."""
    settings = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    j = Judge(settings["flow"], model=model, seed=int(settings.get("seed", 0)), sums=sums)
    step, state = 0, None
    if not init:
        ckpt = last_checkpoint(run_dir)
        if ckpt is None:
            raise SystemExit(f"no checkpoint in {run_dir}/checkpoints (run with checkpoint_every, or to the end)")
        state = j.checkpoint(ckpt)
        if state is None:
            raise SystemExit(f"{ckpt} holds no model `{j.model}`")
        step = int(torch.load(ckpt, map_location="cpu", weights_only=False)["step"])
    right = sum(j.answers(state))
    return {"score": right / len(j.rows), "right": int(right), "total": len(j.rows), "step": step}


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
