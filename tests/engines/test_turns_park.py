"""Tests for suspending a multi-turn call while every live trajectory waits on its environment and resuming it
elsewhere (flowrl.engines.turns: `park`, `Suspended`, `resume_turns`; issue 26 item 5): the same samples as a call
never suspended, however often it is suspended, each resume re-prefilling a trajectory's history once (counted),
and parked rows that cross processes (pickled)."""

from __future__ import annotations

import itertools
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch

from flowrl.engines.turns import Suspended, TurnChunk, generate_turns, resume_turns, stream_turns

from .test_turns import ROWS, TEXTS, E, _model, _trajectories

ARGS: dict[str, Any] = {"n": 2, "max_tokens": 5, "max_turns": 3, "stop": (";",)}


def _whole(module: Any, tok: Any) -> Any:
    envs = E.ThreadEnvs(E.GuessEnv)
    try:
        return generate_turns(module, tok, [tok.encode(t) for t in TEXTS], ROWS, envs, seed=3, **ARGS)
    finally:
        envs.close()


def _suspending(module: Any, tok: Any, envs: Any, limit: int,
                opened: Callable[[Suspended], None] = lambda _s: None) -> tuple[list[TurnChunk], list[Suspended]]:
    """Run with `park` saying yes to the first `limit` chances, each suspension resumed (its rows pickled and
    back, as to another process) until every trajectory is done."""
    chances = itertools.count()

    def park(waits: list[float]) -> bool:
        assert waits and all(w >= 0 for w in waits)
        return next(chances) < limit

    chunks: list[TurnChunk] = []
    stops: list[Suspended] = []
    items: Any = stream_turns(module, tok, [tok.encode(t) for t in TEXTS], ROWS, envs, seed=3, park=park, **ARGS)
    while True:
        stop = None
        for item in items:
            if isinstance(item, Suspended):
                stop = item
            else:
                chunks.append(item)
        if stop is None:
            return chunks, stops
        stops.append(stop)
        opened(stop)
        rows = pickle.loads(pickle.dumps(stop.rows))
        items = resume_turns(module, tok, rows, stop.futures, envs, park=park, **ARGS)


def _check_same(chunks: list[TurnChunk], whole: Any) -> None:
    rows = [r for c in chunks for r in c.rows]
    assert sorted(rows) == list(range(len(whole.ended)))
    want = _trajectories(whole)
    for c in chunks:
        assert _trajectories(c.out) == [want[r] for r in c.rows]
        assert c.out.ended == [whole.ended[r] for r in c.rows]
        width = c.out.logprobs.shape[1]
        assert torch.equal(c.out.turns, whole.turns[c.rows])
        assert torch.equal(c.out.loss_mask, whole.loss_mask[c.rows, :width])
        assert torch.allclose(c.out.logprobs, whole.logprobs[c.rows, :width], atol=1e-5)
        assert torch.equal(c.out.turn_rewards, whole.turn_rewards[c.rows, :width])
        for k, r in enumerate(c.rows):  # a resumed call pads its prompts to its own rows' longest
            assert torch.equal(c.out.prompt_ids[k][c.out.prompt_mask[k] == 1], whole.prompt_ids[r][whole.prompt_mask[r] == 1])


class _Gated(E.GuessEnv):
    """GuessEnv whose steps each wait for a permit: while none is given, every live trajectory waits on its
    environment, so the loop has a chance to park at every turn."""

    def __init__(self, gate: threading.Semaphore) -> None:
        super().__init__()
        self.gate = gate

    def step(self, action: str) -> tuple[str, float, bool]:
        assert self.gate.acquire(timeout=60)  # a bound only so a broken loop fails, not hangs
        return super().step(action)


def test_suspended_once_and_resumed_samples_what_a_call_never_suspended_does() -> None:
    module, tok = _model()
    whole = _whole(module, tok)
    gate = threading.Semaphore(0)
    envs = E.ThreadEnvs(lambda: _Gated(gate), workers=8)
    try:  # suspended at the first turn's steps (gated); the gate then stays open
        chunks, stops = _suspending(module, tok, envs, limit=1, opened=lambda _s: gate.release(1 << 20))
    finally:
        envs.close()
    assert len(stops) == 1 and stops[0].rows
    _check_same(chunks, whole)
    # each parked trajectory prefilled its history once more: prompt + response so far but the token still to feed
    again = {p.place: len(p.prompt) + len(p.ids) - len(p.feed) for p in stops[0].rows}
    for c in chunks:
        for k, r in enumerate(c.rows):
            assert int(c.out.prefill_tokens[k]) == int(whole.prefill_tokens[r]) + again.get(r, 0)


def test_suspended_at_every_turn_still_samples_the_same() -> None:
    module, tok = _model()
    whole = _whole(module, tok)
    gate = threading.Semaphore(0)
    envs = E.ThreadEnvs(lambda: _Gated(gate), workers=8)
    try:
        chunks, stops = _suspending(module, tok, envs, limit=1 << 30, opened=lambda s: gate.release(len(s.rows)))
    finally:
        envs.close()
    assert len(stops) >= int(whole.turns.max())  # one suspension per turn at least (each a step every row waits on)
    _check_same(chunks, whole)
    assert all(s.idle_s <= s.wall_s for s in stops)
