"""The HTTP reward client against real local servers: batching, retries with back-off, and a clear error for each
way a service fails (refused, slow, 5xx, 4xx, garbage, the wrong number of scores)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.errors import RewardError
from flowrl.rewards.http import HttpReward, RewardHttpError

from .conftest import Service, score_lengths

Start = Callable[[Callable[[dict[str, Any]], tuple[int, bytes]]], Service]


def test_batches_are_posted_and_scores_come_back_in_order(service: Start) -> None:
    svc = service(score_lengths)
    client = HttpReward(svc.url, batch=2, concurrency=2)
    assert client(["p"] * 5, ["a", "bb", "ccc", "", "eeeee"], [{"answer": i} for i in range(5)]) == [1, 2, 3, 0, 5]
    assert svc.requests == 3  # batches of 2, 2 and 1


def test_a_bare_list_is_accepted(service: Start) -> None:
    svc = service(lambda body: (200, json.dumps([0.5] * len(body["prompts"])).encode()))
    assert HttpReward(svc.url)(["p", "q"], ["a", "b"]) == [0.5, 0.5]


def test_a_500_is_retried_with_back_off(service: Start) -> None:
    calls: list[int] = []

    def once_then_ok(body: dict[str, Any]) -> tuple[int, bytes]:
        calls.append(1)
        return (500, b"overloaded") if len(calls) == 1 else score_lengths(body)

    svc = service(once_then_ok)
    assert HttpReward(svc.url, retries=2, backoff=0.01)(["p"], ["abc"]) == [3.0]
    assert svc.requests == 2


def test_a_500_every_time_fails_after_the_retries(service: Start) -> None:
    svc = service(lambda body: (500, b"internal error"))
    with pytest.raises(RewardHttpError) as e:
        HttpReward(svc.url, retries=1, backoff=0.01)(["p"], ["a"])
    assert str(e.value) == f"{svc.url}: HTTP 500 Internal Server Error: 'internal error' (2 tries)"


def test_a_4xx_fails_at_once(service: Start) -> None:
    svc = service(lambda body: (404, b"no such route"))
    with pytest.raises(RewardHttpError) as e:
        HttpReward(svc.url, retries=3, backoff=0.01)(["p"], ["a"])
    assert str(e.value) == f"{svc.url}: HTTP 404 Not Found: 'no such route'" and svc.requests == 1


def test_a_slow_service_times_out(service: Start) -> None:
    """The handler waits for an event the test only sets at teardown: the client cannot get an answer in time."""
    svc = service(lambda body: (svc.release.wait(), score_lengths(body))[1])
    with pytest.raises(RewardHttpError) as e:
        HttpReward(svc.url, timeout=0.3, retries=0)(["p"], ["a"])
    assert str(e.value) == f"{svc.url}: timed out after 0.3 s (1 try)"


@pytest.mark.parametrize("answer,message", [
    (b"<html>oops</html>", "the answer is not JSON: b'<html>oops</html>'"),
    (b'{"score": 1}', 'the answer has no list of scores (expected {"scores": [...]} or a list): b\'{"score": 1}\''),
    (b'{"scores": [1, 2, 3]}', "3 scores for 2 samples"),
    (b'{"scores": [1, "high"]}', "score 1 is 'high', not a finite number"),
])
def test_a_malformed_answer_is_a_clear_error(service: Start, answer: bytes, message: str) -> None:
    svc = service(lambda body: (200, answer))
    with pytest.raises(RewardHttpError) as e:
        HttpReward(svc.url)(["p", "q"], ["a", "b"])
    assert str(e.value) == f"{svc.url}: {message}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_is_retried_then_named() -> None:
    url = f"http://127.0.0.1:{_free_port()}/score"  # nothing listens there
    with pytest.raises(RewardHttpError) as e:
        HttpReward(url, retries=1, backoff=0.01)(["p"], ["a"])
    assert str(e.value) == f"{url}: connection refused (2 tries)"


# -- through a run ------------------------------------------------------------------------------------------------

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }}
model ref : reference {{ source = actor }}
reward judge = http("{url}") {{ batch = 8, timeout = 5, retries = 1 }}
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use grpo(reward = judge, group = 4, max_tokens = 3, kl_coef = 0.01)
run {{ steps = 3, seed = 3, checkpoint_every = 1 }}
"""


def _flow(tmp: Path, url: str) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / "judge.flow"
    path.write_text(FLOW.format(url=url))
    return path


def test_a_run_scores_with_the_service(service: Start, tmp_path: Path) -> None:
    seen: list[str] = []

    def record(body: dict[str, Any]) -> tuple[int, bytes]:
        seen.extend(body["responses"])
        return score_lengths(body)

    svc = service(record)
    rows = flowrl.run(flowrl.load(str(_flow(tmp_path, svc.url))), out_dir=tmp_path / "out").metrics
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert svc.requests == 3 * 2 and len(seen) == 3 * 16  # 16 samples a step, in batches of 8
    for step, row in enumerate(rows):  # each step's reward is the mean of the service's scores for its samples
        assert row["reward_mean"] == pytest.approx(sum(map(len, seen[16 * step:16 * step + 16])) / 16)


def test_a_service_that_goes_away_fails_the_step_and_keeps_the_run(service: Start, tmp_path: Path) -> None:
    svc = service(score_lengths)
    down = {"now": False}
    svc.answer = lambda body: (503, b"going down") if down["now"] else score_lengths(body)

    def on_step(step: int, row: object) -> None:
        down["now"] = True  # from step 2 on, every request gets a 503

    out = tmp_path / "out"
    with pytest.raises(RewardError) as e:
        flowrl.run(flowrl.load(str(_flow(tmp_path, svc.url))), out_dir=out, on_step=on_step)
    text = e.value.render()
    assert f"error: reward 'judge' failed: {svc.url}: HTTP 503 Service Unavailable: 'going down' (2 tries)" in text
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001.pt"]
