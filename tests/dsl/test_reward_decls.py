"""Reward declarations with a block (`workers`, `timeout`, `on_error`) and rewards served over HTTP."""

from __future__ import annotations

from collections.abc import Callable
from textwrap import dedent

from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_text

REST = """
model actor : policy { source = "tiny:gpt2" }
model ref : reference { source = actor }
data prompts = jsonl("data/arith.jsonl")
use grpo(reward = r, group = 2)
"""


def flow(reward_line: str) -> str:
    return reward_line + "\n" + REST


def test_a_reward_block_and_an_http_reward_compile_and_print(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(flow('reward r = "flowrl.rewards.arith_exact" { workers = 4, timeout = 5, on_error = "zero" }\n'
                        'reward judge = http("http://127.0.0.1:8000/score") { batch = 8, retries = 1 }'))
    r, judge = g.rewards
    assert (r.kind, r.target, dict(r.options)) == ("python", "flowrl.rewards.arith_exact",
                                                   {"workers": 4, "timeout": 5.0, "on_error": "zero"})
    assert (judge.kind, judge.target, judge.batched) == ("http", "http://127.0.0.1:8000/score", True)
    assert dict(judge.options) == {"batch": 8, "timeout": 10.0, "retries": 1, "concurrency": 4, "on_error": "fail"}
    text = to_text(g)
    assert 'reward r = flowrl.rewards.arith_exact { workers = 4, timeout = 5.0, on_error = "zero" }' in text
    assert 'reward judge = http("http://127.0.0.1:8000/score") (batched) { batch = 8, timeout = 10.0, ' in text


def test_a_reward_without_a_block_keeps_no_options(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(flow('reward r = "flowrl.rewards.arith_exact"'))
    assert dict(g.rewards[0].options) == {} and "{" not in to_text(g).splitlines()[3]


def test_overrides_reach_a_reward_block(compile_ok: Callable[..., Graph]) -> None:
    g = compile_ok(flow('reward r = "flowrl.rewards.arith_exact"'), {"r.workers": "2", "r.timeout": "3"})
    assert dict(g.rewards[0].options) == {"workers": 2, "timeout": 3.0}


def test_every_reward_block_error_is_located(compile_error: Callable[..., str]) -> None:
    text = compile_error(flow('reward r = "flowrl.rewards.arith_exact" { timeout = 5, on_error = "skip", '
                              'workerz = 1 }\nreward j = htp("127.0.0.1:9")\nreward k = http("127.0.0.1:9")'))
    assert text == dedent('''\
        t.flow:1:67: error: `on_error` must be one of fail, zero
            reward r = "flowrl.rewards.arith_exact" { timeout = 5, on_error = "skip", workerz = 1 }
                                                                              ^^^^^^
        t.flow:1:75: error: unknown reward key `workerz`
            reward r = "flowrl.rewards.arith_exact" { timeout = 5, on_error = "skip", workerz = 1 }
                                                                                      ^^^^^^^
        hint: did you mean `workers`?
        t.flow:2:12: error: unknown reward kind `htp`
            reward j = htp("127.0.0.1:9")
                       ^^^
        hint: did you mean `http`?
        t.flow:3:17: error: `http` takes a URL starting with http:// or https://, got "127.0.0.1:9"
            reward k = http("127.0.0.1:9")
                            ^^^^^^^^^^^^^
        hint: write `http("http://127.0.0.1:8000/score")`''')
