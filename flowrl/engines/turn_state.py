"""The state of multi-turn generation (flowrl.engines.turns): what a call returns (`TurnOutput`, handed out in
`TurnChunk`s), each trajectory's state while it runs (`Traj`), and what a suspended call leaves to resume
elsewhere (`Parked` rows in a `Suspended`; serverless instances give their device back while tools run)."""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flowrl.engines.turn_cache import RowKV
from flowrl.envs.protocol import Outcome

__all__ = ["Parked", "Suspended", "Traj", "TurnChunk", "TurnOutput", "park_row", "resumed", "turn_output"]


@dataclass(frozen=True)
class TurnOutput:
    """Trajectories: the n samples of prompt 0 first, then prompt 1, ...; N = B * n rows, tensors on CPU.
    A response is [reset observation][action 0][observation 0][action 1]..."""

    prompt_ids: Tensor  # (N, P) left-padded
    prompt_mask: Tensor  # (N, P)
    response_ids: Tensor  # (N, T) right-padded
    response_mask: Tensor  # (N, T) 1 on every real token, actions and observations
    loss_mask: Tensor  # (N, T) 1 on generated tokens only
    logprobs: Tensor  # (N, T) sampling log-probs; 0 on observations and pads
    turn_index: Tensor  # (N, T) long: turn k on its action and the observation after it (reset obs: 0); -1 pads
    turn_rewards: Tensor  # (N, T) float: turn k's reward at its last action token
    response_lens: Tensor  # (N,)
    prompt_index: Tensor  # (N,)
    turns: Tensor  # (N,) long: actions taken
    calls: Tensor  # (N,) long: steps answered with done False and no error
    errors: Tensor  # (N,) long: reset and step outcomes with an error
    timeouts: Tensor  # (N,) long
    prefill_tokens: Tensor  # (N,) long: prompt + observation tokens
    step_seconds: list[list[float]]  # per trajectory: each environment call's Outcome.seconds (reset first)
    ended: list[str]  # one of ENDED per trajectory
    idle_s: float  # seconds with nothing to decode while environments were pending
    wall_s: float  # seconds of the whole call


@dataclass(frozen=True)
class TurnChunk:
    """Trajectories `stream_turns` hands out together: `rows`, their places in the call (prompt i's sample j is
    row i * n + j), ascending; `out` their TurnOutput (its `prompt_index` the call's; `idle_s` and `wall_s` the
    call's seconds since the previous chunk, so the chunks' sums are the call's)."""

    rows: list[int]
    out: TurnOutput


@dataclass
class Traj:
    """One trajectory's state: its tokens so far and where it is (decoding, waiting on its env, ended)."""

    key: Hashable
    cap: int  # most response tokens (max_total)
    prefill: int  # prompt tokens prefilled
    place: int = 0  # its row in the call (prompt i's sample j: i * n + j)
    prompt: tuple[int, ...] = ()
    ids: list[int] = field(default_factory=list)
    gen: list[int] = field(default_factory=list)  # 1 on sampled tokens
    logp: list[float] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    reward: dict[int, float] = field(default_factory=dict)  # response index -> turn reward
    kv: RowKV | None = None  # kept cache while out of the batch
    logits: Tensor | None = None  # (V,) next-token scores, when known out of the batch
    feed: list[int] = field(default_factory=list)  # tokens to prefill before the next draw
    turn: int = 0  # actions taken
    t: int = 0  # tokens of the current turn
    turn_start: int = 0
    turn_end: str = ""  # why the last turn ended: "eos" | "stop" | "max_tokens" | "length"
    future: Future[Outcome] | None = None
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    step_s: list[float] = field(default_factory=list)
    ended: str = ""
    sent: float = 0.0  # when its pending environment call was sent (perf_counter)


@dataclass(frozen=True)
class Parked:
    """A trajectory taken out of a suspended call while its environment call is pending (`Suspended`): all it
    needs to go on anywhere (`resume_turns`) once that call's outcome is back: its tokens so far, its random
    streams and where it is in them, its turn count; its kept cache is dropped (re-prefilled on resume)."""

    key: Hashable
    place: int
    prompt: tuple[int, ...]
    cap: int
    prefill: int
    ids: tuple[int, ...]
    gen: tuple[int, ...]
    logp: tuple[float, ...]
    turn_of: tuple[int, ...]
    reward: tuple[tuple[int, float], ...]
    feed: tuple[int, ...]  # tokens to prefill before its observation (the action's last token, not yet fed)
    turn: int
    t: int
    turn_start: int
    turn_end: str
    calls: int
    errors: int
    timeouts: int
    step_s: tuple[float, ...]
    keys: tuple[tuple[int, int], ...]  # (max_turns, 2) its turns' random-stream keys


