"""Multi-turn rollouts end to end (issue 26): a flow with `env = NAME` runs on the local backend and reports its
environment metrics; the rollout holds exactly the generated and the observed ids, observation tokens are kept out
of the loss; the same samples on the local, threads and process backends with environments of random latency;
an environment that fails under on_error = "raise" is a run error naming its declaration and the sample; one that
hangs is cut by `timeout`; share-prefix's forwards agree with plain ones on a rollout with observations.

The environments are real classes (tests/runtime/envs_mod.py), run in the pool's warm worker processes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl import backends
from flowrl.errors import ExecutionError
from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_text
from flowrl.runtime.batch import Batch, training_batch
from flowrl.runtime.worker import ModelWorker

HERE = Path(__file__).parent
FLOW = """\
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3,
                        context = 64 }}
model ref : reference {{ source = actor }}
data prompts = jsonl("data.jsonl") {{ batch = 3 }}
env game = "envs_mod.{cls}" {{ max_turns = 3, stop = "+", workers = 1, timeout = {timeout}, on_error = "{on_error}" }}
use grpo(group = 2, max_tokens = 4, env = game)
run {{ steps = 2, seed = 1 }}
"""
ENV_METRICS = ("env/turns_mean", "env/step_s_p50", "env/step_s_p99", "env/errors", "env/timeouts",
               "env/tool_calls_mean", "env/idle_frac", "env/return_mean", "env/prefill_tokens_mean")


def write_flow(tmp: Path, cls: str = "Echo", on_error: str = "observe", timeout: float = 10.0) -> Path:
    rows = [{"prompt": f"{a}+{b}", "answer": a + b} for a in range(3) for b in range(2)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "envs_mod.py").write_text((HERE / "envs_mod.py").read_text())
    path = tmp / "game.flow"
    path.write_text(FLOW.format(cls=cls, on_error=on_error, timeout=timeout))
    return path


def prompts_batch(texts: list[str]) -> Batch:
    return Batch(len(texts), {}, {"prompt": texts, "answer": [0] * len(texts),
                                  "prompt_slot": list(range(len(texts)))})


def generate(graph: Graph, worker: ModelWorker, texts: list[str], seed: int = 5) -> Batch:
    gen = graph.node("rollout")
    return worker.generate("actor", prompts_batch(texts), dict(gen.attrs), step_seed=seed)


@pytest.fixture
def echo(tmp_path: Path) -> tuple[Graph, ModelWorker]:
    graph = flowrl.load(str(write_flow(tmp_path)))
    worker = ModelWorker([graph.model("actor")], graph.models, seed=0)
    yield graph, worker
    worker.close()


def test_a_flow_with_an_env_runs_and_reports_its_metrics(tmp_path: Path) -> None:
    res = flowrl.run(flowrl.load(str(write_flow(tmp_path))), out_dir=tmp_path / "out", steps=2)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(res.metrics) == 2
    for row in rows:
        assert all(k in row for k in ENV_METRICS), [k for k in ENV_METRICS if k not in row]
        assert 1 <= row["env/turns_mean"] <= 3 and row["env/errors"] == 0 and row["env/timeouts"] == 0
        assert 0 <= row["env/idle_frac"] <= 1 and row["env/step_s_p50"] <= row["env/step_s_p99"]
        # each trajectory prefills its prompt (<bos> and 3 characters) and its observations, nothing again
        assert row["env/prefill_tokens_mean"] >= 4 + 1
        assert row["gen_tokens"] <= 6 * 3 * 4  # generated tokens: 6 trajectories of at most 3 turns x 4 tokens


def test_trained_ids_are_the_generated_and_observed_ids(echo: tuple[Graph, ModelWorker]) -> None:
    graph, worker = echo
    rollout = generate(graph, worker, ["0+1", "2+2", "1+0"])
    tok = worker.models["actor"].tokenizer
    assert rollout.size == 6 and rollout["group_id"].tolist() == [0, 0, 1, 1, 2, 2]
    mask, loss, turn = rollout["response_mask"], rollout["loss_mask"], rollout["turn_index"]
    for r in range(rollout.size):
        real = mask[r].bool()
        ids = rollout["response_ids"][r][real].tolist()
        assert tok.decode(ids) == rollout.meta["response"][r]  # one token list, the text it is
        # the observed tokens are exactly the environment's answers: "=" after the prompt, then "=k" per action
        spans, cur, kinds = [], [], []
        for t, g in zip(ids, loss[r][real].tolist(), strict=True):
            if kinds and kinds[-1] != g:
                spans.append(cur)
                cur = []
            if not kinds or kinds[-1] != g:
                kinds.append(g)
            cur.append(t)
        spans.append(cur)
        observed = [tok.decode(s) for s, g in zip(spans, kinds, strict=True) if g == 0]
        actions = [tok.decode(s) for s, g in zip(spans, kinds, strict=True) if g == 1]
        assert observed[0] == "="
        assert observed[1:] == [f"={len(a) % 10}" for a in actions[: len(observed) - 1]]
        assert rollout["env_turns"][r] == len(actions)
        assert (turn[r][~real] == -1).all() and (turn[r][real] >= 0).all()
        # sampling log-probs on actions only; the turn's reward at its last action token
        assert (rollout["gen_logp"][r][real & (loss[r] == 0)] == 0).all()
        assert rollout["env_return"][r] == float(sum(a.endswith("+") for a in actions))
    assert rollout.meta["env_ended"][0] in ("done", "max_turns", "eos", "length", "error")
    assert (rollout["prefill_tokens"] == 1 + 3 + (mask - loss).sum(1)).all()  # <bos>, prompt, observations


def test_observation_tokens_are_out_of_the_loss_the_update_receives(echo: tuple[Graph, ModelWorker]) -> None:
    graph, worker = echo
    rollout = generate(graph, worker, ["0+1", "2+2"])
    scores = rollout.derive("scores", scores=torch.zeros(rollout.size))
    adv = scores.derive("advantages", advantages=torch.ones(rollout.size, rollout["response_ids"].shape[1]))
    batch = training_batch({"rollout": rollout, "advantages": adv})
    observed = batch["response_mask"].bool() & (batch["loss_mask"] == 0)
    assert observed.any() and torch.equal(batch["loss_mask"], rollout["loss_mask"])
    for name in ("loss_mask", "turn_index", "turn_rewards", "env_return"):  # carried into derived batches
        assert name in scores.tensors and name in adv.tensors
    before = {k: v.clone() for k, v in worker.models["actor"].module.state_dict().items()}
    metrics = worker.update("actor", batch, dict(graph.node("actor.update").attrs), step_seed=1)
    assert metrics and any(not torch.equal(before[k], v) for k, v in worker.models["actor"].module.state_dict().items())


def _rollouts(tmp_path: Path, backend: str, overrides: dict[str, str]) -> dict[str, Any]:
    tmp_path.mkdir()
    graph = flowrl.load(str(write_flow(tmp_path, cls="SlowEcho")), overrides=overrides)
    be = backends.make(backend)
    groups = be.start(graph, seed=0, device="cpu")
    try:
        gen = graph.node("rollout")
        out = groups[gen.worker_group].call("generate", "actor", prompts_batch(["0+1", "2+2", "1+0", "2+1"]),
                                            dict(gen.attrs), step_seed=11).result()
    finally:
        be.shutdown()
    real = out["response_mask"].bool()
    return {
        "ids": [out["response_ids"][r][real[r]].tolist() for r in range(out.size)],
        "loss": [out["loss_mask"][r][real[r]].tolist() for r in range(out.size)],
        "turns": [out["turn_index"][r][real[r]].tolist() for r in range(out.size)],
        "return": out["env_return"].tolist(), "group": out["group_id"].tolist(),
    }


def test_the_same_samples_on_every_backend_whatever_the_envs_timing(tmp_path: Path) -> None:
    """SlowEcho answers after a random 0-20 ms; threads and process split the prompts over two ranks (threads also
    with one trajectory decoding at a time on each)."""
    local = _rollouts(tmp_path / "local", "local", {})
    assert sum(map(len, local["ids"])) > 0
    two = {"actor.replicas": "2", "ref.replicas": "2"}
    assert _rollouts(tmp_path / "threads", "threads", two) == local
    assert _rollouts(tmp_path / "queued", "threads", {**two, "game.decode_batch": "1"}) == local
    assert _rollouts(tmp_path / "process", "process", two) == local


def test_decode_batch_is_in_the_graph_and_keeps_the_samples(tmp_path: Path) -> None:
    """`decode_batch = 1` (one trajectory decoding at a time, the others queued) on the local backend: the
    compiled graph says so, and the rollout is the one every trajectory decoding at once gives."""
    capped = _rollouts(tmp_path / "capped", "local", {"game.decode_batch": "1"})
    graph = flowrl.load(str(tmp_path / "capped" / "game.flow"), overrides={"game.decode_batch": "1"})
    assert "env=game (env, max_turns=3, decode_batch=1)" in to_text(graph)
    assert capped == _rollouts(tmp_path / "all", "local", {})


def test_an_env_that_raises_under_on_error_raise_names_the_sample(tmp_path: Path) -> None:
    with pytest.raises(ExecutionError) as info:
        flowrl.run(flowrl.load(str(write_flow(tmp_path, cls="Broken", on_error="raise"))), out_dir=tmp_path / "o",
                   steps=1)
    lines = info.value.render().splitlines()
    assert lines[0].startswith("error: while executing rollout = actor.generate(") and "game.flow:6" in lines[0]
    assert re.fullmatch(r"error: env `game` \(declared at .*game\.flow:5:1\) failed on sample [01] of prompt '\d\+\d', "
                        r"its action '[0-9+=]*': raised ValueError: no such move", lines[1]), lines[1]
    assert lines[2] == 'hint: on_error = "observe" shows the policy the error and "end" ends the trajectory; the run goes on'
    assert "Traceback" not in info.value.render()


def test_an_env_that_raises_under_observe_shows_the_policy_the_error(tmp_path: Path) -> None:
    res = flowrl.run(flowrl.load(str(write_flow(tmp_path, cls="Broken"))), out_dir=tmp_path / "o", steps=1)
    row = res.metrics[0]
    assert row["env/errors"] > 0 and row["env/timeouts"] == 0


def test_a_hanging_env_is_cut_by_its_timeout(tmp_path: Path) -> None:
    """Hang's step never returns (it waits on an event nobody sets): only the timeout can end its turns."""
    res = flowrl.run(flowrl.load(str(write_flow(tmp_path, cls="Hang", on_error="end", timeout=0.5))),
                     out_dir=tmp_path / "o", steps=1)
    row = res.metrics[0]
    # every trajectory's first step failed: timed out, or lost with the worker the pool killed for hanging past
    # twice the timeout (which of the two depends on when each call reached it), and the trajectory ended
    assert row["env/errors"] == 6 and row["env/timeouts"] >= 1
    assert row["env/turns_mean"] == 1


def test_share_prefix_logprobs_agree_on_an_env_rollout(echo: tuple[Graph, ModelWorker]) -> None:
    graph, worker = echo
    rollout = generate(graph, worker, ["0+1", "2+2"])
    plain = worker.logprobs("actor", rollout, {})["logp"]
    shared = worker.logprobs("actor", rollout, {"share_prefix": True, "prefix_min_len": 1})["logp"]
    mask = rollout["response_mask"].bool()
    assert torch.allclose(plain[mask], shared[mask], atol=1e-5)
