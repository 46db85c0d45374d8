"""Length-ranked assignment of a step's prompts to generation instances (flowrl.elastic).

Prompts are sorted by predicted response length (shortest first; ties keep data-set order) and cut into
contiguous runs of near-equal count, one per instance: an instance holds prompts of similar length, so the ones
holding short work finish together and release their device early, instead of every instance waiting on one
long sample. A prompt is the unit, so its samples stay on one instance (share-prefix computes it once there).
"""

from __future__ import annotations

from collections.abc import Sequence


def ranked_runs(predicted: Sequence[float], instances: int) -> list[list[int]]:
    """Prompt indices per instance: `min(instances, len(predicted))` contiguous runs of the length order, the
    first `len % runs` of them one prompt longer."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    order = sorted(range(len(predicted)), key=lambda i: (predicted[i], i))
    runs = min(instances, len(order))
    if runs == 0:
        return []
    size, extra = divmod(len(order), runs)
    out: list[list[int]] = []
    start = 0
    for r in range(runs):
        end = start + size + (1 if r < extra else 0)
        out.append(order[start:end])
        start = end
    return out
