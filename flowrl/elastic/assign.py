"""Length-ranked assignment of a step's prompts to generation instances (flowrl.elastic).

Prompts are sorted by predicted response length (shortest first; ties keep data-set order) and cut into
contiguous runs of near-equal count, one per instance: an instance holds prompts of similar length, so the ones
holding short work finish together and release their device early, instead of every instance waiting on one
long sample. A prompt is the unit, so its samples stay on one instance (share-prefix computes it once there).
The runs' sizes are those of a data-parallel split (`Batch.split`: boundaries at round(i * n / runs)), so the
runs estimated here are the shards a backend sends after putting the prompts in this order.
"""

from __future__ import annotations

from collections.abc import Sequence


def ranked_runs(predicted: Sequence[float], instances: int) -> list[list[int]]:
    """Prompt indices per instance: `min(instances, len(predicted))` contiguous runs of the length order, cut
    where a data-parallel split cuts (`split_runs`)."""
    order = sorted(range(len(predicted)), key=lambda i: (predicted[i], i))
    return [[order[i] for i in run] for run in split_runs(len(order), instances)]


def split_runs(count: int, instances: int) -> list[list[int]]:
    """0..count-1 in `min(instances, count)` contiguous runs with boundaries at round(i * count / runs), as
    `Batch.split` cuts a batch into data-parallel shards."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    runs = min(instances, count)
    bounds = [round(i * count / runs) for i in range(runs + 1)] if runs else [0]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
