"""Dynamic sampling and overlong shaping at run time (flowrl.runtime.refill, flowrl.runtime.shaping): only groups
whose samples scored differently train, the loop draws (and consumes) more prompts, a run resumes exactly,
synchronously and asynchronously, a step that keeps nothing trains nothing, a fused and prefix-sharing step gives
the unfused numbers, and the overlong punishment and `response/clip_ratio` agree with what was generated."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl.backends import make
from flowrl.ir.graph import Graph
from flowrl.runtime.controller import Controller
from flowrl.runtime.runner import loaders_of, scorers_of

ROOT = Path(__file__).resolve().parents[2]
FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }}
model ref : reference {{ source = actor }}
reward scored = "{reward}"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use dapo(reward = scored, group = 4, max_tokens = {max_tokens}, batch = 3, max_gen_batches = 4, kl_coef = 0.01{use})
{placement}
run {{ steps = {steps}, seed = 5{run} }}
"""
SPLIT = """placement {
    pool gen   { gpus = 1 }
    pool train { gpus = 1 }
    actor.generate -> gen
    actor.update, ref -> train
}"""
# Rewards: a response opening with "1" (an untrained policy writes one about once in 16 tries, so most groups of 4
# score all 0 and a few are mixed; the policy soon learns it), none, and a constant.
REWARDS = ("def one(prompt, response, **_):\n    return 1.0 if response[:1] == '1' else 0.0\n\n"
           "def never(prompt, response, **_):\n    return 0.0\n\n"
           "def constant(prompt, response, **_):\n    return 1.0\n")


@pytest.fixture
def dapo(tmp_path: Path) -> Callable[..., Graph]:
    """Writes FLOW (as f.flow), its rewards (first.py) and 16 arithmetic prompts into tmp_path and loads it."""

    def load(*, reward: str = "first.one", use: str = "", steps: int = 3, run: str = "", placement: str = "",
             data: str | None = None, max_tokens: int = 3) -> Graph:
        (tmp_path / "first.py").write_text(REWARDS)
        rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
        (tmp_path / "data.jsonl").write_text(data or "".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / "f.flow").write_text(FLOW.format(reward=reward, use=use, steps=steps, run=run,
                                                     placement=placement, max_tokens=max_tokens))
        return flowrl.load(str(tmp_path / "f.flow"))

    return load


def numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics without timings (and an asynchronous run's waits, and how a stage was fused)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/", "cost/", "fusion/"))
             and not k.endswith("_idle_s") and k not in ("step_time_s", "tokens_per_s")} for r in rows]


def test_only_groups_that_scored_differently_train_and_every_draw_is_consumed(dapo: Callable[..., Graph]) -> None:
    graph = dapo()
    backend = make("local")
    groups = backend.start(graph, seed=5, device="cpu")
    loaders = loaders_of(graph, 5)
    ctl = Controller(graph, groups, loaders, scorers_of(graph), seed=5)
    drawn, refilled = 0, 0
    try:
        for step in (1, 2, 3):
            res = ctl.step(step)
            m, kept, rollout, scored = res.metrics, res.values["kept"], res.values["rollout"], res.values["scores"]
            rounds, k = int(m["filter/gen_rounds"]), int(m["filter/kept_groups"])
            refilled += rounds > 1
            assert m["filter/drawn_groups"] == 4 * rounds and rollout.size == 16 * rounds  # every draw's samples
            assert k + m["filter/short_groups"] == 3 and (k == 3 or rounds == 4)  # full, or out of draws
            assert kept.size == 4 * k and kept["group_id"].tolist() == [g for g in range(k) for _ in range(4)]
            for g in range(k):  # each kept group's samples did not all score the same
                scores = kept["scores"][kept["group_id"] == g]
                assert scores.max() > scores.min()
            # the kept samples are rollout samples (their responses, their prompts), in draw order
            assert set(zip(kept.meta["prompt"], kept.meta["response"], strict=True)) <= \
                set(zip(rollout.meta["prompt"], rollout.meta["response"], strict=True))
            mixed = sum(1 for g in rollout["group_id"].unique()
                        if scored["scores"][rollout["group_id"] == g].unique().numel() > 1)
            assert m["filter/dropped_all_equal"] == 4 * rounds - mixed == m["filter/all_equal_groups"]
            assert m["filter/surplus_groups"] == mixed - k
            assert ("actor/loss" in m) == (k > 0)  # an update ran on what was kept
            assert m["reward_mean"] == pytest.approx(float(scored["scores"].mean()))  # over all that was generated
            drawn += 4 * rounds
            state = loaders["prompts"].state_dict()
            assert state["epoch"] * 16 + state["cursor"] == drawn  # each draw took the data's next prompts
    finally:
        backend.shutdown()
    assert refilled  # the loop did draw more prompts


def test_a_resumed_run_gives_the_metrics_of_an_uninterrupted_one(tmp_path: Path, dapo: Callable[..., Graph]) -> None:
    graph = dapo(steps=4, run=", checkpoint_every = 2")
    whole = flowrl.run(graph, out_dir=tmp_path / "whole", backend="local").metrics
    assert any(r["filter/gen_rounds"] > 1 for r in whole[2:])  # the resumed steps refill too

    def crash(step: int, row: dict[str, Any]) -> None:
        if step == 3:
            raise KeyboardInterrupt  # after step 3: the last checkpoint is step 2's

    with pytest.raises(KeyboardInterrupt):
        flowrl.run(graph, out_dir=tmp_path / "cut", backend="local", on_step=crash)
    resumed = flowrl.run(graph, out_dir=tmp_path / "cut", backend="local", resume=True).metrics
    assert numbers(resumed) == numbers(whole)


