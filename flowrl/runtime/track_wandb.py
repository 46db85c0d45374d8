"""Weights & Biases as a tracker (`run { log = ["wandb"] }`): the `wandb` extra, imported only here.

`WANDB_MODE=offline` needs no network: the run is written under OUT/wandb/ (or `WANDB_DIR`) for a later
`wandb sync OUT/wandb/offline-run-*`. Metrics go to `run.log` at their step, samples as a `wandb.Table` per step
under `samples/KIND`, files (flow, graph, settings, run.json, samples.jsonl) to the run's files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError
from flowrl.runtime.tracking import RunInfo, numbers, table


class WandbTracker:
    name = "wandb"

    def __init__(self, info: RunInfo):
        import wandb

        self.wandb = wandb
        try:
            # console="off": wandb leaves stdout and stderr alone (the progress bar, a closed pipe's handling);
            # quiet: its start and end say where the run is saved, not every metric
            self.run = wandb.init(project=info.project, name=info.name, config=dict(info.settings),
                                  dir=None if os.environ.get("WANDB_DIR") else str(info.out),
                                  id=info.resume_id, resume="allow" if info.resume_id else None,
                                  tags=[f"{k}:{v}" for k, v in info.tags.items()],
                                  settings=wandb.Settings(console="off", quiet=True))
        except Exception as e:  # no API key in online mode, a server that can't be reached, ...
            raise FlowError(Diagnostic(f"wandb could not start its run: {type(e).__name__}: {e}",
                                       hint="WANDB_MODE=offline needs no network (the run goes to OUT/wandb; "
                                            "upload it later with `wandb sync`), or `wandb login` first")) from None
        self.run_id = str(self.run.id)
        self.log_files(info.files)

    def log_metrics(self, step: int, row: Mapping[str, Any]) -> None:
        self.run.log(numbers(row), step=step)

    def log_samples(self, kind: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        columns, data = table(rows)
        self.run.log({f"samples/{kind}": self.wandb.Table(columns=list[str | int](columns), data=data)}, step=step)

    def log_files(self, paths: Sequence[Path]) -> None:
        """Copies in the run's files folder (as they are now: run.json again at the end), saved from there."""
        for p in paths:
            if p.exists():
                kept = Path(self.run.dir) / p.name
                shutil.copyfile(p, kept)
                self.run.save(str(kept), base_path=self.run.dir, policy="now")

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
