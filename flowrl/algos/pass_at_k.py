"""Evaluation scores of sampled answers (flowrl.algos): pass@k, the k's a run reports, and the majority vote.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1):
with n samples of a problem of which c are correct, the chance that at least one of k drawn without replacement is
correct, 1 - C(n-c, k) / C(n, k). Computed with exact integers (`math.comb`), so it equals the formula to the last
bit that a float can hold, for any n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, c of them correct, hold a correct one."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def report_ks(n: int) -> tuple[int, ...]:
    """The k's a run reports pass@k for: 1, 2, 4, ... below n, and n itself (1..8 -> 1, 2, 4, 8; 6 -> 1, 2, 4, 6)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return (*ks, n)


def majority(answers: Sequence[str | None]) -> int | None:
    """The index of the first sample carrying the most common answer (None answers do not vote; a tie goes to the
    answer given first); None when no sample has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[a] for a, c in counts.items() if c == best)