def test_an_asynchronous_run_draws_ahead_and_resumes_exactly(tmp_path: Path, dapo: Callable[..., Graph]) -> None:
    graph = dapo(steps=4, run=", checkpoint_every = 2, max_staleness = 1", placement=SPLIT)
    assert graph.node("kept").attrs["phase"] == "rollout"  # its draws run on the rollout thread
    whole = flowrl.run(graph, out_dir=tmp_path / "whole", backend="process").metrics
    assert [r["async/staleness_mean"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    assert any(r["filter/gen_rounds"] > 1 for r in whole)

    def crash(step: int, row: dict[str, Any]) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        flowrl.run(graph, out_dir=tmp_path / "cut", backend="process", on_step=crash)
    resumed = flowrl.run(graph, out_dir=tmp_path / "cut", backend="process", resume=True).metrics
    assert numbers(resumed) == numbers(whole)


def test_a_step_that_keeps_no_group_trains_nothing_and_says_so(tmp_path: Path, dapo: Callable[..., Graph]) -> None:
    rows = flowrl.run(dapo(reward="first.never", steps=2), out_dir=tmp_path, backend="local").metrics
    for r in rows:
        assert (r["filter/kept_groups"], r["filter/gen_rounds"], r["filter/short_groups"]) == (0.0, 4.0, 3.0)
        assert r["filter/dropped_all_equal"] == 16.0 and r["gen_tokens"] > 0
        assert not [k for k in r if k.startswith("actor/") or k in ("loss", "kl_mean")]  # no update ran
    backend = make("local")  # the weights the run started from (same seed)
    try:
        first = backend.start(dapo(reward="first.never"), seed=5, device="cpu")["colocated"].state_dict()["actor"]
    finally:
        backend.shutdown()
    last = torch.load(tmp_path / "checkpoints" / "step_000002.pt", weights_only=False)["groups"]["colocated"]["actor"]
    assert all(torch.equal(first["module"][k], last["module"][k]) for k in first["module"])


def test_fused_and_prefix_sharing_steps_give_the_unfused_numbers(tmp_path: Path, dapo: Callable[..., Graph]) -> None:
    """Prompts that open alike (share-prefix shares them in generation, the forwards over `kept` and the update)
    and a reward with a worker of its own (fused with generation: it scores each draw's chunks as they finish)."""
    long = "".join(json.dumps({"prompt": f"12+34+56+78+90={a}+{b}=", "answer": a + b}) + "\n"
                   for a in range(4) for b in range(4))
    graph = dapo(data=long, steps=2, max_tokens=16)
    text = (tmp_path / "f.flow").read_text().replace('reward scored = "first.one"',
                                                     'reward scored = "first.one" { workers = 1 }')
    (tmp_path / "f.flow").write_text(text)
    fused = flowrl.load(str(tmp_path / "f.flow"))
    assert fused.node("rollout").attrs["fusion"] == "gen-infer:rollout" == fused.node("scores").attrs["fusion"]
    assert {n.id for n in fused.nodes if n.attrs.get("share_prefix")} == {"rollout", "ref_logp", "actor.update"}
    plain = flowrl.load(str(tmp_path / "f.flow"), no_pass=["share-prefix", "fuse-gen-inference"])
    a = flowrl.run(fused, out_dir=tmp_path / "fused", backend="local").metrics
    b = flowrl.run(plain, out_dir=tmp_path / "plain", backend="local").metrics
    assert any(r["filter/gen_rounds"] > 1 for r in a)
    assert graph.node("kept").attrs["refill"] == ("prompts", "rollout", "scores")
    for x, y in zip(numbers(a), numbers(b), strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-4), key


def _overlong(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """The paper's piecewise punishment, written out again here."""
    if length <= max_tokens - buffer:
        return 0.0
    return ((max_tokens - buffer) - length) / buffer * factor


def test_the_overlong_punishment_is_added_to_each_sample_s_reward(tmp_path: Path, dapo: Callable[..., Graph]) -> None:
    graph = dapo(reward="first.constant", steps=2, use=', keep = "all", overlong_buffer = 2, overlong_penalty = 0.5',
                 run=", log_samples = 64")
    rows = flowrl.run(graph, out_dir=tmp_path, backend="local").metrics
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 16
    for s in samples:  # max_tokens 3, buffer 2: a response of 2 tokens loses 0.25, of 3 the whole 0.5
        assert s["reward"] == pytest.approx(1.0 + _overlong(s["response_tokens"], 3, 2, 0.5))
    for step, r in enumerate(rows, 1):
        mine = [s for s in samples if s["step"] == step]
        assert r["response/overlong_penalty_mean"] == pytest.approx(sum(s["reward"] - 1 for s in mine) / len(mine))
        assert r["reward_mean"] == pytest.approx(1.0 + r["response/overlong_penalty_mean"])
        # cut at max_tokens: a bound from the lengths alone (a response of 3 tokens may end with its EOS)
        at_max = sum(s["response_tokens"] == 3 for s in mine) / len(mine)
        assert 0 < r["response/clip_ratio"] <= at_max


def test_responses_that_cannot_stop_are_all_cut_and_masked_out(tmp_path: Path, dapo: Callable[..., Graph]) -> None:
    """min_tokens = max_tokens bans EOS throughout: every response is cut (clip_ratio 1), and with mask_truncated
    nothing is trained on (no token in the loss)."""
    graph = dapo(reward="first.constant", steps=1, use=', keep = "all", min_tokens = 3, mask_truncated = true')
    (row,) = flowrl.run(graph, out_dir=tmp_path, backend="local").metrics
    assert row["response/clip_ratio"] == 1.0
    assert row["actor/loss"] == 0.0 and row["actor/grad_norm"] == 0.0
