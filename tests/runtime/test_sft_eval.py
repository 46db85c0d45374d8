"""SFT's held-out evaluation (issue 27 item 5): an `sft` update on data with `held_out = "COLUMN"` reports
`eval/sft_loss` on the held-out demonstrations (flowrl.runtime.preference_update.evaluate, called by the
controller's record_update every `eval_every` steps); those rows are never trained on; the figure is the mean
NLL of their response tokens, computed here by hand row by row (no padding, no engine code)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl.errors import Loc
from flowrl.ir.graph import ModelDecl
from flowrl.runtime.batch import training_batch
from flowrl.runtime.preference_update import rows_batch
from flowrl.runtime.worker import ModelWorker

CHARSET = "0123456789+= abcdefghijklmnopqrstuvwxyz:"
SHAPE = {"layers": 2, "dim": 32, "heads": 2, "charset": CHARSET}
ROOT = Path(__file__).resolve().parents[2]


def _demos(n: int, seed: int, held: int, wrong_held: bool = False) -> list[dict[str, Any]]:
    """Sums as demonstrations; the last `held` rows held out (with `wrong_held`, their answers are wrong)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        is_held = i >= n - held
        answer = (a + b + 7) % 19 if is_held and wrong_held else a + b
        out.append({"prompt": f"{a}+{b}=", "response": str(answer), "held_out": is_held})
    return out


def _by_hand(module: torch.nn.Module, tok: Any, rows: list[dict[str, Any]]) -> float:
    """Each row alone: <bos> prompt response <eos>; the response tokens' (with EOS) NLL summed over rows, over
    their count."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = [tok.bos_id, *tok.encode(row["prompt"])] if tok.bos_id is not None else tok.encode(row["prompt"])
            response = [*tok.encode(row["response"]), tok.eos_id]
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(module(input_ids=ids).logits[0].double(), dim=-1)  # (T, V)
            for k, t in enumerate(response):
                nll -= float(logp[len(prompt) + k - 1, t])
            count += len(response)
    return nll / count


def test_eval_sft_loss_is_the_held_out_rows_nll_by_hand() -> None:
    loc = Loc("t.flow", 1, 1)
    actor = ModelDecl("actor", "policy", "tiny:gpt2", loc, config=SHAPE, trainable=True, lr=1e-2)
    worker = ModelWorker([actor], [actor], seed=0)
    rows = _demos(16, seed=0, held=5)
    train, held = rows[:11], rows[11:]
    attrs = {"loss": "sft"}
    tok, module = worker.models["actor"].tokenizer, worker.models["actor"].module
    before = worker.evaluate("actor", rows_batch(held), attrs)
    assert before["eval/sft_loss"] == pytest.approx(_by_hand(module, tok, held), rel=1e-5)
    for seed in range(3):
        worker.update("actor", training_batch({"rollout": rows_batch(train)}), attrs, step_seed=seed)
    after = worker.evaluate("actor", rows_batch(held), attrs)
    assert set(after) == {"eval/sft_loss"}
    assert after["eval/sft_loss"] == pytest.approx(_by_hand(module, tok, held), rel=1e-5)
    assert after["eval/sft_loss"] != before["eval/sft_loss"]  # the trained weights are the ones evaluated
    with pytest.raises(ValueError, match="evaluates demonstrations"):
        worker.evaluate("actor", rows_batch([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]), attrs)


FLOW = """\
model actor : policy {{ source = "tiny:gpt2", layers = 2, dim = 32, heads = 2, charset = "{charset}", lr = 1e-2 }}
data demos = jsonl("demos.jsonl") {{ batch = 4, held_out = "held_out" }}
{body}
run {{ steps = 4, seed = 0 }}
"""


def _run(folder: Path, out: str, rows: list[dict[str, Any]], body: str, steps: int | None = None) -> list[dict[str, Any]]:
    (folder / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    flow = folder / "sft.flow"
    flow.write_text(FLOW.format(charset=CHARSET, body=body), encoding="utf-8")
    flowrl.run(flowrl.load(str(flow)), out_dir=folder / out, steps=steps)
    return [json.loads(line) for line in (folder / out / "metrics.jsonl").read_text().splitlines()]


def test_the_stdlib_sft_reports_eval_sft_loss_each_step_and_never_trains_on_held_out_rows(tmp_path: Path) -> None:
    """Two runs differing only in their held-out rows' answers train alike (same sft_loss every step, same
    weights) and evaluate differently."""
    right = _run(tmp_path, "right", _demos(16, seed=1, held=4), "use sft()")
    wrong = _run(tmp_path, "wrong", _demos(16, seed=1, held=4, wrong_held=True), "use sft()")
    assert [r["step"] for r in right] == [1, 2, 3, 4]
    for a, b in zip(right, wrong, strict=True):
        assert a["actor/sft_loss"] == b["actor/sft_loss"]
        assert "actor/eval/sft_loss" in a and a["actor/eval/sft_loss"] != b["actor/eval/sft_loss"]


def test_eval_every_spaces_the_evaluations(tmp_path: Path) -> None:
    body = 'step {\n    actor.update(demos, loss = "sft", eval_every = 2)\n}'
    rows = _run(tmp_path, "out", _demos(16, seed=2, held=4), body)
    assert ["actor/eval/sft_loss" in r for r in rows] == [False, True, False, True]
    assert all("actor/sft_loss" in r for r in rows)


def test_a_run_shorter_than_eval_every_still_evaluates_at_its_last_step(tmp_path: Path) -> None:
    """`--steps 3` with `eval_every = 50` (issue 33 item 8): the held-out rows are scored at the run's end, and
    a run whose last step is not a multiple of `eval_every` evaluates there too."""
    body = 'step {\n    actor.update(demos, loss = "sft", eval_every = 50)\n}'
    rows = _run(tmp_path, "short", _demos(16, seed=2, held=4), body, steps=3)
    assert ["actor/eval/sft_loss" in r for r in rows] == [False, False, True]
    body = 'step {\n    actor.update(demos, loss = "sft", eval_every = 2)\n}'
    rows = _run(tmp_path, "odd", _demos(16, seed=2, held=4), body, steps=5)
    assert ["actor/eval/sft_loss" in r for r in rows] == [False, True, False, True, True]


def test_the_language_doc_names_the_metric() -> None:
    row = next(line for line in (ROOT / "docs" / "language.md").read_text().splitlines()
               if line.startswith('| `"sft"`'))
    assert "`eval/sft_loss`" in row and "`eval_every = 1`" in row
