"""Tests for flowrl.engines.turns.stream_turns (pass fuse-gen-inference on an env generate): finished trajectories
are handed out before the loop waits on the others' environments, every trajectory exactly once, the same samples
as generate_turns, and the caller's time with a chunk counted as the call's wall, never as idle."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import torch

from flowrl.engines.turns import TurnChunk, generate_turns, stream_turns

from .test_turns import ROWS, TEXTS, E, _model, _trajectories

ARGS: dict[str, Any] = {"n": 2, "max_tokens": 5, "max_turns": 3, "stop": (";",), "seed": 3}


def _stream(module: Any, tok: Any, envs: Any, texts: list[str] = TEXTS, rows: list[dict[str, Any]] = ROWS,
            **kw: Any) -> Any:
    return stream_turns(module, tok, [tok.encode(t) for t in texts], rows, envs, **(ARGS | kw))


def test_chunks_hold_every_trajectory_once_with_the_samples_of_generate_turns() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(E.GuessEnv)
    try:
        whole = generate_turns(module, tok, [tok.encode(t) for t in TEXTS], ROWS, envs, **ARGS)
    finally:
        envs.close()
    seeds = itertools.count(0)
    slow = E.ThreadEnvs(lambda: E.SlowEnv(next(seeds)), workers=8)  # random latency: trajectories end apart
    try:
        chunks: list[TurnChunk] = list(_stream(module, tok, slow))
    finally:
        slow.close()
    assert len(chunks) >= 2  # handed out along the way, not only at the end
    rows = [r for c in chunks for r in c.rows]
    assert sorted(rows) == list(range(len(TEXTS) * 2)) and all(c.rows == sorted(c.rows) for c in chunks)
    want = _trajectories(whole)
    for c in chunks:
        assert _trajectories(c.out) == [want[r] for r in c.rows]
        assert c.out.prompt_index.tolist() == [r // 2 for r in c.rows]
        assert torch.equal(c.out.prompt_ids, whole.prompt_ids[c.rows])
        assert c.out.ended == [whole.ended[r] for r in c.rows]
        width = c.out.logprobs.shape[1]
        assert torch.allclose(c.out.logprobs, whole.logprobs[c.rows, :width], atol=1e-5)
        assert torch.equal(c.out.prefill_tokens, whole.prefill_tokens[c.rows])
        assert 0 <= c.out.idle_s <= c.out.wall_s


class _Relay:
    """Trajectory 0 ends at its first step; trajectory 1's first step answers only once the caller holds
    trajectory 0 (a loop that waited on every environment before handing anything out would never get there)."""

    def __init__(self) -> None:
        self.handed, self.answered = threading.Event(), threading.Event()
        self.unblocked: bool | None = None
        self.ids = itertools.count()


class _Env:
    def __init__(self, relay: _Relay) -> None:
        self.relay, self.first = relay, next(relay.ids) == 0

    def reset(self, row: Any) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.first:
            return "", 1.0, True
        self.relay.unblocked = self.relay.handed.wait(timeout=60)  # a bound only so a broken loop fails, not hangs
        self.relay.answered.set()
        return "", 0.0, True


def test_a_finished_trajectory_is_handed_out_while_another_waits_on_its_environment() -> None:
    module, tok = _model()
    relay = _Relay()
    envs = E.ThreadEnvs(lambda: _Env(relay), workers=1)  # one worker: resets in order, trajectory 0 first
    got: list[list[int]] = []
    try:
        for c in _stream(module, tok, envs, texts=TEXTS[:2], rows=ROWS[:2], n=1):
            got.append(c.rows)
            if c.rows == [0]:
                relay.handed.set()
                assert relay.answered.wait(timeout=60)  # the caller holds the chunk until the other one answered
    finally:
        envs.close()
    assert relay.unblocked is True and got == [[0], [1]]


def test_the_callers_time_with_a_chunk_is_wall_not_idle() -> None:
    module, tok = _model()
    seeds = itertools.count(0)
    envs = E.ThreadEnvs(lambda: E.SlowEnv(next(seeds)), workers=8)
    held = 0.0
    chunks = []
    began = time.perf_counter()
    try:
        for c in _stream(module, tok, envs):
            t0 = time.perf_counter()
            chunks.append(c)
            # real forward work on the trajectories handed out: a full forward over each, as old_logp runs
            with torch.inference_mode():
                module(input_ids=torch.cat([c.out.prompt_ids, c.out.response_ids], 1))
            held += time.perf_counter() - t0
    finally:
        envs.close()
    total = time.perf_counter() - began
    idle = sum(c.out.idle_s for c in chunks)
    wall = sum(c.out.wall_s for c in chunks)
    assert wall <= total and idle + held <= wall + 1e-6  # held and idle are disjoint parts of the call's wall


def test_without_hand_out_one_chunk_in_row_order() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(E.GuessEnv)
    try:
        (only,) = list(_stream(module, tok, envs, hand_out=False))
    finally:
        envs.close()
    assert only.rows == list(range(len(TEXTS) * 2))
