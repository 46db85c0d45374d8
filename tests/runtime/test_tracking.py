"""Experiment tracking (`run { log }`, `flowrl run --log`): offline wandb, an MLflow file store and TensorBoard receive
every metric row, the rollout samples and the run's files, read back with each library's own reader (wandb's record
protobufs, `MlflowClient`, TensorBoard's EventAccumulator); a resumed run continues its tracked runs; eval samples go
through the same sink; a run without `log` imports neither wandb nor MLflow; a missing extra or an unknown tracker is
an error naming it."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.cli import main
from flowrl.errors import FlowError
from flowrl.runtime.controller import StepResult
from flowrl.runtime.sinks import StepSinks
from flowrl.runtime.track_mlflow import mlflow_key

ROOT = Path(__file__).resolve().parents[2]
FLOW = """\
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }}
model ref : reference {{ source = actor }}
reward digits = "digits.reward"
data prompts = jsonl("data.jsonl") {{ batch = 2 }}
use grpo(reward = digits, group = 4, max_tokens = 3, kl_coef = 0.01)
run {{ steps = {steps}, seed = 2, checkpoint_every = 1, log_samples = 3{run} }}
"""


def write_flow(tmp: Path, steps: int = 3, run: str = "") -> Path:
    (tmp / "digits.py").write_text("def reward(prompt, response, **_):\n"
                                   "    return float(sum(c.isdigit() for c in response)) / 3\n")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / "f.flow"
    path.write_text(FLOW.format(steps=steps, run=run))
    return path


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb offline in the run directory, MLflow's default file store (which flowrl allows: the variable is unset
    here, and restored after), no telemetry sent anywhere."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def numeric(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


# ---- wandb's offline transaction log, decoded with wandb's own record protobuf ---------------------------------
# The .wandb file is LevelDB's log format (https://github.com/google/leveldb/blob/main/doc/log_format.md) after a
# 7-byte header (":W&B", 0xBEE1, version 0); wandb 0.31 ships no Python reader for it (its DataStore moved into
# wandb-core), so the framing is read here, every chunk's CRC checked, and each record parsed by wandb.proto.

def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, head = path.read_bytes(), 32768, struct.Struct("<IHB")
    assert struct.unpack_from("<4sHB", data) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + head.size <= len(data):
        if block - pos % block < head.size:  # a block's trailer
            pos += block - pos % block
            continue
        crc, length, kind = head.unpack_from(data, pos)
        if (crc, length, kind) == (0, 0, 0):  # zero padding to the end of a block
            pos += block - pos % block
            continue
        body = data[pos + head.size:pos + head.size + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pos += head.size + length
        pending += body
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(run_dir: Path) -> dict[str, Any]:
    """A wandb offline run directory's history rows by step, files, config and exit code."""
    (log,) = run_dir.glob("run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    files: list[str] = []
    config: dict[str, Any] = {}
    exit_code = None
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(int(row["_step"]), {}).update(row)
        elif kind == "files":
            files += [f.path for f in rec.files.files]
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "exit":
            exit_code = rec.exit.exit_code
    return {"history": history, "files": files, "config": config, "exit_code": exit_code, "id": log.stem[4:]}


def one_run(out: Path) -> Path:
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    return run_dir


# ---- the tests --------------------------------------------------------------------------------------------------

def test_offline_wandb_mlflow_and_tensorboard_receive_every_row_the_samples_and_the_files(
        tmp_path: Path, offline: None) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    assert main(["run", str(write_flow(tmp_path)), "--out", str(out), "--log", "wandb,mlflow,tensorboard",
                 "--quiet"]) == 0
    rows, samples = jsonl(out / "metrics.jsonl"), jsonl(out / "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the first 3 samples of every step, as the rollout holds them: prompt, response, reward, data row
    assert [(s["step"], s["index"], s["kind"]) for s in samples] == [(t, i, "train") for t in (1, 2, 3) for i in range(3)]
    for s in samples:
        assert s["reward"] == pytest.approx(sum(c.isdigit() for c in s["response"]) / 3) == s["rewards"]["scores"]
        assert s["data"] == "prompts" and 0 <= s["row_id"] < 9 and s["prompt"].endswith("=")
    ids = json.loads((out / "tracking.json").read_text())
    files = {"f.flow", "graph.txt", "graph.svg", "settings.json", "run.json", "samples.jsonl"}
    settings = json.loads((out / "settings.json").read_text())
    assert settings["model"]["actor"]["lr"] == 3e-3 and settings["step"]["rollout"]["n"] == 4

    wb = wandb_run(one_run(out))
    assert wb["id"] == ids["wandb"] and wb["exit_code"] == 0
    assert sorted(wb["history"]) == [1, 2, 3]
    for row in rows:
        logged = wb["history"][row["step"]]
        assert {k: logged[k] for k in numeric(row)} == numeric(row)
        table = json.loads((one_run(out) / "files" / logged["samples/train/path"]).read_text())
        want = [s for s in samples if s["step"] == row["step"]]
        assert [dict(zip(table["columns"], d, strict=True)) for d in table["data"]] == \
            [{k: json.dumps(v) if isinstance(v, dict) else v for k, v in s.items()} for s in want]
    assert files <= set(wb["files"])
    assert wb["config"]["model"]["actor"]["lr"] == 3e-3

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["model.actor.lr"] == "0.003"
    for key in numeric(rows[0]):
        history = client.get_metric_history(ids["mlflow"], mlflow_key(key))
        assert [(m.step, m.value) for m in history] == [(r["step"], float(r[key])) for r in rows if key in r], key
    assert files <= {a.path for a in client.list_artifacts(ids["mlflow"])}
    logged_tables = [a.path for a in client.list_artifacts(ids["mlflow"], "samples/train")]
    assert logged_tables == [f"samples/train/step_00000{t}.json" for t in (1, 2, 3)]
    table = json.loads(Path(client.download_artifacts(ids["mlflow"], logged_tables[0], str(tmp_path))).read_text())
    assert [d[table["columns"].index("response")] for d in table["data"]] == [s["response"] for s in samples[:3]]

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Scalars("reward_mean")
    assert [(e.step, e.value) for e in scalars] == [(r["step"], pytest.approx(r["reward_mean"])) for r in rows]
    assert {"samples/train/text_summary", "f.flow/text_summary"} <= set(events.Tags()["tensors"])


def test_a_resumed_run_continues_its_tracked_runs(tmp_path: Path, offline: None) -> None:
    from mlflow.tracking import MlflowClient

    path = write_flow(tmp_path, steps=2, run=', log = ["wandb", "mlflow"]')
    out = tmp_path / "out"
    flowrl.run(flowrl.load(str(path)), out_dir=out)
    first = json.loads((out / "tracking.json").read_text())
    flowrl.run(flowrl.load(str(path), {"run.steps": 3}), out_dir=out, resume=True)
    assert json.loads((out / "tracking.json").read_text()) == first
    rows = jsonl(out / "metrics.jsonl")
    history = MlflowClient((out / "mlruns").resolve().as_uri()).get_metric_history(first["mlflow"], "reward_mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["reward_mean"]) for r in rows]
    runs = [wandb_run(d) for d in sorted((out / "wandb").glob("offline-run-*"))]
    assert {r["id"] for r in runs} == {first["wandb"]}  # both sessions' logs are the one run's (`wandb sync` joins them)
    assert sorted(step for r in runs for step in r["history"]) == [1, 2, 3]
    assert [s["step"] for s in jsonl(out / "samples.jsonl")] == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_eval_samples_and_metrics_go_through_the_same_sinks(tmp_path: Path, offline: None) -> None:
    """What an evaluation between steps hands the sinks: its samples under their own kind, its metrics in the row
    (MLflow's names have no `@`: pass@4 is logged as pass_at_4)."""
    from mlflow.tracking import MlflowClient

    graph = flowrl.load(str(write_flow(tmp_path, run=', log = ["mlflow", "wandb"]')))
    out = tmp_path / "out"
    out.mkdir()
    (out / "graph.txt").write_text("graph\n")
    (out / "run.json").write_text("{}\n")
    sinks = StepSinks(out, graph)
    rows = [{"prompt": "1+1=", "response": "2", "reward": 1.0, "sample": 0},
            {"prompt": "1+1=", "response": "3", "reward": 0.0, "sample": 1}]
    sinks.log_samples("eval/held", rows, 0)
    sinks.write(1, {"step": 1, "reward_mean": 0.5, "eval/held/pass@4": 0.75}, StepResult({}))
    sinks.close()
    assert jsonl(out / "samples.jsonl") == [{"step": 0, "kind": "eval/held", **r} for r in rows]
    ids = json.loads((out / "tracking.json").read_text())
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "eval/held/pass_at_4")] == [(1, 0.75)]
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "samples/eval/held")] == \
        ["samples/eval/held/step_000000.json"]
    wb = wandb_run(one_run(out))
    assert wb["history"][1]["eval/held/pass@4"] == 0.75
    table = json.loads((one_run(out) / "files" / wb["history"][0]["samples/eval/held/path"]).read_text())
    assert table["data"] == [[0, "eval/held", "1+1=", "2", 1.0, 0], [0, "eval/held", "1+1=", "3", 0.0, 1]]


