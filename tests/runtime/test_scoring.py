"""Rewards scored by worker processes: parallel and equal to inline scoring; a sample that hangs or kills its
worker fails the step with a message naming the reward, the sample and what happened, keeping what the run had
written, or, with `on_error = "zero"`, scores 0, is counted, and the run goes on with a fresh worker. A `timeout`
alone means one worker; `on_error` holds for inline rewards too; a wrong signature and an unavailable
`sandbox = "strict"` are errors at the reward's line before the first step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl.errors import FlowError, RewardError
from flowrl.rewards import sandbox

REWARDS = '''
import os, signal, threading
from pathlib import Path
import flowrl

HERE = Path(__file__).parent


def _armed():  # the test arms the bad behaviour after step 1 by writing this file
    return (HERE / "armed").exists()


@flowrl.reward("hangs")
def hangs(prompt, response, **_):
    if _armed() and prompt.startswith("1"):
        threading.Event().wait()  # never returns: only the timeout ends it
    return float(len(response))


@flowrl.reward("crashes")
def crashes(prompt, response, **_):
    if _armed() and prompt.startswith("1"):
        os.kill(os.getpid(), signal.SIGSEGV)
    return float(len(response))


@flowrl.reward("raises")
def raises(prompt, response, **_):
    if _armed() and prompt.startswith("1"):
        raise ValueError("no score for this one")
    return float(len(response))


@flowrl.reward("raises_batched", batched=True)
def raises_batched(prompts, responses, **_):
    if _armed() and any(p.startswith("1") for p in prompts):
        raise ValueError("no scores for this batch")
    return [float(len(r)) for r in responses]


@flowrl.reward("nan_sometimes")
def nan_sometimes(prompt, response, **_):
    return float("nan") if _armed() and prompt.startswith("1") else float(len(response))


@flowrl.reward("one_argument")
def one_argument(response):
    return float(len(response))


@flowrl.reward("plain")
def plain(prompt, response, **_):
    return float(len(response)) + 0.5 * prompt.count("1")


@flowrl.reward("noted")
def noted(prompt, response, **_):  # says why, as code_tests does: a failed test per sample, two for prompts of a 1
    from flowrl.rewards.graded import Graded
    return Graded(0.5, {"failed/assert": 1, **({"failed/timeout": 2} if "1" in prompt else {})})
'''

FLOW = """
import "my_rewards"
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }}
model ref : reference {{ source = actor }}
reward r = "{reward}" {block}
data prompts = jsonl("data.jsonl") {{ batch = 4, shuffle = false }}
use grpo(reward = r, group = 4, max_tokens = 3, kl_coef = 0.01)
run {{ steps = 3, seed = 3, checkpoint_every = 1 }}
"""


def _flow(tmp: Path, reward: str, block: str) -> Path:
    sys.modules.pop("my_rewards", None)  # inline rewards import it here: this test's copy, armed by this test
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "my_rewards.py").write_text(REWARDS)
    path = tmp / f"{reward}.flow"
    path.write_text(FLOW.format(reward=reward, block=block))
    return path


def _arm(tmp: Path) -> object:
    def on_step(step: int, row: object) -> None:
        if step == 1:
            (tmp / "armed").write_text("")
    return on_step


def _scores(metrics: list[dict]) -> list[float]:
    return [r["reward_mean"] for r in metrics]


def test_worker_processes_score_as_inline_scoring_does(tmp_path: Path) -> None:
    inline = flowrl.run(flowrl.load(str(_flow(tmp_path, "plain", ""))), out_dir=tmp_path / "a").metrics
    pooled = flowrl.run(flowrl.load(str(_flow(tmp_path, "plain", "{ workers = 2, timeout = 30 }"))),
                        out_dir=tmp_path / "b").metrics
    assert _scores(pooled) == _scores(inline)
    assert all(r["reward/r/errors"] == 0 and r["reward/r/timeouts"] == 0 for r in pooled)


@pytest.mark.parametrize("reward,block,what", [
    ("hangs", "{ workers = 2, timeout = 0.5 }", "timed out after 0.5 s"),
    ("hangs", "{ timeout = 0.5 }", "timed out after 0.5 s"),  # a timeout alone: one worker, which it can stop
    ("crashes", "{ workers = 2, timeout = 0.5 }", "worker died: signal 11 (SIGSEGV)")])
def test_a_sample_that_hangs_or_kills_its_worker_fails_the_step_and_keeps_the_run(
        tmp_path: Path, reward: str, block: str, what: str) -> None:
    out = tmp_path / "out"
    graph = flowrl.load(str(_flow(tmp_path, reward, block)))
    with pytest.raises(RewardError) as err:
        flowrl.run(graph, out_dir=out, on_step=_arm(tmp_path))
    text = err.value.render()
    assert "while executing scores = reward(rollout)" in text
    assert f"error: reward 'r' {what} on sample " in text
    assert "hint: prompt='1+" in text  # the sample's prompt and response
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # step 1 is kept, and its checkpoint
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001.pt"]


@pytest.mark.parametrize("reward,counter", [("hangs", "reward/r/timeouts"), ("crashes", "reward/r/errors")])
def test_on_error_zero_scores_the_sample_zero_counts_it_and_goes_on(tmp_path: Path, reward: str,
                                                                    counter: str) -> None:
    graph = flowrl.load(str(_flow(tmp_path, reward, '{ workers = 2, timeout = 0.5, on_error = "zero" }')))
    rows = flowrl.run(graph, out_dir=tmp_path / "out", on_step=_arm(tmp_path)).metrics
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 2 holds prompts 1+1, 1+2, 2+0, 2+1 (four samples each): the eight of the first two are zeroed; the
    # killed workers were replaced, so step 3 (2+2, 0+0, 0+1, 0+2) is scored in full again
    assert [r[counter] for r in rows] == [0, 8, 0]


@pytest.mark.parametrize("reward", ["raises", "raises_batched", "nan_sometimes"])
def test_on_error_zero_holds_for_inline_rewards_too(tmp_path: Path, reward: str) -> None:
    graph = flowrl.load(str(_flow(tmp_path, reward, '{ on_error = "zero" }')))
    rows = flowrl.run(graph, out_dir=tmp_path / "out", on_step=_arm(tmp_path)).metrics
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the batched reward fails for the whole of step 2 (16 samples), the others for its 8 samples of 1+1, 1+2
    assert [r["reward/r/errors"] for r in rows] == [0, 16 if reward == "raises_batched" else 8, 0]


def test_an_inline_reward_that_raises_fails_the_step_by_default(tmp_path: Path) -> None:
    with pytest.raises(RewardError, match="reward 'r' raised ValueError: no score for this one on sample"):
        flowrl.run(flowrl.load(str(_flow(tmp_path, "raises", ""))), out_dir=tmp_path / "out",
                   on_step=_arm(tmp_path))


def test_a_reward_with_the_wrong_signature_says_the_expected_one(tmp_path: Path) -> None:
    path = _flow(tmp_path, "one_argument", "")
    with pytest.raises(RewardError) as err:
        flowrl.run(flowrl.load(str(path)), out_dir=tmp_path / "out")
    assert err.value.render() == (
        f"{path}:5:1: error: reward 'r': 'one_argument' takes (response), not the prompt and the response\n"
        '    reward r = "one_argument" \n'
        "    ^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "hint: a reward is `fn(prompt, response, **row) -> float` (`row`: the data row's other columns)")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # said before the first step


def test_the_sandbox_key_is_checked(tmp_path: Path) -> None:
    with pytest.raises(FlowError, match="`sandbox` must be one of auto, strict"):
        flowrl.load(str(_flow(tmp_path, "plain", '{ sandbox = "strictest" }')))


def test_sandbox_strict_refuses_where_isolation_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine without namespaces: the probe's finding replaced, the run's own check is what is tested."""
    missing = sandbox.Isolation(False, ("root (running as uid 1000: namespaces and a user of its own need it)",))
    monkeypatch.setattr(sandbox, "_FOUND", [missing])
    path = _flow(tmp_path, "plain", '{ sandbox = "strict" }')
    with pytest.raises(RewardError) as err:
        flowrl.run(flowrl.load(str(path)), out_dir=tmp_path / "out")
    assert err.value.render().startswith(
        f"{path}:5:1: error: reward 'r' asks for `sandbox = \"strict\"`, which this machine cannot give\n"
        '    reward r = "plain" { sandbox = "strict" }\n')
    assert "hint: code_tests runs solutions WITHOUT isolation" in err.value.render()
    assert "Missing: root (running as uid 1000" in err.value.render()


