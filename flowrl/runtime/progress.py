"""The per-step progress bar (rich): step, reward and generated tokens per second."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class Progress:
    """A rich progress bar on a terminal; one plain line every `every` steps otherwise (CI logs stay short)."""

    def __init__(self, total: int, enabled: bool = True, every: int = 10):
        self.total, self.enabled, self.every = total, enabled, max(1, every)
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("reward {task.fields[reward]:.3f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
                TimeRemainingColumn(), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("run", total=self.total, reward=0.0, tps=0.0)
        return self

    def update(self, step: int, row: dict[str, Any]) -> None:
        reward, tps = float(row.get("reward_mean", 0.0)), float(row.get("tokens_per_s", 0.0))
        if self._bar is not None:
            self._bar.update(self._task, completed=step, reward=reward, tps=tps)
        elif self.enabled and (step % self.every == 0 or step == self.total or step == 1):
            print(f"step {step}/{self.total}  reward {reward:.3f}  {tps:.0f} tok/s  "
                  f"{row.get('step_time_s', 0.0):.2f} s/step", file=sys.stderr, flush=True)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(et, e, tb)