@dataclass(frozen=True)
class Suspended:
    """What a call suspended by `park` ends with: its trajectories still waiting on environments (`futures`: their
    pending calls, where the caller holds the pool; a pool elsewhere answers by `Parked.key`), and the call's
    seconds since its last chunk."""

    rows: list[Parked]
    futures: list[Future[Outcome]]
    idle_s: float
    wall_s: float


def park_row(tr: Traj, keys: Tensor) -> Parked:
    """`tr` as a parked row: its state without its cache and pending call; `keys`: (max_turns, 2) its streams."""
    return Parked(tr.key, tr.place, tr.prompt, tr.cap, tr.prefill, tuple(tr.ids), tuple(tr.gen), tuple(tr.logp),
                  tuple(tr.turn_of), tuple(tr.reward.items()), tuple(tr.feed), tr.turn, tr.t, tr.turn_start,
                  tr.turn_end, tr.calls, tr.errors, tr.timeouts, tuple(tr.step_s),
                  tuple((int(a), int(b)) for a, b in keys.tolist()))


def resumed(p: Parked, future: Future[Outcome], sent: float) -> Traj:
    """A parked row's state again, waiting on `future` (sent at `sent`), its cache to be prefilled."""
    return Traj(p.key, p.cap, p.prefill, p.place, p.prompt, list(p.ids), list(p.gen), list(p.logp), list(p.turn_of),
                dict(p.reward), feed=list(p.feed), turn=p.turn, t=p.t, turn_start=p.turn_start, turn_end=p.turn_end,
                future=future, calls=p.calls, errors=p.errors, timeouts=p.timeouts, step_s=list(p.step_s), sent=sent)


def turn_output(trajs: list[Traj], n: int, columns: int, pad: int, idle: float, wall: float) -> TurnOutput:
    """The TurnOutput of `trajs` (their prompts left-padded to `columns`)."""
    rows = len(trajs)
    width = max(1, max((len(tr.ids) for tr in trajs), default=1))
    resp = torch.full((rows, width), pad, dtype=torch.long)
    resp_mask = torch.zeros((rows, width), dtype=torch.long)
    loss = torch.zeros((rows, width), dtype=torch.long)
    logp = torch.zeros((rows, width), dtype=torch.float32)
    turn_index = torch.full((rows, width), -1, dtype=torch.long)
    rewards = torch.zeros((rows, width), dtype=torch.float32)
    for r, tr in enumerate(trajs):
        k = len(tr.ids)
        resp[r, :k] = torch.tensor(tr.ids, dtype=torch.long)
        resp_mask[r, :k] = 1
        loss[r, :k] = torch.tensor(tr.gen, dtype=torch.long)
        logp[r, :k] = torch.tensor(tr.logp, dtype=torch.float32)
        turn_index[r, :k] = torch.tensor(tr.turn_of, dtype=torch.long)
        for at, value in tr.reward.items():
            rewards[r, at] = value

    def longs(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long)

    index = longs([tr.place for tr in trajs])
    prompt_ids = torch.full((rows, columns), pad, dtype=torch.long)
    prompt_mask = torch.zeros((rows, columns), dtype=torch.long)
    for r, tr in enumerate(trajs):
        if tr.prompt:
            prompt_ids[r, columns - len(tr.prompt) :] = torch.tensor(tr.prompt, dtype=torch.long)
            prompt_mask[r, columns - len(tr.prompt) :] = 1
    return TurnOutput(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        response_ids=resp, response_mask=resp_mask, loss_mask=loss, logprobs=logp, turn_index=turn_index,
        turn_rewards=rewards, response_lens=resp_mask.sum(1), prompt_index=index // n,
        turns=longs([tr.turn for tr in trajs]), calls=longs([tr.calls for tr in trajs]),
        errors=longs([tr.errors for tr in trajs]), timeouts=longs([tr.timeouts for tr in trajs]),
        prefill_tokens=longs([tr.prefill for tr in trajs]), step_seconds=[tr.step_s for tr in trajs],
        ended=[tr.ended for tr in trajs], idle_s=idle, wall_s=wall,
    )  # fmt: skip
