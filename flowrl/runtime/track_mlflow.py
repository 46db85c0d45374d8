"""MLflow as a tracker (`run { log = ["mlflow"] }`): the `mlflow` extra (mlflow-skinny is enough), imported only here.

It writes to `MLFLOW_TRACKING_URI` when set, else to a file store in OUT/mlruns. MLflow 3 keeps its file store in
maintenance mode and refuses it unless `MLFLOW_ALLOW_FILE_STORE=true`, which is set for that default store only:
the database stores need SQLAlchemy and Alembic, which mlflow-skinny does not carry, and the file store needs no
server (read it with `MlflowClient("file:OUT/mlruns")`, or `mlflow ui --backend-store-uri OUT/mlruns` with the
same variable set). The project is the experiment; settings are params (flattened: `model.actor.lr`); metrics are
logged at their step under names MLflow accepts (`@` as `_at_`: `eval/NAME/pass_at_4`); samples are table
artifacts `samples/KIND/step_NNNNNN.json` (MLflow's `{"columns", "data"}` layout).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError
from flowrl.runtime.tracking import RunInfo, flat, numbers, table

MAX_METRICS, MAX_PARAMS, MAX_PARAM_VALUE = 1000, 100, 6000  # MLflow's log_batch and param limits


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: `@` as `_at_`, any other character it refuses as `_`."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key.replace("@", "_at_"))[:250]


def tracking_uri(out: Path) -> str:
    """MLFLOW_TRACKING_URI, else the file store OUT/mlruns (allowed for this process: see the module's docstring)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (out / "mlruns").resolve().as_uri()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, info: RunInfo):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.uri = tracking_uri(info.out)
        try:
            self.client = MlflowClient(self.uri)
            found = self.client.get_experiment_by_name(info.project)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(info.project)
            if info.resume_id:
                self.run_id = info.resume_id
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                self.run_id = self.client.create_run(experiment, run_name=info.name, tags=dict(info.tags)).info.run_id
                params = [Param(mlflow_key(k), str(v)[:MAX_PARAM_VALUE]) for k, v in flat(info.settings).items()]
                for i in range(0, len(params), MAX_PARAMS):
                    self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS])
        except Exception as e:  # a tracking server that can't be reached, a store MLflow refuses, ...
            raise FlowError(Diagnostic(f"MLflow could not start its run at {self.uri}: {type(e).__name__}: {e}",
                                       hint="unset MLFLOW_TRACKING_URI to write a file store in OUT/mlruns")) from None
        self.log_files(info.files)

    def log_metrics(self, step: int, row: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_key(k), v, now, step) for k, v in numbers(row).items()]
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS])

    def log_samples(self, kind: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        columns, data = table(rows)
        self.client.log_dict(self.run_id, {"columns": columns, "data": data},
                             f"samples/{kind}/step_{step:06d}.json")

    def log_files(self, paths: Sequence[Path]) -> None:
        for p in paths:
            if p.exists():
                self.client.log_artifact(self.run_id, str(p))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
