"""The calculator examples' policies judged greedily (examples/calc_tool.flow, calc_notool.flow): each run's
policy answers all 212 prompts at temperature 0, through the tool when its flow has one (the flow's own generate
node, its environment included), and the answers are read by examples/envs/calc.py: the reward, exact answers,
real tool calls (`observed_call`), and answers that start with `;` (the call bonus's old forgery: a `;` written
without calling).

    python bench/calc_greedy.py RUN_DIR [RUN_DIR ...]           # each run's last checkpoint
    python bench/calc_greedy.py RUN_DIR --init                   # the step-0 weights

RUN_DIR is a `flowrl run --out` directory (run.json names the flow, relative to where it ran: run this from
there, the repository root); `--json` prints one JSON object per run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the flows' folder, where `envs.calc` lives

from envs.calc import final_answer, grade, observed_call  # noqa: E402

from flowrl.compiler import compile_any  # noqa: E402
from flowrl.ir.graph import Graph  # noqa: E402
from flowrl.runtime.batch import Batch  # noqa: E402
from flowrl.runtime.runner import last_checkpoint  # noqa: E402
from flowrl.runtime.worker import ModelWorker  # noqa: E402

DATA = ROOT / "examples" / "data" / "calc.jsonl"


def greedy(run_dir: Path, init: bool = False) -> dict[str, Any]:
    """The run's policy's greedy answers to every prompt of calc.jsonl, as counts and means."""
    settings = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    graph = compile_any(settings["flow"], passes=[])
    assert isinstance(graph, Graph)
    gen = next(n for n in graph.nodes if n.op == "generate")
    policy = gen.model or next(m.name for m in graph.models if m.role == "policy")
    worker = ModelWorker([graph.model(policy)], list(graph.models), seed=int(settings.get("seed", 0)), device="cpu")
    step = 0
    if not init:
        ckpt = last_checkpoint(run_dir)
        if ckpt is None:
            raise SystemExit(f"no checkpoint in {run_dir}/checkpoints")
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        worker.models[policy].module.load_state_dict(
            next(g[policy]["module"] for g in state["groups"].values() if policy in g))
        step = int(state["step"])
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = Batch(len(rows), {}, {"prompt": [r["prompt"] for r in rows], "row": rows})
    attrs = {**gen.attrs, "n": 1, "temperature": 0.0}
    try:
        responses = worker.generate(policy, prompts, attrs, step_seed=0).meta["response"]
    finally:
        worker.close()
    rewards = [final_answer(r["prompt"], text, r["answer"], question=r["question"]) for r, text in
               zip(rows, responses, strict=True)]
    calls = [observed_call(text, r["question"]) for r, text in zip(rows, responses, strict=True)]
    exact = sum(grade(final, r["answer"]) == 1.0 for r, (_, final) in zip(rows, calls, strict=True))
    return {"run": str(run_dir), "flow": settings["flow"], "step": step, "prompts": len(rows),
            "reward_mean": round(sum(rewards) / len(rows), 4), "exact": exact,
            "real_calls": sum(called for called, _ in calls),
            "start_with_semicolon": sum(text.startswith(";") for text in responses),
            "common": collections.Counter(responses).most_common(5)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", type=Path, nargs="+")
    p.add_argument("--init", action="store_true", help="the step-0 weights")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for run_dir in a.run_dirs:
        out = greedy(run_dir, a.init)
        if a.json:
            print(json.dumps(out))
            continue
        print(f"{out['flow']} step {out['step']}: greedy reward {out['reward_mean']:.3f}, exact {out['exact']}/"
              f"{out['prompts']}, real tool calls {out['real_calls']}, starting with ';' "
              f"{out['start_with_semicolon']}; most common answers {out['common']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
