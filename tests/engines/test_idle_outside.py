"""`env/idle_frac` checked by an outside clock (issue 26): the decode loop's own `idle_s` (flowrl.engines.turns:
seconds with nothing to decode, and in a fused stage nothing to forward, while environments were pending), as the
controller reports it (flowrl.runtime.controller.env_metrics), against the same quantity measured without the
engine's bookkeeping.

The outside measurement: the environment (a module written to tmp_path, run in the pool's warm worker process)
writes when each reset/step call starts and ends by `time.time()` in that process (the pending intervals), and
forward hooks registered here on the policy module record when each forward runs (the busy intervals), with the
generating thread's CPU clock (`time.thread_time()`) at each. Idle from outside is the time inside the call with
an environment call pending, no forward running and the generating thread off its CPU: between forwards the loop
samples, checks stop texts, packs caches and sends actions, which is work (on this tiny model as long as the
forwards themselves), so "no forward running" alone counts it idle; that coarser figure is checked one way only
(never below the reported one). Nothing here asserts a duration: only that two measurements of one run agree.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import ChunkForward, Scored, concat
from flowrl.runtime.controller import env_metrics
from flowrl.runtime.env_rollout import env_spec_of
from flowrl.runtime.worker import ModelWorker

ENV_MODULE = '''\
"""An environment that sleeps a seeded random time per call and logs when each call runs (its own clock)."""
import os
import random
import threading
import time

_LOCK = threading.Lock()


class Timed:
    def __init__(self, log: str, lo: float, hi: float, turns: int = 3) -> None:
        self.log, self.lo, self.hi, self.left = log, lo, hi, turns
        self.rng = random.Random(0)

    def _record(self, began: float) -> None:
        with _LOCK, open(os.path.join(self.log, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{began!r} {time.time()!r}\\n")

    def reset(self, row: dict) -> str:
        began = time.time()
        self.rng = random.Random(str(row.get("prompt")))  # seeded: latencies by prompt, not by timing
        self._record(began)
        return "="

    def step(self, action: str) -> tuple[str, float, bool]:
        began = time.time()
        time.sleep(self.rng.uniform(self.lo, self.hi))
        self.left -= 1
        self._record(began)
        return f"={len(action) % 10}", float(action.endswith("+")), self.left <= 0
'''

FLOW = """\
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=",
                        context = 96 }}
model ref : reference {{ source = actor }}
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
env game = "timed_env.Timed" {{ max_turns = 3, stop = "+", workers = 1, timeout = 30, log = "{log}",
                                lo = {lo}, hi = {hi}, decode_batch = {decode_batch} }}
