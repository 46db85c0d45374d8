"""Multi-turn generation for the torch engine (flowrl.engines): one state machine per sample on the continuous
decode batch, acting in an environment (flowrl.envs) between turns.

`generate_turns` is `generate` for trajectories. A sample decodes its turn in the shared batch; at a stop text,
EOS or `max_tokens` it leaves the batch with its KV cache kept (flowrl.engines.turn_cache) and its action goes
to `Envs.step`, a future. The others keep decoding; between decode steps the loop looks at `Future.done()`, and
a sample whose observation is back has only its new tokens (the action's last token, not yet fed, and the
observation's own `tokenizer.encode`) prefilled onto its kept cache, together with any others returning at that
step, then rejoins the batch. Only when nothing is left to decode does the loop wait on the environments (that
wait is `idle_s`). Token-in/token-out: the ids returned are exactly the ids sampled and the ids observed, and no
history is re-tokenised or run again (`prefill_tokens` = prompt + observations). With `decode_batch` (the engine's
`max_num_seqs`) at most that many rows decode at once; a trajectory whose turn is due beyond it queues with its
cache kept, and a leaving row's place goes to the furthest behind (fewest turns taken), so no trajectory trails the
others into a tail of its own at the end of the rollout.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.engines.forward import no_grad_mode
from flowrl.engines.generation import check_sampling_args, left_pad_prompts, prefill_prompts
from flowrl.engines.sampling import MASK32, Sampler, mix32, row_keys, sampling_seed, slots_of
from flowrl.engines.turn_cache import RowKV, pack, packed_rows, row_length, unpack
from flowrl.engines.turn_state import (
    Parked,
    Suspended,
    Traj,
    TurnChunk,
    TurnOutput,
    park_row,
    resumed,
    turn_output,
)
from flowrl.envs.protocol import Envs, Outcome
from flowrl.models.build import cache_kw
from flowrl.models.tokenizer import Tokenizer

__all__ = ["ENDED", "Parked", "Suspended", "TurnChunk", "TurnOutput", "generate_turns", "resume_turns", "stream_turns",
           "turn_keys"]

ENDED = ("done", "max_turns", "eos", "length", "error")
_TURN_SALTS = (0x27D4EB2F, 0x165667B1)


def turn_keys(keys: Tensor, turns: Tensor | int) -> Tensor:
    """(R, 2) stream keys of turn `turns` (an int, or (R,)) of the rows keyed `keys` (flowrl.engines.sampling's
    `row_keys`): the same mixer, so each turn of each sample is its own independent stream."""
    t = torch.as_tensor(turns, dtype=torch.long, device=keys.device).expand(keys.shape[0])
    words = [mix32(mix32((t & MASK32) ^ salt) ^ keys[:, w]) for w, salt in enumerate(_TURN_SALTS)]
    return torch.stack(words, dim=1)


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
                   prompt_slots: Sequence[int] | None = None, overlap: bool = True, decode_batch: int = 0,
                   device: str | torch.device = "cpu") -> TurnOutput:
    """Sample `n` trajectories per prompt in `envs` (one environment per trajectory, keyed (prompt slot, j),
    reset with `rows[i]`). A turn is at most `max_tokens` tokens and ends at a stop text (part of the action),
    EOS or `max_tokens`; every turn end calls the environment. A trajectory ends when the outcome says done
    ("done", or "error" when it carries an error), after `max_turns` actions ("max_turns"), at EOS ("eos"), or
    when the response would pass `max_total` tokens ("length"; default: the model's positions minus the prompt;
    an observation is appended only if one action token still fits after it). `min_tokens` bans EOS in each
    turn's first tokens. `decode_batch` (> 0) caps the trajectories decoding at once (vLLM's `max_num_seqs`): the
    others whose turn is due queue with their caches kept, the furthest behind (fewest turns taken) first; the
    samples are the same whatever the cap."""
    (whole,) = stream_turns(module, tokenizer, prompts, rows, envs, n=n, max_tokens=max_tokens, max_turns=max_turns,
                            max_total=max_total, stop=stop, min_tokens=min_tokens, temperature=temperature,
                            top_p=top_p, seed=seed, prompt_slots=prompt_slots, overlap=overlap,
                            decode_batch=decode_batch, device=device, hand_out=False)
    assert isinstance(whole, TurnChunk)  # no `park`: never suspended
    return whole.out


def stream_turns(module: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                 rows: Sequence[Mapping[str, Any]], envs: Envs, *, n: int = 1, max_tokens: int, max_turns: int,
                 max_total: int | None = None, stop: Sequence[str] = (), min_tokens: int = 0,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 prompt_slots: Sequence[int] | None = None, overlap: bool = True, decode_batch: int = 0,
                 device: str | torch.device = "cpu", hand_out: bool = True, chunk: int = 0,
                 park: Callable[[list[float]], bool] | None = None) -> Iterator[TurnChunk | Suspended]:
    """`generate_turns`' trajectories (the same samples), handed out as they finish: with `hand_out`, the ones
    finished so far each time nothing is left to decode while environments are pending (the caller's work on
    them fills that wait) and whenever `chunk` (> 0) of them are waiting to go; the rest at the end. Without
    `hand_out`, one chunk of every trajectory at the end.

    `park` (serverless: give the device back while tools run) is asked, each time nothing is left to decode and
    no pending environment call has answered yet, with how long each pending call has been waiting (seconds);
    when it says yes the call ends with a `Suspended` of those trajectories (`resume_turns` goes on with them)."""
    check_sampling_args(prompts, n, max_tokens, min_tokens, temperature, top_p)
    if len(rows) != len(prompts):
        raise ValueError(f"generate_turns got {len(rows)} rows for {len(prompts)} prompts")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if decode_batch < 0:
        raise ValueError(f"decode_batch must be >= 0 (0: every trajectory at once), got {decode_batch}")
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
    trajs: list[Traj] = []
    for i, prompt in enumerate(prompts):
        room = positions - len(prompt) if positions else None
        caps = [c for c in (max_total, room) if c is not None]
        cap = min(caps) if caps else 1 << 30
        if cap < 1:
            raise ValueError(f"prompt {i} ({len(prompt)} tokens) leaves no room for a response")
        trajs += [Traj((slots[i], j), cap, len(prompt), i * n + j, tuple(prompt)) for j in range(n)]
    ids, mask = left_pad_prompts(prompts, lim.pad, dev)  # (B, P)
    with no_grad_mode(module):
        pre = prefill_prompts(module, prompts, ids, mask, n=n, share=n > 1, extra=0, prefixes=None, pad=lim.pad)
        kvs = unpack(pre.cache, pre.mask, pre.mask.shape[1], range(len(trajs)))
    for i, tr in enumerate(trajs):
        tr.kv, tr.logits = kvs[i], pre.logits[i]
        tr.future, tr.sent = envs.reset(tr.key, rows[i // n]), time.perf_counter()
    loop = _Loop(module, tokenizer, Sampler(temperature, top_p, min_tokens, lim.eos), table, lim, envs, overlap, n,
                 ids.shape[1], decode_batch)
    yield from loop.run(trajs, _Clock(started), hand_out=hand_out, chunk=chunk, park=park)


def resume_turns(module: nn.Module, tokenizer: Tokenizer, parked: Sequence[Parked],
                 pending: Sequence[Future[Outcome]], envs: Envs, *, n: int = 1, max_tokens: int, max_turns: int,
                 stop: Sequence[str] = (), min_tokens: int = 0, temperature: float = 1.0, top_p: float = 1.0,
                 overlap: bool = True, decode_batch: int = 0, device: str | torch.device = "cpu",
                 hand_out: bool = True, chunk: int = 0,
                 park: Callable[[list[float]], bool] | None = None) -> Iterator[TurnChunk | Suspended]:
    """Go on with trajectories a suspended call parked (`Suspended.rows`), on any instance: each one's history
    (prompt and response so far, but the tokens still to feed) is prefilled once (counted in its
    `prefill_tokens`), its pending environment call's outcome is `pending[k]`, and it continues as `stream_turns`
    would have, drawing from its own random streams: the same samples as a call never suspended. The sampling
    arguments must be the suspended call's; chunks' `rows` are the trajectories' places in that call."""
    started = time.perf_counter()
    dev = torch.device(device)
    lim = _Limits(max_tokens, max_turns, tuple(stop), tokenizer.eos_id, tokenizer.pad_id)
    trajs = [resumed(p, f, started) for p, f in zip(parked, pending, strict=True)]
    table = torch.tensor([list(p.keys) for p in parked], dtype=torch.long, device=dev).view(len(parked), max_turns, 2)
    history = [[*tr.prompt, *tr.ids[: len(tr.ids) - len(tr.feed)]] for tr in trajs]
    ids, mask = left_pad_prompts(history, lim.pad, dev)
    with no_grad_mode(module):
        pre = prefill_prompts(module, history, ids, mask, n=1, share=False, extra=0, prefixes=None, pad=lim.pad)
        kvs = unpack(pre.cache, pre.mask, pre.mask.shape[1], range(len(trajs)))
    for r, tr in enumerate(trajs):
        tr.kv, tr.logits = kvs[r], pre.logits[r]
        tr.prefill += len(history[r])
    loop = _Loop(module, tokenizer, Sampler(temperature, top_p, min_tokens, lim.eos), table, lim, envs, overlap, n,
                 max(len(tr.prompt) for tr in trajs), decode_batch)
    yield from loop.run(trajs, _Clock(started), hand_out=hand_out, chunk=chunk, park=park)


