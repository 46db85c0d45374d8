"""Cost-aware instance count (flowrl.elastic).

For each candidate count N of generation instances, the step's generation time T(N) and device-seconds C(N) are
estimated from the predicted response lengths (each prompt's predicted sample lengths when known: an instance
holding a group waits for its longest sample), the length-ranked assignment (`ranked_runs`) and a measured
time-per-decode-step curve: an instance decodes its samples together, each decode step costing what the curve
says for the number still running (at most `slots` at once where the engine's memory caps it, the others
entering as running ones end), and releases its device when its last sample ends. T(N) is the slowest
instance plus the start-up time, C(N) the sum over instances of start-up plus decoding. The choice is
argmin over N of  weight * T(N) / T_ref + (1 - weight) * C(N) / C_ref,  with T_ref and C_ref the smallest T and C
among the candidates; weight 1 buys the fastest step, weight 0 the fewest device-seconds; ties take fewer
instances.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flowrl.elastic.assign import ranked_runs


class DecodeCurve:
    """Seconds per decode step by batch size: measured points, linear between them, the end segments extended
    (one point: constant). Never below zero."""

    def __init__(self, points: Mapping[int, float]):
        if not points:
            raise ValueError("a decode curve needs at least one measured (batch size, seconds) point")
        if any(b < 1 or s < 0 or not math.isfinite(s) for b, s in points.items()):
            raise ValueError(f"decode curve points need batch >= 1 and finite seconds >= 0, got {dict(points)}")
        self.sizes = sorted(points)
        self.secs = [float(points[b]) for b in self.sizes]

    def seconds(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        if len(self.sizes) == 1:
            return self.secs[0]
        i = bisect.bisect_left(self.sizes, batch)
        i = min(max(i, 1), len(self.sizes) - 1)  # the segment [i-1, i], or the nearest end one
        b0, b1, s0, s1 = self.sizes[i - 1], self.sizes[i], self.secs[i - 1], self.secs[i]
        return max(0.0, s0 + (s1 - s0) * (batch - b0) / (b1 - b0))


def decode_seconds(lengths: Iterable[float], curve: DecodeCurve, slots: int | None = None) -> float:
    """Time to decode samples of these lengths together (each decode step timed at the count still running);
    with `slots`, at most that many at once (an engine whose memory holds that many sequences), the others
    entering in the given order as running ones end (continuous batching)."""
    ends = [max(0, math.ceil(n)) for n in lengths]
    if slots is not None and slots < len(ends):
        return _batched(ends, slots, curve.seconds)
    counts = Counter(ends)
    total, done, running = 0.0, 0, len(ends)
    for end in sorted(counts):
        total += (end - done) * curve.seconds(running)  # steps done+1..end run with `running` samples
        running -= counts[end]
        done = end
    return total


def decode_steps(lengths: Iterable[float], slots: int | None = None) -> int:
    """Decode steps until every sample has ended, at most `slots` running at once (in the given order): the
    longest length without a limit."""
    ends = [max(0, math.ceil(n)) for n in lengths]
    if slots is None or slots >= len(ends):
        return max(ends, default=0)
    return round(_batched(ends, slots, lambda _: 1.0))


def _batched(ends: Sequence[int], slots: int, per_step: Callable[[int], float]) -> float:
    """Continuous batching of samples needing `ends` steps, `slots` at a time, in order: the sum over decode steps
    of `per_step(samples running)`."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    waiting = iter(ends)
    running: list[int] = []  # the steps at which running samples end
    step, total = 0, 0.0
    for end in itertools.islice(waiting, slots):
        heapq.heappush(running, step + end)
    while running:
        nxt = running[0]
        total += (nxt - step) * per_step(len(running))
        step = nxt
        while running and running[0] == step:
            heapq.heappop(running)
        for end in itertools.islice(waiting, slots - len(running)):
            heapq.heappush(running, step + end)
    return total


def estimate(predicted: Sequence[float], samples: int, instances: int, curve: DecodeCurve,
             start_s: float = 0.0, profiles: Sequence[Sequence[float]] | None = None,
             slots: int | None = None) -> tuple[float, float]:
    """(T, C) for `instances` instances: `predicted[i]` is prompt i's length, each prompt drawn `samples` times;
    with `profiles`, prompt i's samples are `profiles[i]` instead of `samples` copies of its mean (prompts are
    still ranked by `predicted`); `slots`: the samples an instance decodes at once (None: all it holds)."""
    def lengths(i: int) -> Sequence[float]:
        return profiles[i] if profiles is not None else [predicted[i]] * samples
    times = [decode_seconds([n for i in run for n in lengths(i)], curve, slots)
             for run in ranked_runs(predicted, instances)]
    if not times:
        return 0.0, 0.0
    return start_s + max(times), sum(start_s + t for t in times)


@dataclass(frozen=True)
class Candidate:
    instances: int
    time_s: float  # T(N), predicted
    device_s: float  # C(N), predicted
    score: float


@dataclass(frozen=True)
class ScaleChoice:
    chosen: Candidate
    candidates: tuple[Candidate, ...]


def choose_instances(predicted: Sequence[float], samples: int, counts: Iterable[int], curve: DecodeCurve,
                     weight: float, start_s: float = 0.0,
                     profiles: Sequence[Sequence[float]] | None = None, slots: int | None = None) -> ScaleChoice:
    """The candidate count with the lowest cost-weighted score (see the module docstring); `profiles`: each
    prompt's predicted sample lengths (`LengthPredictor.predict_profiles`), when known; `slots`: the samples an
    instance's engine decodes at once (None: every sample it holds, as flowrl's torch engine does)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"cost weight must be in [0, 1], got {weight}")
    ns = sorted(set(counts))
    if not ns or ns[0] < 1:
        raise ValueError(f"candidate instance counts must be >= 1, got {ns}")
    est = [(n, *estimate(predicted, samples, n, curve, start_s, profiles, slots)) for n in ns]
    t_ref = min(t for _, t, _ in est) or 1.0
    c_ref = min(c for _, _, c in est) or 1.0
    cands = tuple(Candidate(n, t, c, weight * t / t_ref + (1.0 - weight) * c / c_ref) for n, t, c in est)
    best = min(cands, key=lambda c: (c.score, c.instances))
    return ScaleChoice(best, cands)