def test_without_graphviz_the_trackers_get_the_dot_text_said_once(tmp_path: Path, offline: None,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    import flowrl.viz

    monkeypatch.setattr(flowrl.viz.shutil, "which", lambda name: None)  # no `dot` program on PATH
    graph = flowrl.load(str(write_flow(tmp_path, run=', log = ["mlflow"]')))
    out = tmp_path / "out"
    out.mkdir()
    sinks = StepSinks(out, graph, draw=flowrl.viz.draw_into)
    sinks.close()
    assert capsys.readouterr().err.count("graph.dot") == 1
    assert (out / "graph.dot").read_text().startswith("digraph")
    ids = json.loads((out / "tracking.json").read_text())
    assert "graph.dot" in {a.path for a in MlflowClient((out / "mlruns").resolve().as_uri()).list_artifacts(ids["mlflow"])}


def test_without_log_neither_wandb_nor_mlflow_is_imported(tmp_path: Path) -> None:
    path = write_flow(tmp_path, steps=1)
    code = (f"import sys, flowrl\nflowrl.run(flowrl.load({str(path)!r}), out_dir={str(tmp_path / 'out')!r})\n"
            "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name in ("tracking.json", "wandb", "mlruns")] == []


def test_a_missing_extra_is_an_error_naming_it_before_anything_starts(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: find_spec says None, import fails
    graph = flowrl.load(str(write_flow(tmp_path, run=', log = ["mlflow"]')))
    with pytest.raises(FlowError) as err:
        flowrl.run(graph, out_dir=tmp_path / "out")
    assert err.value.render() == (
        "error: run { log } asks for mlflow, which is not installed\n"
        "hint: pip install -e '.[mlflow]' (or `pip install 'flowrl[mlflow]'`), or leave it out of `log` / `--log`")
    assert not (tmp_path / "out").exists()


def test_an_unknown_tracker_is_a_located_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_flow(tmp_path, run=', log = ["wandb", "mlfow"]')
    with pytest.raises(FlowError) as err:
        flowrl.load(str(path))
    assert err.value.render() == (
        f"{path}:6:83: error: unknown tracker \"mlfow\" in `log`\n"
        "    run { steps = 3, seed = 2, checkpoint_every = 1, log_samples = 3, log = [\"wandb\", \"mlfow\"] }\n"
        f"{' ' * 86}^^^^^^^\n"
        "hint: did you mean `mlflow`?")
    assert main(["run", str(write_flow(tmp_path)), "--log", "wandb,tensorbord", "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == "error: --log: unknown tracker 'tensorbord'\nhint: did you mean `tensorboard`?\n"


def test_mlflow_names_keep_what_mlflow_accepts() -> None:
    assert mlflow_key("eval/gsm8k/pass@4") == "eval/gsm8k/pass_at_4"
    assert mlflow_key("time/sync.actor") == "time/sync.actor"
    assert mlflow_key("cost/pool[gen]") == "cost/pool_gen_"
