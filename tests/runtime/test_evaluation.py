"""Evaluation during training (`eval NAME { ... }`, flowrl.runtime.evaluation) and `flowrl eval`: rows at the right
steps, figures that agree with the samples they come from, the same numbers on every backend and outside the run
(`flowrl eval --init` / `--step`), and no change to any training number, resumed or not."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl import cli
from flowrl.ir.graph import Graph

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }}
model ref : reference {{ source = actor }}
reward scored = "evalreward.first_low"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
data held = jsonl("held.jsonl")
use grpo(reward = scored, group = 4, max_tokens = 3, kl_coef = 0.01)
placement {{
    pool gen   {{ gpus = 1 }}
    pool train {{ gpus = 1 }}
    actor.generate -> gen
    actor.update, ref -> train
}}
{evals}
run {{ steps = {steps}, seed = 5, checkpoint_every = 2, max_staleness = {k}{run} }}
"""
EVAL = "eval held { data = held, n = 4, temperature = 1.0, every = 2, at_start = true }"
# right when the answer starts with a low digit, about half the samples of an untrained policy: pass@k moves
REWARD = ('def first_low(prompt, response, **_):\n    return 1.0 if response[:1] in tuple("01234") else 0.0\n\n\n'
          "first_low.extract_answer = lambda response: response[:1] or None\n")
KEYS = ["mean@4", "pass@1", "pass@2", "pass@4", "maj@4", "response_len_mean"]
TIMES = ("step_time_s", "tokens_per_s")


