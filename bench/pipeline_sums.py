"""The preference pipelines of issue 27 judged by their hidden rule through every stage: the policy's greedy
answers to the 100 sums a+b= (examples/data/sums.jsonl) scored by `flowrl.rewards.arith_exact` at its step-0
weights and at every checkpoint of every stage, for examples/sums_pipeline.flow (SFT -> reward model -> PPO) and
examples/sums_dpo.flow (SFT -> DPO). Writes the curve to OUT/pipeline_sums.json, a picture (docs/pipeline_sums.png
with --picture) and a table of the scores at each stage's end. The policy is rebuilt and evaluated by flowrl's own
evaluation (examples/judge_sums.Judge on flowrl.runtime.eval_run.PolicyEval, what `flowrl eval` runs).

    python bench/pipeline_sums.py                       # runs both flows (about 5 + 2 minutes on 2 cores), judges
    python bench/pipeline_sums.py --judge-only          # judges the runs already in OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.judge_sums import Judge  # noqa: E402
from flowrl.compiler import compile_any  # noqa: E402
from flowrl.dsl.stages import Pipeline  # noqa: E402

FLOWS = {"SFT -> RM -> PPO": ROOT / "examples" / "sums_pipeline.flow", "SFT -> DPO": ROOT / "examples" / "sums_dpo.flow"}


def scores(rows: list[dict[str, Any]], right: list[float]) -> dict[str, float]:
    """The fraction right of all sums, of those the demonstrations cover (0-4 + b) and of the rest."""
    few = [x for r, x in zip(rows, right, strict=True) if int(str(r["prompt"])[0]) < 5]
    rest = [x for r, x in zip(rows, right, strict=True) if int(str(r["prompt"])[0]) >= 5]
    return {"all": sum(right) / len(right), "few": sum(few) / len(few), "rest": sum(rest) / len(rest)}


def curve(run: Path, pipe: Pipeline, judge: Any) -> list[dict[str, Any]]:
    """The score at step 0 and at every checkpoint of every stage, on one x axis (steps across stages)."""
    points = [{"stage": "init", "step": 0, "x": 0, **scores(judge.rows, judge.answers())}]
    offset = 0
    for stage in pipe.stages:
        for ckpt in sorted((run / "stages" / stage.name / "checkpoints").glob("step_*.pt")):
            state = judge.checkpoint(ckpt)
            if state is None:
                continue  # a stage without the policy (the reward model's): the policy is as it was
            step = int(ckpt.stem.removeprefix("step_"))
            points.append({"stage": stage.name, "step": step, "x": offset + step,
                           **scores(judge.rows, judge.answers(state))})
        offset += stage.steps
    return points


def picture(curves: dict[str, list[dict[str, Any]]], pipes: dict[str, Pipeline], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for (name, points), style in zip(curves.items(), ("-o", "-s"), strict=False):
        ax.plot([p["x"] for p in points], [p["all"] for p in points], style, markersize=3, label=name)
    x = 0
    for stage in next(iter(pipes.values())).stages:  # the first pipeline's stages (both begin with sft)
        ax.text(x + stage.steps / 2, 0.02, stage.name, ha="center", va="bottom", fontsize=7, color="grey")
        x += stage.steps
        ax.axvline(x, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("step (stages one after another)")
    ax.set_ylabel("sums answered right (greedy, of 100)")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("hidden-rule score of the policy through the stages", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "pipeline_sums")
    p.add_argument("--judge-only", action="store_true")
    p.add_argument("--picture", type=Path, default=None)
    p.add_argument("--backend", default="local")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    curves, pipes = {}, {}
    for name, flow in FLOWS.items():
        run = a.out / flow.stem
        if not a.judge_only:
            subprocess.run([sys.executable, "-m", "flowrl", "run", str(flow), "--out", str(run), "--overwrite",
                            "--backend", a.backend, "--quiet"], check=True, cwd=ROOT)
        pipe = compile_any(str(flow))
        assert isinstance(pipe, Pipeline)
        pipes[name] = pipe
        curves[name] = curve(run, pipe, Judge(str(flow)))
    (a.out / "pipeline_sums.json").write_text(json.dumps(curves, indent=1), encoding="utf-8")
    print("| pipeline | stage end | step | all 100 sums | sums 0-4 + b (demonstrated) | sums 5-9 + b |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, points in curves.items():
        ends = [points[0]] + [max((q for q in points if q["stage"] == s.name), key=lambda q: q["step"])
                              for s in pipes[name].stages if any(q["stage"] == s.name for q in points)]
        for q in ends:
            print(f"| {name} | {q['stage']} | {q['step']} | {q['all']:.2f} | {q['few']:.2f} | {q['rest']:.2f} |")
    if a.picture is not None:
        picture(curves, pipes, a.picture)
        print(f"picture: {a.picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