@dataclass
class _Loop:
    """The decode loop over one call's trajectories (`stream_turns`, `resume_turns`)."""

    module: nn.Module
    tokenizer: Tokenizer
    sampler: Sampler
    table: Tensor  # (N, max_turns, 2) each trajectory's turns' stream keys, in `trajs` order
    lim: _Limits
    envs: Envs
    overlap: bool
    n: int
    width: int  # prompt columns of the chunks' prompt_ids
    cap: int = 0  # rows decoding at once (0: no cap); the others whose turn is due wait in `ready`

    def run(self, trajs: list[Traj], clock: _Clock, *, hand_out: bool, chunk: int,
            park: Callable[[list[float]], bool] | None) -> Iterator[TurnChunk | Suspended]:
        lim, envs, tokenizer = self.lim, self.envs, self.tokenizer
        waiting = list(range(len(trajs)))
        ready: list[int] = []  # observation settled, not in the batch yet (the cap)
        batch: _Batch | None = None
        no_tokens = torch.zeros(0, dtype=torch.long, device=self.table.device)
        finished: list[int] = []  # ended, not handed out yet
        while True:
            if batch is None and not ready:
                if finished and hand_out and waiting:  # the caller's work on them fills the wait below
                    yield clock.chunk(trajs, finished, self.n, self.width, lim.pad)
                    finished = []
                if not waiting:
                    break
                if park is not None and not any(_future(trajs[i]).done() for i in waiting):
                    now = time.perf_counter()
                    if park([now - trajs[i].sent for i in waiting]):
                        yield clock.suspend(trajs, finished, waiting, self.table)
                        return
                began = time.perf_counter()
                wait([_future(trajs[i]) for i in waiting],
                     return_when=FIRST_COMPLETED if self.overlap else ALL_COMPLETED)
                clock.idle += time.perf_counter() - began
            with no_grad_mode(self.module):
                # The barrier loop looks at its environments only once the whole batch has ended its turns (and
                # every queued row has had its turn).
                if waiting and (self.overlap or (batch is None and not ready)):
                    back = [i for i in waiting if _future(trajs[i]).done()]
                    returned = set(back)
                    waiting = [i for i in waiting if i not in returned]
                    ready += [i for i in back if _settle(trajs[i], _future(trajs[i]).result(), lim, tokenizer, envs)]
                    finished += [i for i in back if trajs[i].ended]
                tokens = no_tokens
                if batch is not None:
                    batch, tokens, leaving = _sample(self.sampler, self.table, trajs, batch, lim, tokenizer)
                    for i in leaving:
                        tr = trajs[i]
                        tr.future = envs.step(tr.key, tokenizer.decode(tr.ids[tr.turn_start :]))
                        tr.sent = time.perf_counter()
                        waiting.append(i)
                if self.cap > 0:  # the furthest behind first (fewest turns taken), so none trails at the end
                    ready.sort(key=lambda i: trajs[i].turn)
                room = len(ready) if self.cap <= 0 else self.cap - (len(batch.members) if batch is not None else 0)
                joining, ready = ready[:room], ready[room:]
                batch = _advance(self.module, trajs, batch, tokens, joining, lim)
            if hand_out and chunk > 0 and len(finished) >= chunk:
                yield clock.chunk(trajs, finished, self.n, self.width, lim.pad)
                finished = []
        if finished or not trajs:
            yield clock.chunk(trajs, finished, self.n, self.width, lim.pad)


