"""Sampling for the torch engines (flowrl.engines): a decode step's logits to tokens, each row from its own
counter-based random stream, so a row's draws are a function of what it is, not of the batch it is in.

A generated sample is keyed by (seed, prompt, sample): the seed is the step's (the controller's `step_seed`, per
step and node), the prompt is its place in the step's whole prompt batch (`prompt_slot`, carried by the prompts
wherever they go), the sample is which of that prompt's n samples it is. Its draw for response token t is
`uniforms(keys, t)`: a hash of (key, t), with no generator state. So splitting a batch across ranks or instances,
ranking prompts by predicted length, dropping finished rows from the batch or migrating a tail to another
process changes no draw: a row carries its two-word key and its step, nothing else.

`Sampler` takes the token where the row's uniform falls in its filtered distribution's cumulative mass
(`inverse_cdf`, in vocabulary order; temperature, the EOS ban before `min_tokens` and top-p applied first).

The hash is a 32-bit integer mixer (Wellons' lowbias32) evaluated in int64 tensors with 16-bit-split products,
so no product overflows on any device and CPU and CUDA give the same bits. It is some sixty small tensor ops, so
a decode loop does not run it every step: `Draws` hashes the rows' next `block` steps at once and hands out one
column a step (the same bits as `uniforms(keys, t)`). With that, a step's sampling costs about what the
exponential race it replaced did (bench/gen_speed.py --sampler).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Draws", "Sampler", "Sampling", "inverse_cdf", "request_seed", "row_keys", "sampling_seed", "slots_of", "uniforms"]

MASK32 = 0xFFFFFFFF
# Salts that make the key's two words (and the step word) independent chains of the same mixer.
_SALTS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): two 16-bit-split products, each below 2^48 (no int64 overflow)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32(x: Tensor) -> Tensor:
    """lowbias32 (Chris Wellons' hash-prospector): a bijective 32-bit mixer with low bias, on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xD35A2D97)
    return x ^ (x >> 15)


def row_keys(seed: int, prompt_slots: Sequence[int] | Tensor, n: int, device: torch.device | str = "cpu") -> Tensor:
    """(B * n, 2) int64 keys of the rows of B prompts with n samples each (prompt 0's samples first), from the
    seed, each prompt's slot in its step and the sample index 0..n-1."""
    slots = torch.as_tensor(prompt_slots, dtype=torch.long, device=device).repeat_interleave(n)  # (N,)
    sample = torch.arange(n, dtype=torch.long, device=device).repeat(len(slots) // n if n else 0)  # (N,)
    seed_words = (seed & MASK32, (seed >> 32) & MASK32)
    words = []
    for salt in _SALTS[:2]:
        h = mix32(torch.full_like(slots, seed_words[0] ^ salt))
        h = mix32(h ^ seed_words[1])
        h = mix32(h ^ (slots & MASK32))
        words.append(mix32(h ^ (sample & MASK32)))
    return torch.stack(words, dim=1)


def uniforms(keys: Tensor, step: Tensor | int) -> Tensor:
    """(R,) float64 uniforms in (0, 1), one per row: row i's draw at response token `step` (an int, or (R,) per
    row; or (R, S) steps per row, giving (R, S) draws). 32 bits each, centred in their bucket, so never 0 or 1."""
    t = torch.as_tensor(step, dtype=torch.long, device=keys.device)
    k0, k1 = keys[:, 0], keys[:, 1]
    if t.dim() == 2:
        k0, k1 = k0[:, None], k1[:, None]
    else:
        t = t.expand(keys.shape[0])
    h = mix32((t & MASK32) ^ _SALTS[2])
    h = mix32(h ^ k0)
    h = mix32(h ^ k1)
    return (h.double() + 0.5) * 2.0**-32


class Draws:
    """The uniforms of R rows for their coming steps, hashed `block` steps at a time: `at(t)` is each row's draw
    at its step `start + t`, bit for bit `uniforms(keys, start + t)`. A decode loop takes one column a step
    instead of running the hash's sixty-odd tensor ops every step (which cost more than the step's sampling)."""

    def __init__(self, keys: Tensor, start: Tensor | int = 0, block: int = 32) -> None:
        self.keys = keys  # (R, 2)
        self.start = torch.as_tensor(start, dtype=torch.long, device=keys.device).expand(keys.shape[0])  # (R,)
        self.block = max(1, block)
        self._first = 0  # the t of the table's first column
        self._table: Tensor | None = None  # (R, block)

    def at(self, t: int) -> Tensor:
        """(R,) float64: each row's uniform at its step `start + t`."""
        if self._table is None or not self._first <= t < self._first + self.block:
            ahead = torch.arange(t, t + self.block, dtype=torch.long, device=self.keys.device)
            self._first, self._table = t, uniforms(self.keys, self.start[:, None] + ahead)
        return self._table[:, t - self._first]

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (a batch dropping its finished rows), in that order."""
        self.keys, self.start = self.keys[rows], self.start[rows]
        if self._table is not None:
            self._table = self._table[rows]


def request_seed(seed: int, prompt_slot: int) -> int:
    """A 31-bit seed for one prompt's request (engines that seed per request: vLLM), from the same tuple."""
    key = row_keys(seed, [prompt_slot], 1)[0]
    return int(key[0]) & 0x7FFFFFFF


def sampling_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """The seed of a generation: `seed`, else a handed generator's initial seed, else 0."""
    if seed is not None:
        return int(seed)
    return int(generator.initial_seed()) if generator is not None else 0


def slots_of(prompt_slots: Sequence[int] | None, batch: int) -> list[int]:
    """Each prompt's slot in its step (what its rows' streams are keyed by): as given, or 0..B-1."""
    if prompt_slots is None:
        return list(range(batch))
    slots = [int(s) for s in prompt_slots]
    if len(slots) != batch:
        raise ValueError(f"prompt_slots has {len(slots)} entries for {batch} prompts")
    return slots


@dataclass(frozen=True)
class Sampling:
    """A generation's sampling settings, as the streaming torch engine and the vLLM engine take them."""

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0


class Sampler:
    """Turns one step's (rows, V) logits into tokens and their log-probs. Row i draws one uniform from its own
    stream (its key, at its response step) and takes the token where it falls in the cumulative distribution, so
    what it samples depends on its logits, its key and its step only, never on the other rows of the batch."""

    def __init__(self, temperature: float, top_p: float, min_tokens: int, eos: int) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.min_tokens = min_tokens
        self.eos = eos

    def __call__(self, logits: Tensor, step: Tensor | int, keys: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, their log-probs) for (rows, V) logits; `step`: the response token being sampled (an int, or
        (rows,) for rows at different steps); `keys`: the rows' (rows, 2) stream keys."""
        return self.sample(logits, step, None if self.temperature <= 0 else uniforms(keys, step))

    def sample(self, logits: Tensor, step: Tensor | int, u: Tensor | None) -> tuple[Tensor, Tensor]:
        """`__call__` with the rows' uniforms at `step` already drawn (`Draws.at`; None when greedy)."""
        greedy = self.temperature <= 0
        # x / 1.0 is x: skipping it changes no bit
        scaled = logits if greedy or self.temperature == 1.0 else logits / self.temperature  # (rows, V)
        # Reported log-probs ignore the EOS ban and top-p so they equal forward_logprobs at this temperature.
        logprobs = torch.log_softmax(scaled, dim=-1)
        if isinstance(step, int):
            if step < self.min_tokens:
                scaled = scaled.clone() if scaled is logits else scaled
                scaled[:, self.eos] = float("-inf")
        elif self.min_tokens > 0:
            scaled = scaled.clone() if scaled is logits else scaled
            scaled[:, self.eos] = scaled[:, self.eos].masked_fill(step < self.min_tokens, float("-inf"))
        if greedy:
            tok = scaled.argmax(dim=-1)
        else:
            probs = torch.softmax(scaled, dim=-1)
            if self.top_p < 1.0:
                probs = _nucleus(probs, self.top_p)
            assert u is not None, "sampling at a temperature > 0 needs the rows' uniforms"
            tok = inverse_cdf(probs, u)
        return tok, logprobs.gather(-1, tok[:, None]).squeeze(-1)


# Up to this vocabulary a row's whole float64 cumulative mass is one cheap scan: fewer, smaller tensor ops than
# the two-level search, whose thirty-odd ops cost more than a tiny model's sampling (bench/gen_speed.py --sampler).
FLAT_VOCAB = 512


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """(rows,) tokens: for each row, the first token (in vocabulary order) whose cumulative mass exceeds u * total.

    The running sums are float64, so a tiny change of the logits (~1e-7, another batch's rounding) moves a row's
    token only when u falls within about that change of a boundary. A token of probability 0 is never taken (its
    interval is empty; the one case rounding could reach, past a block's last token with mass, takes that token).
    Up to `FLAT_VOCAB` tokens the sums run over the whole row; above, in two levels, so no (rows, V) float64
    array is written: the float32 mass of blocks of about sqrt(V) tokens, summed up to the block holding the
    target, then that block's tokens. The two place a boundary apart only by the rounding of a block's float32
    sum (~1e-7 of the mass before it); the choice depends on V alone, never on the batch."""
    rows, vocab = probs.shape
    if vocab <= FLAT_VOCAB:
        cdf = probs.double().cumsum(-1)  # (rows, V)
        target = u.to(cdf.device) * cdf[:, -1]  # < cdf[:, -1]: u < 1
        return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    size = math.isqrt(vocab)
    whole = vocab // size * size
    sums = probs[:, :whole].reshape(rows, -1, size).sum(-1)  # (rows, V // size) float32 block masses
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=1)
    ends = sums.double().cumsum(-1)  # (rows, blocks)
    target = u.to(ends.device) * ends[:, -1]  # (rows,)
    block = torch.searchsorted(ends, target[:, None], right=True).squeeze(1).clamp_(max=ends.shape[1] - 1)
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    ahead = torch.arange(size, device=probs.device)
    idx = block[:, None] * size + ahead  # (rows, size) the block's tokens
    mass = probs.gather(1, idx.clamp(max=vocab - 1)).double() * (idx < vocab)
    pos = torch.searchsorted(before[:, None] + mass.cumsum(-1), target[:, None], right=True).squeeze(1)
    last = torch.where(mass > 0, ahead, -1).amax(-1)  # (rows,) the block's last token with mass
    return block * size + torch.minimum(pos, last)


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Zero every token outside the smallest set whose mass reaches `top_p` (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (rows, V)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
