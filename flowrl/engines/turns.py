"""Multi-turn generation for the torch engine (flowrl.engines): one state machine per sample on the continuous
decode batch, acting in an environment (flowrl.envs) between turns.

`generate_turns` is `generate` for trajectories. A sample decodes its turn in the shared batch; at a stop text,
EOS or `max_tokens` it leaves the batch with its KV cache kept (flowrl.engines.turn_cache) and its action goes
to `Envs.step`, a future. The others keep decoding; between decode steps the loop looks at `Future.done()`, and
a sample whose observation is back has only its new tokens (the action's last token, not yet fed, and the
observation's own `tokenizer.encode`) prefilled onto its kept cache, together with any others returning at that
step, then rejoins the batch. Only when nothing is left to decode does the loop wait on the environments (that
wait is `idle_s`). Token-in/token-out: the ids returned are exactly the ids sampled and the ids observed, and no
history is re-tokenised or run again (`prefill_tokens` = prompt + observations).

Sampling: a trajectory's token t of turn k draws from the stream of (seed, prompt slot, sample, turn k) at step
t (`turn_keys`, over flowrl.engines.sampling's keys), so samples depend on neither the batch make-up nor the
environments' timing. `overlap=False` is the barrier loop (the benchmark's baseline), the same code with the
polling switched off: every live sample ends its turn, then every pending environment call is awaited, then all
observations are prefilled together: the same samples, later.

`stream_turns` is the same loop handing finished trajectories out as it goes (`TurnChunk`s; pass
fuse-gen-inference): whenever nothing is left to decode and environments are pending, the trajectories finished
since the last hand-out go to the caller first, so the forwards over them (old/reference log-probs, values,
scores) run in the time the loop would otherwise spend waiting; that time is busy, not `idle_s`.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.engines.generation import check_sampling_args, left_pad_prompts, prefill_prompts
from flowrl.engines.sampling import MASK32, Sampler, mix32, row_keys, sampling_seed, slots_of
from flowrl.engines.turn_cache import RowKV, pack, packed_rows, row_length, unpack
from flowrl.envs.protocol import Envs, Outcome
from flowrl.models.build import cache_kw
from flowrl.models.tokenizer import Tokenizer

__all__ = ["ENDED", "TurnChunk", "TurnOutput", "generate_turns", "stream_turns", "turn_keys"]

ENDED = ("done", "max_turns", "eos", "length", "error")
_TURN_SALTS = (0x27D4EB2F, 0x165667B1)


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


def turn_keys(keys: Tensor, turns: Tensor | int) -> Tensor:
    """(R, 2) stream keys of turn `turns` (an int, or (R,)) of the rows keyed `keys` (flowrl.engines.sampling's
    `row_keys`): the same mixer, so each turn of each sample is its own independent stream."""
    t = torch.as_tensor(turns, dtype=torch.long, device=keys.device).expand(keys.shape[0])
    words = [mix32(mix32((t & MASK32) ^ salt) ^ keys[:, w]) for w, salt in enumerate(_TURN_SALTS)]
    return torch.stack(words, dim=1)


@dataclass
class _Traj:
    """One trajectory's state: its tokens so far and where it is (decoding, waiting on its env, ended)."""

    key: Hashable
    cap: int  # most response tokens (max_total)
    prefill: int  # prompt tokens prefilled
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


@dataclass
class _Batch:
    """The continuous decode batch: its members' rows in a buffered cache, rebuilt when rows join."""

    members: list[int]  # trajectory index of each row
    cache: Any
    attn: Tensor  # (R, capacity) 0 on each row's left padding
    length: int  # cache slots in use per row
    pos: Tensor  # (R,) position of each row's next fed token
    logits: Tensor  # (R, V) scores of each row's next token


@dataclass(frozen=True)
class _Limits:
    max_tokens: int
    max_turns: int
    stop: tuple[str, ...]
    eos: int
    pad: int


