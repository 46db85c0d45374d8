"""Response-length prediction per prompt (flowrl.elastic).

Each prompt, by its id in the data set, keeps an exponentially weighted moving average of the mean response
length of its samples at each step it was drawn (`alpha = 2 / (window + 1)`, the usual span-to-alpha rule: a
window of 1 remembers only the last step). A prompt never seen is predicted as `default` when one is given, else
as the mean prediction of this step's prompts that were seen, else as the mean of every length observed so far,
else as `fallback` (the caller's max_tokens, say). `spearman` says how well a prediction ranked the real lengths.

A prompt drawn several times a step (GRPO's group) also keeps an EWMA of its samples' lengths sorted, its
*profile*: an instance holding the prompt decodes until its longest sample ends, which the mean does not say
(one sample of a group often runs to the cap while the others stop early). `predict_profiles` gives each prompt's
expected sorted sample lengths; a prompt never seen gets its predicted mean times the average profile shape of
the prompts seen (their lengths over their own mean), flat when none was seen.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any


class LengthPredictor:
    """EWMA of each prompt's past response lengths (see the module docstring)."""

    def __init__(self, window: int = 4, default: float | None = None):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.default = default
        self.alpha = 2.0 / (window + 1)
        self.ewma: dict[Hashable, float] = {}
        self.profile: dict[Hashable, list[float]] = {}  # EWMA of the sorted sample lengths
        self.total, self.count = 0.0, 0

    @property
    def mean(self) -> float:
        """The mean of every length observed so far (0 before any)."""
        return self.total / self.count if self.count else 0.0

    def predict(self, prompt_ids: Sequence[Hashable], fallback: float) -> list[float]:
        """One predicted length per prompt id."""
        seen = [self.ewma[p] for p in prompt_ids if p in self.ewma]
        if self.default is not None:
            unseen = float(self.default)
        elif seen:
            unseen = sum(seen) / len(seen)
        elif self.count:
            unseen = self.total / self.count
        else:
            unseen = float(fallback)
        return [self.ewma.get(p, unseen) for p in prompt_ids]

    def observe(self, prompt_ids: Sequence[Hashable], lengths: Sequence[float]) -> None:
        """Record one step: `prompt_ids[i]` produced a response of `lengths[i]` tokens (a prompt's samples repeat
        its id; their mean is the step's observation of that prompt)."""
        if len(prompt_ids) != len(lengths):
            raise ValueError(f"{len(prompt_ids)} prompt ids but {len(lengths)} lengths")
        sums: dict[Hashable, list[float]] = {}
        for p, n in zip(prompt_ids, lengths, strict=True):
            sums.setdefault(p, []).append(float(n))
        for p, ns in sums.items():
            mean = sum(ns) / len(ns)
            old = self.ewma.get(p)
            self.ewma[p] = mean if old is None else self.alpha * mean + (1.0 - self.alpha) * old
            now, before = sorted(ns), self.profile.get(p)
            self.profile[p] = now if before is None else [
                self.alpha * a + (1.0 - self.alpha) * b for a, b in zip(now, resample(before, len(now)), strict=True)]
        self.total += sum(float(n) for n in lengths)
        self.count += len(lengths)

    def predict_profiles(self, prompt_ids: Sequence[Hashable], samples: int, fallback: float) -> list[list[float]]:
        """Each prompt's expected `samples` sample lengths, sorted (see the module docstring)."""
        means = self.predict(prompt_ids, fallback)
        shapes = [[n / m for n in resample(prof, samples)] for p, prof in self.profile.items()
                  if (m := sum(prof) / len(prof)) > 0]
        shape = [sum(col) / len(shapes) for col in zip(*shapes, strict=True)] if shapes else [1.0] * samples
        return [resample(self.profile[p], samples) if p in self.profile else [mean * f for f in shape]
                for p, mean in zip(prompt_ids, means, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """What `predict` depends on (for checkpoints)."""
        return {"ewma": dict(self.ewma), "profile": {p: list(v) for p, v in self.profile.items()},
                "total": self.total, "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ewma, self.total, self.count = dict(state["ewma"]), float(state["total"]), int(state["count"])
        self.profile = {p: list(v) for p, v in state.get("profile", {}).items()}  # absent in older checkpoints


def resample(sorted_lengths: Sequence[float], n: int) -> list[float]:
    """`n` values spread like `sorted_lengths` (sorted): the value at each of n evenly spaced quantiles, linear
    between neighbours; the same list when n equals its length, their mean for one value."""
    k = len(sorted_lengths)
    if k == n:
        return list(sorted_lengths)
    if n == 1:
        return [sum(sorted_lengths) / k]
    if k == 1:
        return [sorted_lengths[0]] * n
    out = []
    for i in range(n):
        x = i * (k - 1) / (n - 1)
        lo = int(x)
        hi = min(lo + 1, k - 1)
        out.append(sorted_lengths[lo] + (sorted_lengths[hi] - sorted_lengths[lo]) * (x - lo))
    return out


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(predicted: Sequence[float], real: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on average ranks); NaN for fewer than two values or a constant
    side, where a ranking says nothing."""
    if len(predicted) != len(real):
        raise ValueError(f"{len(predicted)} predictions but {len(real)} lengths")
    if len(predicted) < 2:
        return math.nan
    a, b = _ranks(predicted), _ranks(real)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return math.nan
    return cov / math.sqrt(va * vb)