@pytest.mark.skipif(not sandbox.isolation().strict, reason=sandbox.isolation().describe())
def test_sandbox_strict_runs_where_isolation_is_there(tmp_path: Path) -> None:
    rows = flowrl.run(flowrl.load(str(_flow(tmp_path, "plain", '{ sandbox = "strict" }'))),
                      out_dir=tmp_path / "out", steps=1).metrics
    assert [r["step"] for r in rows] == [1]


def test_code_tests_without_isolation_warns_before_the_first_step(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    missing = sandbox.Isolation(False, ("root (running as uid 1000)", "unprivileged user namespaces: refused"))
    monkeypatch.setattr(sandbox, "_FOUND", [missing])
    monkeypatch.setattr(sandbox, "_WARNED", [])
    graph = flowrl.load(str(_flow(tmp_path, "code_tests", "")))
    seen: list[int] = []
    with pytest.warns(sandbox.SandboxWarning, match="WITHOUT isolation.*Missing: root") as caught:
        flowrl.run(graph, out_dir=tmp_path / "out", steps=1, on_step=lambda step, row: seen.append(len(caught)))
    assert seen == [1]  # the warning was there when step 1 ended: said at the start, once


@pytest.mark.parametrize("block", ["", "{ workers = 2, timeout = 30 }", '{ on_error = "zero" }'])
def test_the_notes_a_reward_returns_are_summed_into_the_steps_metrics(tmp_path: Path, block: str) -> None:
    """`reward/NAME/KEY` per step, inline (failing on error or not) or from workers: step 1 holds 0+0, 0+1, 0+2,
    1+0 (four samples each), step 2 1+1, 1+2, 2+0, 2+1."""
    rows = flowrl.run(flowrl.load(str(_flow(tmp_path, "noted", block))), out_dir=tmp_path / "out", steps=2).metrics
    assert [r["reward/r/failed/assert"] for r in rows] == [16, 16]
    assert [r["reward/r/failed/timeout"] for r in rows] == [2 * 8, 2 * 12]
