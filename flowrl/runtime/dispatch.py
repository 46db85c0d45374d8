"""Dispatch (flowrl.runtime): how one call to a worker group becomes one call per rank, and how the ranks'
results become one result again. Every multi-rank backend (threads, process, ray, and the ones to come) does
`plan` -> run the planned calls on its ranks -> `merge`, so a flow computes the same numbers on each of them.
Pure functions over `Batch`es (no backend), tested alone.

The mode is `Node.dispatch`, chosen by the compiler and printed by `flowrl compile`:
- "split": the data argument (the first `Batch`, or list of `Batch`es as in `update_fused`) is cut into `world`
  contiguous data-parallel shards, one per rank; results are concatenated in rank order. Generation on 2 ranks
  is sample-identical to 1 rank (each sample's draws are keyed by its prompt's slot in the step and its index,
  flowrl.engines.sampling, not by its rank); so is an update in one mini-batch (the loss uses the global
  mini-batch's denominators, gradients are all-reduced). With several mini-batches or epochs, each rank
  shuffles its own shard, so its mini-batches are not one rank's.
- "broadcast": every rank gets the whole input; rank 0's result is returned (an update's metrics are always
  reduced over the ranks: every rank holds a share of the loss).
- "rank0": only rank 0 runs.

Ranks that share one copy of the weights (`shared_weights`: the thread ranks, one process) run a state-changing
call once, on rank 0 with the whole input: that is what data-parallel ranks compute after their gradient
all-reduce, and running it per shard would step the one optimizer `world` times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from flowrl.engines.training import merge_ranks
from flowrl.ir.attrs import UpdateAttrs
from flowrl.runtime.batch import Batch

MODES = ("split", "broadcast", "rank0")
UPDATES = frozenset({"update", "update_fused"})  # optimizer steps: every rank must take part (all-reduce)
# Methods that change a rank's state: the group snapshots its weights after each one (for restarts).
MUTATING = UPDATES | {"load_state_dict", "load_weights"}
# Methods that run a model (the ones the test-only crash hook counts).
MODEL_CALLS = UPDATES | {"generate", "logprobs", "values", "score"}


class DispatchError(ValueError):
    """A call that cannot be dispatched to this group (unknown mode, an update that cannot be split)."""


@dataclass(frozen=True)
class RankCall:
    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    offset: int = 0  # index of this shard's first sample in the whole batch
    tokens: tuple[float, ...] = (1.0,)  # valid response tokens per data batch (weights averaged update metrics)


@dataclass(frozen=True)
class Plan:
    method: str
    mode: str
    calls: tuple[RankCall, ...]
    shared: tuple[int, ...] = field(default=())  # positions of args every rank gets whole (put in the store once)


def rank_seed(step_seed: int, rank: int) -> int:
    """Every rank keeps the step seed: a sample's draws are keyed by its prompt's slot and its index
    (flowrl.engines.sampling), so a split samples as one rank does. (The fused stage's streaming ranks too.)"""
    return step_seed


def plan(method: str, args: Sequence[Any], kwargs: Mapping[str, Any], mode: str, world: int, *,
         shared_weights: bool = False) -> Plan:
    """The calls each rank gets. `shared_weights`: the ranks hold one copy of the weights (see the docstring)."""
    if mode not in MODES:
        raise DispatchError(f"unknown dispatch mode {mode!r} for {method} (expected one of {', '.join(MODES)})")
    args, kwargs = tuple(args), dict(kwargs)
    where = _data_arg(args)
    if method in UPDATES and mode == "rank0" and world > 1 and not shared_weights:
        raise DispatchError(f"{method} with dispatch rank0 on {world} ranks would leave ranks 1..{world - 1} with "
                            "stale weights; use split (data parallel) or broadcast")
    tokens = _tokens(args, where)
    if mode == "rank0" or world == 1 or (shared_weights and method in MUTATING):
        return Plan(method, mode, (RankCall(0, args, kwargs, 0, tokens),))
    if mode == "broadcast" or where is None:
        return _broadcast(method, args, kwargs, world, where, tokens)
    if method in UPDATES:
        _check_update_split(args, where, world)
    data = args[where]
    shards = [b.split(world) for b in data] if isinstance(data, list) else [data.split(world)]
    if len({len(s) for s in shards}) != 1:  # batches too small to cut into as many shards: every rank takes all
        return _broadcast(method, args, kwargs, world, where, tokens)
    calls: list[RankCall] = []
    offset = 0
    for rank in range(len(shards[0])):
        rank_kwargs = dict(kwargs)
        if method == "generate" and "step_seed" in kwargs:
            rank_kwargs["step_seed"] = rank_seed(int(kwargs["step_seed"]), rank)
        mine = [s[rank] for s in shards]
        shard_args = (*args[:where], mine if isinstance(data, list) else mine[0], *args[where + 1:])
        calls.append(RankCall(rank, shard_args, rank_kwargs, offset, _tokens(shard_args, where)))
        offset += mine[0].size
    return Plan(method, "split", tuple(calls))


def _broadcast(method: str, args: tuple[Any, ...], kwargs: dict[str, Any], world: int, where: int | None,
               tokens: tuple[float, ...]) -> Plan:
    shared = tuple(i for i, a in enumerate(args) if isinstance(a, (Batch, dict)) or i == where)
    return Plan(method, "broadcast", tuple(RankCall(r, args, kwargs, 0, tokens) for r in range(world)), shared)


def _data_arg(args: Sequence[Any]) -> int | None:
    """Position of the data to split: the first Batch, or a non-empty list of Batches."""
    for i, a in enumerate(args):
        if isinstance(a, Batch) or (isinstance(a, list) and a and all(isinstance(b, Batch) for b in a)):
            return i
    return None


def _check_update_split(args: Sequence[Any], where: int, world: int) -> None:
    """Every rank must run as many optimizer steps as the others (each one is an all-reduce)."""
    data, after = args[where], args[where + 1] if where + 1 < len(args) else {}
    batches = data if isinstance(data, list) else [data]
    attrs = after if isinstance(after, list) else [after] * len(batches)
    for batch, a in zip(batches, attrs, strict=False):
        parts = max(1, UpdateAttrs.of(a if isinstance(a, Mapping) else {}).mini_batches)
        if batch.size // world < parts:
            raise DispatchError(f"cannot split an update batch of {batch.size} samples over {world} ranks with "
                                f"{parts} mini-batches: every rank needs a sample in each mini-batch (they all "
                                "take part in each gradient all-reduce); use a bigger batch or fewer replicas")


def _tokens(args: Sequence[Any], where: int | None) -> tuple[float, ...]:
    if where is None:
        return (1.0,)
    data = args[where]
    return tuple(float(b["response_mask"].sum()) if "response_mask" in b.tensors else float(b.size)
                 for b in (data if isinstance(data, list) else [data]))


def run_plan(p: Plan, call: Callable[[RankCall], Any], pool: Executor | None = None) -> list[Any]:
    """Every planned call, all at once on `pool` (collectives inside an update need every rank), results in
    rank order. For the backends whose ranks are called synchronously (threads, process); Ray submits its own."""
    if len(p.calls) == 1 or pool is None:
        return [call(c) for c in p.calls]
    return list(pool.map(call, p.calls))


def merge(p: Plan, results: Sequence[Any], pad: int = 0) -> Any:
    """One result from the ranks' results (in rank order, one per `p.calls`). `pad`: the token id that pads
    the shards' rollouts to one width (the model's tokenizer's; masked out wherever it is read)."""
    if len(results) == 1:
        return results[0]
    if p.method == "update":
        return merge_ranks(results, [c.tokens[0] for c in p.calls])
    if p.method == "update_fused":  # {"results": [one update's metrics per model], "order": the turns taken}
        per_model = zip(*[r["results"] for r in results], strict=True)
        return {**results[0], "results": [merge_ranks(list(ms), [c.tokens[i] for c in p.calls])
                                          for i, ms in enumerate(per_model)]}
    if p.mode != "split":
        return results[0]
    if p.method == "generate":
        shifted = [_shift_groups(b, c.offset) for b, c in zip(results, p.calls, strict=True)]
        return Batch.concat(shifted, fill={"prompt_ids": pad, "response_ids": pad})
    if all(isinstance(r, Batch) for r in results):
        return Batch.concat(list(results))
    return results[0]


def _shift_groups(rollout: Batch, prompt_offset: int) -> Batch:
    """A rank numbers its prompts from 0; in the whole rollout its prompts start at `prompt_offset`."""
    if not prompt_offset or "group_id" not in rollout.tensors:
        return rollout
    tensors = {**rollout.tensors, "group_id": rollout.tensors["group_id"] + prompt_offset}
    return Batch(rollout.size, tensors, rollout.meta, rollout.primary)