def write(folder: Path, *, steps: int = 3, k: int = 0, evals: str = EVAL, run: str = "") -> Graph:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evalreward.py").write_text(REWARD)
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = [{"prompt": f"{a}+{b}=", "answer": a + b, "data_source": "low" if a < 6 else "high"}
            for a, b in ((4, 5), (5, 5), (6, 3), (7, 1), (8, 8), (9, 0))]
    (folder / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    (folder / "f.flow").write_text(FLOW.format(evals=evals, steps=steps, k=k, run=run))
    return flowrl.load(str(folder / "f.flow"))


def evals(row: dict[str, Any]) -> dict[str, float]:
    return {k.removeprefix("eval/held/"): v for k, v in row.items() if k.startswith("eval/held/")}


def training(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps' numbers: no step-0 row, no evaluation, no timings."""
    return [{k: v for k, v in r.items() if not k.startswith(("eval/", "time/", "cost/", "async/")) and k not in TIMES}
            for r in rows if r["step"] > 0]


def samples(run: Path) -> list[dict[str, Any]]:
    """The evaluation's samples in the run's samples.jsonl."""
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "eval/held"]


def flowrl_eval(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert cli.main(["eval", *args, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The flow with its eval block, 3 steps on the local backend (checkpoints at 2 and 3): the reference."""
    folder = tmp_path_factory.mktemp("local")
    return folder, flowrl.run(write(folder), out_dir=folder / "out").metrics


def majority_reward(group: list[dict[str, Any]]) -> float:
    """maj@K of one prompt worked out here: the answer (first character) most samples give, a tie to the one given
    first; right when the first sample giving it is."""
    answers = [s["response"][:1] for s in group if s["response"][:1]]
    if not answers:
        return 0.0
    counts = Counter(answers)
    best = max(counts.values())
    winner = min((a for a in counts if counts[a] == best), key=answers.index)
    return float(next(s for s in group if s["response"][:1] == winner)["reward"] == 1.0)


def test_evaluations_land_on_their_steps_with_figures_the_samples_give(
        local_run: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, rows = local_run
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: at_start, in a row of its own
    assert [r["step"] for r in rows if "eval/held/mean@4" in r] == [0, 2, 3]  # every 2, and the last step
    assert set(rows[0]) == {"step", "time/eval/held", *(f"eval/held/{k}" for k in KEYS),
                            *(f"eval/held/{s}/{k}" for s in ("low", "high") for k in KEYS)}
    recorded = samples(folder / "out")
    assert sorted(Counter(s["step"] for s in recorded).items()) == [(0, 24), (2, 24), (3, 24)]
    for row in rows:  # each step's figures, recomputed here from its samples with the formulas
        mine = [s for s in recorded if s["step"] == row["step"]]
        if not mine:
            continue
        got = evals(row)
        for source, part in (("", mine), ("low/", [s for s in mine if s["data_source"] == "low"]),
                             ("high/", [s for s in mine if s["data_source"] == "high"])):
            by_row: dict[int, list[dict[str, Any]]] = {}
            for s in sorted(part, key=lambda s: s["sample"]):
                by_row.setdefault(s["row_id"], []).append(s)
            assert {len(v) for v in by_row.values()} == {4}
            right = [sum(s["reward"] == 1.0 for s in v) for v in by_row.values()]
            assert got[f"{source}mean@4"] == pytest.approx(sum(s["reward"] for s in part) / len(part))
            for k in (1, 2, 4):
                want = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in right) / len(right)
                assert got[f"{source}pass@{k}"] == pytest.approx(want)
            assert got[f"{source}maj@4"] == pytest.approx(
                sum(majority_reward(v) for v in by_row.values()) / len(by_row))
            assert got[f"{source}response_len_mean"] == pytest.approx(
                sum(s["response_tokens"] for s in part) / len(part))
    assert any(0 < evals(r)["pass@1"] < evals(r)["pass@4"] < 1 for r in rows if "eval/held/pass@1" in r)
    spans = [e for e in json.loads((folder / "out" / "trace.json").read_text())["traceEvents"]
             if e.get("cat") == "eval"]  # what `flowrl timeline` draws
    assert sorted({e["args"]["step"] for e in spans}) == [0, 2, 3]
    assert {e["name"] for e in spans} == {"eval/held", "eval/held.score"}


def test_an_eval_block_changes_no_training_number(tmp_path: Path, local_run: tuple[Path, list[dict[str, Any]]]) -> None:
    plain = flowrl.run(write(tmp_path, evals=""), out_dir=tmp_path / "out").metrics
    held = local_run[1]
    assert [r["step"] for r in plain] == [1, 2, 3]
    assert training(held) == training(plain)  # gen_tokens, reward, loss, kl: eval draws from none of them
    assert [r["gen_tokens"] for r in held if r["step"] > 0] == [r["gen_tokens"] for r in plain]


def test_flowrl_eval_gives_the_runs_own_numbers_at_step_0_and_at_a_checkpoint(
        tmp_path: Path, local_run: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    folder, rows = local_run
    out, data = str(folder / "out"), str(folder / "held.jsonl")
    init = flowrl_eval(capsys, out, "--init", "--data", data, "--samples", str(tmp_path / "s.jsonl"))
    assert init == {**evals(rows[0]), "rows": 6, "step": 0}  # exact: same weights, prompts, seeds and reward
    assert [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()] == [
        s for s in samples(folder / "out") if s["step"] == 0]
    assert flowrl_eval(capsys, out, "--step", "2", "--data", data) == {**evals(rows[2]), "rows": 6, "step": 2}
    assert flowrl_eval(capsys, out, "--data", data) == {**evals(rows[3]), "rows": 6, "step": 3}  # the last
    # other settings than the eval block's: greedy, one answer, the reward named
    greedy = flowrl_eval(capsys, out, "--data", data, "--n", "1", "--temperature", "0",
                         "--reward", "evalreward.first_low")
    assert set(greedy) == {"mean@1", "pass@1", "response_len_mean", "low/mean@1", "low/pass@1",
                           "low/response_len_mean", "high/mean@1", "high/pass@1", "high/response_len_mean", "rows",
                           "step"}
    other = flowrl_eval(capsys, out, "--data", str(folder / "data.jsonl"))  # another file: the block's n and so on
    assert (other["rows"], other["step"], "mean@4" in other, "maj@4" in other) == (16, 3, True, True)
    api = flowrl.evaluate(out, data=data, init=True)
    assert api.metrics == {k: v for k, v in init.items() if k not in ("rows", "step")} and len(api.samples) == 24


def test_the_trackers_get_every_evaluation_and_its_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           local_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """`run { log = ["mlflow"] }`: each evaluation's metrics at its step and its samples as a table, read back with
    MLflow's own client (its names have no `@`: pass@4 is logged as pass_at_4)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run's own file store, OUT/mlruns
    flowrl.run(write(tmp_path, run=', log = ["mlflow"]'), out_dir=tmp_path / "out")
    ids = json.loads((tmp_path / "out" / "tracking.json").read_text())
    client = MlflowClient((tmp_path / "out" / "mlruns").resolve().as_uri())
    history = client.get_metric_history(ids["mlflow"], "eval/held/pass_at_4")
    want = [(r["step"], r["eval/held/pass@4"]) for r in local_run[1] if "eval/held/pass@4" in r]
    assert sorted((m.step, m.value) for m in history) == want
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "samples/eval/held")] == [
        f"samples/eval/held/step_{s:06d}.json" for s in (0, 2, 3)]


def test_a_resumed_run_evaluates_as_an_uninterrupted_one(tmp_path: Path,
                                                        local_run: tuple[Path, list[dict[str, Any]]]) -> None:
    graph = write(tmp_path)
    flowrl.run(graph, out_dir=tmp_path / "cut", steps=2)
    resumed = flowrl.run(graph, out_dir=tmp_path / "cut", resume=True).metrics

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/")) and k not in TIMES} for r in rows]

    assert strip(resumed) == strip(local_run[1])
    assert samples(tmp_path / "cut") == samples(local_run[0] / "out")


@pytest.mark.parametrize("args", [
    (["nowhere"], "error: eval: no run directory nowhere\nhint: pass the --out folder of a `flowrl run`\n"),
    (["{out}", "--step", "7"], "error: eval: no checkpoint at step 7 in {out}/checkpoints\n"
                               "hint: checkpoints at steps: 2, 3\n"),
    (["{out}", "--model", "ref"], "error: eval: `ref` is a reference; an evaluation generates with a policy\n"
                                  "hint: policies: actor\n"),
    (["{out}", "--model", "critic"], "error: eval: no model `critic` in {out}\nhint: its models: actor, ref\n"),
    (["{out}", "--reward", "evalreward.nope"],
     "error: --reward: cannot resolve reward \"evalreward.nope\": module 'evalreward' has no attribute 'nope'\n"
     "hint: a registered reward (arith_exact, math_equal, ...) or a dotted path to a Python function, `module.fn`\n"),
    (["{out}", "--n", "0"], "error: eval: --n must be at least 1, got 0\n"),
    (["{out}", "--init", "--data", "{out}/none.jsonl"], "error: eval: data file not found: {out}/none.jsonl\n"),
], ids=["run_dir", "step", "not_a_policy", "model", "reward", "n", "data"])
def test_flowrl_eval_says_what_is_wrong_without_a_traceback(
        args: tuple[list[str], str], local_run: tuple[Path, list[dict[str, Any]]],
        capsys: pytest.CaptureFixture[str]) -> None:
    argv, want = args
    out = str(local_run[0] / "out")
    code = cli.main(["eval", "--data", str(local_run[0] / "held.jsonl"), *(a.format(out=out) for a in argv)])
    assert (code, capsys.readouterr().err) == (1, want.format(out=out))


def test_flowrl_eval_names_the_line_of_bad_data(tmp_path: Path, local_run: tuple[Path, list[dict[str, Any]]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"prompt": 3}\n')
    assert cli.main(["eval", str(local_run[0] / "out"), "--data", str(bad)]) == 1
    assert capsys.readouterr().err == (f"{bad}:2:1: error: missing string field 'prompt'\n"
                                       '    {"prompt": 3}\n    ^\n'
                                       'hint: every row needs "prompt": "..." (or chat messages)\n')


# ---- every backend: the same numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["threads", "process", pytest.param("ray", marks=pytest.mark.ray),
                                     pytest.param("serverless", marks=pytest.mark.ray)])
def test_every_backend_evaluates_with_the_local_numbers(backend: str, tmp_path: Path,
                                                        local_run: tuple[Path, list[dict[str, Any]]],
                                                        request: pytest.FixtureRequest) -> None:
    """The local run (`local_run`) is the reference."""
    if backend in ("ray", "serverless"):
        request.getfixturevalue("ray_session")
    rows, local_rows = flowrl.run(write(tmp_path), out_dir=tmp_path / "out", backend=backend).metrics, local_run[1]
    assert [r["step"] for r in rows if "eval/held/mean@4" in r] == [0, 2, 3]
    for got, want in zip(rows, local_rows, strict=True):
        assert evals(got) == pytest.approx(evals(want), abs=1e-6), (backend, got["step"])
    for got_row, want_row in zip(training(rows), training(local_rows), strict=True):  # (and how each backend ran)
        assert {k: got_row[k] for k in want_row} == pytest.approx(want_row, abs=1e-4), backend


def test_an_asynchronous_run_evaluates_the_trained_weights(tmp_path: Path,
                                                           local_run: tuple[Path, list[dict[str, Any]]],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rows = flowrl.run(write(tmp_path, k=1), out_dir=tmp_path / "out", backend="process").metrics
    assert [r.get("async/version") for r in rows] == [None, 0.0, 0.0, 1.0]  # asynchronous indeed
    assert [r["step"] for r in rows if "eval/held/mean@4" in r] == [0, 2, 3]
    assert evals(rows[0]) == evals(local_run[1][0])  # the same step-0 weights
    # step 2's evaluation scored the weights after update 2 (the train group's), not the generation group's older
    at2 = flowrl_eval(capsys, str(tmp_path / "out"), "--step", "2", "--data", str(tmp_path / "held.jsonl"))
    assert at2 == {**evals(rows[2]), "rows": 6, "step": 2}


STAGED = """flow staged
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }
model ref : reference { source = actor }
model rm : reward_model { source = actor, lr = 1e-3 }
reward scored = "evalreward.first_low"
data prompts = jsonl("data.jsonl") { batch = 4 }
data demos = jsonl("demos.jsonl") { batch = 4 }
data pairs = jsonl("pairs.jsonl") { batch = 4 }
data held = jsonl("held.jsonl")
run { steps = 2, seed = 3 }
eval held { data = held, at_start = true }
stage sft { use sft(demos = demos) }
stage rm  { use reward_model(pairs = pairs) }
stage rl  { use grpo(reward = scored, group = 4, max_tokens = 3) }
"""


def test_a_pipeline_evaluates_in_the_stages_that_use_the_policy_and_flowrl_eval_finds_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flowrl import backends
    from flowrl.compiler import compile_any
    from flowrl.dsl.stages import Pipeline
    from flowrl.runtime.pipeline import run_pipeline

    write(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "response": str(r["answer"])})
                                                  + "\n" for r in rows))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": str(r["answer"]),
                                                              "rejected": "9"}) + "\n" for r in rows))
    (tmp_path / "staged.flow").write_text(STAGED)
    pipe = compile_any(str(tmp_path / "staged.flow"))
    assert isinstance(pipe, Pipeline)
    got = run_pipeline(pipe, out_dir=tmp_path / "out", backend=lambda stage: backends.make("local")).metrics
    held = [(r["stage"], r["stage_step"], r["step"]) for r in got if "eval/held/mean@1" in r]
    assert held == [("sft", 0, 0), ("sft", 2, 2), ("rl", 0, 4), ("rl", 2, 6)]  # none in rm: the policy is as it was
    by = {(r["stage"], r["stage_step"]): evals(r) for r in got if "eval/held/mean@1" in r}
    assert by[("rl", 0)] == by[("sft", 2)]  # greedy, and rl starts from sft's weights
    out, data = str(tmp_path / "out"), str(tmp_path / "held.jsonl")
    assert flowrl_eval(capsys, out, "--data", data) == {**by[("rl", 2)], "rows": 6, "step": 6, "stage": "rl"}
    assert flowrl_eval(capsys, out, "--data", data, "--step", "2") == {**by[("sft", 2)], "rows": 6, "step": 2,
                                                                       "stage": "sft"}
