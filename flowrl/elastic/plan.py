"""One generation's decisions on an elastic pool (flowrl.elastic), as the serverless backend and the simulator
both take them: how many instances, which prompts each holds, which one takes the others' migrated tails, and
what a finished generation teaches the next decision.

`plan_generation` is the pure part of the serverless backend's `Scaler.shards` (backends/serverless/scaling.py)
and `migrate` role choice: with a pool of `world` instances and a measured decode curve it takes the cost-aware
count (`choose_instances`), without one (the first step) all `world`; the prompts go out in length-ranked runs
(`ranked_runs`, cut where `Batch.split` cuts the reordered batch, so the runs are the shards), or in data order
when assignment is off; with more than one instance and `tau` < 1 the *sink* is the instance holding the most
predicted work (`migration_sink`, the backend's `Scaler.sink`: it holds its device longest anyway). `learn_decode` is the pure part of
`Scaler.measure`: seconds per decode step by the samples an instance decoded, an even EWMA of what each finished
instance measured (its run time over its longest response).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flowrl.elastic.assign import ranked_runs, split_runs
from flowrl.elastic.migrate import migration_target
from flowrl.elastic.predict import LengthPredictor
from flowrl.elastic.scale import DecodeCurve, ScaleChoice, choose_instances


@dataclass(frozen=True)
class GenerationPlan:
    instances: int
    runs: tuple[tuple[int, ...], ...]  # per instance, positions in the step's prompts, in the order it holds them
    ranked: bool  # the runs follow the length order (the backend reorders the batch)
    sink: int | None  # the instance migrated tails go to (None: no cut-and-migrate)
    choice: ScaleChoice | None  # the cost-aware choice (None: no measured curve yet, or scaling off)


def predictions(predictor: LengthPredictor, prompt_ids: Sequence[Hashable], samples: int,
                predict: bool = True) -> tuple[list[float], list[list[float]] | None]:
    """(each prompt's predicted length, each prompt's predicted sorted sample lengths or None): a prompt never
    seen falls back to 0 as the backend's does; without prediction every prompt gets the mean so far."""
    if not predict:
        return [predictor.mean] * len(prompt_ids), None
    return predictor.predict(prompt_ids, fallback=0.0), predictor.predict_profiles(prompt_ids, samples, fallback=0.0)


def migration_sink(work: Sequence[float], rows: Sequence[int]) -> int | None:
    """The instance the others hand their tails to: the one kept to the end is the one with the most predicted
    work (`work[i]`: its prompts' predicted lengths summed; ties: the later, which length-ranked runs give the
    longest prompts), confirmed by `migration_target` with its free slots the step's rows less its own (`rows[i]`:
    instance i's prompts); None with one instance, or when some source's rows would not fit there."""
    if len(work) < 2:
        return None
    keep = max(range(len(work)), key=lambda i: (work[i], i))
    free = {keep: sum(rows) - rows[keep]}
    targets = {migration_target(free, src, rows[src]) for src in range(len(rows)) if src != keep}
    return keep if targets == {keep} else None


def plan_generation(predicted: Sequence[float], samples: int, world: int, decode: Mapping[int, float],
                    overhead_s: float, weight: float, tau: float, profiles: Sequence[Sequence[float]] | None = None,
                    *, assign: bool = True, scale: bool = True, slots: int | None = None) -> GenerationPlan:
    """The generation's instance count, runs and sink (see the module docstring); `slots`: the samples an
    instance decodes at once (None: all it holds, flowrl's torch engine)."""
    if world < 1:
        raise ValueError(f"a pool needs at least one instance, got {world}")
    choice = None
    n = world
    if world > 1 and decode and scale:
        choice = choose_instances(predicted, samples, range(1, world + 1), DecodeCurve(decode), weight,
                                  start_s=overhead_s, profiles=profiles, slots=slots)
        n = choice.chosen.instances
    ranked = world > 1 and assign
    runs = ranked_runs(predicted, n) if ranked else split_runs(len(predicted), n)
    sink = None
    if len(runs) > 1 and tau < 1.0:
        sink = migration_sink([sum(predicted[i] for i in run) for run in runs], [len(run) for run in runs])
    return GenerationPlan(len(runs), tuple(tuple(r) for r in runs), ranked, sink, choice)


def learn_decode(decode: Mapping[int, float], measured: Iterable[tuple[int, int, float]]) -> dict[int, float]:
    """The decode curve's points after a generation: `measured` has, per instance, (samples it decoded at once,
    its decode steps: its longest response in tokens where all ran together, `decode_steps` under a slot limit,
    its run seconds); each gives run / max(1, steps) seconds a step at that batch, averaged evenly with the
    point's old value."""
    out = dict(decode)
    for size, steps, run_s in measured:
        if size < 1:
            continue
        per_step = run_s / max(1, steps)
        old = out.get(size)
        out[size] = per_step if old is None else 0.5 * old + 0.5 * per_step
    return out


def start_overhead(instances: Sequence[tuple[float, bool]]) -> float:
    """A generation instance's time beyond its run, as the next choice's `overhead_s`: the mean over the warm
    instances of (held - run) seconds; `instances` holds (held - run, cold) per instance. 0 when every
    instance was cold (their build time is not what a warm instance pays)."""
    warm = [over for over, cold in instances if not cold]
    return sum(warm) / max(1, len(warm))
