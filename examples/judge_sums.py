"""Judge a run's policy by the sums' hidden rule: its greedy answer to each of the 100 sums a+b= (examples/data/
sums.jsonl), scored by `flowrl.rewards.arith_exact` (1 for the exact sum). Prints the score (the fraction right).

    python examples/judge_sums.py RUN_DIR            # the run's last checkpoint
    python examples/judge_sums.py RUN_DIR --init     # the same policy before training (its step-0 weights)

RUN_DIR is a `flowrl run --out` directory, evaluated by `flowrl eval` (flowrl.evaluate: graph.json's models, the
checkpoints' weights). `--model` picks the policy (default: the one the flow generates with); `--json` prints
{"score", "right", "total", "step"} instead of a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import flowrl
from flowrl.compiler import compile_any
from flowrl.ir.graph import Graph
from flowrl.runtime.carry import checkpoint_weights
from flowrl.runtime.eval_run import PolicyEval, reward_scorer
from flowrl.runtime.evaluation import EvalSpec

SUMS = Path(__file__).parent / "data" / "sums.jsonl"
GREEDY = EvalSpec("judge", n=1, temperature=0.0, max_tokens=3)  # one greedy answer of up to 3 tokens a sum


class Judge:
    """A flow's policy rebuilt once (a staged flow's: from its first stage that has it) by flowrl's evaluation
    (`flowrl.runtime.eval_run.PolicyEval`, what `flowrl eval` runs); `answers(state)` loads those weights (None: the
    step-0 weights) and scores its greedy answers to the sums."""

    def __init__(self, flow: str, *, model: str | None = None, seed: int = 0, sums: Path = SUMS) -> None:
        loaded = compile_any(flow, passes=[])
        graphs = [loaded] if isinstance(loaded, Graph) else [s.graph for s in loaded.stages]
        graph = next(g for g in graphs if any(m.role == "policy" for m in g.models))
        self.model = model or next(m.name for m in graph.models if m.role == "policy")
        self.policy = PolicyEval(graph.models, self.model, seed=seed)
        self.scorer = reward_scorer("arith_exact")
        self.rows = [json.loads(line) for line in sums.read_text(encoding="utf-8").splitlines() if line.strip()]

    def samples(self, state: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Each sum's greedy answer with its arith_exact, in the file's order."""
        self.policy.load(state)
        return self.policy.evaluate(list(enumerate(self.rows)), GREEDY, self.scorer, seed=0, step=0).samples

    def answers(self, state: dict[str, Any] | None = None) -> list[float]:
        """arith_exact of the greedy answer to each sum, in the file's order."""
        return [float(s["reward"]) for s in self.samples(state)]

    def responses(self, state: dict[str, Any] | None = None) -> list[str]:
        """The greedy answers' text, in the file's order."""
        return [str(s["response"]) for s in self.samples(state)]

    def checkpoint(self, path: Path) -> dict[str, Any] | None:
        """The policy's weights in a checkpoint (None when it holds no such model: a reward model's stage)."""
        return dict(checkpoint_weights(path).get(self.model, {})) or None


def judge(run_dir: Path, *, model: str | None = None, init: bool = False, sums: Path = SUMS) -> dict[str, Any]:
    """The score of `run_dir`'s policy (its last checkpoint, or with `init` its step-0 weights) on `sums`:
    `flowrl eval RUN_DIR --data sums.jsonl --reward arith_exact --n 1 --temperature 0 --max-tokens 3`. A pipeline
    stage's directory (OUT/stages/NAME) is judged by its stage's checkpoints."""
    got = flowrl.evaluate(str(run_dir), data=str(sums), reward="arith_exact", model=model, n=1, temperature=0.0,
                          max_tokens=3, init=init)
    right = sum(s["reward"] for s in got.samples)
    return {"score": right / got.rows, "right": int(right), "total": got.rows, "step": got.step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--init", action="store_true", help="judge the policy's step-0 weights")
    p.add_argument("--sums", type=Path, default=SUMS)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        result = judge(a.run_dir, model=a.model, init=a.init, sums=a.sums)
    except flowrl.FlowError as e:
        print(e.render(), file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(result))
    else:
        print(f"step {result['step']}: {result['right']}/{result['total']} sums right ({result['score']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