def generate_turns(module: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                   rows: Sequence[Mapping[str, Any]], envs: Envs, *, n: int = 1, max_tokens: int, max_turns: int,
                   max_total: int | None = None, stop: Sequence[str] = (), min_tokens: int = 0,
                   temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                   prompt_slots: Sequence[int] | None = None, overlap: bool = True,
                   device: str | torch.device = "cpu") -> TurnOutput:
    """Sample `n` trajectories per prompt in `envs` (one environment per trajectory, keyed (prompt slot, j),
    reset with `rows[i]`). A turn is at most `max_tokens` tokens and ends at a stop text (part of the action),
    EOS or `max_tokens`; every turn end calls the environment. A trajectory ends when the outcome says done
    ("done", or "error" when it carries an error), after `max_turns` actions ("max_turns"), at EOS ("eos"), or
    when the response would pass `max_total` tokens ("length"; default: the model's positions minus the prompt;
    an observation is appended only if one action token still fits after it). `min_tokens` bans EOS in each
    turn's first tokens."""
    (whole,) = stream_turns(module, tokenizer, prompts, rows, envs, n=n, max_tokens=max_tokens, max_turns=max_turns,
                            max_total=max_total, stop=stop, min_tokens=min_tokens, temperature=temperature,
                            top_p=top_p, seed=seed, prompt_slots=prompt_slots, overlap=overlap, device=device,
                            hand_out=False)
    return whole.out


