"""The devices a serverless run's pools may start at once (backends/serverless/slots.py), counted per resource
from the cluster's totals as they are at each decision: worked cases on a cluster that grows from nothing."""

from __future__ import annotations

from flowrl.backends.serverless.slots import Slots


def _slots(totals: dict[str, float]) -> Slots:
    """A gen pool taking half a GPU an instance, a train pool a whole one, and a reward pool a device slot, on a
    cluster whose totals are `totals` (read at each decision, as `ray.cluster_resources()` is)."""
    slots = Slots(lambda resource: totals.get(resource, 0.0))
    for pool, ask in (("gen", ("GPU", 0.5)), ("train", ("GPU", 1.0)), ("reward", ("device_slot", 1.0))):
        slots.register(pool, ask, lambda: [], lambda: None)
    return slots


def test_a_cluster_scaled_to_zero_caps_at_none_and_the_caps_grow_with_it() -> None:
    totals: dict[str, float] = {}
    slots = _slots(totals)
    assert slots.room("gen", 4) == 0 and slots.room("reward", 2) == 0  # nothing yet: no cap switched off
    totals["GPU"] = 1.0  # the autoscaler added a one-GPU node
    assert slots.room("gen", 4) == 2 and slots.room("train", 4) == 1 and slots.room("reward", 2) == 0
    totals["device_slot"] = 2.0
    assert slots.room("reward", 4) == 2


def test_instances_started_beside_count_on_their_own_resource_and_waiting_ones_as_the_pools_own() -> None:
    slots = _slots({"GPU": 2.0, "device_slot": 1.0})
    assert slots.room("gen", 4, {"train": 1}) == 2  # train's whole GPU beside: one GPU left, two halves
    assert slots.room("gen", 4, {"reward": 1}) == 4  # a slot does not take from the GPUs
    assert slots.room("gen", 4, {"train": 3}) == 0  # what is beside cannot start: nothing of the stage does
    assert slots.room("gen", 4, {"reward": 2}) == 0
    assert slots.make_room("gen", 4, {"train": 1}, mine=0) == 2
