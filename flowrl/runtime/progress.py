"""The per-step progress bar (rich): step, the step's headline metric (reward, or a preference stage's training
accuracy or loss), what else a preference step measured (its loss, the latest held-out score), the latest `eval`
block's score (`eval NAME`: its mean@K) and its rate: generated tokens per second where the step generated, else
data rows trained on per second."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from flowrl.runtime import evaluation

# A step without a reward (an SFT, reward-model or DPO update on data) is summed up by the first of these its row
# has, held-out (eval) metrics left out so the headline stays the same from step to step: (key suffix, the name
# shown). The held-out scores are shown beside it (_EVALS).
_HEADLINES = (("rewards/accuracies", "acc"), ("/rm_accuracy", "acc"), ("/sft_loss", "sft_loss"),
              ("/dpo_loss", "dpo_loss"), ("loss", "loss"))
_LOSSES = ("/rm_loss", "/dpo_loss")  # shown beside an accuracy headline
_EVALS = (("/eval/rewards/accuracies", "eval_acc"), ("/eval_accuracy", "eval_acc"), ("/eval/sft_loss", "eval_loss"))


def _held_out(key: str) -> bool:
    """A metric measured on held-out rows (`rm/eval_accuracy`, `actor/eval/...`, `eval/...`)."""
    return key.startswith("eval") or "/eval" in key


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def headline_key(row: dict[str, Any]) -> tuple[str, str] | None:
    """(metric key, name shown) of the metric a step is summed up by: `reward_mean` where the step scored
    rollouts, else a preference update's training accuracy or loss (never a held-out score, which only some
    steps have); None for a row with none of them."""
    if "reward_mean" in row:
        return "reward_mean", "reward"
    for suffix, name in _HEADLINES:
        for key, value in row.items():
            if key.endswith(suffix) and _number(value) and not _held_out(key):
                return key, name
    return None


def headline(row: dict[str, Any]) -> tuple[str, float]:
    """(name shown, value) of `headline_key` ("reward", 0.0 for a row without one)."""
    found = headline_key(row)
    return (found[1], float(row[found[0]])) if found is not None else ("reward", 0.0)


def held_out(row: dict[str, Any]) -> dict[str, float]:
    """The held-out scores a step measured: a preference update's (steps where `eval_every` came round) and an
    `eval` block's mean@K (`eval NAME`): name -> value."""
    out: dict[str, float] = {}
    for suffix, name in _EVALS:
        for key, value in row.items():
            if key.endswith(suffix) and _number(value) and not key.startswith("eval/"):
                out.setdefault(name, float(value))
    found = evaluation.headline(row)
    if found is not None:
        out[found[0]] = found[1]
    return out


def details(row: dict[str, Any]) -> dict[str, float]:
    """What is shown beside the headline: a preference update's loss where the headline is its accuracy."""
    found = headline_key(row)
    if found is None or found[1] != "acc":
        return {}
    loss = next((float(v) for k, v in row.items() if k.endswith(_LOSSES) and _number(v) and not _held_out(k)), None)
    return {"loss": loss} if loss is not None else {}


def rate(row: dict[str, Any]) -> str:
    """'812 tok/s' where the step generated; '2450 rows/s' for a step that trained on data rows alone."""
    if not row.get("gen_tokens") and row.get("data_rows"):
        return f"{float(row['data_rows']) / max(float(row.get('step_time_s', 0.0)), 1e-9):.0f} rows/s"
    return f"{float(row.get('tokens_per_s', 0.0)):.0f} tok/s"


def summary(rows: list[dict[str, Any]]) -> str:
    """'last-5 reward 0.812' (the mean of the headline over the last five rows, named by the last row's)."""
    last = [r for r in rows if not evaluation.eval_only(r)][-5:]  # a step-0 evaluation is no training step
    if not last:
        return "no steps"
    name = headline(last[-1])[0]
    values = [v for n, v in map(headline, last) if n == name]
    return f"last-{len(values)} {name} {sum(values) / len(values):.3f}"


def _fields(values: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in values.items())


class Progress:
    """A rich progress bar on a terminal; one plain line every `every` steps otherwise (CI logs stay short). The
    latest held-out score stays shown after the step that measured it."""

    def __init__(self, total: int, enabled: bool = True, every: int = 10):
        self.total, self.enabled, self.every = total, enabled, max(1, every)
        self._bar: Any = None
        self._task: Any = None
        self._held_out: dict[str, float] = {}

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[what]} {task.fields[value]:.3f}"), TextColumn("{task.fields[more]}"),
                TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("run", total=self.total, what="reward", value=0.0, more="", rate="")
        return self

    def line(self, step: int, row: dict[str, Any]) -> str:
        """The plain progress line of `row` (the step's own values, and the latest held-out score so far)."""
        self._held_out.update(held_out(row))
        if evaluation.eval_only(row):  # the step-0 evaluation (`at_start`): no step's figures yet
            return f"step {step}/{self.total}  {_fields(self._held_out)}"
        what, value = headline(row)
        more = _fields({**details(row), **self._held_out})
        return (f"step {step}/{self.total}  {what} {value:.3f}  " + (f"{more}  " if more else "")
                + f"{rate(row)}  {row.get('step_time_s', 0.0):.2f} s/step")

    def update(self, step: int, row: dict[str, Any]) -> None:
        text = self.line(step, row)
        if self._bar is not None and evaluation.eval_only(row):
            self._bar.update(self._task, more=_fields(self._held_out))
        elif self._bar is not None:
            what, value = headline(row)
            self._bar.update(self._task, completed=step, what=what, value=value, rate=rate(row),
                             more=_fields({**details(row), **self._held_out}))
        elif self.enabled and (step % self.every == 0 or step == self.total or step == 1 or step == 0
                               or evaluation.headline(row) is not None):
            print(text, file=sys.stderr, flush=True)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(et, e, tb)