use grpo(group = {group}, max_tokens = {max_tokens}, env = game)
run {{ steps = 1, seed = 3 }}
"""


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def minus(covered: list[tuple[float, float]], holes: list[tuple[float, float]]) -> float:
    """The measure of union(covered) outside union(holes)."""
    total = 0.0
    holes = union(holes)
    for a, b in union(covered):
        cut = sum(max(0.0, min(b, d) - max(a, c)) for c, d in holes)
        total += (b - a) - cut
    return total


@dataclass(frozen=True)
class Measured:
    """One generate call measured twice: by the engine (as reported) and from outside."""

    reported_frac: float  # env/idle_frac as the controller reports it
    engine_idle: float  # sum(gen_idle_s): the loop's own count
    engine_wall: float  # sum(gen_wall_s)
    off_cpu: float  # outside: environment pending, no forward running, the generating thread off its CPU
    no_forward: float  # outside: environment pending, no forward running (the loop's own work counts too)
    wall: float  # outside: the call's wall seconds
    queued: float  # the kernel's count: in the gaps measured, the generating thread runnable but off a busy CPU


def run_outside(tmp: Path, *, prompts: int, group: int, max_tokens: int, lo: float, hi: float,
                fused: bool = False, decode_batch: int = 0) -> Measured:
    """One multi-turn generate call on the local worker (this thread), measured by the engine and from outside.
    `fused`: the stream of a fused stage (fuse-gen-inference's own-rank schedule) instead, the policy's log-probs
    of each chunk of finished trajectories run inline while the others wait on their environments."""
    log = tmp / "log"
    log.mkdir(exist_ok=True)
    for f in log.iterdir():
        f.unlink()
    (tmp / "timed_env.py").write_text(ENV_MODULE)
    rows = [{"prompt": f"{a}+{b}", "answer": a + b} for a in range(4) for b in range(4)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / "idle.flow"
    path.write_text(FLOW.format(log=log, lo=lo, hi=hi, group=group, max_tokens=max_tokens, decode_batch=decode_batch))
    graph = flowrl.load(str(path))
    worker = ModelWorker([graph.model("actor")], graph.models, seed=0)
    try:
        gen = graph.node("rollout")
        texts = [f"{a}+{a + 1}" for a in range(prompts)]
        batch = Batch(len(texts), {}, {"prompt": texts, "answer": [0] * len(texts),
                                       "prompt_slot": list(range(len(texts)))})
        spec = env_spec_of(gen.attrs)
        assert spec is not None
        worker.envs.get(spec).start()  # the warm worker process is up before the call (its start is not a step)
        busy: list[tuple[float, float]] = []
        # (wall, this thread's CPU seconds, its seconds runnable but waiting for a CPU) at each forward's start and end
        marks: list[tuple[float, float, float]] = []
        module = worker.models["actor"].module

        def pre(mod: torch.nn.Module, args: object, kwargs: object) -> None:
            marks.append((time.time(), time.thread_time(), runqueue_wait()))

        def post(mod: torch.nn.Module, args: object, kwargs: object, out: object) -> None:
            marks.append((time.time(), time.thread_time(), runqueue_wait()))
            busy.append((marks[-2][0], marks[-1][0]))

        handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.register_forward_hook(post, with_kwargs=True)]
        try:
            start = (time.time(), time.thread_time(), runqueue_wait())
            if fused:
                inline = [ChunkForward("old_logp", "logprobs", "actor", {})]
                items = list(worker.generate_stream("actor", batch, dict(gen.attrs), step_seed=7, inline=inline))
                assert items and all(isinstance(i, Scored) for i in items)
                rollout = concat([i.batch for i in items if isinstance(i, Scored)])
            else:
                rollout = worker.generate("actor", batch, dict(gen.attrs), step_seed=7)
            end = (time.time(), time.thread_time(), runqueue_wait())
        finally:
            for h in handles:
                h.remove()
    finally:
        worker.close()
    pending = [(float(a), float(b)) for f in log.iterdir() for a, b in
               (line.split() for line in f.read_text().splitlines())]
    assert pending and busy
    t0, t1 = start[0], end[0]
    inside = [(max(a, t0), min(b, t1)) for a, b in pending if min(b, t1) > max(a, t0)]
    no_forward = minus(inside, busy)
    # Between forwards the loop samples, checks stops, packs caches and sends actions: work, on this thread's CPU.
    # Idle is the part of a gap between forwards this thread spent off its CPU, bounded by the part of the gap
    # with an environment call pending; and only in a gap in which an environment call ended: waiting on
    # environments ends when one answers, so a gap with no answer in it held no wait, and its time off the CPU
    # was the machine's (other processes preempting this one), not the loop's.
    edges = [start, *marks, end]
    answers = sorted(b for _, b in pending)
    off_cpu = queued = 0.0
    for (w0, c0, q0), (w1, c1, q1) in zip(edges[0::2], edges[1::2], strict=True):
        if bisect.bisect_left(answers, w0) == bisect.bisect_right(answers, w1):
            continue
        off_cpu += min(max(0.0, (w1 - w0) - (c1 - c0)),
                       measure([(max(a, w0), min(b, w1)) for a, b in inside if min(b, w1) > max(a, w0)]))
        queued += q1 - q0
    return Measured(env_metrics(rollout)["env/idle_frac"], float(rollout["gen_idle_s"].sum()),
                    float(rollout["gen_wall_s"].sum()), off_cpu, no_forward, t1 - t0, queued)


def runqueue_wait() -> float:
    """Seconds this thread has spent runnable but not running, waiting for a CPU other processes held (the
    kernel's scheduler statistics: /proc/thread-self/schedstat, its second field in nanoseconds)."""
    with open("/proc/thread-self/schedstat", encoding="ascii") as f:
        return int(f.read().split()[1]) / 1e9


# (prompts, group, max_tokens, environment latency range in seconds, fused, decode_batch)
CASES = {
    # few short trajectories, environments of 30-100 ms: the loop mostly waits (idle ~80% of the call here)
    "idle": (3, 2, 4, 0.03, 0.1, False, 0),
    # 32 trajectories of 16-token turns, environments of 0-5 ms: others decode while one waits (idle ~5%)
    "overlap": (8, 4, 16, 0.0, 0.005, False, 0),
    # the idle case streamed: the log-probs of trajectories already finished run where the loop would wait
    "fused": (3, 2, 4, 0.03, 0.1, True, 0),
    # 32 trajectories, 4 decoding at once, environments of 5-40 ms: queued rows fill the waits until the tail
    "queued": (8, 4, 4, 0.005, 0.04, False, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reported_idle_agrees_with_an_outside_clock(tmp_path: Path, case: str) -> None:
    """Tolerance: 10% relative or 20 ms absolute, or 1% of the call's wall, whichever is largest. What separates
    the two measurements is the handful of moments the engine's clock and the outside one see differently: an
    answer travelling back from the environment's worker process (the loop still waits; the environment is
    done), the loop waiting on the interpreter lock held by the pool's reader thread, the hooks' own time, the
    settling of an answer before the next forward; each a fraction of a millisecond, a few per turn. On a shared
    machine, other processes preempting the loop's work in a gap that holds an answer count as idle outside:
    that grows with how long the machine makes the call take (the 1% of wall; measured at most 0.3% of a call
    slowed 40x by other work). Measured on this 2-core machine, reported vs outside idle seconds: idle 0.214 vs
    0.214, overlap 0.0088 vs 0.0146 (0.0025 vs 0.0170 in a 6.6 s call under load), fused 0.206 vs 0.205, queued
    0.056 vs 0.056 and 0.046 vs 0.050."""
    prompts, group, max_tokens, lo, hi, fused, decode_batch = CASES[case]
    m = run_outside(tmp_path, prompts=prompts, group=group, max_tokens=max_tokens, lo=lo, hi=hi, fused=fused,
                    decode_batch=decode_batch)
    # Time the loop was ready to run but the machine gave its CPU to others (the kernel's run-queue wait, measured
    # in the same gaps) is seen as idle by one clock or the other depending on when it fell (an answer's wake-up
    # delayed; the loop's work between answers preempted): a margin the machine's load sets, measured, not guessed.
    tol = max(0.1 * m.engine_idle, 0.02, 0.01 * m.wall) + m.queued
    assert abs(m.off_cpu - m.engine_idle) <= tol, m
    # The engine's wall lies inside the outside one; what is left is prompt encoding, the rollout's assembly and
    # (fused) the forwards on the last chunk, after the loop's last hand-out.
    assert 0.0 <= m.wall - m.engine_wall <= max(0.1 * m.wall, 0.02), m
    frac_tol = tol / m.wall + (m.wall - m.engine_wall) / m.wall
    assert abs(m.off_cpu / m.wall - m.reported_frac) <= frac_tol, m
    # Counting as busy only the forwards (the loop's sampling, stop checks and sends between them are counted
    # idle) gives at least as much idle: the engine never counts a forward's time, or a time with nothing
    # pending, as idle.
    assert m.engine_idle <= m.no_forward + 0.02, m