class _Clock:
    """The call's seconds since the last hand-out: wall, and idle (nothing to decode, environments pending);
    the time the caller holds a chunk is the call's wall, never idle."""

    def __init__(self, started: float):
        self.mark, self.idle = started, 0.0

    def chunk(self, trajs: list[Traj], rows: list[int], n: int, width: int, pad: int) -> TurnChunk:
        now = time.perf_counter()
        mine = sorted((trajs[i] for i in rows), key=lambda tr: tr.place)
        out = turn_output(mine, n, width, pad, self.idle, now - self.mark)
        self.mark, self.idle = now, 0.0
        return TurnChunk([tr.place for tr in mine], out)

    def suspend(self, trajs: list[Traj], finished: list[int], waiting: list[int], table: Tensor) -> Suspended:
        assert not finished  # handed out before
        now = time.perf_counter()
        rows = [park_row(trajs[i], table[i]) for i in waiting]
        futures = [_future(trajs[i]) for i in waiting]
        out = Suspended(rows, futures, self.idle, now - self.mark)
        self.mark, self.idle = now, 0.0
        return out


def _future(tr: Traj) -> Future[Outcome]:
    assert tr.future is not None
    return tr.future


def _settle(tr: Traj, out: Outcome, lim: _Limits, tokenizer: Tokenizer, envs: Envs) -> bool:
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


def _sample(sampler: Sampler, table: Tensor, trajs: list[Traj], batch: _Batch, lim: _Limits,
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


def _advance(module: nn.Module, trajs: list[Traj], batch: _Batch | None, tokens: Tensor, joining: list[int],
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


def _kv(tr: Traj) -> RowKV:
    assert tr.kv is not None
    return tr.kv


def _logits(tr: Traj) -> Tensor:
    assert tr.logits is not None
    return tr.logits


def _turn_end(tr: Traj, token: int, lim: _Limits, tokenizer: Tokenizer) -> str:
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
