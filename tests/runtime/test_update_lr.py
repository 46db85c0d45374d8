"""An update's own `lr` (0: the model's): the same update trains a model declared at lr 1e-3 with `lr = 1e-2` to the
weights a model declared at 1e-2 reaches, and the model's warm-up still scales it."""

from __future__ import annotations

from pathlib import Path

import torch

import flowrl
from flowrl.runtime.batch import Batch
from flowrl.runtime.worker import ModelWorker

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=", lr = {lr}{extra} }}
data demos = jsonl("demos.jsonl") {{ batch = 2 }}
use sft(demos = demos, lr = {update_lr})
"""


def _weights_after(tmp_path: Path, lr: str, update_lr: str, extra: str = "") -> list[torch.Tensor]:
    (tmp_path / "demos.jsonl").write_text('{"prompt": "1+2=", "response": "3"}\n{"prompt": "2+2=", "response": "4"}\n')
    (tmp_path / "f.flow").write_text(FLOW.format(lr=lr, update_lr=update_lr, extra=extra))
    graph = flowrl.load(str(tmp_path / "f.flow"))
    node = next(n for n in graph.nodes if n.op == "update")
    worker = ModelWorker([graph.model("actor")], graph.models, seed=0)
    rows = [{"prompt": "1+2=", "response": "3"}, {"prompt": "2+2=", "response": "4"}]
    worker.update("actor", Batch(2, {}, {"prompt": [r["prompt"] for r in rows], "row": rows}), dict(node.attrs),
                  step_seed=0)
    return [p.detach().clone() for p in worker.models["actor"].module.parameters()]


def test_the_updates_lr_wins_over_the_models(tmp_path: Path) -> None:
    declared = _weights_after(tmp_path, "1e-2", "0.0")
    overridden = _weights_after(tmp_path, "1e-3", "1e-2")
    kept = _weights_after(tmp_path, "1e-3", "0.0")
    for a, b in zip(declared, overridden, strict=True):
        torch.testing.assert_close(a, b)
    assert any(not torch.allclose(a, b) for a, b in zip(declared, kept, strict=True))


def test_warm_up_scales_the_updates_lr(tmp_path: Path) -> None:
    """warmup_steps = 10: the first step trains at a tenth of the update's lr (the model declared at 1e-3)."""
    warmed = _weights_after(tmp_path, "1e-3", "1e-1", extra=", warmup_steps = 10")
    plain = _weights_after(tmp_path, "1e-2", "0.0")
    for a, b in zip(warmed, plain, strict=True):
        torch.testing.assert_close(a, b)
