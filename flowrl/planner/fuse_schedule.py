"""The fused actor/critic training schedule (RLHFuse intra-stage fusion), solved as RLHFuse does.

Two models train side by side on the same A nodes. Model 0 has A pipeline stages, stage s on node s. Model 1 has
B stages (B divides A) and runs as A/B data-parallel copies; copy c covers nodes c*B .. (c+1)*B-1 in reverse order
(its stage 0 on node (c+1)*B-1) and takes M1/(A/B) of model 1's micro-batches. A forward of model j takes F_j per
stage, a backward 2*F_j; a forward needs the previous stage's forward of its micro-batch, the last stage's
backward its forward, a backward the next stage's backward; a node runs one task at a time. Each node so holds one
stage of model 0 and one stage of one copy of model 1, whose pipeline bubbles the other fills.

Solved in three steps: list scheduling (a free node starts, among its ready tasks, the one with the longest path
still behind it, backwards first or not; the best of a plain run, randomised restarts and model 0 in 1F1B order
with model 1 filling its bubbles), then simulated
annealing over each node's task order (moves: a task moved to another place in its node's order; orders that
deadlock are rejected), first for the makespan, then for the lowest peak activation memory at that makespan
(a micro-batch holds P_j on a node from the start of its forward there to the end of its backward there). The
lower bound is the larger of each model's pipeline bound, 3*F*(M + S - 1) for S stages and M micro-batches, and
each node's work plus its unavoidable start (the earliest a first forward can reach it) and tail (the backwards
still to run below it after its last task). Standard library only; deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    a: int  # model 0's stages = nodes
    b: int  # model 1's stages per copy
    m: tuple[int, int]  # micro-batches of model 0, of model 1 (all copies)
    fwd: tuple[float, float]  # forward time per stage
    mem: tuple[float, float] = (1.0, 1.0)  # activation memory one micro-batch holds on a stage

    def __post_init__(self) -> None:
        if self.a < 1 or self.b < 1 or self.a % self.b:
            raise ValueError(f"pipeline stages: B = {self.b} must divide A = {self.a} (both >= 1)")
        if min(self.m) < 1 or self.m[1] % (self.a // self.b):
            raise ValueError(f"micro-batches: model 1's {self.m[1]} must split evenly over its {self.a // self.b} "
                             f"copies, and each model needs at least one (got {self.m[0]}, {self.m[1]})")
        if min(self.fwd) <= 0 or min(self.mem) < 0:
            raise ValueError(f"forward times must be > 0 and memory >= 0, got {self.fwd}, {self.mem}")

    @property
    def copies(self) -> int:
        return self.a // self.b

    def node(self, model: int, copy: int, stage: int) -> int:
        return stage if model == 0 else (copy + 1) * self.b - 1 - stage

    def stages(self, model: int) -> int:
        return self.a if model == 0 else self.b

    def mbs(self, model: int) -> int:
        return self.m[0] if model == 0 else self.m[1] // self.copies


@dataclass(frozen=True)
class Task:
    model: int
    copy: int
    mb: int
    stage: int
    kind: str  # "F" or "B"


class _Graph:
    """Tasks, their dependencies, durations and nodes, as indices."""

    def __init__(self, p: Problem):
        self.p = p
        self.tasks: list[Task] = []
        index: dict[Task, int] = {}
        for model in (0, 1):
            for copy in range(1 if model == 0 else p.copies):
                for mb in range(p.mbs(model)):
                    for stage in range(p.stages(model)):
                        for kind in ("F", "B"):
                            t = Task(model, copy, mb, stage, kind)
                            index[t] = len(self.tasks)
                            self.tasks.append(t)
        n = len(self.tasks)
        self.node = [p.node(t.model, t.copy, t.stage) for t in self.tasks]
        self.dur = [p.fwd[t.model] * (1.0 if t.kind == "F" else 2.0) for t in self.tasks]
        self.deps: list[list[int]] = [[] for _ in range(n)]
        for i, t in enumerate(self.tasks):
            last = p.stages(t.model) - 1
            if t.kind == "F" and t.stage > 0:
                self.deps[i].append(index[Task(t.model, t.copy, t.mb, t.stage - 1, "F")])
            if t.kind == "B":
                prior = Task(t.model, t.copy, t.mb, t.stage, "F") if t.stage == last else \
                    Task(t.model, t.copy, t.mb, t.stage + 1, "B")
                self.deps[i].append(index[prior])
        self.users: list[list[int]] = [[] for _ in range(n)]
        for i, ds in enumerate(self.deps):
            for d in ds:
                self.users[d].append(i)
        self.tail = [0.0] * n  # the longest path from a task's start to the end of its chain
        for i in sorted(range(n), key=lambda i: -self._depth(i)):
            self.tail[i] = self.dur[i] + max((self.tail[u] for u in self.users[i]), default=0.0)

    def _depth(self, i: int) -> int:
        t = self.tasks[i]
        return t.stage if t.kind == "F" else 2 * self.p.stages(t.model) - 1 - t.stage


def ends(g: _Graph, orders: Sequence[Sequence[int]]) -> list[float] | None:
    """End time of every task in `orders` (NaN for tasks not in them), each node running its order in turn; None
    when the orders deadlock."""
    end = [math.nan] * len(g.tasks)
    pos = [0] * len(orders)
    free = [0.0] * len(orders)
    progress = True
    remaining = sum(len(o) for o in orders)
    while remaining and progress:
        progress = False
        for n, order in enumerate(orders):
            while pos[n] < len(order):
                i = order[pos[n]]
                if any(math.isnan(end[d]) for d in g.deps[i]):
                    break
                start = max([free[n], *(end[d] for d in g.deps[i])])
                end[i] = free[n] = start + g.dur[i]
                pos[n] += 1
                remaining -= 1
                progress = True
    return None if remaining else end


def evaluate(g: _Graph, orders: Sequence[Sequence[int]]) -> tuple[float, list[float]] | None:
    """(makespan, peak memory per node) of these per-node task orders, or None when they deadlock."""
    end = ends(g, orders)
    if end is None:
        return None
    peaks = []
    for order in orders:
        held = peak = 0.0
        for i in order:
            t = g.tasks[i]
            if t.kind == "F":
                held += g.p.mem[t.model]
                peak = max(peak, held)
            else:
                held -= g.p.mem[t.model]
        peaks.append(peak)
    return max((e for e in end if not math.isnan(e)), default=0.0), peaks


def greedy(g: _Graph, rng: random.Random | None = None, noise: float = 0.0,
           backward_first: bool = True) -> list[list[int]]:
    """List scheduling: each time a node can start a task, it starts the ready one with the longest path behind it
    (scaled by up to 1 + `noise`, drawn once per task, for randomised restarts); `backward_first` puts ready
    backwards before forwards (they free activation memory)."""
    n_nodes = g.p.a
    orders: list[list[int]] = [[] for _ in range(n_nodes)]
    waiting = [len(d) for d in g.deps]
    ready: list[set[int]] = [set() for _ in range(n_nodes)]
    avail = [0.0] * len(g.tasks)  # when a task's dependencies are done
    weight = [t * (1.0 + noise * rng.random()) if rng is not None else t for t in g.tail]
    for i, w in enumerate(waiting):
        if w == 0:
            ready[g.node[i]].add(i)
    free = [0.0] * n_nodes
    left = len(g.tasks)
    while left:
        best: tuple[float, int, float, int, int] | None = None
        for n in range(n_nodes):
            for i in ready[n]:
                kind = (0 if g.tasks[i].kind == "B" else 1) if backward_first else 0
                key = (max(free[n], avail[i]), kind, -weight[i], n, i)
                if best is None or key < best:
                    best = key
        assert best is not None, "a task graph without a ready task"
        start, _, _, n, i = best
        ready[n].discard(i)
        orders[n].append(i)
        free[n] = start + g.dur[i]
        left -= 1
        for u in g.users[i]:
            waiting[u] -= 1
            avail[u] = max(avail[u], free[n])
            if waiting[u] == 0:
                ready[g.node[u]].add(u)
    return orders


def bubble_fill(g: _Graph) -> list[list[int]]:
    """RLHFuse's other starting point: model 0 in 1F1B order on its own (it meets its pipeline bound), then each
    of model 1's tasks, in dependency order, at the earliest time on its node that fits between the tasks
    already placed there, so model 1 fills model 0's bubbles without delaying it."""
    p = g.p
    index = {t: i for i, t in enumerate(g.tasks)}
    orders: list[list[int]] = [[] for _ in range(p.a)]
    for stage in range(p.a):  # 1F1B: warm-up forwards, one forward one backward, cool-down backwards
        m, warm = p.mbs(0), min(p.a - stage - 1, p.mbs(0))
        seq = [("F", k) for k in range(warm)]
        for k in range(m - warm):
            seq += [("F", warm + k), ("B", k)]
        seq += [("B", k) for k in range(m - warm, m)]
        orders[stage] = [index[Task(0, 0, k, stage, kind)] for kind, k in seq]
    model0 = ends(g, orders)
    assert model0 is not None  # 1F1B never deadlocks
    placed = {i: e - g.dur[i] for i, e in enumerate(model0) if not math.isnan(e)}  # start times
    busy: list[list[tuple[float, float]]] = [sorted((placed[i], placed[i] + g.dur[i]) for i in o) for o in orders]
    ones = sorted((i for i, t in enumerate(g.tasks) if t.model == 1), key=lambda i: g._depth(i))
    for i in ones:
        ready = max((placed[d] + g.dur[d] for d in g.deps[i]), default=0.0)
        n, start = g.node[i], ready
        for a, b in busy[n]:  # the first gap after `ready` long enough
            if start + g.dur[i] <= a:
                break
            start = max(start, b)
        placed[i] = start
        busy[n] = sorted([*busy[n], (start, start + g.dur[i])])
    return [sorted((i for i in range(len(g.tasks)) if g.node[i] == n and i in placed), key=lambda i: placed[i])
            for n in range(p.a)]


