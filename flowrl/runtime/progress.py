"""The per-step progress bar (rich): step, the step's headline metric (reward, or a preference stage's accuracy or
loss), generated tokens per second, and the latest held-out evaluation's score (`eval NAME`'s mean@K)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from flowrl.runtime import evaluation

# A step without a reward (an SFT, reward-model or DPO update on data) is summed up by the first of these its row
# has: (key suffix, the name shown).
_HEADLINES = (("eval/rewards/accuracies", "eval_acc"), ("/eval_accuracy", "eval_acc"), ("rewards/accuracies", "acc"),
              ("/rm_accuracy", "acc"), ("/sft_loss", "sft_loss"), ("/dpo_loss", "dpo_loss"), ("loss", "loss"))


def headline(row: dict[str, Any]) -> tuple[str, float]:
    """The metric a step is summed up by: `reward_mean` where the step scored rollouts, else a preference update's
    held-out accuracy, training accuracy or loss."""
    if "reward_mean" in row:
        return "reward", float(row["reward_mean"])
    for suffix, name in _HEADLINES:
        for key, value in row.items():
            if key.endswith(suffix) and isinstance(value, (int, float)):
                return name, float(value)
    return "reward", 0.0


def summary(rows: list[dict[str, Any]]) -> str:
    """'last-5 reward 0.812' (the mean of the headline over the last five rows, named by the last row's)."""
    last = [r for r in rows if not evaluation.eval_only(r)][-5:]  # a step-0 evaluation is no training step
    if not last:
        return "no steps"
    name = headline(last[-1])[0]
    values = [v for n, v in map(headline, last) if n == name]
    return f"last-{len(values)} {name} {sum(values) / len(values):.3f}"


class Progress:
    """A rich progress bar on a terminal; one plain line every `every` steps otherwise (CI logs stay short)."""

    def __init__(self, total: int, enabled: bool = True, every: int = 10):
        self.total, self.enabled, self.every = total, enabled, max(1, every)
        self.held = ""  # the latest evaluation, as shown: "  eval held 0.450"
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[what]} {task.fields[value]:.3f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
                TextColumn("{task.fields[held]}"), TimeRemainingColumn(), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("run", total=self.total, what="reward", value=0.0, tps=0.0, held="")
        return self

    def update(self, step: int, row: dict[str, Any]) -> None:
        (what, value), tps = headline(row), float(row.get("tokens_per_s", 0.0))
        held = evaluation.headline(row)
        if held is not None:
            self.held = f"{held[0]} {held[1]:.3f}"
        if self._bar is not None:
            if evaluation.eval_only(row):  # the step-0 evaluation: no step's figures to show yet
                self._bar.update(self._task, held=self.held)
            else:
                self._bar.update(self._task, completed=step, what=what, value=value, tps=tps, held=self.held)
        elif self.enabled and evaluation.eval_only(row):
            print(f"step {step}/{self.total}  {self.held}", file=sys.stderr, flush=True)
        elif self.enabled and (step % self.every == 0 or step == self.total or step == 1 or held is not None):
            shown = f"  {self.held}" if self.held else ""
            print(f"step {step}/{self.total}  {what} {value:.3f}  {tps:.0f} tok/s  "
                  f"{row.get('step_time_s', 0.0):.2f} s/step{shown}", file=sys.stderr, flush=True)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(et, e, tb)
