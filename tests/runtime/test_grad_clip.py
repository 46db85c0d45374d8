"""An update's `max_grad_norm` reaches the optimizer step, on the torch engine and on DeepSpeed (stage 0 clips in
flowrl's pre-step hook, ZeRO 1-3 in DeepSpeed's optimizer). Set through a template (`use grpo(max_grad_norm =
...)`), a bound far below the gradient's norm shrinks AdamW's first step (the clipped gradient is then small
against AdamW's `eps`), while the reported `grad_norm` stays the norm before clipping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl import run

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=",
                        lr = 1e-2{engine} }}
model ref : reference {{ source = actor }}
reward correct = "flowrl.rewards.length_target"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use grpo(reward = correct, group = 4, max_tokens = 3, temperature = 1.0)
run {{ steps = 1, seed = 5, checkpoint_every = 1 }}
"""

ENGINES = {"torch": "", "deepspeed-0": ', engine = "deepspeed", zero_stage = 0',
           "deepspeed-2": ', engine = "deepspeed", zero_stage = 2'}


def _first_step(tmp: Path, engine: str, bound: str) -> tuple[float, float]:
    """(norm of the actor's change in its first step, the step's reported grad_norm). The reference holds the
    actor's initial weights, so the change is actor - ref in the step-1 checkpoint."""
    rows = [{"prompt": f"{a}+{b}=", "length": 2} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / "clip.flow"
    path.write_text(FLOW.format(engine=ENGINES[engine]))
    graph = flowrl.load(str(path), overrides={"use.max_grad_norm": bound})
    assert next(n for n in graph.nodes if n.id == "actor.update").attrs["max_grad_norm"] == float(bound)
    out = tmp / f"out-{bound}"
    res = run(graph, out_dir=out)
    saved = torch.load(out / "checkpoints" / "step_000001.pt", weights_only=False)
    models = next(iter(saved["groups"].values()))
    actor, ref = models["actor"]["module"], models["ref"]["module"]
    change = sum(float((actor[k].float() - ref[k].float()).pow(2).sum()) for k in ref) ** 0.5
    return change, float(res.metrics[0]["actor/grad_norm"])


@pytest.mark.parametrize("engine", list(ENGINES))
def test_max_grad_norm_bounds_the_step(tmp_path: Path, engine: str) -> None:
    free, norm = _first_step(tmp_path, engine, "1e3")
    clipped, norm_clipped = _first_step(tmp_path, engine, "1e-10")
    assert norm > 1e-6 and norm_clipped == pytest.approx(norm, rel=1e-5)  # same rollout, same gradient
    assert free > 0
    assert clipped < 0.2 * free, (engine, clipped, free)
