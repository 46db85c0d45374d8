"""Cut-and-migrate (flowrl.elastic): when an instance's unfinished sequences move, and where to.

An instance that has finished a fraction `tau` of its sequences hands the rest to an instance with free slots
(with their decoding state, where the engine can export it) and releases its device: the last few long samples
then share one device instead of keeping several held and mostly idle.
"""

from __future__ import annotations

from collections.abc import Mapping

TAU = 0.7


def should_migrate(finished: int, total: int, tau: float = TAU) -> bool:
    """Whether an instance holding `total` sequences, `finished` of them done, should hand off the rest."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    return 0 < total and finished < total and finished >= tau * total


def migration_target(free_slots: Mapping[int, int], source: int, need: int) -> int | None:
    """The instance (not `source`) with the most free slots, at least `need` of them (ties: the lowest id);
    None when no instance can take all `need` sequences, and the source keeps them."""
    fits = [(-free, inst) for inst, free in free_slots.items() if inst != source and free >= need]
    return min(fits)[1] if fits else None
