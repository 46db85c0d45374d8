"""Weight sync for split placement (ray backend): a model placed in several worker groups (e.g. `actor.generate`
in pool `rollout`, `actor.update` in pool `train`) is trained in one group and read in the others.

Colocated models need nothing: generation and training share the weights in one process per rank. After an
update in group A, every other group holding the model is marked behind; `push` sends rank 0's new weights
through the object store (put once, read by every rank of every group behind) and is what the controller
calls right after the update (`RayBackend.after_update`, timed as its own node). A group that is still behind
when it next uses the model pulls first, so results never depend on the controller making that call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from flowrl.backends.ray.group import RayWorkerGroup


class WeightSync:
    def __init__(self, holders: Mapping[str, Sequence[str]], manual: Set[str] = frozenset()):
        self.holders = {m: tuple(gs) for m, gs in holders.items()}  # model -> the groups that hold it
        self.manual = frozenset(manual)  # models the controller syncs itself (an asynchronous run's policy)
        self.groups: dict[str, RayWorkerGroup] = {}
        self.behind: dict[str, tuple[str, set[str]]] = {}  # model -> (group with the newest weights, groups behind)
        self.seconds: dict[str, float] = {}  # time spent syncing each model, pulls included
        self.count: dict[str, int] = {}

    def shared(self, model: str) -> bool:
        return len(self.holders.get(model, ())) > 1

    def updated(self, model: str, group: str) -> None:
        """`group` has just trained `model`: every other holder is now behind."""
        others = set(self.holders.get(model, ())) - {group}
        if others and model not in self.manual:
            self.behind[model] = (group, others)

    def pull(self, model: str, group: str) -> None:
        """Before `group` uses `model`: bring it up to date if another group trained it since."""
        if model in self.behind and group in self.behind[model][1]:
            self.push(model)

    def push(self, model: str) -> float:
        """Send the newest weights of `model` to every group behind; seconds taken (0.0 if none was behind)."""
        if model not in self.behind:
            return 0.0
        began = time.perf_counter()
        source, targets = self.behind.pop(model)
        # numpy arrays (runtime.transport): Ray hands them over out-of-band, tensors it pickles in-band
        weights = self.groups[source].call("weights", model, packed=True, dispatch="rank0").result()
        ref = ray.put(weights)  # one copy in the object store, read by every rank of every target group
        futures = [self.groups[t].call("load_weights", model, ref, dispatch="broadcast") for t in sorted(targets)]
        for f in futures:
            f.result()
        took = time.perf_counter() - began
        self.seconds[model] = self.seconds.get(model, 0.0) + took
        self.count[model] = self.count.get(model, 0) + 1
        return took