def best_greedy(g: _Graph, rng: random.Random,
                restarts: int) -> tuple[list[list[int]], tuple[float, list[float]]]:
    """The best of the plain list schedule, the bubble-filled 1F1B one and `restarts` randomised list schedules
    (noise 0.3 and 1.0, backwards first or not), by makespan, then peak memory; with its (makespan, peaks)."""
    tries = [greedy(g), bubble_fill(g)]
    for r in range(restarts):
        tries.append(greedy(g, rng, noise=(0.3, 1.0)[r % 2], backward_first=(r // 2) % 2 == 0))
    scored = []
    for orders in tries:
        score = evaluate(g, orders)
        assert score is not None, "a list schedule deadlocked"
        scored.append((orders, score))
    return min(scored, key=lambda t: (t[1][0], max(t[1][1])))


def _anneal(g: _Graph, orders: list[list[int]], rng: random.Random, iters: int, memory: bool) -> list[list[int]]:
    """Simulated annealing over per-node orders: a task moved within its node's order. Phase 1 minimises the
    makespan; phase 2 (`memory`) the largest peak memory (then their sum) without a longer makespan."""
    scored = evaluate(g, orders)
    assert scored is not None
    span0 = scored[0]

    def cost(s: tuple[float, list[float]]) -> float:
        return s[0] if not memory else max(s[1]) + 1e-6 * sum(s[1])

    cur, cur_cost = [list(o) for o in orders], cost(scored)
    best, best_cost = [list(o) for o in cur], cur_cost
    temp0 = max(cur_cost, 1e-9) * 0.05
    movable = [n for n, o in enumerate(cur) if len(o) > 1]
    if not movable:
        return best
    for k in range(iters):
        n = rng.choice(movable)
        order = cur[n]
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        if i == j:
            continue
        task = order.pop(i)
        order.insert(j, task)
        s = evaluate(g, cur)
        ok = s is not None and (not memory or s[0] <= span0 + 1e-9)
        new_cost = cost(s) if s is not None and ok else math.inf
        temp = temp0 * (1.0 - k / iters) + 1e-12
        if new_cost <= cur_cost or (ok and rng.random() < math.exp((cur_cost - new_cost) / temp)):
            cur_cost = new_cost
            if new_cost < best_cost - 1e-12:
                best, best_cost = [list(o) for o in cur], new_cost
        else:
            order.pop(j)
            order.insert(i, task)
    return best


def lower_bound(p: Problem) -> float:
    """The larger of each model's pipeline bound and each node's work plus unavoidable start and tail."""
    bounds = [3.0 * p.fwd[j] * (p.mbs(j) + p.stages(j) - 1) for j in (0, 1)]
    for n in range(p.a):
        s1 = (n // p.b + 1) * p.b - 1 - n  # model 1's stage on this node
        work = 3.0 * (p.fwd[0] * p.mbs(0) + p.fwd[1] * p.mbs(1))
        start = min(n * p.fwd[0], s1 * p.fwd[1])
        tail = min(n * 2.0 * p.fwd[0], s1 * 2.0 * p.fwd[1])
        bounds.append(start + work + tail)
    return max(bounds)


@dataclass(frozen=True)
class Schedule:
    makespan: float
    lower_bound: float
    peak_memory: list[float]
    greedy_makespan: float
    schedule: list[list[Task]]

    def to_json(self) -> dict[str, object]:
        return {"makespan": self.makespan, "lower_bound": self.lower_bound, "peak_memory": self.peak_memory,
                "schedule": [[{"model": t.model, "copy": t.copy, "mb": t.mb, "kind": t.kind} for t in node]
                             for node in self.schedule]}


def solve(p: Problem, *, seed: int = 0, iters: int | None = None, restarts: int = 32,
          memory: bool = True) -> Schedule:
    """Greedy (the best of a plain and `restarts` randomised list schedules), then annealing for the makespan,
    then (`memory`) for peak memory at that makespan (module docstring)."""
    g = _Graph(p)
    rng = random.Random(seed)
    steps = iters if iters is not None else min(4_000, 4 * len(g.tasks))
    first, scored = best_greedy(g, rng, restarts)
    orders = _anneal(g, first, rng, steps, memory=False)
    if memory:
        orders = _anneal(g, orders, rng, steps // 2, memory=True)
    final = evaluate(g, orders)
    assert final is not None
    return Schedule(final[0], lower_bound(p), final[1], scored[0], [[g.tasks[i] for i in o] for o in orders])