def stream_turns(module: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                 rows: Sequence[Mapping[str, Any]], envs: Envs, *, n: int = 1, max_tokens: int, max_turns: int,
                 max_total: int | None = None, stop: Sequence[str] = (), min_tokens: int = 0,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 prompt_slots: Sequence[int] | None = None, overlap: bool = True,
                 device: str | torch.device = "cpu", hand_out: bool = True, chunk: int = 0) -> Iterator[TurnChunk]:
    """`generate_turns`' trajectories (the same samples), handed out as they finish: with `hand_out`, the ones
    finished so far each time nothing is left to decode while environments are pending (the caller's work on
    them fills that wait) and whenever `chunk` (> 0) of them are waiting to go; the rest at the end. Without
    `hand_out`, one chunk of every trajectory at the end."""
    check_sampling_args(prompts, n, max_tokens, min_tokens, temperature, top_p)
    if len(rows) != len(prompts):
        raise ValueError(f"generate_turns got {len(rows)} rows for {len(prompts)} prompts")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if any(not s for s in stop):
        raise ValueError("stop texts must be non-empty")
    started = time.perf_counter()
    dev = torch.device(device)
    lim = _Limits(max_tokens, max_turns, tuple(stop), tokenizer.eos_id, tokenizer.pad_id)
    slots = slots_of(prompt_slots, len(prompts))
    streams = row_keys(sampling_seed(seed, None), slots, n, dev)  # (N, 2)
    # Every turn's key of every trajectory, at once (the mixer costs per call, not per row).
    table = turn_keys(streams.repeat_interleave(max_turns, 0), torch.arange(max_turns, device=dev).repeat(len(streams)))
    table = table.view(len(streams), max_turns, 2)  # (N, max_turns, 2)
    positions = _positions(module)
    trajs: list[_Traj] = []
    for i, prompt in enumerate(prompts):
        room = positions - len(prompt) if positions else None
        caps = [c for c in (max_total, room) if c is not None]
        cap = min(caps) if caps else 1 << 30
        if cap < 1:
            raise ValueError(f"prompt {i} ({len(prompt)} tokens) leaves no room for a response")
        trajs += [_Traj((slots[i], j), cap, len(prompt)) for j in range(n)]
    sampler = Sampler(temperature, top_p, min_tokens, lim.eos)

    ids, mask = left_pad_prompts(prompts, lim.pad, dev)  # (B, P)
    with torch.inference_mode():
        pre = prefill_prompts(module, prompts, ids, mask, n=n, share=n > 1, extra=0, prefixes=None, pad=lim.pad)
        kvs = unpack(pre.cache, pre.mask, pre.mask.shape[1], range(len(trajs)))
    for i, tr in enumerate(trajs):
        tr.kv, tr.logits = kvs[i], pre.logits[i]
        tr.future = envs.reset(tr.key, rows[i // n])
    waiting = list(range(len(trajs)))
    batch: _Batch | None = None
    no_tokens = torch.zeros(0, dtype=torch.long, device=dev)
    clock = _Clock(started)
    finished: list[int] = []  # ended, not handed out yet
    while True:
        if batch is None:
            if finished and hand_out and waiting:  # the caller's work on them fills the wait below
                yield clock.chunk(trajs, finished, n, ids, mask, lim.pad)
                finished = []
            if not waiting:
                break
            began = time.perf_counter()
            wait([_future(trajs[i]) for i in waiting], return_when=FIRST_COMPLETED if overlap else ALL_COMPLETED)
            clock.idle += time.perf_counter() - began
        with torch.inference_mode():
            # The barrier loop looks at its environments only once the whole batch has ended its turns.
            joining: list[int] = []
            if waiting and (overlap or batch is None):
                back = [i for i in waiting if _future(trajs[i]).done()]
                returned = set(back)
                waiting = [i for i in waiting if i not in returned]
                joining = [i for i in back if _settle(trajs[i], _future(trajs[i]).result(), lim, tokenizer, envs)]
                finished += [i for i in back if trajs[i].ended]
            tokens = no_tokens
            if batch is not None:
                batch, tokens, leaving = _sample(sampler, table, trajs, batch, lim, tokenizer)
                for i in leaving:
                    tr = trajs[i]
                    tr.future = envs.step(tr.key, tokenizer.decode(tr.ids[tr.turn_start :]))
                    waiting.append(i)
            batch = _advance(module, trajs, batch, tokens, joining, lim)
        if hand_out and chunk > 0 and len(finished) >= chunk:
            yield clock.chunk(trajs, finished, n, ids, mask, lim.pad)
            finished = []
    if finished or not trajs:
        yield clock.chunk(trajs, finished, n, ids, mask, lim.pad)


class _Clock:
    """The call's seconds since the last hand-out: wall, and idle (nothing to decode, environments pending);
    the time the caller holds a chunk is the call's wall, never idle."""

    def __init__(self, started: float):
        self.mark, self.idle = started, 0.0

    def chunk(self, trajs: list[_Traj], rows: list[int], n: int, ids: Tensor, mask: Tensor, pad: int) -> TurnChunk:
        now = time.perf_counter()
        rows = sorted(rows)
        out = _output([trajs[i] for i in rows], rows, n, ids, mask, pad, self.idle, now - self.mark)
        self.mark, self.idle = now, 0.0
        return TurnChunk(rows, out)


def _future(tr: _Traj) -> Future[Outcome]:
    assert tr.future is not None
    return tr.future


def _settle(tr: _Traj, out: Outcome, lim: _Limits, tokenizer: Tokenizer, envs: Envs) -> bool:
    """Apply an environment's outcome to its trajectory: True when it goes on (its observation appended to
    `feed`, to be prefilled), False when it ended (its environment released)."""
    reset = tr.turn == 0
    tr.future = None
    tr.step_s.append(out.seconds)
    if out.error is not None:
        tr.errors += 1
        tr.timeouts += int(out.timed_out)
    if not reset:
        last = len(tr.ids) - 1  # the turn's last action token
        tr.reward[last] = tr.reward.get(last, 0.0) + float(out.reward)
        tr.calls += int(not out.done and out.error is None)
    obs = tokenizer.encode(out.observation) if not out.done else []
    if out.done:
        tr.ended = "error" if out.error is not None else "done"
    elif not reset and tr.turn_end == "eos":
        tr.ended = "eos"
    elif tr.turn >= lim.max_turns:
        tr.ended = "max_turns"
    elif len(tr.ids) + len(obs) >= tr.cap:  # no room for the observation and one more action token
        tr.ended = "length"
    if tr.ended:
        tr.kv = tr.logits = None
        tr.feed = []
        envs.release(tr.key)
        return False
    tr.ids += obs
    tr.gen += [0] * len(obs)
    tr.logp += [0.0] * len(obs)
    tr.turn_of += [max(tr.turn - 1, 0)] * len(obs)
    tr.feed += obs
    tr.prefill += len(obs)
    tr.turn_start, tr.t = len(tr.ids), 0
    return True


def _sample(sampler: Sampler, table: Tensor, trajs: list[_Traj], batch: _Batch, lim: _Limits,
            tokenizer: Tokenizer) -> tuple[_Batch | None, Tensor, list[int]]:
    """Sample one token for every row; rows whose turn ended leave the batch, their caches kept (their token is
    fed later, before their observation). Returns the batch of the staying rows (None if none), their (R,)
    tokens, still to be fed, and the leaving trajectories."""
    members = batch.members
    steps = torch.tensor([trajs[i].t for i in members], dtype=torch.long, device=batch.logits.device)
    turns = torch.tensor([trajs[i].turn for i in members], dtype=torch.long, device=table.device)
    keys = table[torch.tensor(members, dtype=torch.long, device=table.device), turns]  # (R, 2)
    tok, lp = sampler(batch.logits, steps, keys)
    tokens, logps = tok.tolist(), lp.tolist()
    stay: list[int] = []
    leave: list[int] = []
    for r, i in enumerate(members):
        tr = trajs[i]
        tr.ids.append(tokens[r])
        tr.gen.append(1)
        tr.logp.append(logps[r])
        tr.turn_of.append(tr.turn)
        tr.t += 1
        end = _turn_end(tr, tokens[r], lim, tokenizer)
        if end:
            tr.turn_end, tr.turn, tr.feed = end, tr.turn + 1, [tokens[r]]
            leave.append(r)
        else:
            stay.append(r)
    gone = [members[r] for r in leave]
    if not leave:
        return batch, tok, gone
    for i, kv in zip(gone, unpack(batch.cache, batch.attn, batch.length, leave), strict=True):
        trajs[i].kv = kv
    if not stay:
        return None, tok[:0], gone
    keep = torch.as_tensor(stay, dtype=torch.long, device=batch.attn.device)
    batch.cache.batch_select_indices(keep)
    batch.attn, batch.pos, batch.logits = batch.attn[keep], batch.pos[keep], batch.logits[keep]
    batch.members = [members[r] for r in stay]
    return batch, tok[keep], gone


def _advance(module: nn.Module, trajs: list[_Traj], batch: _Batch | None, tokens: Tensor, joining: list[int],
             lim: _Limits) -> _Batch | None:
    """Feed the batch's rows their sampled `tokens` (one decode step); prefill the `joining` trajectories' new
    tokens (the last action token and the observation) onto their kept caches, in a forward of their own (the
    batch's rows would otherwise each run as many padding tokens); then merge both into one batch. Returns the
    batch with every row's next-token scores."""
    if batch is not None:
        batch.length += 1
        out = module(input_ids=tokens[:, None], attention_mask=batch.attn[:, : batch.length],
                     position_ids=batch.pos[:, None], use_cache=True, **cache_kw(module, batch.cache))  # fmt: skip
        batch.logits = out.logits[:, -1].float()
        batch.pos = batch.pos + 1
    if not joining:
        return batch
    feeds = [trajs[i].feed for i in joining]
    grow = max(len(f) for f in feeds)  # 0 when every row joins with an empty reset observation
    kvs = [_kv(trajs[i]) for i in joining]
    # Joining alone, the rows keep max_tokens of room: at most that many steps before they leave or merge.
    cache, mask, width = pack(module, kvs, grow + lim.max_tokens)
    dev = mask.device
    start = torch.tensor([row_length(kv) for kv in kvs], dtype=torch.long, device=dev)  # (J,)
    ids = torch.full((len(feeds), grow), lim.pad, dtype=torch.long, device=dev)  # (J, grow) left-padded
    new = torch.zeros((len(feeds), grow), dtype=torch.long, device=dev)
    for row, feed in enumerate(feeds):
        if feed:
            ids[row, grow - len(feed) :] = torch.as_tensor(feed, dtype=torch.long)
            new[row, grow - len(feed) :] = 1
    attn = torch.cat([mask, new, torch.ones((len(feeds), lim.max_tokens), dtype=torch.long, device=dev)], 1)
    if grow:
        # Pads take the last real position (never read); new tokens continue each row's own count.
        positions = start[:, None] + new.cumsum(1) - 1  # (J, grow)
        out = module(input_ids=ids, attention_mask=attn[:, : width + grow], position_ids=positions, use_cache=True,
                     logits_to_keep=1, **cache_kw(module, cache))  # fmt: skip
        logits = out.logits[:, -1].float()  # (J, V): left-padded, a row fed anything has it last
        for r, i in enumerate(joining):
            if not trajs[i].feed:  # an empty reset observation: the prompts' prefill scored its next token
                logits[r] = _logits(trajs[i])
    else:
        logits = torch.stack([_logits(trajs[i]) for i in joining])
    for i in joining:
        trajs[i].kv = trajs[i].logits = None
        trajs[i].feed = []
    joined = _Batch(joining, cache, attn, width + grow, start + new.sum(1), logits)
    if batch is None:
        return joined
    groups = [packed_rows(b.cache, b.attn, b.length) for b in (batch, joined)]
    cache, mask, width = pack(module, [], lim.max_tokens, groups)
    rows = mask.shape[0]
    attn = torch.cat([mask, torch.ones((rows, lim.max_tokens), dtype=torch.long, device=dev)], 1)
    return _Batch(batch.members + joining, cache, attn, width, torch.cat([batch.pos, joined.pos]),
                  torch.cat([batch.logits, joined.logits]))


def _kv(tr: _Traj) -> RowKV:
    assert tr.kv is not None
    return tr.kv


def _logits(tr: _Traj) -> Tensor:
    assert tr.logits is not None
    return tr.logits


def _turn_end(tr: _Traj, token: int, lim: _Limits, tokenizer: Tokenizer) -> str:
    """Why the current turn ends at this token ("" if it goes on). A stop text is looked for in the decoded
    text of the turn so far, so it is found whatever tokens spell it."""
    if token == lim.eos:
        return "eos"
    if lim.stop:
        text = tokenizer.decode(tr.ids[tr.turn_start :])
        if any(s in text for s in lim.stop):
            return "stop"
    if len(tr.ids) >= tr.cap:
        return "length"
    return "max_tokens" if tr.t >= lim.max_tokens else ""


def _positions(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _output(trajs: list[_Traj], places: list[int], n: int, ids: Tensor, mask: Tensor, pad: int, idle: float,
            wall: float) -> TurnOutput:
    """The TurnOutput of `trajs`, the call's rows `places` (prompt i's sample j is row i * n + j)."""
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

    index = longs(places)
    return TurnOutput(
        prompt_ids=ids.cpu()[index // n], prompt_mask=mask.cpu()[index // n],
        response_ids=resp, response_mask=resp_mask, loss_mask=loss, logprobs=logp, turn_index=turn_index,
        turn_rewards=rewards, response_lens=resp_mask.sum(1), prompt_index=index // n,
        turns=longs([tr.turn for tr in trajs]), calls=longs([tr.calls for tr in trajs]),
        errors=longs([tr.errors for tr in trajs]), timeouts=longs([tr.timeouts for tr in trajs]),
        prefill_tokens=longs([tr.prefill for tr in trajs]), step_seconds=[tr.step_s for tr in trajs],
        ended=[tr.ended for tr in trajs], idle_s=idle, wall_s=wall,
    )  # fmt: skip
